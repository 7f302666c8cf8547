"""torch.func transforms over gradops.nn: ``grad``, ``vjp``, ``jacrev``, ``vmap`` and their
compositions (per-sample gradients: ``vmap(grad(...))``), on both backends.

vmap runs with torch's per-example fallback switched off (an op without a batching rule
raises), so every batched call here goes through gradops' own rules. Oracles: torch's
``layer_norm`` / ``rms_norm`` (and float64 formulas for NSA and Floyd attention) under the
same transforms, and the unbatched gradops calls in a Python loop.
"""
import pytest
import torch
from torch.func import functional_call, grad, jacrev, vjp, vmap

import gradops
import gradops.ops.layer_norm as ln_ops
import gradops.ops.rms_norm as rms_ops
from gradops.errors import AclnnError
from gradops.nn import functional as GF

from helpers import assert_close

TF = torch.nn.functional
f64 = torch.float64


@pytest.fixture(autouse=True)
def _no_vmap_fallback():
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(True)


def draw(gen, device, *shape, dtype=f64):
    return torch.randn(shape, generator=gen, dtype=f64, device="cpu").to(dtype).to(device)


def assert_all_close(got, want, dtype, what):
    got, want = (list(t.values()) if isinstance(t, dict) else t for t in (got, want))
    got, want = ([t] if isinstance(t, torch.Tensor) else list(t) for t in (got, want))
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, dtype=dtype, what=f"{what}[{i}]")


def loop(fn, *args, in_dims):
    """``fn`` over the examples one call at a time, results stacked: what vmap must give."""
    size = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    results = [fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(size)]
    if isinstance(results[0], torch.Tensor):
        return torch.stack(results)
    return tuple(torch.stack(r) for r in zip(*results))


# The norms as (gradops, torch) pairs of f(x, weight, bias, residual) -> tensor or (y, h);
# the fused ones against torch's norm of h = x + residual.
def _fused(norm):
    def f(x, w, b, r):
        h = x + r
        return norm(h, w, b), h
    return f


NORMS = {
    "layer_norm": (lambda x, w, b, r: GF.layer_norm(x, (8,), w, b),
                   lambda x, w, b, r: TF.layer_norm(x, (8,), w, b)),
    "rms_norm": (lambda x, w, b, r: GF.rms_norm(x, (8,), w, 1e-6),
                 lambda x, w, b, r: TF.rms_norm(x, (8,), w, 1e-6)),
    "rms_norm_offset": (lambda x, w, b, r: GF.rms_norm(x, (8,), w, 1e-6, offset=1.0),
                        lambda x, w, b, r: TF.rms_norm(x, (8,), w + 1.0, 1e-6)),
    "fused_add_layer_norm": (lambda x, w, b, r: GF.fused_add_layer_norm(x, r, (8,), w, b),
                             _fused(lambda h, w, b: TF.layer_norm(h, (8,), w, b))),
    "fused_add_rms_norm": (lambda x, w, b, r: GF.fused_add_rms_norm(x, r, (8,), w, 1e-6),
                           _fused(lambda h, w, b: TF.rms_norm(h, (8,), w, 1e-6))),
}


def norm_inputs(device, dtype, *lead):
    gen = torch.Generator().manual_seed(1)
    return (draw(gen, device, *lead, 8, dtype=dtype), draw(gen, device, 8, dtype=dtype),
            draw(gen, device, 8, dtype=dtype), draw(gen, device, *lead, 8, dtype=dtype))


def scalar_loss(fn):
    """A scalar of every output, each weighted by fixed values (not a plain sum, whose
    gradient through a norm is zero)."""
    def loss(x, w, b, r):
        out = fn(x, w, b, r)
        outs = (out,) if isinstance(out, torch.Tensor) else out
        return sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype, device=o.device).view(o.shape)).sum()
                   for o in outs)
    return loss


# ---------------------------------------------------------------- grad, vjp, jacrev

@pytest.mark.parametrize("dtype", [f64, torch.float32])
@pytest.mark.parametrize("name", list(NORMS))
def test_grad_vjp_jacrev_match_torch(backend, device, name, dtype):
    ours, torchs = NORMS[name]
    x, w, b, r = norm_inputs(device, dtype, 2, 3)
    argnums = (0, 1, 2, 3)
    assert_all_close(grad(scalar_loss(ours), argnums)(x, w, b, r), grad(scalar_loss(torchs), argnums)(x, w, b, r),
                     dtype, f"{name} grad")
    out, pullback = vjp(ours, x, w, b, r)
    want_out, want_pullback = vjp(torchs, x, w, b, r)
    assert_all_close(out, want_out, dtype, f"{name} output")
    cotangent = tuple(torch.randn_like(o) for o in (want_out if isinstance(want_out, tuple) else (want_out,)))
    cotangent = cotangent if isinstance(want_out, tuple) else cotangent[0]
    assert_all_close(pullback(cotangent), want_pullback(cotangent), dtype, f"{name} vjp")
    # jacrev: vmap over the backward with the basis as the batch of upstream gradients
    xs = x[0, :2]
    jac = jacrev(lambda x, w: ours(x, w, b, r[0, :2]), (0, 1))(xs, w)
    want = jacrev(lambda x, w: torchs(x, w, b, r[0, :2]), (0, 1))(xs, w)
    assert_all_close(torch.utils._pytree.tree_leaves(jac), torch.utils._pytree.tree_leaves(want), dtype,
                     f"{name} jacrev")


# ---------------------------------------------------------------- vmap

@pytest.mark.parametrize("name", list(NORMS))
def test_vmap_matches_the_loop_and_torch(backend, device, name):
    ours, torchs = NORMS[name]
    x, w, b, r = norm_inputs(device, f64, 2, 3, 3)  # examples along dim 1
    gen = torch.Generator().manual_seed(2)
    ws, bs = draw(gen, device, 3, 8), draw(gen, device, 3, 8)
    for in_dims, args in (((1, None, None, 1), (x, w, b, r)),        # rows only: one call
                          ((None, None, None, 1), (x[:, 0], w, b, r)),  # x shared, residual batched
                          ((1, 0, 0, 1), (x, ws, bs, r))):            # a weight per example: one call each
        got = vmap(ours, in_dims=in_dims)(*args)
        assert_all_close(got, loop(ours, *args, in_dims=in_dims), f64, f"{name} {in_dims} vs loop")
        assert_all_close(got, loop(torchs, *args, in_dims=in_dims), f64, f"{name} {in_dims} vs torch")


def test_nested_vmap_and_autograd_through_vmap(backend, device):
    x, w, b, _ = norm_inputs(device, f64, 2, 3, 2)
    assert_all_close(vmap(vmap(lambda x: GF.layer_norm(x, (8,), w, b)))(x), TF.layer_norm(x, (8,), w, b), f64,
                     "nested vmap")
    # torch.autograd outside the transform: the vmapped call is part of an ordinary graph
    leaves, ref = [[t.clone().requires_grad_() for t in (x, w)] for _ in range(2)]
    vmap(lambda x: GF.rms_norm(x, (8,), leaves[1]))(leaves[0]).pow(2).sum().backward()
    TF.rms_norm(ref[0], (8,), ref[1]).pow(2).sum().backward()
    assert_all_close([t.grad for t in leaves], [t.grad for t in ref], f64, "backward through vmap")


# ---------------------------------------------------------------- per-sample gradients

@pytest.mark.parametrize("dtype", [f64, torch.float32])
@pytest.mark.parametrize("name", list(NORMS))
def test_per_sample_gradients_match_torch_and_the_loop(backend, device, name, dtype):
    ours, torchs = NORMS[name]
    x, w, b, r = norm_inputs(device, dtype, 3, 2)
    in_dims = (0, None, None, 0)
    for argnums in (0, (0, 1, 2, 3)):  # the input only (the batch in one call), and every argument
        got = vmap(grad(scalar_loss(ours), argnums), in_dims)(x, w, b, r)
        want = vmap(grad(scalar_loss(torchs), argnums), in_dims)(x, w, b, r)
        assert_all_close(got, want, dtype, f"{name} {argnums} vs torch")
        assert_all_close(got, loop(grad(scalar_loss(ours), argnums), x, w, b, r, in_dims=in_dims), dtype,
                         f"{name} {argnums} vs loop")


@pytest.mark.parametrize("family", ["layer_norm", "rms_norm"])
def test_vmap_computes_a_batch_of_rows_in_one_call(backend, device, family, monkeypatch):
    # A vmapped dim is more rows: one forward and one backward call, unless the backward
    # returns weight gradients per example (one call each: one call would sum them)
    forward, backward = ((ln_ops, "prepare_layer_norm"), (ln_ops, "prepare_layer_norm_backward")) \
        if family == "layer_norm" else ((rms_ops, "prepare_rms_norm"), (rms_ops, "prepare_rms_norm_grad"))
    calls = []
    for module, fn in (forward, backward):
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
    ours = NORMS[family][0]
    x, w, b, r = norm_inputs(device, f64, 4, 2)
    vmap(grad(scalar_loss(ours)), (0, None, None, None))(x, w, b, r)
    assert calls == [forward[1], backward[1]]
    calls.clear()
    vmap(grad(scalar_loss(ours), (0, 1)), (0, None, None, None))(x, w, b, r)
    assert calls == [forward[1]] + [backward[1]] * 4


def test_rms_norm_llama_casting_under_vmap_and_grad(backend, device):
    gen = torch.Generator().manual_seed(3)
    x = draw(gen, device, 3, 2, 8, dtype=torch.bfloat16)
    for w in (draw(gen, device, 8, dtype=torch.bfloat16), draw(gen, device, 8, dtype=torch.float32)):
        def loss(x, w):
            return (GF.rms_norm(x, (8,), w, casting_mode="llama", offset=0.5).float() * x.float()).sum()

        got = vmap(grad(loss, (0, 1)), (0, None))(x, w)
        want = loop(grad(loss, (0, 1)), x, w, in_dims=(0, None))
        for g, e in zip(got, want):
            assert g.dtype == e.dtype
            assert_close(g, e, what=f"llama, {w.dtype} weight")
        y = vmap(lambda x: GF.rms_norm(x, (8,), w, casting_mode="llama"))(x)
        assert_close(y, GF.rms_norm(x, (8,), w, casting_mode="llama"), what="llama forward")


# ---------------------------------------------------------------- modules

@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
def test_modules_under_functional_call(backend, device, cls):
    ours, torchs = getattr(gradops.nn, cls)(8, dtype=f64), getattr(torch.nn, cls)(8, dtype=f64)
    gen = torch.Generator().manual_seed(4)
    params = {k: draw(gen, device, *v.shape) for k, v in ours.named_parameters()}
    assert set(params) == {k for k, _ in torchs.named_parameters()}
    x = draw(gen, device, 3, 2, 8)

    def loss(module):
        return lambda p, x: scalar_loss(lambda x, *_: functional_call(module, p, (x,)))(x, None, None, None)

    assert_all_close(grad(loss(ours))(params, x), grad(loss(torchs))(params, x), f64, f"{cls} grad")
    assert_all_close(vmap(grad(loss(ours)), (None, 0))(params, x), vmap(grad(loss(torchs)), (None, 0))(params, x),
                     f64, f"{cls} per-sample")


# ---------------------------------------------------------------- NSA and Floyd attention

def nsa_formula(x, w, block, stride, ends):
    rows, start = [], 0
    for end in ends:
        for s in range(start, end - block + 1, stride):
            rows.append((w[:, :, None] * x[s:s + block]).sum(0))
        start = end
    return torch.stack(rows)


def test_nsa_compress_under_vmap_and_grad(backend, device):
    gen = torch.Generator().manual_seed(5)
    x, w = draw(gen, device, 3, 10, 2, 4), draw(gen, device, 3, 4, 2)  # 3 examples of x [T, N, D], w [block, N]
    ours = lambda x, w: GF.nsa_compress(x, w, 4, 2, [6, 10])
    formula = lambda x, w: nsa_formula(x, w, 4, 2, [6, 10])
    for in_dims in ((0, 0), (0, None)):
        args = (x, w if in_dims[1] == 0 else w[0])
        assert_all_close(vmap(ours, in_dims)(*args), loop(formula, *args, in_dims=in_dims), f64, f"vmap {in_dims}")
    loss = lambda f: lambda x, w: (f(x, w) ** 2).sum()
    assert_all_close(grad(loss(ours), (0, 1))(x[0], w[0]), grad(loss(formula), (0, 1))(x[0], w[0]), f64, "grad")
    assert_all_close(vmap(grad(loss(ours), (0, 1)))(x, w), vmap(grad(loss(formula), (0, 1)))(x, w), f64,
                     "per-sample")
    with pytest.raises(AclnnError, match="seq_lens is batched under torch.vmap"):
        vmap(lambda x, s: GF.nsa_compress(x, w[0], 4, 2, s))(x, torch.tensor([[6, 10]] * 3, device=device))


def floyd_formula(q, k1, v1, k2, v2, mask, scale):
    s = scale * (torch.einsum("bhnmd,bhnkd->bhnmk", q, k1) + torch.einsum("bhnmd,bhkmd->bhnmk", q, k2))
    p = torch.softmax(s.masked_fill(mask.bool(), -1e300), dim=-1)
    return torch.einsum("bhnmk,bhnkd->bhnmd", p, v1) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2)


@pytest.mark.floyd_float64
def test_floyd_attention_under_vmap_and_grad(backend, device):
    gen = torch.Generator().manual_seed(6)
    v, b, h, n, m, k, d = 2, 2, 1, 2, 3, 4, 3
    q = draw(gen, device, v, b, h, n, m, d)
    k1, v1 = draw(gen, device, v, b, h, n, k, d), draw(gen, device, v, b, h, n, k, d)
    k2, v2 = draw(gen, device, v, b, h, k, m, d), draw(gen, device, v, b, h, k, m, d)
    mask = (torch.rand(v, b, 1, n, 1, k, generator=gen, device="cpu") < 0.3).to(device)
    ours = lambda *a: GF.floyd_attention(*a, scale=0.5)
    formula = lambda *a: floyd_formula(*a, scale=0.5)
    args = (q, k1, v1, k2, v2, mask)
    for in_dims in ((0,) * 6, (0, None, 0, None, 0, None)):  # unbatched keys and mask are shared
        batch = tuple(a if dim == 0 else a[0] for a, dim in zip(args, in_dims))
        assert_all_close(vmap(ours, in_dims)(*batch), loop(formula, *batch, in_dims=in_dims), f64, f"vmap {in_dims}")
    loss = lambda f: lambda *a: (f(*a) ** 2).sum()
    argnums = (0, 1, 2, 3, 4)
    first = tuple(a[0] for a in args)
    assert_all_close(grad(loss(ours), argnums)(*first), grad(loss(formula), argnums)(*first), f64, "grad")
    assert_all_close(vmap(grad(loss(ours), argnums))(*args), vmap(grad(loss(formula), argnums))(*args), f64,
                     "per-sample")


# ---------------------------------------------------------------- what is refused

def test_higher_order_and_forward_mode_are_refused(backend, device):
    x, w, b, _ = norm_inputs(device, f64, 2)
    f = lambda x: GF.layer_norm(x, (8,), w, b)
    with pytest.raises(NotImplementedError, match="layer_norm: double backward"):
        jacrev(jacrev(f))(x)
    with pytest.raises(NotImplementedError, match="jvp"):  # forward mode: no jvp rule
        torch.func.jacfwd(f)(x)


def test_compiled_vmap_traces_the_batching_rules(backend, device):
    # dynamo turns vmap into a higher-order op of its own: it must meet the custom ops and
    # their rules, not the transforms' autograd.Functions (which it cannot trace)
    x, w, b, r = norm_inputs(device, f64, 3, 2)
    f = vmap(lambda x, r: GF.fused_add_layer_norm(x, r, (8,), w, b))
    torch._dynamo.reset()
    assert_all_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, r), f(x, r), f64, "compiled vmap")


def test_the_norm_triton_ops_have_the_batching_rules(device):
    # A compiled vmap on a GPU traces the Triton ops themselves (static CUDA calls take them):
    # they carry the custom ops' rule, so a vmapped call is one call of more rows. Called
    # eagerly here (under the interpreter on a CPU their bodies run the kernels directly).
    from gradops.nn import _triton_ops

    if not _triton_ops._register_triton_ops():
        pytest.skip("this torch has no torch.library.triton_op, or triton is not installed")
    x, w, b, r = norm_inputs(device, torch.float32, 3, 2)
    ln = vmap(lambda x: torch.ops.gradops.triton_layer_norm(x, None, [8], w, b, 1e-5, "triton")[0])
    rms = vmap(lambda x: torch.ops.gradops.triton_rms_norm(x, None, w, 1e-6, 0.0, "gemma", "triton")[0])
    assert_all_close(ln(x), torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5), torch.float32, "layer_norm")
    assert_all_close(rms(x), torch.nn.functional.rms_norm(x, (8,), w, 1e-6), torch.float32, "rms_norm")
