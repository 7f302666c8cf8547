"""RMSNorm (aclnnRmsNorm / aclnnRmsNormGrad semantics) against float64 autograd through the
forward formula, on both backends (calls that name no backend take the ``backend`` fixture's)."""
import pytest
import torch

import gradops
from gradops import oracles
from gradops.errors import (
    ACLNN_ERR_INNER_TILING_ERROR as TILING,
    ACLNN_ERR_PARAM_INVALID as INVALID,
    ACLNN_ERR_PARAM_NULLPTR as NULLPTR,
)

from helpers import assert_close, raises_status, rand

# (x dtype, gamma dtype) pairs of CANN's table, plus float64 throughout
TABLE = [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64),
]


@pytest.mark.parametrize("x_dtype,g_dtype", TABLE)
@pytest.mark.parametrize("shape,n", [((1, 3), 1), ((4, 64), 1), ((3, 7, 129), 1), ((2, 3, 4, 5), 2),
                                     ((5, 1000), 1)])
def test_forward_and_backward_match_float64_autograd(backend, shape, n, x_dtype, g_dtype, device):
    x, dy = rand(shape, x_dtype, device), rand(shape, x_dtype, device)
    gamma = rand(shape[len(shape) - n:], g_dtype, device)
    y, rstd = gradops.rms_norm(x, gamma)
    acc = torch.float64 if x_dtype == torch.float64 else torch.float32
    assert y.dtype == x_dtype and rstd.dtype == acc
    assert rstd.shape == shape[: len(shape) - n] + (1,) * n
    ey, erstd = oracles.rms_norm(x, gamma)
    assert_close(y, ey, x_dtype, what="y")
    assert_close(rstd, erstd, acc, what="rstd")
    dx, dgamma = gradops.rms_norm_grad(dy, x, rstd, gamma)
    assert dx.dtype == x_dtype and dgamma.dtype == acc and dgamma.shape == gamma.shape
    edx, edgamma = oracles.rms_norm_backward(dy, x, gamma)
    assert_close(dx, edx, x_dtype, what="dx")
    # dgamma sums half-precision products in float32: its error is the inputs' rounding only
    assert_close(dgamma, edgamma, acc, what="dgamma")


def test_float64_is_exact_to_1e_10_on_random_shapes(backend):
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        rows = int(torch.randint(1, 20, (1,), generator=gen, device="cpu"))
        cols = int(torch.randint(1, 300, (1,), generator=gen, device="cpu"))
        x, dy, g = rand((rows, cols), torch.float64), rand((rows, cols), torch.float64), rand((cols,), torch.float64)
        _, rstd = gradops.rms_norm(x, g)
        for a, e in zip(gradops.rms_norm_grad(dy, x, rstd, g), oracles.rms_norm_backward(dy, x, g)):
            assert_close(a, e, tol=1e-10)


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma):
        y, rstd = gradops.rms_norm(x, gamma)
        ctx.save_for_backward(x, rstd, gamma)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, gamma = ctx.saved_tensors
        return gradops.rms_norm_grad(dy.contiguous(), x, rstd, gamma)


def test_gradcheck_finite_differences(backend):
    x = rand((4, 5), torch.float64).requires_grad_()
    g = rand((5,), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(_RmsNormFn.apply, (x, g))


def test_rstd_accepted_keepdim_or_not(backend):
    x, dy, g = rand((2, 3, 8)), rand((2, 3, 8)), rand((8,))
    _, rstd = gradops.rms_norm(x, g)
    a = gradops.rms_norm_grad(dy, x, rstd, g)
    b = gradops.rms_norm_grad(dy, x, rstd.reshape(2, 3), g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_in_place_writes_dx_into_dy(backend):
    x, dy, g = rand((4, 10)), rand((4, 10)), rand((10,))
    _, rstd = gradops.rms_norm(x, g)
    want = gradops.rms_norm_grad(dy, x, rstd, g)
    buf = dy.clone()
    dx, dgamma = gradops.rms_norm_grad(buf, x, rstd, g, in_place=True)
    assert dx is buf and torch.equal(buf, want[0]) and torch.equal(dgamma, want[1])


def test_empty_rows_and_non_contiguous(backend):
    x = torch.empty(0, 5)
    y, rstd = gradops.rms_norm(x, torch.ones(5))
    assert y.shape == (0, 5) and rstd.shape == (0, 1)
    dx, dgamma = gradops.rms_norm_grad(x, x, rstd, torch.ones(5))
    assert dx.shape == (0, 5) and torch.equal(dgamma, torch.zeros(5))
    base = rand((6, 9, 4))
    xs, dys = base.transpose(0, 1)[::2], rand((9, 6, 4))[::2]
    g = rand((8,))[::2]
    _, rstd = gradops.rms_norm(xs, g)
    for a, e in zip(gradops.rms_norm_grad(dys, xs, rstd, g), oracles.rms_norm_backward(dys, xs, g)):
        assert_close(a, e, torch.float32)


def test_nan_propagates_to_its_row_only(backend):
    x, dy, g = rand((4, 8)), rand((4, 8)), rand((8,))
    x[1, 0] = float("nan")
    y, rstd = gradops.rms_norm(x, g)
    dx, dgamma = gradops.rms_norm_grad(dy, x, rstd, g)
    assert torch.isnan(dx[1]).all() and not torch.isnan(dx[[0, 2, 3]]).any()
    assert torch.isnan(dgamma).all()


# ---- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("x_dtype,g_dtype", [
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16), (torch.float64, torch.float32), (torch.float32, torch.float64),
])
def test_dtype_outside_the_table_is_161002(backend, x_dtype, g_dtype):
    x = rand((2, 8), x_dtype)
    with raises_status(INVALID, "gamma", "dtype"):
        gradops.rms_norm(x, rand((8,), g_dtype))


def test_grad_errors(backend):
    x, dy, g = rand((3, 8)), rand((3, 8)), rand((8,))
    _, rstd = gradops.rms_norm(x, g)
    for name in ("dy", "x", "rstd", "gamma"):
        args = dict(dy=dy, x=x, rstd=rstd, gamma=g)
        args[name] = None
        with raises_status(NULLPTR, name):
            gradops.rms_norm_grad(**args)
    with raises_status(INVALID, "rstd", "dtype"):
        gradops.rms_norm_grad(dy, x, rstd.half(), g)
    with raises_status(INVALID, "dy", "dtype"):
        gradops.rms_norm_grad(dy.half(), x, rstd, g)
    with raises_status(TILING, "gamma", "x.shape[-1:] == (8,)"):
        gradops.rms_norm_grad(dy, x, rstd, rand((7,)))
    with raises_status(TILING, "dy", "shape"):
        gradops.rms_norm_grad(rand((3, 9)), x, rstd, g)
    with raises_status(TILING, "rstd", "shape"):
        gradops.rms_norm_grad(dy, x, torch.ones(4), g)
    with raises_status(INVALID, "x", "dtype"):
        gradops.rms_norm(torch.ones(3, 8, dtype=torch.int64), g)


def test_failed_in_place_call_writes_nothing(backend):
    x, dy, g = rand((3, 8)), rand((3, 8)), rand((8,))
    _, rstd = gradops.rms_norm(x, g)
    before = dy.clone()
    with raises_status(TILING, "rstd"):
        gradops.rms_norm_grad(dy, x, torch.ones(2), g, in_place=True)
    assert torch.equal(dy, before)


def test_dtype_rules_come_before_tiling_shape_rules(backend):
    """CANN reports a dtype error (161002) even when a shape is also wrong (561002)."""
    x, dy = rand((3, 8)), rand((3, 8))
    with raises_status(INVALID, "rstd", "dtype"):
        gradops.rms_norm_grad(dy, x, torch.ones(3, dtype=torch.float16), rand((7,)))
    with raises_status(INVALID, "dy", "dtype"):
        gradops.rms_norm_grad(dy.double(), x, torch.ones(5), rand((7,)))
