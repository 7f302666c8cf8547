"""LayerNorm: ``layer_norm`` / ``layer_norm_backward`` (aclnnLayerNorm / aclnnLayerNormBackward,
PyTorch's native_layer_norm) and the AscendC-semantics ``layer_norm_grad`` /
``layer_norm_grad_beta`` (OPERATORS.md sections 1 and 2). Every LayerNorm rule is 161001
(a None) or 161002: CANN checks them in its op API, none at tiling.

Beyond CANN: the fused residual add of pre-norm blocks (``residual``: normalise ``h = x +
residual`` and return h too; ``dresidual``: h's gradient from elsewhere, added to dx).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from .._backend import implementation
from ._checks import (
    FLOAT_DTYPES,
    check_bool_attr,
    check_overwritten,
    check_companion,
    check_dtype,
    check_float_attr,
    check_same_device,
    check_same_dtype,
    check_shape,
    dtype_name,
    dtype_names,
    invalid,
    require_tensor,
    stat_dtype,
)
from . import _plans
from ._prepared import Prepared
from ._shapes import (
    aliases,
    as_shape,
    as_bool_triple,
    as_int_tuple,
    check_stat,
    check_trailing,
    finish_dx,
    in_place_rows,
    rows_cols,
)

FAMILY = "layer_norm"


def param_dtypes(x_dtype: torch.dtype):
    """Dtypes a weight/bias may have beside activations of ``x_dtype``: the same, or float32
    master weights beside half-precision activations."""
    return (x_dtype,) if x_dtype in (torch.float32, torch.float64) else (x_dtype, torch.float32)


def stat_dtypes(x_dtype: torch.dtype):
    """Dtypes the backward takes mean/rstd in: float32 (what CANN and torch on a GPU return
    for every input dtype), or x's own dtype (torch on CPU returns half statistics for half
    input, float64 for float64). They are computed in float32 (float64 for float64 input)."""
    return (torch.float32,) if x_dtype == torch.float32 else (torch.float32, x_dtype)


def _grad_dtype(weight, x):
    """The dtype of dweight and dbias: the weight's (float32 master weights get float32
    gradients), or the accumulator's without a weight."""
    return weight.dtype if weight is not None else stat_dtype(x.dtype)


def _check_affine(op, name, t, x, normalized_shape):
    if t is None:
        return None
    require_tensor(op, name, t)
    check_dtype(op, name, t, param_dtypes(x.dtype))
    check_shape(op, name, t, normalized_shape, "normalized_shape")
    return t


class LayerNormPlan(NamedTuple):
    """What the checks of a ``layer_norm`` call concluded (kept per call signature)."""
    impl: object  # the backend module
    normalized_shape: Tuple[int, ...]
    eps: float
    rows: int
    cols: int
    stat_shape: Tuple[int, ...]  # mean/rstd as the operator returns them (x's leading dims, then 1s)
    outputs: tuple  # (shape, dtype) of y, mean, rstd (and h)


def plan_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual=None, backend=None,
                    op="layer_norm") -> LayerNormPlan:
    """Checks a ``layer_norm`` call (once per call signature) and plans it."""
    key = _plans.signature(op, backend, (x, weight, bias, residual), (normalized_shape, eps))
    plan = _plans.lookup(key)
    if plan is not None:
        return plan
    require_tensor(op, "x", x)
    normalized_shape = as_int_tuple(op, "normalized_shape", normalized_shape)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_trailing(op, "normalized_shape", x, "x", normalized_shape)
    _check_affine(op, "weight", weight, x, normalized_shape)
    _check_affine(op, "bias", bias, x, normalized_shape)
    eps = check_float_attr(op, "eps", eps)
    if residual is not None:
        check_companion(op, "residual", residual, "x", x)
    check_same_device(op, [("x", x), ("weight", weight), ("bias", bias), ("residual", residual)])
    impl = implementation(op, FAMILY, backend, x.device)
    rows, cols = rows_cols(x, len(normalized_shape))
    stat_shape = tuple(x.shape[: x.dim() - len(normalized_shape)]) + (1,) * len(normalized_shape)
    acc = stat_dtype(x.dtype)
    outputs = ((tuple(x.shape), x.dtype), (stat_shape, acc), (stat_shape, acc))
    if residual is not None:
        outputs += ((tuple(x.shape), x.dtype),)
    return _plans.remember(key, LayerNormPlan(impl, normalized_shape, eps, rows, cols, stat_shape, outputs))


def run_layer_norm(plan: LayerNormPlan, x, weight, bias, residual):
    """(y, mean, rstd, h) of a planned call: y and h (None without a residual) in x's shape,
    mean and rstd one per row (``[rows]``, as the backward takes them)."""
    rows, cols = plan.rows, plan.cols
    h = None if residual is None else torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    y, mean, rstd = plan.impl.layer_norm(
        as_shape(x, (rows, cols)),
        None if weight is None else as_shape(weight, (cols,)),
        None if bias is None else as_shape(bias, (cols,)),
        plan.eps,
        None if residual is None else as_shape(residual, (rows, cols)),
        h,
    )
    return as_shape(y, x.shape), mean, rstd, None if h is None else as_shape(h, x.shape)


def run_planned_layer_norm_backward(plan: LayerNormPlan, dy, x, mean, rstd, weight, output_mask, dresidual):
    """(dx, dweight, dbias) of a planned call's backward (gradops.nn's eager path), None where
    ``output_mask`` says so: autograd hands it dy (and dresidual) with the metadata of the
    outputs whose inputs the plan checked, and mean/rstd as :func:`run_layer_norm` returned
    them."""
    rows_cols = (plan.rows, plan.cols)
    dx, dw, db = plan.impl.layer_norm_backward(
        as_shape(dy, rows_cols), as_shape(x, rows_cols), mean, rstd,
        None if weight is None else as_shape(weight, (plan.cols,)), output_mask, None,
        None if dresidual is None else as_shape(dresidual, rows_cols), grad_dtype=_grad_dtype(weight, x))
    shape = plan.normalized_shape
    return (None if dx is None else as_shape(dx, x.shape), None if dw is None else as_shape(dw, shape),
            None if db is None else as_shape(db, shape))


def prepare_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual=None,
                       backend=None, op="layer_norm") -> Prepared:
    """``run()`` returns (y, mean, rstd), and h = x + residual fourth when ``residual`` is given."""
    plan = plan_layer_norm(x, normalized_shape, weight, bias, eps, residual=residual, backend=backend, op=op)

    def run():
        y, mean, rstd, h = run_layer_norm(plan, x, weight, bias, residual)
        out = (y, mean.reshape(plan.stat_shape), rstd.reshape(plan.stat_shape))
        return out if h is None else out + (h,)

    return Prepared(op, x.device, plan.impl, plan.outputs, run)


def prepare_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight=None, bias=None,
                                output_mask=(True, True, True), *, in_place=False, dresidual=None,
                                backend=None, op="layer_norm_backward") -> Prepared:
    """``x`` is what the forward normalised (h, with a residual); ``dresidual`` is the
    gradient h receives from elsewhere, added to dx."""
    # (an in-place call's overlap rules read data pointers: it is checked every time)
    key = None if in_place is not False else _plans.signature(
        op, backend, (dy, x, mean, rstd, weight, bias, dresidual), (normalized_shape, output_mask))
    plan = _plans.lookup(key)
    if plan is None:
        plan = _plans.remember(key, _check_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias,
                                                               output_mask, in_place, dresidual, backend, op))
    impl, normalized_shape, output_mask, in_place, outputs = plan

    def run():
        return run_layer_norm_backward(impl, dy, x, normalized_shape, mean, rstd, weight, output_mask,
                                       in_place=in_place, dresidual=dresidual)

    return Prepared(op, x.device, impl, outputs, run)


def _check_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias, output_mask, in_place, dresidual,
                               backend, op):
    """(backend module, normalized_shape, output_mask, in_place, output specs) of a valid call."""
    for name, t in (("dy", dy), ("x", x)):
        require_tensor(op, name, t)
    normalized_shape = as_int_tuple(op, "normalized_shape", normalized_shape)
    require_tensor(op, "mean", mean)
    require_tensor(op, "rstd", rstd)
    output_mask = as_bool_triple(op, "output_mask", output_mask)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_same_dtype(op, "dy", dy, "x", x)
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.dtype not in stat_dtypes(x.dtype):
            invalid(op, f"{name} has dtype {dtype_name(t.dtype)} beside x of dtype {dtype_name(x.dtype)}, "
                        f"expected dtype in {dtype_names(stat_dtypes(x.dtype))} (float32 or x's dtype)")
    check_shape(op, "dy", dy, x.shape, "x.shape")
    check_trailing(op, "normalized_shape", x, "x", normalized_shape)
    n_norm = len(normalized_shape)
    check_stat(op, "mean", mean, x, n_norm)
    check_shape(op, "rstd", rstd, mean.shape, "mean.shape")
    _check_affine(op, "weight", weight, x, normalized_shape)
    _check_affine(op, "bias", bias, x, normalized_shape)  # checked like CANN, unused by the math
    if dresidual is not None:
        check_companion(op, "dresidual", dresidual, "x", x)
    in_place = check_bool_attr(op, "in_place", in_place)
    if in_place and not output_mask[0]:
        invalid(op, "in_place is True but output_mask[0] is False, expected the input gradient to be "
                    "computed when it is to be written into dy")
    check_same_device(op, [("dy", dy), ("x", x), ("mean", mean), ("rstd", rstd), ("weight", weight),
                           ("bias", bias), ("dresidual", dresidual)])
    if in_place:
        check_overwritten(op, "dy", dy, [("x", x), ("mean", mean), ("rstd", rstd), ("weight", weight),
                                         ("dresidual", dresidual)])
    impl = implementation(op, FAMILY, backend, x.device)
    grad_dtype = _grad_dtype(weight, x)
    outputs = (
        (tuple(x.shape), x.dtype) if output_mask[0] else None,
        (normalized_shape, grad_dtype) if output_mask[1] else None,
        (normalized_shape, grad_dtype) if output_mask[2] else None,
    )
    return impl, normalized_shape, output_mask, in_place, outputs


def run_layer_norm_backward(impl, dy, x, normalized_shape, mean, rstd, weight, output_mask, *,
                            in_place=False, dresidual=None):
    """What a validated ``layer_norm_backward`` call computes, on backend module ``impl``."""
    rows, cols = rows_cols(x, len(normalized_shape))
    acc = stat_dtype(x.dtype)
    dy2 = as_shape(dy, (rows, cols))
    dx_out = in_place_rows(dy, dy2, in_place)
    # dw and db in the weight's dtype, rounded once by the backend as it writes them
    dx, dw, db = impl.layer_norm_backward(
        dy2, as_shape(x, (rows, cols)), _row_stat(mean, rows, acc), _row_stat(rstd, rows, acc),
        None if weight is None else as_shape(weight, (cols,)), output_mask, dx_out,
        None if dresidual is None else as_shape(dresidual, (rows, cols)),
        grad_dtype=_grad_dtype(weight, x))
    if dx is not None:
        dx = finish_dx(dx, dy, dx_out, in_place, x.shape)
    if dw is not None:
        dw = as_shape(dw, normalized_shape)
    if db is not None:
        db = as_shape(db, normalized_shape)
    return dx, dw, db


def _row_stat(t, rows, acc):
    """A per-row statistic as ``[rows]`` in the accumulator dtype."""
    t = as_shape(t, (rows,))
    return t if t.dtype == acc else t.to(acc)


def _check_ascendc_rows(op, x, dy):
    """x/dy ``[..., H]`` of one float dtype (AscendC T; float64 too in the Python API)."""
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_same_dtype(op, "dy", dy, "x", x)
    check_shape(op, "dy", dy, x.shape, "x.shape")
    if x.dim() < 1:
        invalid(op, "x has 0 dims, expected [..., H]")


def _check_reuse(op, reuse_source, dtype):
    reuse_source = check_bool_attr(op, "reuse_source", reuse_source)
    if reuse_source and dtype not in (torch.float32, torch.float64):
        invalid(op, f"reuse_source is True with dtype {str(dtype).replace('torch.', '')}, expected "
                    f"reuse_source only for float inputs (CANN's isReuseSource rule)")


def prepare_layer_norm_grad(dy, x, variance, mean, gamma, eps, reuse_source=False, *, backend=None,
                            op="layer_norm_grad") -> Prepared:
    for name, t in (("dy", dy), ("x", x), ("variance", variance), ("mean", mean), ("gamma", gamma)):
        require_tensor(op, name, t)
    eps = check_float_attr(op, "eps", eps)
    _check_ascendc_rows(op, x, dy)
    for name, t in (("variance", variance), ("mean", mean), ("gamma", gamma)):
        check_same_dtype(op, name, t, "x", x)
    check_stat(op, "variance", variance, x, 1)
    check_stat(op, "mean", mean, x, 1)
    check_shape(op, "gamma", gamma, x.shape[-1:], "x.shape[-1:]")
    _check_reuse(op, reuse_source, x.dtype)
    check_same_device(op, [("dy", dy), ("x", x), ("variance", variance), ("mean", mean), ("gamma", gamma)])
    if reuse_source:  # dy and x are overwritten (dy*gamma, x-mean)
        check_overwritten(op, "dy", dy, [("x", x), ("variance", variance), ("mean", mean), ("gamma", gamma)])
        check_overwritten(op, "x", x, [("variance", variance), ("mean", mean), ("gamma", gamma)])
    impl = implementation(op, FAMILY, backend, x.device)
    rows, cols = rows_cols(x, 1)
    if x.dtype == torch.float16:
        eps = float(torch.tensor(eps, dtype=torch.float16))  # CANN's epsilon has type T

    def run():
        dy2, x2 = dy.reshape(rows, cols), x.reshape(rows, cols)
        pd_x, res = impl.layer_norm_grad(dy2, x2, variance.reshape(rows), mean.reshape(rows), gamma,
                                         eps, reuse_source)
        if reuse_source:  # the overwrite must land in the caller's tensors even if they were copied
            if not aliases(dy2, dy):
                dy.copy_(dy2.reshape(dy.shape))
            if not aliases(x2, x):
                x.copy_(x2.reshape(x.shape))
        return pd_x.reshape(x.shape), res.reshape(x.shape)

    outputs = ((tuple(x.shape), x.dtype), (tuple(x.shape), x.dtype))
    return Prepared(op, x.device, impl, outputs, run)


def prepare_layer_norm_grad_beta(res_for_gamma, dy, reuse_source=False, *, backend=None,
                                 op="layer_norm_grad_beta") -> Prepared:
    require_tensor(op, "res_for_gamma", res_for_gamma)
    require_tensor(op, "dy", dy)
    check_dtype(op, "dy", dy, FLOAT_DTYPES)
    check_same_dtype(op, "res_for_gamma", res_for_gamma, "dy", dy)
    check_shape(op, "res_for_gamma", res_for_gamma, dy.shape, "dy.shape")
    if dy.dim() < 1:
        invalid(op, "dy has 0 dims, expected [..., H]")
    _check_reuse(op, reuse_source, dy.dtype)
    check_same_device(op, [("res_for_gamma", res_for_gamma), ("dy", dy)])
    if reuse_source:  # res_for_gamma is overwritten (dy*res_for_gamma)
        check_overwritten(op, "res_for_gamma", res_for_gamma, [("dy", dy)])
    impl = implementation(op, FAMILY, backend, dy.device)
    rows, cols = rows_cols(dy, 1)

    def run():
        res2 = res_for_gamma.reshape(rows, cols)
        pd_gamma, pd_beta = impl.layer_norm_grad_beta(res2, dy.reshape(rows, cols), reuse_source)
        if reuse_source and not aliases(res2, res_for_gamma):
            res_for_gamma.copy_(res2.reshape(res_for_gamma.shape))
        return pd_gamma, pd_beta

    outputs = (((dy.shape[-1],), dy.dtype), ((dy.shape[-1],), dy.dtype))
    return Prepared(op, dy.device, impl, outputs, run)
