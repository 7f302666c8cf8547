"""3-Floyd (3-pivot) attention as a differentiable functional: its custom ops (what torch.compile
traces, with fake implementations), their autograd and autocast rules, and the eager path, an
autograd.Function that runs the operator's checked call without the ops' dispatch (as
``_floyd`` does for the 2-pivot operator; ``_custom_ops.takes_eager_path`` decides)."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ..ops import floyd3_attention as _floyd3_ops
from ..ops._checks import check_float_attr, require_tensor
from ._custom_ops import (backend_arg, double_backward_error, empty_like_spec, fresh, no_autocast, register_autocast,
                          takes_eager_path)
from ._floyd import autocast_inputs
from ._transforms import transformable, transformed

_OP = "floyd3_attention"
_NAMES = ("q", "k1", "v1", "k2", "v2", "k3", "v3")


@torch.library.custom_op("gradops::floyd3_attention", mutates_args=())
def _floyd3_op(q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, k3: Tensor, v3: Tensor,
               mask: Optional[Tensor], scale: float, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    with no_autocast(q.device.type):
        out, smax, ssum = _floyd3_ops.prepare_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale,
                                                               backend=backend).run()
    return fresh(out), fresh(smax), fresh(ssum)


@_floyd3_op.register_fake
def _(q, k1, v1, k2, v2, k3, v3, mask, scale, backend):
    p = _floyd3_ops.prepare_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale, backend=backend)
    return tuple(empty_like_spec(s, q) for s in p.outputs)


@torch.library.custom_op("gradops::floyd3_attention_backward", mutates_args=())
def _floyd3_backward_op(dy: Tensor, q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, k3: Tensor,
                        v3: Tensor, out: Tensor, softmax_max: Tensor, softmax_sum: Tensor, mask: Optional[Tensor],
                        scale: float, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                       Tensor, Tensor]:
    with no_autocast(q.device.type):
        grads = _floyd3_ops.prepare_floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, out, softmax_max,
                                                          softmax_sum, mask, scale, backend=backend).run()
    return tuple(fresh(g) for g in grads)


@_floyd3_backward_op.register_fake
def _(dy, q, k1, v1, k2, v2, k3, v3, out, softmax_max, softmax_sum, mask, scale, backend):
    p = _floyd3_ops.prepare_floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, out, softmax_max, softmax_sum,
                                                  mask, scale, backend=backend)
    return tuple(empty_like_spec(s, q) for s in p.outputs)


def _setup(ctx, inputs, output):
    *tensors, mask, scale, backend = inputs
    out, smax, ssum = output
    ctx.mark_non_differentiable(smax, ssum)
    ctx.set_materialize_grads(False)  # the statistics' gradients stay None: no zeros to fill
    ctx.save_for_backward(*tensors, out, smax, ssum, mask)
    ctx.scale = scale
    ctx.backend = backend


def _grads_needed(ctx, dy, grad_enabled):
    """The gradients of the seven tensors (None where not needed): through the backward op where
    a graph is built (its autograd node refuses a second backward), else the operator directly."""
    *tensors, out, smax, ssum, mask = ctx.saved_tensors
    needs = ctx.needs_input_grad[:7]
    if not any(needs):
        return (None,) * 7
    if dy is None:
        dy = torch.zeros_like(out)
    if grad_enabled:
        grads = transformed(torch.ops.gradops.floyd3_attention_backward)(dy, *tensors, out, smax, ssum, mask,
                                                                         ctx.scale, ctx.backend)
    else:
        grads = _floyd3_ops.prepare_floyd3_attention_grad(dy, *tensors, out, smax, ssum, mask, ctx.scale,
                                                          backend=ctx.backend).run()
    return tuple(g if need else None for g, need in zip(grads, needs))


def _backward(ctx, dy, _dmax, _dsum):
    return _grads_needed(ctx, dy, True) + (None, None, None)


_NO_DOUBLE_BACKWARD = double_backward_error("floyd3_attention", "floydnet.pivotal_attention3 (einsums)")
torch.library.register_autograd("gradops::floyd3_attention", _backward, setup_context=_setup)
torch.library.register_autograd("gradops::floyd3_attention_backward", _NO_DOUBLE_BACKWARD)
# torch.func transforms (see _transforms): grad and vjp through these rules; jvp is refused (no
# forward-mode rule), where the bare custom op would give a silent zero tangent
transformable("floyd3_attention", _setup, _backward)
transformable("floyd3_attention_backward", None, _NO_DOUBLE_BACKWARD)
register_autocast("floyd3_attention", True)  # matmul-like, as scaled_dot_product_attention
register_autocast("floyd3_attention_backward", False)


class _Floyd3Function(torch.autograd.Function):
    """The eager path: the operator's call (checked once per signature, its plan remembered by
    ``ops.floyd3_attention``) run directly, and its backward likewise."""

    @staticmethod
    def forward(ctx, q, k1, v1, k2, v2, k3, v3, mask, scale, backend):
        out, smax, ssum = _floyd3_ops.prepare_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale,
                                                               backend=backend).run()
        ctx.save_for_backward(q, k1, v1, k2, v2, k3, v3, out, smax, ssum, mask)
        ctx.scale, ctx.backend = scale, backend
        return out

    @staticmethod
    def backward(ctx, dy):
        return _grads_needed(ctx, dy, torch.is_grad_enabled()) + (None, None, None)


def refuse_dtensors(op, names, tensors):
    """3-Floyd attention has no sharding rule: a DTensor argument is refused (before torch's own
    error for an op without one)."""
    for name, t in zip(names, tensors):
        if type(t).__name__ == "DTensor":
            raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                             f"{op}: {name} is a DTensor; 3-Floyd attention has no sharding rule: call it on "
                             f"each rank's local tensors (DTensor.to_local())")


def _check_call(op, tensors, mask, scale) -> float:
    """The functional's own checks (before the operator's): tensors where tensors belong, no
    DTensor, a float scale; returns the scale."""
    for name, t in zip(_NAMES, tensors):
        require_tensor(op, name, t)
    refuse_dtensors(op, _NAMES, tensors)
    require_tensor(op, "mask", mask, optional=True)
    return check_float_attr(op, "scale", scale)


def floyd3_attention(q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, k3: Tensor, v3: Tensor,
                     mask: Optional[Tensor] = None, scale: float = 1.0, *, backend: Optional[str] = None) -> Tensor:
    """3-Floyd (3-pivot) attention with gradops' forward and backward operators; returns the
    output only (the softmax statistics are saved for the backward).

    q ``[B,H,I,J,K,D]``, k1/v1 ``[B,H,P,J,K,D]``, k2/v2 ``[B,H,I,P,K,D]``, k3/v3
    ``[B,H,I,J,P,D]``, mask None or bool/uint8 broadcastable to ``[B,1,I,J,K,P]`` (True
    removes the pivot), ``scale`` (default 1.0, as the operator). For FloydNet's argument
    order, default scale and general masks use :func:`gradops.pivotal_attention3`.
    """
    tensors = (q, k1, v1, k2, v2, k3, v3)
    return checked_call(tensors, mask, _check_call(_OP, tensors, mask, scale), backend_arg(_OP, backend))


def checked_call(tensors, mask, scale: float, backend: str) -> Tensor:
    """The operator's output for a call whose tensors, mask and scale the caller has checked as
    :func:`floyd3_attention` does (``pivotal_attention3``'s fused path): the eager path, or the
    custom op (the operator's own checks run in both)."""
    if takes_eager_path(tensors[0]):
        return _Floyd3Function.apply(*autocast_inputs(tensors), mask, scale, backend)
    out, _, _ = transformed(torch.ops.gradops.floyd3_attention)(*tensors, mask, scale, backend)
    return out
