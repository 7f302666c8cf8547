"""RMSNorm: ``rms_norm`` / ``rms_norm_grad`` (aclnnRmsNorm / aclnnRmsNormGrad, OPERATORS.md
section 3). CANN checks RMSNorm's shapes at tiling, so shape rules are 561002; dtypes 161002.

Beyond CANN, the variants real models use (docs/nn.md): ``offset`` (scale by ``offset +
gamma``, Gemma's ``1 + w``), ``casting_mode`` ("gemma": everything in float32, one
rounding at the end, as CANN and torch compute; "llama": x-hat rounded to x's dtype before
gamma, HF Llama's ``weight * hidden.to(input_dtype)``) and the fused residual add
(``residual``: normalise ``h = x + residual`` and return h too; ``dresidual``: h's gradient
from elsewhere, added to dx).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from .._backend import implementation
from ._checks import (
    ACLNN_ERR_PARAM_NULLPTR,
    TILING,
    check_bool_attr,
    check_companion,
    check_dtype,
    check_float_attr,
    check_overwritten,
    check_same_device,
    check_same_dtype,
    check_shape,
    dtype_name,
    fail,
    invalid,
    require_tensor,
    short_repr,
    stat_dtype,
    wrong_type,
)
from . import _plans
from ._prepared import Prepared
from ._shapes import as_shape, check_stat, check_trailing, finish_dx, in_place_rows, rows_cols

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


CASTING_MODES = ("gemma", "llama")


def check_casting_mode(op, casting_mode) -> bool:
    """Validates ``casting_mode``; returns whether it rounds x-hat to x's dtype before gamma."""
    if casting_mode is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"casting_mode is None, expected one of {', '.join(map(repr, CASTING_MODES))}")
    if not isinstance(casting_mode, str):  # before the comparison, which an array would answer elementwise
        wrong_type(op, f"casting_mode is a {type(casting_mode).__name__}, expected a str "
                       f"({', '.join(map(repr, CASTING_MODES))})")
    if casting_mode not in CASTING_MODES:
        invalid(op, f"casting_mode is {short_repr(casting_mode)}, expected one of {', '.join(map(repr, CASTING_MODES))}")
    return casting_mode == "llama"


def _check_gamma_shape(op, x, gamma):
    if gamma.dim() < 1:
        invalid(op, "gamma has 0 dims, expected x.shape[-n:] with n >= 1", status=TILING)
    check_trailing(op, "gamma", x, "x", tuple(gamma.shape), status=TILING, verb="has shape")


class RmsNormPlan(NamedTuple):
    """What the checks of an ``rms_norm`` call concluded (kept per call signature)."""
    impl: object  # the backend module
    eps: float
    offset: float
    round_xhat: bool
    rows: int
    cols: int
    rstd_shape: Tuple[int, ...]  # rstd as the operator returns it (x's leading dims, then 1s)
    outputs: tuple  # (shape, dtype) of y, rstd (and h)


def plan_rms_norm(x, gamma, eps=1e-6, *, offset=0.0, casting_mode="gemma", residual=None, backend=None,
                  op="rms_norm") -> RmsNormPlan:
    """Checks an ``rms_norm`` call (once per call signature) and plans it."""
    key = _plans.signature(op, backend, (x, gamma, residual), (eps, offset, casting_mode))
    plan = _plans.lookup(key)
    if plan is not None:
        return plan
    require_tensor(op, "x", x)
    require_tensor(op, "gamma", gamma)
    eps = check_float_attr(op, "eps", eps)
    offset = check_float_attr(op, "offset", offset)
    round_xhat = check_casting_mode(op, casting_mode)
    _check_dtypes(op, x, gamma)
    if residual is not None:
        check_companion(op, "residual", residual, "x", x, status=TILING)
    _check_gamma_shape(op, x, gamma)
    check_same_device(op, [("x", x), ("gamma", gamma), ("residual", residual)])
    impl = implementation(op, FAMILY, backend, x.device)
    n = gamma.dim()
    rows, cols = rows_cols(x, n)
    rstd_shape = tuple(x.shape[: x.dim() - n]) + (1,) * n
    outputs = ((tuple(x.shape), x.dtype), (rstd_shape, stat_dtype(x.dtype)))
    if residual is not None:
        outputs += ((tuple(x.shape), x.dtype),)
    return _plans.remember(key, RmsNormPlan(impl, eps, offset, round_xhat, rows, cols, rstd_shape, outputs))


def run_rms_norm(plan: RmsNormPlan, x, gamma, residual):
    """(y, rstd, h) of a planned call: y and h (None without a residual) in x's shape, rstd one
    per row (``[rows]``, as the backward takes it)."""
    rows, cols = plan.rows, plan.cols
    h = None if residual is None else torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    y, rstd = plan.impl.rms_norm(as_shape(x, (rows, cols)), as_shape(gamma, (cols,)), plan.eps, plan.offset,
                                 plan.round_xhat, None if residual is None else as_shape(residual, (rows, cols)), h)
    return as_shape(y, x.shape), rstd, None if h is None else as_shape(h, x.shape)


def run_planned_rms_norm_grad(plan: RmsNormPlan, dy, x, rstd, gamma, dresidual, grad_dtype):
    """(dx, dgamma) of a planned call's backward (gradops.nn's eager path): autograd hands it
    dy (and dresidual) with the metadata of the outputs whose inputs the plan checked, and
    ``rstd`` as :func:`run_rms_norm` returned it; dgamma in ``grad_dtype``."""
    rows_cols = (plan.rows, plan.cols)
    dx, dgamma = plan.impl.rms_norm_grad(as_shape(dy, rows_cols), as_shape(x, rows_cols), rstd,
                                         as_shape(gamma, (plan.cols,)), None, plan.offset, plan.round_xhat,
                                         None if dresidual is None else as_shape(dresidual, rows_cols), grad_dtype)
    return as_shape(dx, x.shape), as_shape(dgamma, gamma.shape)


def prepare_rms_norm(x, gamma, eps=1e-6, *, offset=0.0, casting_mode="gemma", residual=None,
                     backend=None, op="rms_norm") -> Prepared:
    """``run()`` returns (y, rstd), and h = x + residual third when ``residual`` is given."""
    plan = plan_rms_norm(x, gamma, eps, offset=offset, casting_mode=casting_mode, residual=residual,
                         backend=backend, op=op)

    def run():
        y, rstd, h = run_rms_norm(plan, x, gamma, residual)
        out = (y, rstd.reshape(plan.rstd_shape))
        return out if h is None else out + (h,)

    return Prepared(op, x.device, plan.impl, plan.outputs, run)


def prepare_rms_norm_grad(dy, x, rstd, gamma, *, in_place=False, offset=0.0, casting_mode="gemma",
                          dresidual=None, backend=None, op="rms_norm_grad") -> Prepared:
    """``x`` is what the forward normalised (h, with a residual); ``dresidual`` is the
    gradient h receives from elsewhere, added to dx."""
    # (an in-place call's overlap rules read data pointers: it is checked every time)
    key = None if in_place is not False else _plans.signature(
        op, backend, (dy, x, rstd, gamma, dresidual), (offset, casting_mode))
    plan = _plans.lookup(key)
    if plan is None:
        plan = _plans.remember(key, _check_rms_norm_grad(dy, x, rstd, gamma, in_place, offset, casting_mode,
                                                         dresidual, backend, op))
    impl, in_place, offset, round_xhat, outputs = plan

    def run():
        return run_rms_norm_grad(impl, dy, x, rstd, gamma, in_place=in_place, offset=offset, round_xhat=round_xhat,
                                 dresidual=dresidual)

    return Prepared(op, x.device, impl, outputs, run)


def _check_rms_norm_grad(dy, x, rstd, gamma, in_place, offset, casting_mode, dresidual, backend, op):
    """(backend module, in_place, offset, round_xhat, output specs) of a valid call."""
    for name, t in (("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma)):
        require_tensor(op, name, t)
    offset = check_float_attr(op, "offset", offset)
    round_xhat = check_casting_mode(op, casting_mode)
    # every dtype rule (161002) before the shape rules CANN checks at tiling (561002)
    _check_dtypes(op, x, gamma)
    check_same_dtype(op, "dy", dy, "x", x)
    check_dtype(op, "rstd", rstd, (stat_dtype(x.dtype),))
    if dresidual is not None:
        check_same_dtype(op, "dresidual", require_tensor(op, "dresidual", dresidual), "x", x)
    _check_gamma_shape(op, x, gamma)
    check_shape(op, "dy", dy, x.shape, "x.shape", status=TILING)
    if dresidual is not None:
        check_shape(op, "dresidual", dresidual, x.shape, "x.shape", status=TILING)
    n = gamma.dim()
    check_stat(op, "rstd", rstd, x, n, status=TILING)
    in_place = check_bool_attr(op, "in_place", in_place)
    check_same_device(op, [("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma), ("dresidual", dresidual)])
    if in_place:  # dx is written into dy's memory
        check_overwritten(op, "dy", dy, [("x", x), ("rstd", rstd), ("gamma", gamma), ("dresidual", dresidual)])
    impl = implementation(op, FAMILY, backend, x.device)
    outputs = ((tuple(x.shape), x.dtype), (tuple(gamma.shape), stat_dtype(x.dtype)))
    return impl, in_place, offset, round_xhat, outputs


def run_rms_norm_grad(impl, dy, x, rstd, gamma, *, in_place=False, offset=0.0, round_xhat=False, dresidual=None):
    """What a validated ``rms_norm_grad`` call computes, on backend module ``impl`` (dgamma in
    float32, the operator's)."""
    rows, cols = rows_cols(x, gamma.dim())
    dy2 = as_shape(dy, (rows, cols))
    dx_out = in_place_rows(dy, dy2, in_place)
    dx, dgamma = impl.rms_norm_grad(dy2, as_shape(x, (rows, cols)), as_shape(rstd, (rows,)), as_shape(gamma, (cols,)),
                                    dx_out, offset, round_xhat,
                                    None if dresidual is None else as_shape(dresidual, (rows, cols)))
    return finish_dx(dx, dy, dx_out, in_place, x.shape), as_shape(dgamma, gamma.shape)
