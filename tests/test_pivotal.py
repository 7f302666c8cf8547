"""gradops.pivotal_attention against FloydNet's formulation, written out here independently:
the whole [B,H,L_i,L_k,L_j] score tensor with autograd. Every mask kind, the cap, the scale
default, dropout, permuted views, which path runs, and the chunked path's bounded memory."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import autocast

import gradops.nn.pivotal as pivotal_mod
from gradops.errors import AclnnError
from gradops.nn.pivotal import pivotal_attention

f64 = torch.float64


def floydnet_formula(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask=None, dropout=0.0, scale=None, inf=1e9,
                     softmax_cap=-1):
    """FloydNet's pivotal attention: softmax over the pivot j of scale * q_ik.(k_ij + k_jk),
    tanh cap, boolean mask -> -inf, other masks added, dropout on the weights."""
    if scale is None:
        scale = 1.0 / math.sqrt(2.0 * q_ik.shape[-1])
    q = q_ik * scale
    s = torch.einsum("bhikd,bhijd->bhikj", q, k_ij) + torch.einsum("bhikd,bhjkd->bhikj", q, k_jk)
    if softmax_cap > 0:
        s = softmax_cap * torch.tanh(s / softmax_cap)
    if attn_mask is not None:
        s = s.masked_fill(attn_mask, -inf) if attn_mask.dtype == torch.bool else s + attn_mask
    p = torch.softmax(s, dim=-1)
    if dropout > 0:
        p = torch.nn.functional.dropout(p, p=dropout)
    return torch.einsum("bhikj,bhijd->bhikd", p, v_ij) + torch.einsum("bhikj,bhjkd->bhikd", p, v_jk)


def make_inputs(b=2, h=2, li=4, lk=3, lj=5, d=4, dtype=f64):
    """q_ik, k_ij, k_jk, v_ij, v_jk as leaves."""
    shapes = [(b, h, li, lk, d), (b, h, li, lj, d), (b, h, lj, lk, d), (b, h, li, lj, d), (b, h, lj, lk, d)]
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def compare(inputs, atol=1e-10, rtol=1e-10, **kwargs):
    """Forward and all input gradients of gradops vs the formula on the same values."""
    ours_in = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref_in = [t.detach().clone().requires_grad_(True) for t in inputs]
    mask = kwargs.pop("attn_mask", None)
    y = pivotal_attention(*ours_in, attn_mask=mask, **kwargs)
    r = floydnet_formula(*ref_in, attn_mask=mask, **kwargs)
    torch.testing.assert_close(y, r, atol=atol, rtol=rtol)
    g = torch.randn_like(r)
    for a, b in zip(torch.autograd.grad(y, ours_in, g), torch.autograd.grad(r, ref_in, g)):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.fixture
def path_spy(monkeypatch):
    """Records which path ran: 'fused' (gradops' operator) or 'chunked'."""
    seen = []
    real_fused, real_chunked = pivotal_mod._fused, pivotal_mod._chunked

    def fused(*a, **k):
        seen.append("fused")
        return real_fused(*a, **k)

    def chunked(*a, **k):
        seen.append("chunked")
        return real_chunked(*a, **k)

    monkeypatch.setattr(pivotal_mod, "_fused", fused)
    monkeypatch.setattr(pivotal_mod, "_chunked", chunked)
    return seen


def bool_mask(shape, p=0.3):
    return torch.rand(shape) < p


# (mask factory, expected path): shapes broadcast to (B, H, L_i, L_k, L_j) = (2, 2, 4, 3, 5)
MASKS = {
    "none": (lambda: None, "fused"),
    "bool_b1n1k": (lambda: bool_mask((2, 1, 4, 1, 5)), "fused"),
    "bool_full_row": (lambda: torch.ones(2, 1, 4, 1, 5, dtype=torch.bool).index_fill_(2, torch.tensor([0, 2]), False),
                      "fused"),
    "bool_rank3_broadcast": (lambda: bool_mask((4, 1, 5)), "fused"),
    "bool_per_head": (lambda: bool_mask((2, 2, 4, 1, 5)), "chunked"),
    "bool_per_k": (lambda: bool_mask((1, 1, 4, 3, 5)), "chunked"),
    "bool_full_shape": (lambda: bool_mask((2, 2, 4, 3, 5)), "chunked"),
    "float_full": (lambda: torch.randn(2, 2, 4, 3, 5, dtype=f64), "chunked"),
    "float_broadcast": (lambda: torch.randn(3, 5, dtype=f64), "chunked"),
    "float_neg_inf": (lambda: torch.zeros(1, 1, 4, 1, 5, dtype=f64).masked_fill_(bool_mask((1, 1, 4, 1, 5)), -1e4),
                      "chunked"),
    "uint8_is_additive": (lambda: torch.randint(0, 2, (2, 1, 4, 1, 5), dtype=torch.uint8), "chunked"),
}


@pytest.mark.floyd_float64
@pytest.mark.parametrize("kind", list(MASKS))
def test_masks_match_floydnet(backend, kind, path_spy):
    factory, expected_path = MASKS[kind]
    mask = factory()
    if kind != "bool_full_row" and mask is not None and mask.dtype == torch.bool:
        mask.view(-1)[0] = True
    compare(make_inputs(), attn_mask=mask)
    assert path_spy == [expected_path]


@pytest.mark.floyd_float64
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("cap", [-1, 0.0, 2.0])
def test_scale_default_and_softmax_cap(backend, scale, cap, path_spy):
    ins = make_inputs()
    with torch.no_grad():
        ins[0].mul_(3.0)  # large logits so the cap bites
    compare(ins, scale=scale, softmax_cap=cap, attn_mask=bool_mask((2, 1, 4, 1, 5)))
    assert path_spy == ["chunked" if cap > 0 else "fused"]


@pytest.mark.floyd_float64
def test_scale_default_is_one_over_sqrt_2d(backend):
    ins = [t.detach() for t in make_inputs(d=8)]
    torch.testing.assert_close(pivotal_attention(*ins), pivotal_attention(*ins, scale=1 / math.sqrt(16)),
                               atol=0, rtol=0)


def test_small_inf_takes_the_literal_path(backend, path_spy):
    """With a small ``inf`` a masked pivot keeps a visible share of the softmax (FloydNet's
    finite -inf); the fused operator excludes it exactly, so the literal path runs."""
    mask = bool_mask((2, 1, 4, 1, 5))
    mask[0, 0, 0] = True
    compare(make_inputs(), attn_mask=mask, inf=1.0)
    assert path_spy == ["chunked"]


@pytest.mark.floyd_float64
def test_floydnet_block_views(backend, path_spy):
    """FloydNet's block layout: one [B, N, N, 5C] projection chunked and permuted to five
    non-contiguous [B, H, N, N, D] views, passed with the dropout= keyword."""
    b, n, h, d = 2, 5, 2, 3
    proj = torch.randn(b, n, n, 5 * h * d, dtype=f64)
    views = [t.view(b, n, n, h, d).permute(0, 3, 1, 2, 4) for t in proj.chunk(5, dim=-1)]
    assert not any(v.is_contiguous() for v in views)
    mask = bool_mask((b, 1, n, 1, n))
    ours_leaf = proj.clone().requires_grad_(True)
    ref_leaf = proj.clone().requires_grad_(True)

    def run(fn, leaf):
        vs = [t.view(b, n, n, h, d).permute(0, 3, 1, 2, 4) for t in leaf.chunk(5, dim=-1)]
        return fn(*vs, attn_mask=mask, dropout=0.0)

    y, r = run(pivotal_attention, ours_leaf), run(floydnet_formula, ref_leaf)
    torch.testing.assert_close(y, r, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(r)
    y.backward(g)
    r.backward(g)
    torch.testing.assert_close(ours_leaf.grad, ref_leaf.grad, atol=1e-10, rtol=1e-10)
    assert path_spy == ["fused"]
    # and the chunked path on the same views
    compare(views, attn_mask=bool_mask((b, h, n, n, n)))


def test_chunked_path_tiles_and_bounded_memory(backend, monkeypatch):
    """Many small tiles: same values and gradients as the whole formula, and no tensor as
    large as the [B,H,L_i,L_k,L_j] scores is ever created, forward or backward."""
    monkeypatch.setattr(pivotal_mod, "TILE_ELEMENTS", 96)
    b, h, li, lk, lj, d = 1, 2, 12, 10, 16, 2
    full = b * h * li * lk * lj
    ins = make_inputs(b, h, li, lk, lj, d)
    mask = torch.randn(b, h, li, lk, lj, dtype=f64)  # additive and full-shaped: sliced per tile
    compare(ins, attn_mask=mask, softmax_cap=3.0)

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    LargestTensor.largest = max(LargestTensor.largest, t.numel())
            return out

    xs = [t.detach().clone().requires_grad_(True) for t in ins]
    with LargestTensor():
        y = pivotal_attention(*xs, softmax_cap=3.0, dropout=0.1)
        y.sum().backward()
    inputs_max = max(t.numel() for t in ins)
    assert LargestTensor.largest <= max(inputs_max, 96 * 4) < full


def test_dropout_matches_floydnet_with_the_same_generator_state(backend):
    """One tile: the attention weights are dropped with the very draws FloydNet makes."""
    ins = make_inputs()
    ours_in = [t.detach().clone().requires_grad_(True) for t in ins]
    ref_in = [t.detach().clone().requires_grad_(True) for t in ins]
    torch.manual_seed(123)
    y = pivotal_attention(*ours_in, dropout=0.3)
    torch.manual_seed(123)
    r = floydnet_formula(*ref_in, dropout=0.3)
    torch.testing.assert_close(y, r, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(r)
    for a, b in zip(torch.autograd.grad(y, ours_in, g), torch.autograd.grad(r, ref_in, g)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_dropout_backward_reuses_the_forward_mask(backend, monkeypatch):
    """Tiles are recomputed in backward; the recomputation must drop the same weights. For a
    fixed dropout mask y is linear in (v_ij, v_jk), so <g, y> == <dv_ij, v_ij> + <dv_jk, v_jk>
    exactly when backward saw the forward's mask."""
    monkeypatch.setattr(pivotal_mod, "TILE_ELEMENTS", 40)
    ins = make_inputs()
    y = pivotal_attention(*ins, dropout=0.5)
    g = torch.randn_like(y)
    dv_ij, dv_jk = torch.autograd.grad(y, [ins[3], ins[4]], g)
    lhs = (g * y).sum()
    rhs = (dv_ij * ins[3]).sum() + (dv_jk * ins[4]).sum()
    torch.testing.assert_close(lhs, rhs, atol=1e-10, rtol=1e-10)
    assert float((y == 0).double().mean()) < 1  # dropout did not zero everything
    zero = pivotal_attention(*[t.detach() for t in ins], dropout=1.0)
    assert torch.count_nonzero(zero) == 0


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("fused", [True, False])
def test_low_precision_inputs(floyd_backend, dtype, tol, fused):
    ins = [t.detach().to(dtype) for t in make_inputs()]
    cap = -1 if fused else 5.0
    y = pivotal_attention(*ins, softmax_cap=cap)
    assert y.dtype == dtype
    ref = floydnet_formula(*[t.to(f64) for t in ins], softmax_cap=cap)
    torch.testing.assert_close(y.to(f64), ref, atol=tol, rtol=tol)


def test_autocast_casts_to_the_autocast_dtype_on_both_paths(floyd_backend):
    ins = [t.detach().float() for t in make_inputs()]
    with autocast():
        fused = pivotal_attention(*ins)
        chunked = pivotal_attention(*ins, softmax_cap=50.0)
    assert fused.dtype == chunked.dtype == torch.bfloat16
    bf = [t.bfloat16() for t in ins]
    torch.testing.assert_close(fused, pivotal_attention(*bf), atol=0, rtol=0)
    torch.testing.assert_close(chunked, pivotal_attention(*bf, softmax_cap=50.0), atol=0, rtol=0)


def test_bad_arguments_name_the_parameter(backend):
    ins = [t.detach() for t in make_inputs()]
    with pytest.raises(AclnnError, match="k_jk"):
        pivotal_attention(ins[0], ins[1], ins[2].transpose(2, 3), ins[3], ins[4])
    with pytest.raises(AclnnError, match="v_ij"):
        pivotal_attention(ins[0], ins[1], ins[2], ins[3][..., :2], ins[4])
    with pytest.raises(AclnnError, match="attn_mask"):
        pivotal_attention(*ins, attn_mask=torch.zeros(2, 2, 4, 3, 4, dtype=torch.bool))
    with pytest.raises(AclnnError, match="dropout"):
        pivotal_attention(*ins, dropout=1.5)
    with pytest.raises(AclnnError, match="q_ik"):
        pivotal_attention(ins[0][0], *ins[1:])


def test_exported_from_gradops_nn(backend):
    import gradops.nn
    assert gradops.nn.pivotal_attention is pivotal_attention
