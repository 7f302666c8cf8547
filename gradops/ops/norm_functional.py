"""The calls of the norm functionals (``gradops.nn.functional``'s ``layer_norm``, ``rms_norm``
and their fused residual adds), planned once per call signature.

A plan holds what the functional's checks concluded (under torch's parameter names: input,
normalized_shape, weight, bias, eps, residual), its dtype rules (RMSNorm's weight) and, for a
call that runs eagerly, the operator's own plan. gradops.nn asks for the plan and launches
it: a training step's calls skip every check (``_plans``). None where a tensor is required is
AclnnError 161001; a wrong Python type is AclnnTypeError (161002); the operators' rules keep
their status (LayerNorm's 161002, RMSNorm's shape rules 561002), renamed to the functional's
parameter names and naming the functional.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .._backend import _check_name, requested
from ..errors import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, AclnnError
from . import _plans
from . import layer_norm as _ln
from . import rms_norm as _rms
from ._checks import check_companion, check_float_attr, renamed_errors, require_tensor, short_repr, stat_dtype
from ._shapes import as_int_tuple, check_trailing

# the operators' parameter names -> the functionals' (torch's)
NORM_NAMES = {"x": "input", "gamma": "weight"}


class LayerNormCall(NamedTuple):
    normalized_shape: Tuple[int, ...]
    eps: float
    backend: str  # as asked (checked); the operator resolves it
    plan: Optional[_ln.LayerNormPlan]  # the operator's, made by the first call that runs eagerly


class RmsNormCall(NamedTuple):
    eps: float
    offset: float  # the operator's
    casting_mode: str
    backend: str
    plan: Optional[_rms.RmsNormPlan]
    # The operator's gamma where it is not the caller's weight (made or converted here: such a
    # call is not remembered), else None
    gamma: Optional[torch.Tensor]
    # Llama with a weight of another dtype: the operator returns the rounded x-hat and y is
    # (weight + scale_offset) * x-hat in their promoted dtype, as HF computes it; else None
    scale_offset: Optional[float]


def layer_norm_call(op: str, input, residual, normalized_shape, weight, bias, eps, backend, *,
                    eager: bool) -> LayerNormCall:
    """``op`` is "layer_norm" or "fused_add_layer_norm"; ``eager``: the call runs the operator
    directly, so its plan is made too (traced calls leave it to the custom op's fake)."""
    backend = requested(backend)
    key = _plans.signature("gradops.nn.functional." + op, backend, (input, residual, weight, bias),
                           (normalized_shape, eps))
    call = _remembered(key, eager)
    if call is not None:
        return call
    shape, eps = _check_args(op, input, residual, normalized_shape, weight, bias, eps,
                             status=ACLNN_ERR_PARAM_INVALID, eps_optional=False)
    backend = _check_name(op, backend)
    plan = None
    if eager:
        with renamed_errors(NORM_NAMES):
            plan = _ln.plan_layer_norm(input, shape, weight, bias, eps, residual=residual, backend=backend, op=op)
    return _plans.remember(key, LayerNormCall(shape, eps, backend, plan))


def rms_norm_call(op: str, input, residual, normalized_shape, weight, eps, offset, casting_mode, backend, *,
                  eager: bool) -> RmsNormCall:
    """``op`` is "rms_norm" or "fused_add_rms_norm"; ``eager`` as in :func:`layer_norm_call`."""
    backend = requested(backend)
    key = _plans.signature("gradops.nn.functional." + op, backend, (input, residual, weight),
                           (normalized_shape, eps, offset, casting_mode))
    call = _remembered(key, eager)
    if call is not None:
        return call
    # RMSNorm's shape rules are tiling rules (561002)
    shape, eps = _check_args(op, input, residual, normalized_shape, weight, None, eps,
                             status=ACLNN_ERR_INNER_TILING_ERROR, eps_optional=True)
    backend = _check_name(op, backend)
    offset = check_float_attr(op, "offset", offset)
    _rms.check_casting_mode(op, casting_mode)
    if eps is None:
        # torch takes the machine eps of the dtype it computes in, float32 for half inputs
        # (not bf16's 2**-7, which would visibly shift small-magnitude rows)
        eps = torch.finfo(stat_dtype(input.dtype)).eps if input.is_floating_point() else 0.0
    gamma, scale_offset = _rms_gamma(op, input, shape, weight, offset, casting_mode)
    if scale_offset is not None:
        offset = 0.0
    plan = None
    if eager:
        with renamed_errors(NORM_NAMES):
            plan = _rms.plan_rms_norm(input, gamma, eps, offset=offset, casting_mode=casting_mode, residual=residual,
                                      backend=backend, op=op)
    call = RmsNormCall(float(eps), offset, casting_mode, backend, plan, None if gamma is weight else gamma,
                       scale_offset)
    return call if call.gamma is not None else _plans.remember(key, call)


def _remembered(key, eager: bool):
    """The call remembered under ``key``, unless it runs eagerly and the plan lacks the
    operator's (a call first traced, then run eagerly, makes it then)."""
    call = _plans.lookup(key)
    return call if call is not None and (call.plan is not None or not eager) else None


def _rms_gamma(op, input, shape, weight, offset, casting_mode):
    """(the operator's gamma, scale_offset) for the caller's weight (see RmsNormCall)."""
    if weight is None:
        if offset != 0:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                             f"{op}: offset is {short_repr(offset)} but weight is None, expected a weight for the "
                             f"offset to shift (offset + weight scales the row)")
        return _ones(input, shape), None
    if tuple(weight.shape) != shape:
        raise AclnnError(ACLNN_ERR_INNER_TILING_ERROR,
                         f"{op}: weight has shape {tuple(weight.shape)}, expected normalized_shape == {shape}")
    if not (weight.is_floating_point() and input.is_floating_point() and weight.dtype != input.dtype):
        return weight, None
    if input.dtype in (torch.float32, torch.float64) and weight.dtype.itemsize < input.dtype.itemsize:
        # torch (and HF's norms) compute a float32/float64 input with a half weight in the
        # input's precision; CANN's table has no such pair, so widen the weight (exactly; its
        # gradient flows back through the cast)
        return weight.to(input.dtype), None
    if casting_mode == "llama":
        # Llama multiplies the rounded half x-hat by a weight of another dtype (a float32
        # master weight, or the other half type) in their promoted dtype and returns that
        return _ones(input, shape), offset
    if weight.dtype in (torch.float16, torch.bfloat16):
        # the other half type (fp16 beside bf16): "gemma" computes in float32 anyway, so the
        # exactly widened weight gives the same result in CANN's dtype table
        return weight.float(), None
    return weight, None


def _ones(input, shape):
    """The constant gamma of a call without a weight: float32 beside half input (in CANN's
    dtype table), float32/float64 input keep their own."""
    dtype = stat_dtype(input.dtype) if input.is_floating_point() else torch.float32
    # (new_ones: beside a DTensor input, a DTensor replicated on its mesh)
    return input.new_ones(shape, dtype=dtype)


def _check_args(op, input, residual, normalized_shape, weight, bias, eps, *, status, eps_optional):
    """(normalized_shape as a tuple, eps) of a norm functional's arguments, checked before the
    dispatcher sees them (which would refuse a wrong Python type with its own RuntimeError).
    They read Python values and tensor metadata only: torch.compile traces them without a
    graph break. ``eps_optional``: None stays None (torch's default)."""
    require_tensor(op, "input", input)
    if op.startswith("fused_add_"):
        check_companion(op, "residual", residual, "input", input, status=status)
    shape = as_int_tuple(op, "normalized_shape", normalized_shape)
    check_trailing(op, "normalized_shape", input, "input", shape, status=status)
    require_tensor(op, "weight", weight, optional=True)
    require_tensor(op, "bias", bias, optional=True)
    if eps is not None or not eps_optional:
        eps = check_float_attr(op, "eps", eps)
    return shape, eps
