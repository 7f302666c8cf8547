"""gradops.nn modules against torch.nn's (and a FloydNet attention layer written here) on the
same weights: forward, gradients, state_dict round trips both ways."""
import math

import pytest
import torch
from torch import nn

import gradops.nn as gnn
from gradops.errors import AclnnError

f64 = torch.float64


def assert_same_forward_and_grads(ours, theirs, x, atol=1e-10, rtol=1e-10, **fwd):
    xo, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yo, yt = ours(xo, **fwd), theirs(xt, **fwd)
    torch.testing.assert_close(yo, yt, atol=atol, rtol=rtol)
    g = torch.randn_like(yt)
    yo.backward(g)
    yt.backward(g)
    torch.testing.assert_close(xo.grad, xt.grad, atol=atol, rtol=rtol)
    po, pt = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert po.keys() == pt.keys()
    for name in po:
        assert po[name].grad.dtype == pt[name].grad.dtype, name
        torch.testing.assert_close(po[name].grad, pt[name].grad, atol=atol, rtol=rtol, msg=name)


def randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


def round_trip(ours, theirs):
    """torch -> gradops and gradops -> torch, strict, same keys and values."""
    assert list(ours.state_dict().keys()) == list(theirs.state_dict().keys())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    randomize(ours)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for k, v in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v)


@pytest.mark.parametrize("kwargs", [
    dict(normalized_shape=16),
    dict(normalized_shape=(4, 6), eps=1e-3),
    dict(normalized_shape=[16], bias=False),
    dict(normalized_shape=16, elementwise_affine=False),
])
def test_layer_norm_is_torch_layer_norm(backend, kwargs):
    ours = gnn.LayerNorm(**kwargs, dtype=f64)
    theirs = nn.LayerNorm(**kwargs, dtype=f64)
    assert isinstance(ours, nn.LayerNorm) and repr(ours) == repr(theirs)
    round_trip(ours, theirs)
    shape = kwargs["normalized_shape"]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    assert_same_forward_and_grads(ours, theirs, torch.randn((3, 2) + shape, dtype=f64))


@pytest.mark.parametrize("kwargs", [
    dict(normalized_shape=16),
    dict(normalized_shape=(4, 6), eps=1e-4),
    dict(normalized_shape=16, elementwise_affine=False),
])
def test_rms_norm_is_torch_rms_norm(backend, kwargs):
    ours = gnn.RMSNorm(**kwargs, dtype=f64)
    theirs = nn.RMSNorm(**kwargs, dtype=f64)
    assert isinstance(ours, nn.RMSNorm) and repr(ours) == repr(theirs)
    round_trip(ours, theirs)
    shape = kwargs["normalized_shape"]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    assert_same_forward_and_grads(ours, theirs, torch.randn((3, 2) + shape, dtype=f64))


def test_float32_norms_match_torch_within_float32_rounding(backend):
    for ours, theirs in ((gnn.LayerNorm(32), nn.LayerNorm(32)), (gnn.RMSNorm(32), nn.RMSNorm(32))):
        randomize(theirs)
        ours.load_state_dict(theirs.state_dict())
        assert_same_forward_and_grads(ours, theirs, torch.randn(8, 32), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- NsaCompress

def nsa_formula(x, w, block, stride, ends):
    rows, start = [], 0
    for end in ends:
        s = start
        while s + block <= end:
            rows.append(torch.einsum("jn,jnd->nd", w, x[s:s + block]))
            s += stride
        start = end
    return torch.stack(rows)


def test_nsa_compress_module(backend):
    m = gnn.NsaCompress(block_size=4, stride=2, num_heads=3, dtype=f64)
    assert list(m.state_dict()) == ["weight"] and m.weight.shape == (4, 3)
    x = torch.randn(19, 3, 5, dtype=f64)
    ends = [8, 19]
    # initialised as mean pooling: each output row is its block's average token
    torch.testing.assert_close(m(x, ends), torch.stack([x[s:s + 4].mean(0) for s in (0, 2, 4, 8, 10, 12, 14)]))
    randomize(m)
    xo, wo = x.clone().requires_grad_(True), m.weight.detach().clone().requires_grad_(True)
    xl = x.clone().requires_grad_(True)
    y = m(xl, torch.tensor([8, 11]), seq_lens_type="lengths")
    r = nsa_formula(xo, wo, 4, 2, ends)
    torch.testing.assert_close(y, r)
    g = torch.randn_like(r)
    y.backward(g)
    r.backward(g)
    torch.testing.assert_close(xl.grad, xo.grad)
    torch.testing.assert_close(m.weight.grad, wo.grad)
    fresh = gnn.NsaCompress(4, 2, 3, dtype=f64)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh.weight, m.weight)
    with pytest.raises(AclnnError, match="stride"):
        gnn.NsaCompress(4, 0, 3)


# ---------------------------------------------------------------- FloydAttention

class FloydNetAttention(nn.Module):
    """The attention part of a FloydNet block, as a FloydNet user writes it (einsum over the
    whole [B,H,N,N,N] score tensor)."""

    def __init__(self, c, heads, bias=False):
        super().__init__()
        self.h, self.d = heads, c // heads
        self.c_qkv = nn.Linear(c, 5 * c, bias=bias)
        self.c_proj = nn.Linear(c, c, bias=bias)

    def forward(self, x, attn_mask=None):
        b, n, _, c = x.shape
        q, kij, kjk, vij, vjk = (t.reshape(b, n, n, self.h, self.d).permute(0, 3, 1, 2, 4)
                                 for t in self.c_qkv(x).chunk(5, dim=-1))
        q = q / math.sqrt(2 * self.d)
        s = torch.einsum("bhikd,bhijd->bhikj", q, kij) + torch.einsum("bhikd,bhjkd->bhikj", q, kjk)
        if attn_mask is not None:
            s = s.masked_fill(attn_mask, -1e9)
        p = s.softmax(-1)
        y = torch.einsum("bhikj,bhijd->bhikd", p, vij) + torch.einsum("bhikj,bhjkd->bhikd", p, vjk)
        return self.c_proj(y.permute(0, 2, 3, 1, 4).reshape(b, n, n, c))


@pytest.mark.floyd_float64
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_floyd_attention_is_floydnet_attention(backend, bias, masked):
    c, heads, b, n = 8, 2, 2, 5
    ours = gnn.FloydAttention(c, heads, bias=bias, dtype=f64)
    theirs = FloydNetAttention(c, heads, bias=bias).to(f64)
    round_trip(ours, theirs)
    fwd = {}
    if masked:
        mask = torch.rand(b, 1, n, 1, n) < 0.3
        mask[0, 0, 1] = True  # a pair whose every pivot is removed
        fwd["attn_mask"] = mask
    ours.eval()
    assert_same_forward_and_grads(ours, theirs, torch.randn(b, n, n, c, dtype=f64), **fwd)


@pytest.mark.floyd_float64
def test_floyd_attention_dropout_only_while_training(backend):
    m = gnn.FloydAttention(8, 2, dropout=0.5, dtype=f64)
    x = torch.randn(1, 4, 4, 8, dtype=f64)
    m.eval()
    torch.testing.assert_close(m(x), m(x), atol=0, rtol=0)
    m.train()
    torch.manual_seed(0)
    a = m(x)
    torch.manual_seed(1)
    assert not torch.equal(a, m(x))
    with pytest.raises(AclnnError, match="embed_dim"):
        gnn.FloydAttention(10, 3)
    with pytest.raises(AclnnError, match="x has shape"):
        m(torch.randn(1, 4, 5, 8, dtype=f64))


def test_small_model_trains(backend):
    """A pair-representation model built only from gradops modules learns a fixed target."""
    torch.manual_seed(0)
    model = nn.Sequential(gnn.LayerNorm(8), gnn.FloydAttention(8, 2), gnn.RMSNorm(8), nn.Linear(8, 1))
    x, target = torch.randn(2, 5, 5, 8), torch.randn(2, 5, 5, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


class _TorchNsa(nn.Module):
    """NsaCompress written with torch ops (the formula above), same parameter."""

    def __init__(self, block_size, stride, num_heads):
        super().__init__()
        self.block_size, self.stride = block_size, stride
        self.weight = nn.Parameter(torch.full((block_size, num_heads), 1.0 / block_size))

    def forward(self, x, seq_lens):
        return nsa_formula(x, self.weight, self.block_size, self.stride, seq_lens)


class _PairModel(nn.Module):
    """Every gradops module in one model: pair features through LayerNorm, FloydAttention and
    RMSNorm; the rows of the pair grid, read as packed sequences, through NsaCompress."""

    def __init__(self, norm, rms, attn, nsa):
        super().__init__()
        self.norm, self.attn, self.rms, self.nsa, self.head = norm, attn, rms, nsa, nn.Linear(8, 1)

    def forward(self, x, mask, seq_lens):
        h = self.rms(x + self.attn(self.norm(x), attn_mask=mask))
        tokens = h.reshape(-1, 2, 4)  # [T, N=2 heads, D=4]
        return self.head(h).mean() + self.nsa(tokens, seq_lens).square().mean()


def test_training_loop_matches_torch_modules(backend):
    """The same model built from gradops modules and from torch.nn modules (FloydNet's einsum
    attention, the NSA formula), same initial weights, trained side by side with AdamW: the
    losses and the final weights agree to float32 rounding on every backend."""
    torch.manual_seed(0)
    ours = _PairModel(gnn.LayerNorm(8), gnn.RMSNorm(8), gnn.FloydAttention(8, 2), gnn.NsaCompress(4, 3, 2))
    theirs = _PairModel(nn.LayerNorm(8), nn.RMSNorm(8), FloydNetAttention(8, 2), _TorchNsa(4, 3, 2))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 5, 8)
    mask = torch.rand(2, 1, 5, 1, 5) < 0.3
    mask[1, 0, 3] = True  # a pair with no pivot left
    seq_lens = [13, 13, 29, 50]  # over the 50 tokens of the grid: an empty sequence, a short tail
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(8):
        losses = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss = model(x, mask, seq_lens)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert math.isclose(losses[0], losses[1], rel_tol=1e-5, abs_tol=1e-6), (step, losses)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
