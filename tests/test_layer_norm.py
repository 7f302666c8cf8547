"""LayerNorm (aclnnLayerNorm/aclnnLayerNormBackward semantics) and the AscendC LayerNormGrad /
LayerNormGradBeta semantics, against float64 oracles, on both backends (calls that name no
backend take the ``backend`` fixture's)."""
import pytest
import torch

import gradops
from gradops import oracles
from gradops.errors import ACLNN_ERR_PARAM_INVALID as INVALID, ACLNN_ERR_PARAM_NULLPTR as NULLPTR
from gradops.reference import layer_norm as RLN

from helpers import DTYPES, assert_close, raises_status, rand

SHAPES = [((1, 3), 1), ((4, 64), 1), ((3, 5, 33), 1), ((2, 3, 4, 5), 2), ((7, 1000), 1)]


@pytest.mark.usefixtures("statistics")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,n_norm", SHAPES)
def test_forward_and_backward_match_aten_float64(backend, shape, n_norm, dtype, device):
    ns = shape[len(shape) - n_norm:]
    x, dy = rand(shape, dtype, device), rand(shape, dtype, device)
    w, b = rand(ns, dtype, device), rand(ns, dtype, device)
    y, mean, rstd = gradops.layer_norm(x, ns, w, b, backend="reference")
    ey, emean, erstd = oracles.layer_norm(x, ns, w, b)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert y.dtype == dtype and mean.dtype == acc and rstd.dtype == acc
    assert mean.shape == emean.shape  # keepdim, as torch.native_layer_norm
    assert_close(y, ey, dtype, what="y")
    assert_close(mean, emean, dtype, what="mean")
    assert_close(rstd, erstd, dtype, what="rstd")
    dx, dw, db = gradops.layer_norm_backward(dy, x, ns, mean, rstd, w, b, backend="reference")
    edx, edw, edb = oracles.layer_norm_backward(dy, x, ns, w)
    assert dx.dtype == dtype and dw.dtype == dtype and db.dtype == dtype
    for name, a, e in (("dx", dx, edx), ("dw", dw, edw), ("db", db, edb)):
        assert_close(a, e, dtype, what=name)
    # a second, independent oracle: autograd through the forward formula
    adx, adw = oracles.layer_norm_autograd(dy, x, n_norm, w)
    assert_close(dx, adx, dtype, what="dx vs autograd")
    assert_close(dw, adw, dtype, what="dw vs autograd")


@pytest.mark.usefixtures("statistics")
def test_width_one_normalises_to_zero_exactly(backend):
    """With one element per row x-hat is 0: dx and dw are exactly zero, db = dy summed."""
    x, dy, w = rand((5, 1)), rand((5, 1)), rand((1,))
    y, mean, rstd = gradops.layer_norm(x, [1], w, w)
    assert torch.equal(y, w.expand(5, 1))
    dx, dw, db = gradops.layer_norm_backward(dy, x, [1], mean, rstd, w)
    assert torch.equal(dx, torch.zeros(5, 1)) and torch.equal(dw, torch.zeros(1))
    assert torch.allclose(db, dy.sum(0))


def test_width_one_dx_is_nan_where_dy_is_not_finite(backend):
    """dx = rstd * (g - mean(g)) with g = dy * w: at width 1 exactly 0 where g is finite, NaN
    where it is not (inf - inf), on both backends alike."""
    x, w = rand((4, 1)), rand((1,))
    dy = torch.tensor([[float("nan")], [float("inf")], [1.0], [float("-inf")]], device="cpu").to(x.device)
    _, mean, rstd = gradops.layer_norm(x, [1], w, None)
    dx, _, _ = gradops.layer_norm_backward(dy, x, [1], mean, rstd, w, output_mask=(True, False, False))
    g = dy.double() * w.double()
    expected = rstd.reshape(4, 1).double() * (g - g)  # the formula in float64
    assert torch.equal(dx.isnan(), expected.isnan()) and torch.equal(dx[~dx.isnan()], torch.zeros(1, device=x.device))


@pytest.mark.usefixtures("statistics")
def test_float64_is_exact_to_1e_10_on_random_shapes(backend):
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        rows = int(torch.randint(1, 20, (1,), generator=gen, device="cpu"))
        cols = int(torch.randint(1, 300, (1,), generator=gen, device="cpu"))
        x, dy = rand((rows, cols), torch.float64), rand((rows, cols), torch.float64)
        w = rand((cols,), torch.float64)
        _, mean, rstd = gradops.layer_norm(x, [cols], w)
        got = gradops.layer_norm_backward(dy, x, [cols], mean, rstd, w)
        want = oracles.layer_norm_backward(dy, x, [cols], w)
        for a, e in zip(got, want):
            assert_close(a, e, tol=1e-10)


# ATen's CUDA LayerNorm forward for float32 rows of a multiple of 4 elements
# (vectorized_layer_norm_kernel in aten/src/ATen/native/cuda/layer_norm_kernel.cu), emulated
# in float32 after its source: 128 threads (4 warps) per row, each folding its 4-element
# vectors by cuWelfordOnlineSum, then cuWelfordCombine down each warp (shuffles 16..1) and
# across the warps (2, 1), nvcc contracting a * b + c into one FMA as it does by default. It
# reproduces the constant-row statistics the H100 run logged (a row of 1234.5678 at eps =
# 1e-12: rstd 1.706e4 at width 200, 2.479e4 at 300, where 1/sqrt(eps) = 1e6; a float16 row
# of -3.699: the mean 2.4e-7 off).
def _fma32(a, b, c):
    import numpy as np

    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _welford_online(val, wd):
    import numpy as np

    f32 = np.float32
    mean, sigma2, count = wd
    delta = f32(val - mean)
    new_count = f32(count + f32(1))
    new_mean = _fma32(delta, f32(f32(1) / new_count), mean)
    return new_mean, _fma32(delta, f32(val - new_mean), sigma2), new_count


def _welford_combine(b, a):
    import numpy as np

    f32 = np.float32
    delta, count = f32(b[0] - a[0]), f32(a[2] + b[2])
    if count <= 0:
        return f32(0), f32(0), count
    coef = f32(f32(1) / count)
    n_a, n_b = f32(a[2] * coef), f32(b[2] * coef)
    return (_fma32(n_a, a[0], f32(n_b * b[0])),
            _fma32(f32(f32(delta * delta) * a[2]), n_b, f32(a[1] + b[1])), count)


def _aten_cuda_row_statistics(row, eps):
    """(mean, rstd) of one float32 row as ATen's vectorised CUDA kernel computes them."""
    import numpy as np

    f32 = np.float32
    zero = (f32(0), f32(0), f32(0))
    threads = [zero] * 128
    for i in range(row.size // 4):
        for v in row[4 * i: 4 * i + 4]:
            threads[i % 128] = _welford_online(v, threads[i % 128])
    warps = []
    for w in range(4):
        lanes = threads[32 * w: 32 * w + 32]
        for offset in (16, 8, 4, 2, 1):
            lanes = [_welford_combine(lanes[i], lanes[i + offset] if i + offset < 32 else lanes[i]) for i in range(32)]
        warps.append(lanes[0])
    for offset in (2, 1):
        warps = [_welford_combine(warps[y], warps[y + offset]) if y < offset else warps[y] for y in range(4)]
    mean, sigma2 = warps[0][0], f32(warps[0][1] / f32(row.size))
    return mean, f32(1 / np.sqrt(np.float64(f32(sigma2 + f32(eps)))))  # (rsqrtf: within 2 ulp of this)


def _native_layer_norm_as_on_cuda(x, normalized_shape, weight, bias, eps, _cpu=torch.native_layer_norm):
    """torch.native_layer_norm with the statistics of ATen's CUDA kernel where that kernel is
    the vectorised one (float32, width a multiple of 4); as on the CPU otherwise (float64 runs
    ATen's Welford there too, exact on constant rows)."""
    n = x.shape[-1]
    if x.dtype != torch.float32 or n % 4 or len(normalized_shape) != 1:
        return _cpu(x, normalized_shape, weight, bias, eps)
    rows = x.reshape(-1, n).cpu().numpy()
    stats = torch.tensor([_aten_cuda_row_statistics(r, eps) for r in rows], dtype=torch.float32).to(x.device)
    mean, rstd = stats[:, :1], stats[:, 1:]
    y = (x.reshape(-1, n) - mean) * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.reshape(x.shape), mean.reshape(*x.shape[:-1], 1), rstd.reshape(*x.shape[:-1], 1)


def test_reference_statistics_of_constant_rows_are_exact_on_every_device(device, monkeypatch):
    """The reference is the golden: a constant row's mean is its value and its variance 0
    (rstd = 1/sqrt(eps), y = bias) on every device (docs/operators.md section 1). On the CPU
    it may take them from ATen, whose CPU kernel computes them so; ATen's CUDA kernel does not.
    On a GPU run this checks the real thing; on the CPU the reference is made to take its path
    for other devices, with torch.native_layer_norm computing as its CUDA kernel does."""
    values = torch.tensor([0.1, -3.7, 1234.5678, 1e-3, 7.0, -0.3, -3.699, 1234.57], dtype=torch.float64)
    if device == "cpu":
        monkeypatch.setattr(RLN, "_aten_statistics", lambda dev: False)
        monkeypatch.setattr(torch, "native_layer_norm", _native_layer_norm_as_on_cuda)
        # (what the H100 run saw: ATen's CUDA statistics of these rows are not exact)
        _, mean, rstd = _native_layer_norm_as_on_cuda(values.float()[:, None].expand(8, 200).contiguous(), [200],
                                                      None, None, 1e-12)
        assert not torch.equal(rstd.flatten(), torch.full((8,), 1e6))
    for dtype in DTYPES:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        v = values.to(dtype)
        for n in (200, 300):
            x = v[:, None].expand(8, n).contiguous().to(device)
            w, b = rand((n,), dtype, device), rand((n,), dtype, device)
            for eps in (1e-12, 1e-5):
                y, mean, rstd = RLN.layer_norm(x, w, b, eps)
                exact_rstd = torch.tensor(eps, dtype=acc).sqrt().reciprocal()  # the contract at variance 0
                what = f"{dtype} width {n} eps {eps}"
                assert torch.equal(mean.cpu(), v.to(acc)), what
                assert torch.equal(rstd.cpu(), exact_rstd.expand(8)), what
                assert torch.equal(y, b.expand(8, n)), what


class _LayerNormFn(torch.autograd.Function):
    """Forward and backward both by gradops, so gradcheck checks the library's backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        y, mean, rstd = gradops.layer_norm(x, x.shape[-1:], w, b)
        ctx.save_for_backward(x, mean, rstd, w, b)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mean, rstd, w, b = ctx.saved_tensors
        return gradops.layer_norm_backward(dy.contiguous(), x, x.shape[-1:], mean, rstd, w, b)


@pytest.mark.usefixtures("statistics")
def test_gradcheck_finite_differences(backend):
    x = rand((3, 6), torch.float64).requires_grad_()
    w = rand((6,), torch.float64).requires_grad_()
    b = rand((6,), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(_LayerNormFn.apply, (x, w, b))


@pytest.mark.usefixtures("statistics")
def test_weight_none_returns_float32_dw_db_as_if_ones(backend, device):
    x, dy = rand((5, 12), torch.bfloat16, device), rand((5, 12), torch.bfloat16, device)
    _, mean, rstd = gradops.layer_norm(x, [12])
    dx, dw, db = gradops.layer_norm_backward(dy, x, [12], mean, rstd)
    assert dw.dtype == torch.float32 and db.dtype == torch.float32
    edx, edw, edb = oracles.layer_norm_backward(dy, x, [12], None)
    assert_close(dx, edx, torch.bfloat16)
    assert_close(dw, edw, torch.float32, tol=1e-5)  # accumulated in float32 from bf16 inputs
    assert_close(db, edb, torch.float32, tol=1e-5)
    _, _, rstd64 = gradops.layer_norm(x.double(), [12])
    assert gradops.layer_norm_backward(dy.double(), x.double(), [12], rstd64 * 0, rstd64)[1].dtype == torch.float64


@pytest.mark.usefixtures("statistics")
def test_float32_weight_with_half_activations(backend):
    x, dy = rand((4, 16), torch.float16), rand((4, 16), torch.float16)
    w = rand((16,), torch.float32)
    y, mean, rstd = gradops.layer_norm(x, [16], w, w)
    assert y.dtype == torch.float16
    dx, dw, db = gradops.layer_norm_backward(dy, x, [16], mean, rstd, w)
    assert dx.dtype == torch.float16 and dw.dtype == torch.float32 and db.dtype == torch.float32
    edx, edw, _ = oracles.layer_norm_backward(dy, x, [16], w)
    assert_close(dx, edx, torch.float16)
    assert_close(dw, edw, tol=1e-5)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (False, False, True),
                                  (False, False, False), (True, True, False)])
def test_output_mask_returns_none_for_masked_outputs(backend, mask):
    x, dy, w = rand((3, 8)), rand((3, 8)), rand((8,))
    _, mean, rstd = gradops.layer_norm(x, [8], w)
    got = gradops.layer_norm_backward(dy, x, [8], mean, rstd, w, None, mask)
    full = gradops.layer_norm_backward(dy, x, [8], mean, rstd, w)
    for keep, g, f in zip(mask, got, full):
        if keep:
            assert torch.equal(g, f)
        else:
            assert g is None


def test_statistics_accepted_keepdim_or_not(backend):
    x, dy = rand((2, 3, 8)), rand((2, 3, 8))
    _, mean, rstd = gradops.layer_norm(x, [8])
    a = gradops.layer_norm_backward(dy, x, [8], mean, rstd)
    b = gradops.layer_norm_backward(dy, x, [8], mean.reshape(2, 3), rstd.reshape(2, 3))
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_in_place_writes_dx_into_dy(backend):
    x, dy = rand((4, 10)), rand((4, 10))
    _, mean, rstd = gradops.layer_norm(x, [10])
    expected = gradops.layer_norm_backward(dy, x, [10], mean, rstd)
    buf = dy.clone()
    dx, dw, db = gradops.layer_norm_backward(buf, x, [10], mean, rstd, in_place=True)
    assert dx is buf
    assert torch.equal(buf, expected[0]) and torch.equal(dw, expected[1])
    # a dy that cannot be viewed as rows still receives dx
    big = rand((10, 8)).t()  # [8, 10], non-contiguous rows
    dyn = big[:4]
    want = gradops.layer_norm_backward(dyn.contiguous(), x, [10], mean, rstd)[0]
    dxn = gradops.layer_norm_backward(dyn, x, [10], mean, rstd, in_place=True)[0]
    assert dxn is dyn and torch.allclose(dyn, want, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("statistics")
def test_empty_leading_dims_give_zero_weight_grads(backend):
    x = torch.empty(0, 7)
    _, mean, rstd = gradops.layer_norm(x, [7])
    assert mean.shape == (0, 1)
    dx, dw, db = gradops.layer_norm_backward(torch.empty(0, 7), x, [7], mean, rstd, torch.ones(7))
    assert dx.shape == (0, 7) and torch.equal(dw, torch.zeros(7)) and torch.equal(db, torch.zeros(7))


@pytest.mark.usefixtures("statistics")
def test_non_contiguous_inputs(backend):
    base_x, base_dy = rand((8, 6, 4)), rand((8, 6, 4))
    x, dy = base_x.transpose(0, 1)[:, ::2], base_dy.transpose(0, 1)[:, ::2]  # [6, 4, 4]
    w = rand((8,))[::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    y, mean, rstd = gradops.layer_norm(x, [4], w)
    ey, _, _ = oracles.layer_norm(x, [4], w)
    assert_close(y, ey, torch.float32)
    got = gradops.layer_norm_backward(dy, x, [4], mean, rstd, w)
    for a, e in zip(got, oracles.layer_norm_backward(dy, x, [4], w)):
        assert_close(a, e, torch.float32)


@pytest.mark.usefixtures("statistics")
def test_nan_propagates_to_its_row_only(backend):
    x, dy = rand((4, 8)), rand((4, 8))
    x[2, 3] = float("nan")
    y, mean, rstd = gradops.layer_norm(x, [8])
    dx, dw, db = gradops.layer_norm_backward(dy, x, [8], mean, rstd, torch.ones(8))
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3]]).any()
    assert torch.isnan(dx[2]).all() and not torch.isnan(dx[[0, 1, 3]]).any()
    assert torch.isnan(dw).all() and not torch.isnan(db).any()


def test_inputs_are_not_modified(backend):
    x, dy, w = rand((3, 8)), rand((3, 8)), rand((8,))
    _, mean, rstd = gradops.layer_norm(x, [8], w)
    copies = [t.clone() for t in (x, dy, w, mean, rstd)]
    gradops.layer_norm_backward(dy, x, [8], mean, rstd, w)
    for a, b in zip((x, dy, w, mean, rstd), copies):
        assert torch.equal(a, b)


# ---- errors --------------------------------------------------------------------------------

def _args():
    x, dy, w = rand((3, 8)), rand((3, 8)), rand((8,))
    _, mean, rstd = gradops.layer_norm(x, [8], w)
    return dict(dy=dy, x=x, normalized_shape=[8], mean=mean, rstd=rstd, weight=w, bias=None)


@pytest.mark.parametrize("name", ["dy", "x", "normalized_shape", "mean", "rstd", "output_mask"])
def test_none_required_argument_is_161001(backend, name):
    args = _args()
    args[name] = None
    with raises_status(NULLPTR, name):
        gradops.layer_norm_backward(**args)


# (the changes are made in the test, on the test device: a tensor in a parametrize table would
# be made at collection, on the CPU)
@pytest.mark.parametrize("change,words", [
    (lambda: dict(dy=rand((3, 8), torch.float16)), ("dy", "dtype")),
    (lambda: dict(x=torch.ones(3, 8, dtype=torch.int32)), ("x", "dtype")),
    (lambda: dict(mean=torch.zeros(3, 1, dtype=torch.float16)), ("mean", "dtype")),
    (lambda: dict(rstd=torch.zeros(3, 1, dtype=torch.float64)), ("rstd", "dtype")),
    (lambda: dict(weight=rand((8,), torch.float16)), ("weight", "dtype")),
    (lambda: dict(dy=rand((3, 9))), ("dy", "shape")),
    (lambda: dict(normalized_shape=[7]), ("normalized_shape",)),
    (lambda: dict(normalized_shape=[2, 3, 8]), ("normalized_shape",)),
    (lambda: dict(mean=torch.zeros(4)), ("mean", "shape")),
    (lambda: dict(rstd=torch.zeros(3)), ("rstd", "shape")),
    (lambda: dict(weight=rand((7,))), ("weight", "shape")),
    (lambda: dict(bias=rand((9,))), ("bias", "shape")),
    (lambda: dict(output_mask=(True, True)), ("output_mask", "length 3")),
    (lambda: dict(normalized_shape=8.0), ("normalized_shape",)),
])
def test_invalid_arguments_are_161002(backend, change, words):
    args = _args()
    args.update(change())
    with raises_status(INVALID, *words):
        gradops.layer_norm_backward(**args)


def test_forward_errors(backend):
    x = rand((3, 8))
    with raises_status(NULLPTR, "x"):
        gradops.layer_norm(None, [8])
    with raises_status(INVALID, "weight", "dtype"):
        gradops.layer_norm(x, [8], rand((8,), torch.float64))
    with raises_status(INVALID, "bias", "shape"):
        gradops.layer_norm(x, [8], None, rand((4,)))
    with raises_status(INVALID, "eps"):
        gradops.layer_norm(x, [8], eps="small")


def test_failed_in_place_call_writes_nothing(backend):
    args = _args()
    args["weight"] = rand((7,))
    before = args["dy"].clone()
    with raises_status(INVALID, "weight"):
        gradops.layer_norm_backward(**args, in_place=True)
    assert torch.equal(args["dy"], before)


# ---- AscendC LayerNormGrad / LayerNormGradBeta semantics -----------------------------------

def test_layer_norm_grad_worked_example_from_cann_docs(backend):
    x = torch.arange(64, dtype=torch.float32).reshape(1, 8, 8)
    dy = x.clone()
    mean = (3.5 + 8 * torch.arange(8, dtype=torch.float32)).reshape(1, 8)
    variance = torch.full((1, 8), 5.25)
    gamma = torch.arange(8, dtype=torch.float32)
    pd_x, res = gradops.layer_norm_grad(dy, x, variance, mean, gamma, 1e-4)
    assert res[0, 0, 0].item() == pytest.approx(-1.5275106, rel=1e-6)
    expected = torch.tensor([3.0548172, 0.4362857, -1.3093826, -2.182187])
    assert torch.allclose(pd_x[0, 0, :4], expected, rtol=1e-5, atol=1e-6)


def test_layer_norm_grad_beta_worked_example_from_cann_docs(backend):
    dy = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    pd_gamma, pd_beta = gradops.layer_norm_grad_beta(dy.clone(), dy)
    assert pd_gamma[0].item() == 8960 and pd_beta[0].item() == 224
    assert pd_gamma.dtype == torch.float32 and pd_gamma.shape == (8,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_grad_equals_layer_norm_dx_with_true_statistics(backend, dtype):
    x, dy = rand((2, 5, 24), dtype), rand((2, 5, 24), dtype)
    gamma = rand((24,), dtype)
    xd = x.double()
    mean, var = xd.mean(-1), xd.var(-1, unbiased=False)
    eps = float(torch.tensor(1e-5, dtype=dtype))
    pd_x, res = gradops.layer_norm_grad(dy, x, var.to(dtype), mean.to(dtype), gamma, eps)
    assert pd_x.dtype == dtype and res.dtype == dtype
    edx, _ = oracles.layer_norm_autograd(dy, x, 1, gamma, eps=eps)
    assert_close(pd_x, edx, dtype)
    assert_close(res, (xd - mean[..., None]) / torch.sqrt(var[..., None] + eps), dtype)
    pd_gamma, pd_beta = gradops.layer_norm_grad_beta(res, dy)
    rows_dy = dy.reshape(-1, 24).double()
    assert_close(pd_gamma, (rows_dy * res.reshape(-1, 24).double()).sum(0), dtype)
    assert_close(pd_beta, rows_dy.sum(0), dtype)


def test_layer_norm_grad_literal_pd_mean_term(backend):
    """The pd_mean term CANN keeps (sum(-2 x2) / H) matters when mean is not x's mean."""
    x, dy, gamma = rand((3, 8), torch.float64), rand((3, 8), torch.float64), rand((8,), torch.float64)
    mean, var, eps = x.mean(-1) + 0.5, x.var(-1, unbiased=False), 1e-5
    pd_x, _ = gradops.layer_norm_grad(dy, x, var, mean, gamma, eps)
    r = 1 / torch.sqrt(var[:, None] + eps)
    x2, x1 = x - mean[:, None], dy * gamma
    pd_var = (-0.5 * x1 * x2 * r ** 3).sum(-1, keepdim=True)
    pd_mean = (-x1 * r).sum(-1, keepdim=True) + pd_var * (-2 * x2).sum(-1, keepdim=True) / 8
    expected = x1 * r + pd_var * 2 / 8 * x2 + pd_mean / 8
    assert_close(pd_x, expected, tol=1e-12)


def test_reuse_source_overwrites_like_cann(backend):
    x, dy = rand((2, 3, 16)), rand((2, 3, 16))
    gamma = rand((16,))
    mean, var = x.mean(-1), x.var(-1, unbiased=False)
    want = gradops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5)
    xr, dyr = x.clone(), dy.clone()
    got = gradops.layer_norm_grad(dyr, xr, var, mean, gamma, 1e-5, reuse_source=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.allclose(dyr, dy * gamma) and torch.allclose(xr, x - mean[..., None])
    res = want[1].clone()
    pg, pb = gradops.layer_norm_grad_beta(res, dy, reuse_source=True)
    assert torch.allclose(res, dy * want[1])
    assert torch.equal(pg, gradops.layer_norm_grad_beta(want[1], dy)[0])


def test_reuse_source_with_half_is_161002(backend):
    x = rand((2, 8), torch.float16)
    with raises_status(INVALID, "reuse_source"):
        gradops.layer_norm_grad(x, x, x[:, 0], x[:, 0], x[0], 1e-5, reuse_source=True)
    with raises_status(INVALID, "reuse_source"):
        gradops.layer_norm_grad_beta(x, x, reuse_source=True)


def test_layer_norm_grad_errors(backend):
    x = rand((2, 3, 8))
    v, m, g = torch.ones(2, 3), torch.zeros(2, 3), torch.ones(8)
    with raises_status(NULLPTR, "variance"):
        gradops.layer_norm_grad(x, x, None, m, g, 1e-5)
    with raises_status(INVALID, "gamma", "dtype"):
        gradops.layer_norm_grad(x, x, v, m, g.half(), 1e-5)
    with raises_status(INVALID, "gamma", "shape"):
        gradops.layer_norm_grad(x, x, v, m, torch.ones(7), 1e-5)
    with raises_status(INVALID, "mean", "shape"):
        gradops.layer_norm_grad(x, x, v, torch.zeros(6), g, 1e-5)
    with raises_status(INVALID, "res_for_gamma", "shape"):
        gradops.layer_norm_grad_beta(x[:, :2], x)
    with raises_status(NULLPTR, "dy"):
        gradops.layer_norm_grad_beta(x, None)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_weight_and_bias_gradients_are_separate_tensors(backend, weight_dtype):
    """dweight and dbias (and LayerNormGradBeta's pd_gamma and pd_beta) never share memory:
    gradops.nn's custom ops may not return aliases (a float32 weight beside bf16 input used to
    get two views of one buffer, and autograd refused them)."""
    x, dy = rand((5, 12), torch.bfloat16), rand((5, 12), torch.bfloat16)
    w, b = rand((12,), weight_dtype), rand((12,), weight_dtype)
    _, mean, rstd = gradops.layer_norm(x, [12], w, b)
    _, dw, db = gradops.layer_norm_backward(dy, x, [12], mean, rstd, w, b)
    assert dw.untyped_storage().data_ptr() != db.untyped_storage().data_ptr()
    pd_gamma, pd_beta = gradops.layer_norm_grad_beta(rand((5, 12)), rand((5, 12)))
    assert pd_gamma.untyped_storage().data_ptr() != pd_beta.untyped_storage().data_ptr()
