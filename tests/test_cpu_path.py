"""The reference backend's CPU path (docs/backends.md, "The CPU path"): LayerNorm's forward
through ATen's kernel (half precision as float32 row blocks), its backward through ATen's
kernel on centred row blocks, and RMSNorm in row blocks with reused buffers.

Every variant against float64 oracles: autograd through the formulas with each variant's
rounding points, and ATen in float64 (gradops.oracles). Each test runs with the rows in one
block and, forced by a small ``BLOCK_ELEMENTS``, in several row blocks with a ragged last
one.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradops import oracles
from gradops.ops.layer_norm import prepare_layer_norm, prepare_layer_norm_backward
from gradops.ops.rms_norm import prepare_rms_norm, prepare_rms_norm_grad
from gradops.reference import _rows

from helpers import assert_close

CPU = "cpu"
HALF = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
M, N = 7, 130
ALL = (True, True, True)


def rand(shape, dtype, scale=1.0, offset=0.0):
    return (torch.randn(shape, dtype=torch.float64, device=CPU) * scale + offset).to(dtype)


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.fixture(params=["one-block", "blocks"])
def blocks(request, monkeypatch):
    """The number of row blocks the CPU path takes (M = 7 rows: 4 blocks, the last of 1 row)."""
    if request.param == "blocks":
        monkeypatch.setattr(_rows, "BLOCK_ELEMENTS", 2 * N)
        return 4
    return 1


class Ops(TorchDispatchMode):
    """The ATen ops a call runs."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def ste_round(t, dtype):
    """``t`` rounded to ``dtype``, with the identity's gradient (as autograd through ``.to``)."""
    return t + (t.to(dtype).to(t.dtype) - t).detach()


def float64_grads(formula, inputs, dy, dh, *args):
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    y, h = formula(*leaves, *args)
    outs, grads = [y], [dy.double()]
    if dh is not None:
        outs.append(h)
        grads.append(dh.double())
    wanted = [t for t in leaves if t is not None]
    it = iter(torch.autograd.grad(outs, wanted, grads))
    return y.detach(), h.detach(), [None if t is None else next(it) for t in leaves]


def ln_formula(x, residual, w, b, eps, dtype):
    h = ste_round(x + residual, dtype) if residual is not None else x
    mean = h.mean(-1, keepdim=True)
    y = (h - mean) / torch.sqrt((h - mean).pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, h


def rms_formula(x, residual, w, eps, offset, round_xhat, dtype):
    h = ste_round(x + residual, dtype) if residual is not None else x
    xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if round_xhat:
        xhat = ste_round(xhat, dtype)
    return (xhat * (w + offset) if w is not None else xhat), h


def strided(t):
    """``t``'s values in a non-contiguous view (every other column of a wider tensor)."""
    big = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
    big[..., ::2] = t
    return big[..., ::2]


# ------------------------------------------------------------------ LayerNorm forward
def dtype_affine(affines):
    """(dtype, affine) pairs: float32 master weights ("float32") only beside half activations."""
    return [(d, a) for d in DTYPES for a in affines if a != "float32" or d in HALF]


@pytest.mark.parametrize("dtype,affine", dtype_affine(["none", "weight", "both", "float32"]), ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_layer_norm_forward(blocks, dtype, affine, with_residual):
    pdt = torch.float32 if affine == "float32" else dtype
    x, residual = rand((M, N), dtype, 2.0, 0.5), rand((M, N), dtype) if with_residual else None
    x[2] = x[2, 0]  # a constant row (of h too)
    if residual is not None:
        residual[2] = 0
    w = rand((N,), pdt) if affine != "none" else None
    b = rand((N,), pdt) if affine in ("both", "float32") else None
    with Ops() as ops:
        out = prepare_layer_norm(x, (N,), w, b, 1e-5, residual=residual, backend="reference").run()
    y, mean, rstd = out[:3]
    want_y, want_h, _ = float64_grads(ln_formula, (x, residual, w, b), torch.zeros(M, N), None, 1e-5, dtype)
    h = x if residual is None else out[3]
    if residual is not None:
        assert torch.equal(h, x + residual)
    acc = acc_of(dtype)
    assert y.dtype == dtype and mean.dtype == acc and rstd.dtype == acc
    assert_close(y, want_y, dtype, what="y")
    _, emean, erstd = oracles.layer_norm(h, (N,), eps=1e-5)
    assert_close(mean, emean, acc, what="mean")
    assert_close(rstd, erstd, acc, what="rstd")
    # a constant row: its mean is its value, it is centred to exact zeros, y is the bias
    assert mean[2].item() == h[2, 0].item()
    want_row = torch.zeros(N, dtype=dtype) if b is None else b.to(dtype)
    assert torch.equal(y[2], want_row)
    # ATen's kernel: float32/float64 rows at once, half rows in float32 blocks
    assert ops.names.count("native_layer_norm") == (blocks if dtype in HALF else 1)


@pytest.mark.usefixtures("statistics")
def test_layer_norm_forward_empty_rows_and_no_rows(blocks):
    for dtype in DTYPES:
        y, mean, rstd = prepare_layer_norm(rand((3, 0), dtype), (0,), backend="reference").run()
        assert y.shape == (3, 0) and y.dtype == dtype and mean.dtype == acc_of(dtype)
        assert torch.equal(mean, torch.zeros_like(mean)) and torch.isnan(rstd).all()
        y, mean, rstd = prepare_layer_norm(rand((0, 5), dtype), (5,), backend="reference").run()
        assert y.shape == (0, 5) and mean.shape == (0, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_forward_non_contiguous_and_leading_dims(blocks, dtype):
    x = strided(rand((M, N), dtype, 3.0))
    xt = rand((N, M), dtype).t()  # rows with a column stride
    for t in (x, xt, x.reshape(1, M, N)):
        y, mean, rstd = prepare_layer_norm(t, (t.shape[-1],), backend="reference").run()
        ey, emean, erstd = oracles.layer_norm(t, (t.shape[-1],))
        assert_close(y, ey, dtype, what="y")
        assert_close(rstd, erstd, acc_of(dtype), what="rstd")


def test_layer_norm_forward_on_meta():
    x = torch.empty((M, N), dtype=torch.bfloat16, device="meta")
    y, mean, rstd, h = prepare_layer_norm(x, (N,), torch.empty(N, device="meta"), None,
                                          residual=x, backend="reference").run()
    assert y.device.type == "meta" and y.shape == (M, N) and y.dtype == torch.bfloat16
    assert mean.shape == (M, 1) and mean.dtype == torch.float32 and h.shape == (M, N)


# ------------------------------------------------------------------ LayerNorm backward
def _ln_stats(h, dtype):
    """float64 statistics of h, given as the backward receives them (acc)."""
    _, mean, rstd = oracles.layer_norm(h, h.shape[-1:])
    return mean.to(acc_of(dtype)), rstd.to(acc_of(dtype))


@pytest.mark.parametrize("dtype,affine", dtype_affine(["none", "weight", "float32"]), ids=str)
@pytest.mark.parametrize("mask", [ALL, (True, False, False), (False, True, True), (False, False, True),
                                  (True, True, False)], ids=str)
def test_layer_norm_backward(blocks, dtype, affine, mask):
    pdt = torch.float32 if affine == "float32" else dtype
    x, dy = rand((M, N), dtype, 2.0, 3.0), rand((M, N), dtype)
    x[4] = x[4, 0]  # a constant row
    w = rand((N,), pdt) + 1.0 if affine != "none" else None
    b = rand((N,), pdt) if affine != "none" else None
    mean, rstd = _ln_stats(x, dtype)
    with Ops() as ops:
        dx, dw, db = prepare_layer_norm_backward(dy, x, (N,), mean, rstd, w, b, mask,
                                                 backend="reference").run()
    _, _, (gx, _, gw, gb) = float64_grads(ln_formula, (x, None, w, b), dy, None, 1e-5, dtype)
    edx, edw, edb = oracles.layer_norm_backward(dy, x, (N,), w)
    grad_dtype = pdt if w is not None else acc_of(dtype)
    for got, want, want2, on, name in ((dx, gx, edx, mask[0], "dx"), (dw, gw, edw, mask[1], "dw"),
                                       (db, gb, edb, mask[2], "db")):
        if not on:
            assert got is None, name
            continue
        want = want if want is not None else want2  # no weight: dw/db as if it were ones
        assert got.dtype == (dtype if name == "dx" else grad_dtype)
        assert_close(got, want, got.dtype, what=name)
        assert_close(got, want2, got.dtype, what=name + " vs ATen float64")
    assert ops.names.count("native_layer_norm_backward") == blocks  # ATen's kernel, once per row block


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_place", [False, True], ids=["fresh", "in_place"])
def test_fused_add_layer_norm_backward(blocks, dtype, in_place):
    """dres (the gradient h gets from elsewhere) is added to dx; in_place writes dx into dy's
    memory after dweight/dbias were taken from dy."""
    x, residual, dy, dh = (rand((M, N), dtype) for _ in range(4))
    w, b = rand((N,), dtype) + 1.0, rand((N,), dtype)
    h = x + residual
    mean, rstd = _ln_stats(h, dtype)
    dy_mem = dy.clone()
    dx, dw, db = prepare_layer_norm_backward(dy_mem, h, (N,), mean, rstd, w, b, in_place=in_place,
                                             dresidual=dh, backend="reference").run()
    _, _, (gx, gr, gw, gb) = float64_grads(ln_formula, (x, residual, w, b), dy, dh, 1e-5, dtype)
    assert_close(dx, gx, dtype, what="dx")
    assert_close(dw, gw, dtype, what="dw")
    assert_close(db, gb, dtype, what="db")
    if in_place:
        assert dx.data_ptr() == dy_mem.data_ptr()
    else:
        assert torch.equal(dy_mem, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_backward_non_contiguous(blocks, dtype):
    x, dy = strided(rand((M, N), dtype)), rand((N, M), dtype).t()
    w = rand((N,), dtype)
    mean, rstd = _ln_stats(x, dtype)
    mean, rstd = strided(mean.reshape(M)), strided(rstd.reshape(M))  # strided statistics too
    dx, dw, db = prepare_layer_norm_backward(dy, x, (N,), mean, rstd, w, backend="reference").run()
    edx, edw, edb = oracles.layer_norm_backward(dy, x, (N,), w)
    for got, want, name in ((dx, edx, "dx"), (dw, edw, "dw"), (db, edb, "db")):
        assert_close(got, want, dtype, what=name)


def test_layer_norm_backward_keeps_precision_on_rows_with_a_large_mean(blocks):
    """ATen's kernel computes dx as a * dy * w + b * x + c, which cancels on rows whose mean
    is large beside their deviation (1e-4 of dx lost in float32 here); given x-hat it does not."""
    x = rand((M, N), torch.float32, 0.1, 1e3)
    dy, w = rand((M, N), torch.float32), rand((N,), torch.float32)
    _, mean, rstd = oracles.layer_norm(x, (N,))
    dx, dw, db = prepare_layer_norm_backward(dy, x, (N,), mean.float(), rstd.float(), w,
                                             backend="reference").run()
    # the formula in float64 from the same (float32) statistics
    xhat = (x.double() - mean.float().double()) * rstd.float().double()
    g = dy.double() * w.double()
    edx = rstd.float().double() * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    assert_close(dx, edx, torch.float32, what="dx")
    assert_close(dw, (dy.double() * xhat).sum(0), torch.float32, what="dw")


def test_layer_norm_backward_empty_rows_and_no_rows(blocks):
    for dtype in DTYPES:
        acc = acc_of(dtype)
        x = rand((3, 0), dtype)
        stat = torch.zeros(3, dtype=acc)
        dx, dw, db = prepare_layer_norm_backward(x, x, (0,), stat, stat.fill_(float("nan")), None,
                                                 backend="reference").run()
        assert dx.shape == (3, 0) and dw.shape == (0,) and db.shape == (0,)
        x = rand((0, 5), dtype)
        empty = torch.zeros(0, dtype=acc)
        dx, dw, db = prepare_layer_norm_backward(x, x, (5,), empty, empty, rand((5,), dtype),
                                                 backend="reference").run()
        assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros(5, dtype=dtype))
        assert torch.equal(db, torch.zeros(5, dtype=dtype))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_dweight_dbias_are_float32_accurate(dtype):
    """Half dy and x, float32 master weights: dweight/dbias keep float32 precision (ATen's
    half kernel sums them in half precision, percents off at this size)."""
    m, n = 2048, 64
    x, dy = rand((m, n), dtype, 2.0), rand((m, n), dtype)
    w = rand((n,), torch.float32)
    mean, rstd = _ln_stats(x, dtype)
    _, dw, db = prepare_layer_norm_backward(dy, x, (n,), mean, rstd, w, w, backend="reference").run()
    _, edw, edb = oracles.layer_norm_backward(dy, x, (n,), w)
    assert dw.dtype == torch.float32
    assert_close(dw, edw, torch.float32, what="dw")
    assert_close(db, edb, torch.float32, what="db")


# ------------------------------------------------------------------ RMSNorm
def test_layer_norm_backward_on_meta():
    x, dy = (torch.empty((M, N), dtype=torch.bfloat16, device="meta") for _ in range(2))
    stat = torch.empty(M, device="meta")
    dx, dw, db = prepare_layer_norm_backward(dy, x, (N,), stat, stat, torch.empty(N, device="meta"),
                                             in_place=True, dresidual=x, backend="reference").run()
    assert dx.shape == (M, N) and dx.dtype == torch.bfloat16 and dw.shape == (N,) and db.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["gemma", "llama"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("in_place", [False, True], ids=["fresh", "in_place"])
def test_rms_norm_variants(blocks, dtype, mode, offset, with_residual, in_place):
    x, dy = rand((M, N), dtype, 2.0), rand((M, N), dtype)
    residual = rand((M, N), dtype) if with_residual else None
    dh = rand((M, N), dtype) if with_residual else None
    w = rand((N,), dtype, 0.5) + (0.0 if offset else 1.0)
    want_y, _, (gx, _, gw) = float64_grads(rms_formula, (x, residual, w), dy, dh, 1e-6, offset,
                                           mode == "llama", dtype)
    out = prepare_rms_norm(x, w, 1e-6, offset=offset, casting_mode=mode, residual=residual,
                           backend="reference").run()
    y, rstd = out[:2]
    h = x if residual is None else out[2]
    if residual is not None:
        assert torch.equal(h, x + residual)
    assert y.dtype == dtype and rstd.dtype == acc_of(dtype)
    assert_close(y, want_y, dtype, what="y")
    erstd = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_close(rstd, erstd, acc_of(dtype), what="rstd")
    dy_mem = dy.clone()
    dx, dgamma = prepare_rms_norm_grad(dy_mem, h, rstd, w, in_place=in_place, offset=offset,
                                       casting_mode=mode, dresidual=dh, backend="reference").run()
    assert dx.dtype == dtype and dgamma.dtype == acc_of(dtype)
    assert_close(dx, gx, dtype, what="dx")
    assert_close(dgamma, gw, acc_of(dtype), what="dgamma")  # not rounded to x's dtype
    if in_place:
        assert dx.data_ptr() == dy_mem.data_ptr()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_rms_norm_float32_gamma_beside_half(blocks, dtype):
    x, dy, w = rand((M, N), dtype), rand((M, N), dtype), rand((N,), torch.float32)
    want_y, _, (gx, gw) = float64_grads(lambda x_, w_: rms_formula(x_, None, w_, 1e-6, 0.0, False, dtype),
                                        (x, w), dy, None)
    y, rstd = prepare_rms_norm(x, w, 1e-6, backend="reference").run()
    dx, dgamma = prepare_rms_norm_grad(dy, x, rstd, w, backend="reference").run()
    assert_close(y, want_y, dtype, what="y")
    assert_close(dx, gx, dtype, what="dx")
    assert_close(dgamma, gw, torch.float32, what="dgamma")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_non_contiguous(blocks, dtype):
    x, dy, w = strided(rand((M, N), dtype)), rand((N, M), dtype).t(), rand((N,), dtype)
    y, rstd = prepare_rms_norm(x, w, 1e-6, backend="reference").run()
    dx, dgamma = prepare_rms_norm_grad(dy, x, rstd, w, backend="reference").run()
    ey, _ = oracles.rms_norm(x, w)
    edx, edgamma = oracles.rms_norm_backward(dy, x, w)
    assert_close(y, ey, dtype, what="y")
    assert_close(dx, edx, dtype, what="dx")
    assert_close(dgamma, edgamma, acc_of(dtype), what="dgamma")


def test_rms_norm_empty_rows_and_no_rows(blocks):
    for dtype in DTYPES:
        for m, n in ((3, 0), (0, 5)):
            x, w = rand((m, n), dtype), rand((n,), dtype)
            y, rstd = prepare_rms_norm(x, w, backend="reference").run()
            assert y.shape == (m, n) and rstd.shape == (m, 1) and rstd.dtype == acc_of(dtype)
            dx, dgamma = prepare_rms_norm_grad(x, x, rstd, w, backend="reference").run()
            assert dx.shape == (m, n) and torch.equal(dgamma, torch.zeros(n, dtype=acc_of(dtype)))


def test_rms_norm_on_meta():
    x = torch.empty((M, N), dtype=torch.bfloat16, device="meta")
    w = torch.empty(N, device="meta")
    y, rstd, h = prepare_rms_norm(x, w, residual=x, casting_mode="llama", backend="reference").run()
    assert y.shape == (M, N) and y.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    dx, dgamma = prepare_rms_norm_grad(x, h, rstd, w, dresidual=x, backend="reference").run()
    assert dx.shape == (M, N) and dgamma.shape == (N,) and dgamma.device.type == "meta"
