"""RMSNorm: ``rms_norm`` / ``rms_norm_grad`` (aclnnRmsNorm / aclnnRmsNormGrad, OPERATORS.md
section 3). CANN checks RMSNorm's shapes at tiling, so shape rules are 561002; dtypes 161002."""
from __future__ import annotations

import torch

from .._backend import implementation
from ._checks import (
    TILING,
    check_dtype,
    check_float_attr,
    check_same_device,
    check_same_dtype,
    check_shape,
    dtype_name,
    invalid,
    require_tensor,
    stat_dtype,
)
from ._prepared import Prepared
from ._shapes import check_stat, check_trailing, finish_dx, in_place_rows, rows_cols

FAMILY = "rms_norm"

# x dtype -> gamma dtypes allowed beside it (CANN's table, plus float64 throughout)
GAMMA_DTYPES = {
    torch.float16: (torch.float32, torch.float16),
    torch.bfloat16: (torch.float32, torch.bfloat16),
    torch.float32: (torch.float32,),
    torch.float64: (torch.float64,),
}


def _check_dtypes(op, x, gamma):
    check_dtype(op, "x", x, tuple(GAMMA_DTYPES))
    allowed = GAMMA_DTYPES[x.dtype]
    if gamma.dtype not in allowed:
        invalid(op, f"gamma has dtype {dtype_name(gamma.dtype)} beside x of dtype {dtype_name(x.dtype)}, "
                    f"expected dtype in {'/'.join(dtype_name(d) for d in allowed)}")


def _check_gamma_shape(op, x, gamma):
    if gamma.dim() < 1:
        invalid(op, "gamma has 0 dims, expected x.shape[-n:] with n >= 1", status=TILING)
    check_trailing(op, "gamma", x, "x", tuple(gamma.shape), status=TILING, verb="has shape")


def prepare_rms_norm(x, gamma, eps=1e-6, *, backend=None, op="rms_norm") -> Prepared:
    require_tensor(op, "x", x)
    require_tensor(op, "gamma", gamma)
    eps = check_float_attr(op, "eps", eps)
    _check_dtypes(op, x, gamma)
    _check_gamma_shape(op, x, gamma)
    check_same_device(op, [("x", x), ("gamma", gamma)])
    impl = implementation(op, FAMILY, backend, x.device)
    n = gamma.dim()
    rows, cols = rows_cols(x, n)
    rstd_shape = tuple(x.shape[: x.dim() - n]) + (1,) * n

    def run():
        y, rstd = impl.rms_norm(x.reshape(rows, cols), gamma.reshape(cols), eps)
        return y.reshape(x.shape), rstd.reshape(rstd_shape)

    outputs = ((tuple(x.shape), x.dtype), (rstd_shape, stat_dtype(x.dtype)))
    return Prepared(op, x.device, impl, outputs, run)


def prepare_rms_norm_grad(dy, x, rstd, gamma, *, in_place=False, backend=None,
                          op="rms_norm_grad") -> Prepared:
    for name, t in (("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma)):
        require_tensor(op, name, t)
    # every dtype rule (161002) before the shape rules CANN checks at tiling (561002)
    _check_dtypes(op, x, gamma)
    check_same_dtype(op, "dy", dy, "x", x)
    check_dtype(op, "rstd", rstd, (stat_dtype(x.dtype),))
    _check_gamma_shape(op, x, gamma)
    check_shape(op, "dy", dy, x.shape, "x.shape", status=TILING)
    n = gamma.dim()
    check_stat(op, "rstd", rstd, x, n, status=TILING)
    if not isinstance(in_place, bool):
        invalid(op, f"in_place is {in_place!r}, expected a bool")
    check_same_device(op, [("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma)])
    impl = implementation(op, FAMILY, backend, x.device)
    rows, cols = rows_cols(x, n)

    def run():
        dy2 = dy.reshape(rows, cols)
        dx_out = in_place_rows(dy, dy2, in_place)
        dx, dgamma = impl.rms_norm_grad(dy2, x.reshape(rows, cols), rstd.reshape(rows),
                                        gamma.reshape(cols), dx_out=dx_out)
        return finish_dx(dx, dy, dx_out, in_place, x.shape), dgamma.reshape(gamma.shape)

    outputs = ((tuple(x.shape), x.dtype), (tuple(gamma.shape), stat_dtype(x.dtype)))
    return Prepared(op, x.device, impl, outputs, run)
