"""gradops.nn.functional: gradcheck in float64, values and gradients against independent
float64 PyTorch formulas, the library's backward operators really being the ones called,
double backward refused, custom-op registrations (opcheck) and the autocast policy."""

import importlib

import pytest
import torch

import gradops.ops.floyd_attention as floyd_ops
import gradops.ops.nsa_compress as nsa_ops
from gradops.errors import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, AclnnError
from gradops.nn import functional as F

from helpers import autocast, interpreted, skip_if_floyd_float64_refused

f64 = torch.float64


# ---------------------------------------------------------------- independent float64 oracles

def ln_oracle(x, shape, w=None, b=None, eps=1e-5):
    dims = tuple(range(-len(shape), 0))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def rms_oracle(x, shape, w=None, eps=None):
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    dims = tuple(range(-len(shape), 0))
    y = x / torch.sqrt((x * x).mean(dim=dims, keepdim=True) + eps)
    return y if w is None else y * w


def nsa_oracle(x, w, block, stride, ends):
    """Blocks of each sequence ``[start, end)``: ``out[c] = sum_j w[j] * x[start_c + j]``."""
    rows, start = [], 0
    for end in ends:
        s = start
        while s + block <= end:
            rows.append((w[:, :, None] * x[s:s + block]).sum(0))
            s += stride
        start = end
    if not rows:
        return x.new_zeros((0,) + tuple(x.shape[1:]))
    return torch.stack(rows)


def floyd_oracle(q, k1, v1, k2, v2, mask=None, scale=1.0):
    """The whole [B,H,N,M,K] score tensor, masked pivots excluded (a fully masked row is uniform)."""
    s = scale * (torch.einsum("bhnmd,bhnkd->bhnmk", q, k1) + torch.einsum("bhnmd,bhkmd->bhnmk", q, k2))
    if mask is not None:
        s = s.masked_fill(mask.bool(), -1e300)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhnmk,bhnkd->bhnmd", p, v1) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def floyd_inputs(b=1, h=2, n=3, m=4, k=5, d=3, dtype=f64):
    q = torch.randn(b, h, n, m, d, dtype=dtype)
    k1, v1 = torch.randn(b, h, n, k, d, dtype=dtype), torch.randn(b, h, n, k, d, dtype=dtype)
    k2, v2 = torch.randn(b, h, k, m, d, dtype=dtype), torch.randn(b, h, k, m, d, dtype=dtype)
    return q, k1, v1, k2, v2


def assert_grads_match(fn, oracle, inputs, atol=1e-10, rtol=1e-10):
    """Forward and every input gradient of ``fn`` equal the oracle's (autograd on the formula)."""
    a, o = leaves(*inputs), leaves(*inputs)
    ya, yo = fn(*a), oracle(*o)
    torch.testing.assert_close(ya, yo, atol=atol, rtol=rtol)
    gy = torch.randn_like(yo)
    ga = torch.autograd.grad(ya, a, gy)
    go = torch.autograd.grad(yo, o, gy)
    for x, y in zip(ga, go):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- gradcheck (float64)

@pytest.mark.parametrize("shape,affine", [((8,), "wb"), ((3, 4), "wb"), ((8,), "w"), ((8,), "b"), ((8,), "")])
def test_layer_norm_gradcheck(backend, shape, affine):
    x = torch.randn((2, 3) + shape, dtype=f64, requires_grad=True)
    w = torch.randn(shape, dtype=f64, requires_grad=True) if "w" in affine else None
    b = torch.randn(shape, dtype=f64, requires_grad=True) if "b" in affine else None
    args = [t for t in (x, w, b) if t is not None]

    def fn(*ts):
        it = iter(ts)
        xx = next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        return F.layer_norm(xx, shape, ww, bb, eps=1e-5)

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("shape,with_weight", [((8,), True), ((2, 4), True), ((8,), False)])
def test_rms_norm_gradcheck(backend, shape, with_weight):
    x = torch.randn((3, 2) + shape, dtype=f64, requires_grad=True)
    if with_weight:
        w = torch.randn(shape, dtype=f64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w: F.rms_norm(x, shape, w, eps=1e-6), (x, w))
    else:
        assert torch.autograd.gradcheck(lambda x: F.rms_norm(x, shape), (x,))


@pytest.mark.parametrize("seq_lens,kind", [([9, 20], "cumsum"), ([9, 0, 11], "lengths"),
                                           ("host tensor [7, 20]", "cumsum")], ids=str)
def test_nsa_compress_gradcheck(backend, seq_lens, kind):
    if seq_lens == "host tensor [7, 20]":  # made here: a parametrize argument is made at collection
        seq_lens = torch.tensor([7, 20], device="cpu")
    x = torch.randn(20, 2, 3, dtype=f64, requires_grad=True)
    w = torch.randn(4, 2, dtype=f64, requires_grad=True)  # block 4 > stride 2: overlapping windows
    assert torch.autograd.gradcheck(lambda x, w: F.nsa_compress(x, w, 4, 2, seq_lens, kind), (x, w),
                                    fast_mode=interpreted(backend))


@pytest.mark.floyd_float64
@pytest.mark.parametrize("masked", ["none", "some", "full_row"])
def test_floyd_attention_gradcheck(backend, masked):
    ins = leaves(*floyd_inputs())
    mask = None
    if masked != "none":
        mask = torch.rand(1, 1, 3, 1, 5) < 0.4
        if masked == "full_row":
            mask[0, 0, 1] = True  # every pivot of row n=1 removed: uniform softmax
    assert torch.autograd.gradcheck(lambda *t: F.floyd_attention(*t, mask=mask, scale=0.6), ins,
                                    fast_mode=interpreted(backend))


# ---------------------------------------------------------------- against float64 formulas

def test_layer_norm_matches_formula_and_torch(backend):
    x, w, b = torch.randn(4, 5, 6, dtype=f64), torch.randn(5, 6, dtype=f64), torch.randn(5, 6, dtype=f64)
    assert_grads_match(lambda x, w, b: F.layer_norm(x, (5, 6), w, b, 1e-3),
                       lambda x, w, b: ln_oracle(x, (5, 6), w, b, 1e-3), (x, w, b))
    torch.testing.assert_close(F.layer_norm(x, [5, 6], w, b), torch.nn.functional.layer_norm(x, [5, 6], w, b))


def test_rms_norm_matches_formula_and_default_eps(backend):
    x, w = torch.randn(4, 7, dtype=f64) * 1e-9, torch.randn(7, dtype=f64)  # tiny x: eps matters
    assert_grads_match(lambda x, w: F.rms_norm(x, 7, w), lambda x, w: rms_oracle(x, (7,), w, None), (x, w))
    x32 = torch.randn(4, 7) * 1e-4
    torch.testing.assert_close(F.rms_norm(x32, [7]), torch.nn.functional.rms_norm(x32, [7]))


def test_nsa_compress_matches_formula(backend):
    x, w = torch.randn(37, 3, 4, dtype=f64), torch.randn(5, 3, dtype=f64)
    ends = [12, 12, 30, 37]  # an empty sequence and a tail that fills no block
    assert_grads_match(lambda x, w: F.nsa_compress(x, w, 5, 3, ends),
                       lambda x, w: nsa_oracle(x, w, 5, 3, ends), (x, w))
    lengths = [12, 0, 18, 7]
    assert_grads_match(lambda x, w: F.nsa_compress(x, w, 5, 3, torch.tensor(lengths), "lengths"),
                       lambda x, w: nsa_oracle(x, w, 5, 3, ends), (x, w))


@pytest.mark.floyd_float64
def test_floyd_attention_matches_formula_on_views(backend):
    q, k1, v1, k2, v2 = floyd_inputs(b=2, h=2, n=4, m=3, k=5, d=4)
    mask = torch.rand(2, 1, 4, 1, 5) < 0.3
    mask[1, 0, 2] = True
    # permuted, non-contiguous views of the same values
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k1, v1, k2, v2)]
    assert not views[0].is_contiguous()
    assert_grads_match(lambda *t: F.floyd_attention(*t, mask=mask, scale=0.5),
                       lambda *t: floyd_oracle(*t, mask=mask, scale=0.5), views)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_half_inputs_compute_in_float32(backend, dtype, tol):
    """Half activations with float32 master weights: output in the activation dtype, weight
    gradients in float32, values within the dtype's rounding of the float64 result."""
    x = torch.randn(6, 16)
    w, b = torch.randn(16), torch.randn(16)
    xh = x.to(dtype).requires_grad_(True)
    wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y = F.layer_norm(xh, (16,), wl, bl)
    assert y.dtype == dtype
    gy = torch.randn(6, 16).to(dtype)
    y.backward(gy)
    assert xh.grad.dtype == dtype and wl.grad.dtype == torch.float32 and bl.grad.dtype == torch.float32
    o = leaves(xh.detach().to(f64), w.to(f64), b.to(f64))
    yo = ln_oracle(*o[:1], (16,), o[1], o[2])
    yo.backward(gy.to(f64))
    torch.testing.assert_close(y.to(f64), yo, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(wl.grad.to(f64), o[1].grad, atol=tol * 8, rtol=tol)
    torch.testing.assert_close(xh.grad.to(f64), o[0].grad, atol=tol * 8, rtol=tol)

    gr = torch.randn(16).requires_grad_(True)
    xr = x.to(dtype).requires_grad_(True)
    F.rms_norm(xr, 16, gr).backward(gy)
    assert gr.grad.dtype == torch.float32 and xr.grad.dtype == dtype


# ---------------------------------------------------------------- the library's backwards

@pytest.mark.parametrize("family", ["layer_norm", "rms_norm", "nsa_compress", "floyd_attention"])
def test_backward_is_the_library_operator(backend, family, monkeypatch):
    """Autograd reaches gradops' backward operator (prepare_*_grad/_backward; for the norms the
    backend's computation, which both their prepare and the eager path run; for Floyd attention,
    whose eager call this is, the planned backward of ops.floyd_attention), once per backward."""
    calls = []
    backend_module = importlib.import_module(f"gradops.{'kernels' if backend == 'triton' else 'reference'}.{family}")
    module, name = {"layer_norm": (backend_module, "layer_norm_backward"),
                    "rms_norm": (backend_module, "rms_norm_grad"),
                    "nsa_compress": (nsa_ops, "prepare_nsa_compress_grad"),
                    "floyd_attention": (floyd_ops, "run_planned_floyd_attention_grad")}[family]
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    if family == "layer_norm":
        x, w = leaves(torch.randn(3, 8), torch.randn(8))
        F.layer_norm(x, 8, w).sum().backward()
    elif family == "rms_norm":
        x, w = leaves(torch.randn(3, 8), torch.randn(8))
        F.rms_norm(x, 8, w).sum().backward()
    elif family == "nsa_compress":
        x, w = leaves(torch.randn(12, 2, 4), torch.randn(4, 2))
        F.nsa_compress(x, w, 4, 4, [12]).sum().backward()
    else:
        ins = leaves(*floyd_inputs(dtype=torch.float32))
        F.floyd_attention(*ins).sum().backward()
        x, w = ins[0], ins[1]
    assert calls == [name]
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("family", ["layer_norm", "rms_norm", "nsa_compress", "floyd_attention"])
def test_double_backward_is_a_clear_error(backend, family):
    if family == "layer_norm":
        x, w = leaves(torch.randn(3, 8, dtype=f64), torch.randn(8, dtype=f64))
        y = F.layer_norm(x, 8, w)
    elif family == "rms_norm":
        x, w = leaves(torch.randn(3, 8, dtype=f64), torch.randn(8, dtype=f64))
        y = F.rms_norm(x, 8, w)
    elif family == "nsa_compress":
        x, w = leaves(torch.randn(8, 2, 4, dtype=f64), torch.randn(4, 2, dtype=f64))
        y = F.nsa_compress(x, w, 4, 2, [8])
    else:
        skip_if_floyd_float64_refused(backend, torch.get_default_device())
        ins = leaves(*floyd_inputs())
        x = ins[0]
        y = F.floyd_attention(*ins)
    (gx,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)  # first order is fine
    with pytest.raises(NotImplementedError, match=f"{family}: double backward"):
        gx.sum().backward()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused_add"])
@pytest.mark.parametrize("family", ["layer_norm", "rms_norm"])
def test_first_order_gradients_with_create_graph_of_batched_rows(backend, family, fused, device):
    # With create_graph the backward runs as the backward op, which takes the statistics in
    # the operator's shapes (x's leading dims), not the eager path's one per row; rows in two
    # leading dims, against float64 autograd of the formula.
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, device="cpu").to(device) for _ in range(2))
    w = torch.randn(8, generator=gen, dtype=torch.float64, device="cpu").to(device)
    dy = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, device="cpu").to(device)
    plain, add, formula = ((F.layer_norm, F.fused_add_layer_norm, lambda h, w: ln_oracle(h, (8,), w))
                           if family == "layer_norm" else (F.rms_norm, F.fused_add_rms_norm,
                                                           lambda h, w: rms_oracle(h, (8,), w)))
    for create_graph in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, r, w)]
        y = add(leaves[0], leaves[1], (8,), leaves[2])[0] if fused else plain(leaves[0], (8,), leaves[2])
        got = torch.autograd.grad(y, leaves if fused else [leaves[0], leaves[2]], dy, create_graph=create_graph)
        ref = [t.clone().requires_grad_() for t in (x, r, w)]
        want = torch.autograd.grad(formula(ref[0] + ref[1] if fused else ref[0], ref[2]),
                                   ref if fused else [ref[0], ref[2]], dy)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_gradients_skip_unneeded_outputs(backend, monkeypatch):
    """Only the gradients autograd asks for are computed (output_mask follows requires_grad)."""
    seen = []
    backend_module = importlib.import_module(f"gradops.{'kernels' if backend == 'triton' else 'reference'}.layer_norm")
    real = backend_module.layer_norm_backward

    def spy(dy, x, mean, rstd, weight, output_mask, *args, **kwargs):
        seen.append(tuple(output_mask))
        return real(dy, x, mean, rstd, weight, output_mask, *args, **kwargs)

    monkeypatch.setattr(backend_module, "layer_norm_backward", spy)
    x = torch.randn(3, 8, requires_grad=True)
    w, b = torch.randn(8), torch.randn(8, requires_grad=True)
    F.layer_norm(x, 8, w, b).sum().backward()
    assert seen == [(True, False, True)]
    assert b.grad is not None


# ---------------------------------------------------------------- eager path and custom ops
# Eager calls of the norms run an autograd.Function; whatever traces or transforms a call
# gets the custom op (its fake implementation, its registrations).

_NORMS = {
    "layer_norm": lambda x, w: F.layer_norm(x, (8,), w, None),
    "rms_norm": lambda x, w: F.rms_norm(x, (8,), w),
    "fused_add_layer_norm": lambda x, w: F.fused_add_layer_norm(x, x * 0.5, (8,), w)[0],
    "fused_add_rms_norm": lambda x, w: F.fused_add_rms_norm(x, x * 0.5, (8,), w)[0],
}


@pytest.mark.parametrize("name", list(_NORMS))
def test_norm_outputs_can_be_modified_in_place(backend, name):
    """As torch's: an output is a tensor of its own, not a view autograd forbids writing."""
    x, w = leaves(torch.randn(3, 2, 8, dtype=f64), torch.randn(8, dtype=f64))
    y = _NORMS[name](x, w)
    want = torch.autograd.grad((y * 2).sum(), (x, w), retain_graph=True)
    y.mul_(2)
    got = torch.autograd.grad(y.sum(), (x, w))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("name", list(_NORMS))
def test_norms_on_meta_tensors_plan_shapes(name):
    x = torch.empty(4, 8, device="meta", dtype=f64, requires_grad=True)
    y = _NORMS[name](x, torch.empty(8, device="meta", dtype=f64))
    assert y.device.type == "meta" and y.shape == (4, 8)


@pytest.mark.parametrize("name", list(_NORMS))
def test_vmap_over_the_norms(name):
    x, w = torch.randn(3, 2, 8, dtype=f64), torch.randn(8, dtype=f64)
    got = torch.func.vmap(lambda r: _NORMS[name](r, w))(x)
    want = torch.stack([_NORMS[name](r, w) for r in x])
    torch.testing.assert_close(got, want)


def test_make_fx_records_the_custom_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = torch.randn(2, 8), torch.randn(8)
    for name, fn in _NORMS.items():
        graph = make_fx(fn)(x, w).graph
        ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
        assert f"gradops.{name.replace('fused_add_', '')}.default" in ops, (name, ops)


# ---------------------------------------------------------------- errors

def test_errors_carry_cann_status_and_name_the_parameter(backend):
    with pytest.raises(AclnnError, match="normalized_shape") as e:
        F.layer_norm(torch.randn(3, 8), (7,))
    assert e.value.status == ACLNN_ERR_PARAM_INVALID
    with pytest.raises(AclnnError, match="weight") as e:
        F.rms_norm(torch.randn(3, 8), (8,), torch.randn(4))
    assert e.value.status == ACLNN_ERR_INNER_TILING_ERROR
    with pytest.raises(AclnnError, match="seq_lens_type"):
        F.nsa_compress(torch.randn(8, 2, 4), torch.randn(4, 2), 4, 2, [8], "bogus")
    with pytest.raises(AclnnError, match="mask"):
        ins = floyd_inputs(dtype=torch.float32)
        F.floyd_attention(*ins, mask=torch.zeros(1, 2, 3, 4, 5, dtype=torch.bool))


# ---------------------------------------------------------------- registrations

def test_custom_op_registrations_pass_opcheck(backend):
    """Fake implementations, autograd registrations and schemas agree with the real ops."""
    x, r, w, b = leaves(torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8))
    for residual in (None, r):  # the plain norms and the fused residual add
        torch.library.opcheck(torch.ops.gradops.layer_norm.default, (x, residual, [8], w, b, 1e-5, None))
        torch.library.opcheck(torch.ops.gradops.rms_norm.default, (x, residual, w, 1e-6, 0.0, "gemma", None))
        torch.library.opcheck(torch.ops.gradops.rms_norm.default, (x, residual, w, 1e-6, 1.0, "llama", None))
    xs, ws = leaves(torch.randn(12, 2, 4), torch.randn(4, 2))
    torch.library.opcheck(torch.ops.gradops.nsa_compress.default, (xs, ws, 4, 2, [5, 12], "cumsum", None))
    ins = leaves(*floyd_inputs(dtype=torch.float32))
    mask = torch.rand(1, 1, 3, 1, 5) < 0.3
    torch.library.opcheck(torch.ops.gradops.floyd_attention.default, (*ins, mask, 0.5, None))
    torch.library.opcheck(torch.ops.gradops.nsa_compress_seqlens_tensor.default,
                          (xs, ws, 4, 2, torch.tensor([5, 12]), "cumsum", None))


def test_backward_op_registrations_pass_opcheck(backend):
    """The backward ops (called by the autograd formulas, and traced into compiled backward
    graphs) have consistent fake implementations too. Inputs do not require grad: these ops
    deliberately have no derivative."""
    x, w, b, dy = torch.randn(3, 8), torch.randn(8), torch.randn(8), torch.randn(3, 8)
    _, mean, rstd, _ = torch.ops.gradops.layer_norm(x, None, [8], w, b, 1e-5, None)
    _, rstd_rms, _ = torch.ops.gradops.rms_norm(x, None, w, 1e-6, 0.0, "gemma", None)
    for dres in (None, torch.randn(3, 8)):  # h's gradient of the fused residual add
        torch.library.opcheck(torch.ops.gradops.layer_norm_backward.default,
                              (dy, dres, x, [8], mean, rstd, w, b, [True, False, True], None))
        torch.library.opcheck(torch.ops.gradops.rms_norm_backward.default,
                              (dy, dres, x, rstd_rms, w, 1.0, "llama", None))
    xs, ws = torch.randn(12, 2, 4), torch.randn(4, 2)
    dout = torch.randn_like(F.nsa_compress(xs, ws, 4, 2, [5, 12]))
    for seq_lens, op in (([5, 12], torch.ops.gradops.nsa_compress_backward.default),
                         (torch.tensor([5, 12]), torch.ops.gradops.nsa_compress_seqlens_tensor_backward.default)):
        torch.library.opcheck(op, (dout, xs, ws, 4, 2, seq_lens, "cumsum", None))
    ins = floyd_inputs(dtype=torch.float32)
    mask = torch.rand(1, 1, 3, 1, 5) < 0.3
    out, smax, ssum = torch.ops.gradops.floyd_attention(*ins, mask, 0.5, None)
    torch.library.opcheck(torch.ops.gradops.floyd_attention_backward.default,
                          (torch.randn_like(out), *ins, out, smax, ssum, mask, 0.5, None))


# ---------------------------------------------------------------- autocast policy

def test_autocast_norms_keep_the_input_dtype(backend):
    """Norms are autocast-neutral (torch's CPU behaviour): a float32 input stays float32 and is
    computed exactly as outside autocast; a bf16 input stays bf16."""
    x, w, b = torch.randn(4, 16), torch.randn(16), torch.randn(16)
    plain = F.layer_norm(x, 16, w, b)
    with autocast():
        y = F.layer_norm(x, 16, w, b)
        r = F.rms_norm(x, 16, w)
        yb = F.layer_norm(x.bfloat16(), 16, w, b)
    assert y.dtype == torch.float32 and r.dtype == torch.float32 and yb.dtype == torch.bfloat16
    torch.testing.assert_close(y, plain, atol=0, rtol=0)
    torch.testing.assert_close(r, F.rms_norm(x, 16, w), atol=0, rtol=0)


def test_autocast_matmul_like_ops_take_the_autocast_dtype(backend):
    """nsa_compress and floyd_attention cast float32 inputs to the autocast dtype (as matmul
    and SDPA do); gradients flow back to the float32 leaves in float32; the op's own math is
    not lowered further: the result equals the op run on the bf16-cast inputs outside autocast."""
    ins = leaves(*floyd_inputs(dtype=torch.float32))
    with autocast():
        y = F.floyd_attention(*ins, scale=0.5)
    assert y.dtype == torch.bfloat16
    expected = F.floyd_attention(*(t.detach().bfloat16() for t in ins), scale=0.5)
    torch.testing.assert_close(y, expected, atol=0, rtol=0)
    y.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in ins)

    x, w = leaves(torch.randn(12, 2, 16), torch.randn(4, 2))
    with autocast():
        out = F.nsa_compress(x, w, 4, 4, [12])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.nsa_compress(x.detach().bfloat16(), w.detach().bfloat16(), 4, 4, [12]),
                               atol=0, rtol=0)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    # the float64 formula on the bf16-rounded inputs bounds the error by bf16 output rounding
    ref = nsa_oracle(x.detach().bfloat16().to(f64), w.detach().bfloat16().to(f64), 4, 4, [12])
    torch.testing.assert_close(out.to(f64), ref, atol=2e-2, rtol=1e-2)


def test_rms_norm_widens_a_half_weight_beside_float32_input_as_torch_does(backend):
    import torch.nn.functional as F
    from gradops.nn import functional as GF
    x = torch.randn(3, 8, dtype=torch.float32, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    y = GF.rms_norm(x, [8], w, 1e-6)
    ref = F.rms_norm(x.detach().double(), [8], w.detach().double(), 1e-6)
    assert y.dtype == torch.float32
    assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    y.sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.bfloat16
