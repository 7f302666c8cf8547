"""Independent check of gradops.nn (issue 7): gradcheck on shapes the other nn tests do not
use, drop-in equivalence of the norm modules with torch.nn's, and torch.compile of a model
using every module (fullgraph, no graph breaks, dynamic shapes)."""
import pytest
import torch
from torch import nn

import gradops
import gradops.nn as gnn
from gradops._backend import available_backends
from gradops.nn import functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import interpreted, promoted_layer_norm

f64 = torch.float64


def _leaf(*shape, dtype=f64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


# ------------------------------------------------------------------ 1. gradcheck (float64)

@pytest.mark.parametrize("x_shape,normalized_shape,affine", [
    ((2, 3, 4, 5), (4, 5), "wb"),
    ((2, 3, 4, 5), (3, 4, 5), "w"),
    ((3, 2, 6), (2, 6), "b"),
    ((4, 7), (7,), ""),
    ((2, 2, 3), [3], "wb"),
])
def test_layer_norm_gradcheck(backend, x_shape, normalized_shape, affine):
    x = _leaf(*x_shape)
    w = _leaf(*normalized_shape) if "w" in affine else None
    b = _leaf(*normalized_shape) if "b" in affine else None
    args = [t for t in (x, w, b) if t is not None]

    def fn(*ts):
        it = iter(ts)
        xx = next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        return F.layer_norm(xx, normalized_shape, ww, bb, eps=1e-3)

    assert torch.autograd.gradcheck(fn, args)


def test_layer_norm_gradcheck_non_contiguous_input(backend):
    base = torch.randn(5, 3, 4, dtype=f64, requires_grad=True)
    w = _leaf(3, 5)
    assert torch.autograd.gradcheck(lambda t, ww: F.layer_norm(t.transpose(0, 2), (3, 5), ww), (base, w))


@pytest.mark.parametrize("x_shape,normalized_shape,with_weight,eps", [
    ((2, 3, 4, 5), (4, 5), True, None),
    ((2, 3, 4, 5), (3, 4, 5), False, 1e-2),
    ((6, 2, 3), (2, 3), False, None),
    ((3, 9), (9,), True, 0.5),
])
def test_rms_norm_gradcheck(backend, x_shape, normalized_shape, with_weight, eps):
    x = _leaf(*x_shape)
    if with_weight:
        w = _leaf(*normalized_shape)
        assert torch.autograd.gradcheck(lambda a, b: F.rms_norm(a, normalized_shape, b, eps), (x, w))
    else:
        assert torch.autograd.gradcheck(lambda a: F.rms_norm(a, normalized_shape, None, eps), (x,))


# empty sequences (repeated ends, a leading 0, zero lengths), sequences shorter than a block,
# stride larger than the block (tokens covered by no window get a zero gradient)
NSA_CASES = [
    (3, 5, [0, 7, 7, 19], "cumsum"),
    (3, 5, [0, 2, 13, 0], "lengths"),
    (2, 2, [4, 4, 11], "cumsum"),
    (4, 1, [5, 0, 9], "lengths"),
    (1, 3, [10], "cumsum"),
]


# the Triton interpreter is slow: its kernels get the first case only (empty sequences, stride > block)
@pytest.mark.parametrize("block,stride,seq_lens,kind,backend",
                         [c + ("reference",) for c in NSA_CASES] +
                         [NSA_CASES[0] + (b,) for b in available_backends("nsa_compress", torch.device("cpu"))
                          if b != "reference"])
def test_nsa_compress_gradcheck(block, stride, seq_lens, kind, backend):
    total = sum(seq_lens) if kind == "lengths" else seq_lens[-1]
    x, w = _leaf(total, 2, 3), _leaf(block, 2)
    if backend == "triton":
        pytest.importorskip("triton")
        try:
            F.nsa_compress(x, w, block, stride, seq_lens, kind, backend=backend)
        except gradops.AclnnError as e:  # a kernel without float64 support says so, by status
            pytest.skip(f"triton backend rejects float64: {e}")
    for sl in (seq_lens, torch.tensor(seq_lens)) if backend == "reference" else (seq_lens,):
        assert torch.autograd.gradcheck(
            lambda a, b, sl=sl: F.nsa_compress(a, b, block, stride, sl, kind, backend=backend), (x, w))


def test_nsa_compress_uncovered_tokens_get_zero_gradient(backend):
    # stride 5 > block 3 on one sequence of 13: windows [0,3), [5,8), [10,13)
    x, w = _leaf(13, 2, 3), _leaf(3, 2)
    out = F.nsa_compress(x, w, 3, 5, [13])
    assert out.shape == (3, 2, 3)
    out.backward(torch.ones_like(out))
    covered = torch.zeros(13, dtype=torch.bool)
    for s in (0, 5, 10):
        covered[s:s + 3] = True
    assert (x.grad[~covered] == 0).all()
    assert (x.grad[covered] != 0).all()


def test_nsa_compress_all_sequences_too_short(backend):
    # no block at all: an empty output, and zero gradients
    x, w = _leaf(5, 2, 3), _leaf(4, 2)
    out = F.nsa_compress(x, w, 4, 2, [3, 5])
    assert out.shape == (0, 2, 3)
    (out.sum() + 0 * x.sum() + 0 * w.sum()).backward()
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(w.grad) == 0


def _floyd(b, h, n, m, k, d):
    return (_leaf(b, h, n, m, d), _leaf(b, h, n, k, d), _leaf(b, h, n, k, d), _leaf(b, h, k, m, d),
            _leaf(b, h, k, m, d))


@pytest.mark.floyd_float64
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
def test_floyd_attention_gradcheck_fully_masked_rows(backend, mask_dtype):
    b, h, n, m, k, d = 2, 1, 3, 2, 4, 5
    ins = _floyd(b, h, n, m, k, d)
    mask = torch.rand(b, 1, n, 1, k) < 0.4
    mask[1, 0, 2] = True      # every pivot of (b=1, n=2): a uniform row
    mask[0, 0, 0] = False     # and a row with none masked
    mask = mask.to(mask_dtype)
    assert torch.autograd.gradcheck(lambda *t: F.floyd_attention(*t, mask=mask, scale=0.3), ins,
                                    fast_mode=interpreted(backend))


@pytest.mark.floyd_float64
def test_floyd_attention_gradcheck_single_pivot_no_mask(backend):
    ins = _floyd(1, 3, 2, 3, 1, 2)   # K = 1: softmax over one pivot is constant 1
    assert torch.autograd.gradcheck(lambda *t: F.floyd_attention(*t), ins,
                                    fast_mode=interpreted(backend))


@pytest.mark.parametrize("kwargs", [
    dict(attn_mask="bool_full_row"),                     # fused path with a fully masked row
    dict(attn_mask="bool_per_k", softmax_cap=1.5),       # chunked path
    dict(attn_mask="additive", scale=0.7),               # chunked path, additive
])
@pytest.mark.floyd_float64
def test_pivotal_attention_gradcheck(backend, kwargs):
    b, h, li, lk, lj, d = 1, 2, 3, 2, 4, 3
    ins = (_leaf(b, h, li, lk, d), _leaf(b, h, li, lj, d), _leaf(b, h, lj, lk, d), _leaf(b, h, li, lj, d),
           _leaf(b, h, lj, lk, d))
    kwargs = dict(kwargs)
    kind = kwargs.pop("attn_mask")
    if kind == "bool_full_row":
        mask = torch.rand(b, 1, li, 1, lj) < 0.3
        mask[0, 0, 1] = True
    elif kind == "bool_per_k":
        mask = torch.rand(b, 1, 1, lk, lj) < 0.3
        mask[..., 0, :] = True
    else:
        mask = torch.randn(b, h, li, lk, lj, dtype=f64)
    assert torch.autograd.gradcheck(lambda *t: gradops.pivotal_attention(*t, attn_mask=mask, **kwargs), ins,
                                    fast_mode=interpreted(backend))


# ------------------------------------------------------------------ 2. drop-in norm modules

LN_ARGS = [
    dict(normalized_shape=16),
    dict(normalized_shape=(4, 6), eps=1e-3),
    dict(normalized_shape=[12], elementwise_affine=False),
    dict(normalized_shape=(3, 8), bias=False),
    dict(normalized_shape=10, eps=0.1, elementwise_affine=True, bias=False),
]
RMS_ARGS = [
    dict(normalized_shape=16),
    dict(normalized_shape=(4, 6), eps=1e-3),
    dict(normalized_shape=[12], elementwise_affine=False),
    dict(normalized_shape=(3, 8), eps=None),
    dict(normalized_shape=10, eps=0.1),
]

# bf16 output: 8-bit mantissa, both sides round a float32 result once (ulp 2^-8 relative),
# so they may differ by one bf16 ulp; parameter gradients are summed over 3*5 rows in
# float32 by both and rounded once to the parameter dtype.
TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}


def _perturb_params(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))


def _fwd_bwd(module, x, dy, forward=None):
    """y, dx and the parameters' gradients of ``module`` (called through ``forward(module, x)``
    when given)."""
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = module(xi) if forward is None else forward(module, xi)
    y.backward(dy)
    return y.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()}


def _check_drop_in(ours, theirs, dtype):
    assert isinstance(ours, type(theirs).__mro__[0].__mro__[0]) or isinstance(ours, nn.Module)
    shape = tuple(theirs.normalized_shape)
    _perturb_params(theirs)
    theirs.to(dtype)
    # torch checkpoint -> ours (strict) and back
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ours.to(dtype)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    back = type(theirs)(**{k: v for k, v in _ctor_args(theirs).items()}).to(dtype)
    back.load_state_dict(ours.state_dict(), strict=True)
    for k, v in back.state_dict().items():
        assert torch.equal(v, theirs.state_dict()[k])
    x = (torch.randn((3, 5) + shape) * 3 + 1).to(dtype)
    dy = torch.randn_like(x)
    yo, gxo, gpo = _fwd_bwd(ours, x, dy)
    yt, gxt, gpt = _fwd_bwd(theirs, x, dy)
    assert yo.dtype == yt.dtype == dtype
    assert gpo.keys() == gpt.keys()
    assert all(gpo[k].dtype == gpt[k].dtype for k in gpo)
    if dtype == torch.float32:
        tol = TOLS[dtype]
        torch.testing.assert_close(yo, yt, **tol)
        torch.testing.assert_close(gxo, gxt, **tol)
        for k in gpo:
            torch.testing.assert_close(gpo[k], gpt[k], **tol, msg=lambda m, k=k: f"grad {k}: {m}")
        return
    # bf16: torch's CPU LayerNorm accumulates the parameter gradients less precisely than
    # gradops (measured: up to ~12 bf16 ulps off the float64 value where gradops is ~1-2), so
    # compare both with the float64 result of the same rounded inputs: gradops' error may not
    # exceed torch's by more than one bf16 ulp of the tensor's largest value.
    oracle = type(theirs)(**_ctor_args(theirs)).to(f64)
    oracle.load_state_dict({k: v.to(f64) for k, v in theirs.state_dict().items()})
    if isinstance(oracle, nn.RMSNorm) and oracle.eps is None:
        oracle.eps = torch.finfo(dtype).eps  # what eps=None means for the bf16 input
    y64, gx64, gp64 = _fwd_bwd(oracle, x.to(f64), dy.to(f64))
    for name, a, b, ref in [("y", yo, yt, y64), ("dx", gxo, gxt, gx64)] + \
            [(f"grad {k}", gpo[k], gpt[k], gp64[k]) for k in gpo]:
        err_ours = (a.to(f64) - ref).abs().max().item()
        err_torch = (b.to(f64) - ref).abs().max().item()
        ulp = ref.abs().max().item() * 2.0 ** -8
        assert err_ours <= err_torch + ulp, f"{name}: gradops err {err_ours:.4g}, torch err {err_torch:.4g}"
        torch.testing.assert_close(a.to(f64), ref, rtol=2 ** -7, atol=2 * ulp, msg=lambda m, n=name: f"{n}: {m}")


def _ctor_args(m):
    if isinstance(m, nn.LayerNorm):
        return dict(normalized_shape=m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine,
                    bias=m.bias is not None if m.elementwise_affine else True)
    return dict(normalized_shape=m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", LN_ARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_layer_norm_module_is_drop_in(backend, kwargs, dtype):
    ours, theirs = gnn.LayerNorm(**kwargs), nn.LayerNorm(**kwargs)
    assert isinstance(ours, nn.LayerNorm)
    assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    _check_drop_in(ours, theirs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", RMS_ARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_rms_norm_module_is_drop_in(backend, kwargs, dtype):
    ours, theirs = gnn.RMSNorm(**kwargs), nn.RMSNorm(**kwargs)
    assert isinstance(ours, nn.RMSNorm)
    _check_drop_in(ours, theirs, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rms_norm_default_eps_is_torchs_for_every_dtype(backend, dtype):
    # regression: eps=None took finfo(input dtype).eps (2**-7 for bf16) where torch takes the
    # compute dtype's (float32's 1.2e-7 for half input): with rows of rms ~ 0.03 the two
    # differed by up to ~140% (1.39 absolute against the float64 formula), far beyond rounding
    x = (torch.randn(4, 8) * 0.03).to(dtype)
    w = torch.randn(8, dtype=dtype)
    ours = F.rms_norm(x, (8,), w)
    theirs = torch.nn.functional.rms_norm(x, (8,), w)
    compute = f64 if dtype == f64 else torch.float32
    x64 = x.to(f64)
    exact = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + torch.finfo(compute).eps) * w.to(f64)
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5, f64: 1e-12}[dtype]
    torch.testing.assert_close(ours.to(f64), exact, rtol=tol, atol=tol)
    torch.testing.assert_close(ours.to(f64), theirs.to(f64), rtol=tol, atol=tol)
    module, torch_module = gnn.RMSNorm(8, dtype=dtype), nn.RMSNorm(8, dtype=dtype)
    torch.testing.assert_close(module(x).to(f64), torch_module(x).to(f64), rtol=tol, atol=tol)


@pytest.mark.parametrize("cls", [gnn.LayerNorm, gnn.RMSNorm])
def test_norm_module_float32_params_with_bf16_input(backend, cls):
    # the mixed-precision layout (fp32 master weights, bf16 activations) torch also accepts
    torch_cls = nn.LayerNorm if cls is gnn.LayerNorm else nn.RMSNorm
    ours, theirs = cls(8), torch_cls(8)
    _perturb_params(theirs)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 8, dtype=torch.bfloat16) * 0.05  # small rows: the default eps shows
    dy = torch.randn_like(x)
    yo, gxo, gpo = _fwd_bwd(ours, x, dy)
    # no torch LayerNorm call for this mix exists on both devices (promoted_layer_norm says why)
    promoted = None
    if cls is gnn.LayerNorm:
        def promoted(m, xi):
            return promoted_layer_norm(xi, m.normalized_shape, m.weight, m.bias, m.eps)
    yt, gxt, gpt = _fwd_bwd(theirs, x, dy, promoted)
    assert yo.dtype == yt.dtype
    torch.testing.assert_close(yo.float(), yt.float(), **TOLS[torch.bfloat16])
    torch.testing.assert_close(gxo.float(), gxt.float(), **TOLS[torch.bfloat16])
    for k in gpo:
        assert gpo[k].dtype == gpt[k].dtype == torch.float32
        torch.testing.assert_close(gpo[k], gpt[k], **TOLS[torch.bfloat16])


# ------------------------------------------------------------------ 3. torch.compile

class EveryModule(nn.Module):
    def __init__(self, c=8, heads=2):
        super().__init__()
        self.ln = gnn.LayerNorm((4, c), bias=False)          # multi-dim normalized_shape
        self.attn = gnn.FloydAttention(c, heads, bias=True)
        self.rms = gnn.RMSNorm(c, elementwise_affine=False)
        self.rms2 = gnn.RMSNorm(c, eps=1e-4)
        self.nsa = gnn.NsaCompress(block_size=3, stride=4, num_heads=heads)  # stride > block

    def forward(self, x, seq_lens, attn_mask=None):
        y = self.ln(x) if x.shape[-2] == 4 else x
        y = self.rms2(x + self.attn(self.rms(y), attn_mask))
        b, n, _, c = y.shape
        return self.nsa(y.reshape(b * n * n, 2, c // 2), seq_lens)


def _grads(model, x, seq_lens, mask):
    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = model(xi, seq_lens, mask)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), xi.grad, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def _same(a, b, tol=dict(rtol=1e-5, atol=1e-6)):
    torch.testing.assert_close(a[0], b[0], **tol)
    torch.testing.assert_close(a[1], b[1], **tol)
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        torch.testing.assert_close(a[2][k], b[2][k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mask_kind", ["fused_bool", "additive"])
def test_explain_reports_no_graph_break(backend, fresh_dynamo, mask_kind):
    torch.manual_seed(0)
    model = EveryModule()
    x = torch.randn(2, 4, 4, 8)
    mask = torch.rand(2, 1, 4, 1, 4) < 0.3 if mask_kind == "fused_bool" else torch.randn(4, 4) 
    explanation = torch._dynamo.explain(model)(x, [20, 32], mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("dynamic", [None, True])
def test_compile_with_changing_seq_lens_lists(backend, fresh_dynamo, dynamic):
    # regression: after a second distinct seq_lens list (automatic dynamic shapes), or with
    # dynamic=True from the start, dynamo passed symbolic ints to nsa_compress's fake
    # implementation, which rejected them ("seq_lens is [s13, s78], expected a list of
    # ints"): a training loop crashed on its second batch
    torch.manual_seed(0)
    model = EveryModule()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend=counter)
    cases = ((2, [20, 32]), (2, [7, 32]), (3, [5, 48]), (3, [5, 48]))
    for i, (b, ends) in enumerate(cases):
        if i == len(cases) - 1:
            before = counter.frame_count
        x = torch.randn(b, 4, 4, 8)
        mask = torch.rand(b, 1, 4, 1, 4) < 0.3
        _same(_grads(model, x, ends, mask), _grads(compiled, x, ends, mask))
    # a list is a compile-time constant: each new list compiles once (dynamo may also compile
    # an empty wrapper frame), a repeated one reuses its graph
    assert counter.frame_count == before
    assert sum(len(g.graph.nodes) > 0 for g in counter.graphs) <= 3


def test_compile_dynamic_with_tensor_seq_lens_does_not_recompile(backend, fresh_dynamo):
    torch.manual_seed(0)
    model = EveryModule()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    # batch sizes differ from len(seq_lens) == 2, so duck sizing adds no equality guard
    for i, (b, ends) in enumerate(((3, [20, 48]), (5, [5, 80]), (4, [60, 64]))):
        x = torch.randn(b, 4, 4, 8)
        sl = torch.tensor(ends)
        _same(_grads(model, x, sl, None), _grads(compiled, x, sl, None))
        if i == 0:
            first = counter.frame_count
    assert counter.frame_count == first  # new batch sizes and seq_lens values: no recompile
    assert max(len(g.graph.nodes) for g in counter.graphs) > 0
