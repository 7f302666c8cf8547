"""Floyd (pivotal) attention as a differentiable functional: its custom ops, their fakes,
autograd and autocast rules (see ``_custom_ops``), and the eager path, which runs the call's
remembered plan (``gradops.ops.floyd_attention.plan_floyd_attention``) in an autograd.Function
without the ops' dispatch. DTensor inputs go to the row-sharded rule of
``gradops.distributed`` (``_custom_ops.dtensor_arguments``)."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._backend import requested
from ..ops import floyd_attention as _floyd_ops
from ..ops._checks import check_float_attr, require_tensor
from ._custom_ops import (autocast_eligible, autocast_off, backend_arg, double_backward_error, dtensor_arguments,
                          empty_like_spec, fresh, no_autocast, register_autocast, takes_eager_path)
from ._transforms import register_folded_vmap, transformable, transformed

@torch.library.custom_op("gradops::floyd_attention", mutates_args=())
def _floyd_op(q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, mask: Optional[Tensor],
              scale: float, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    with no_autocast(q.device.type):
        out, smax, ssum = _floyd_ops.prepare_floyd_attention(q, k1, v1, k2, v2, mask, scale,
                                                             backend=backend).run()
    return fresh(out), fresh(smax), fresh(ssum)


@_floyd_op.register_fake
def _(q, k1, v1, k2, v2, mask, scale, backend):
    p = _floyd_ops.prepare_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend)
    return tuple(empty_like_spec(s, q) for s in p.outputs)


@torch.library.custom_op("gradops::floyd_attention_backward", mutates_args=())
def _floyd_backward_op(dy: Tensor, q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, out: Tensor,
                       softmax_max: Tensor, softmax_sum: Tensor, mask: Optional[Tensor], scale: float,
                       backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with no_autocast(q.device.type):
        grads = _floyd_ops.prepare_floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum,
                                                        mask, scale, backend=backend).run()
    return tuple(fresh(g) for g in grads)


@_floyd_backward_op.register_fake
def _(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask, scale, backend):
    p = _floyd_ops.prepare_floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask,
                                                scale, backend=backend)
    return tuple(empty_like_spec(s, q) for s in p.outputs)


def _floyd_setup(ctx, inputs, output):
    q, k1, v1, k2, v2, mask, scale, backend = inputs
    out, smax, ssum = output
    ctx.mark_non_differentiable(smax, ssum)
    ctx.set_materialize_grads(False)  # the statistics' gradients stay None: no zeros to fill
    ctx.save_for_backward(q, k1, v1, k2, v2, out, smax, ssum, mask)
    ctx.scale = scale
    ctx.backend = backend


def _floyd_backward(ctx, dy, _dmax, _dsum):
    q, k1, v1, k2, v2, out, smax, ssum, mask = ctx.saved_tensors
    needs = ctx.needs_input_grad[:5]
    if not any(needs):
        return (None,) * 8
    if dy is None:
        dy = torch.zeros_like(out)
    backward_op = transformed(torch.ops.gradops.floyd_attention_backward)
    grads = backward_op(dy, q, k1, v1, k2, v2, out, smax, ssum, mask, ctx.scale, ctx.backend)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None, None, None)


torch.library.register_autograd("gradops::floyd_attention", _floyd_backward, setup_context=_floyd_setup)
torch.library.register_autograd("gradops::floyd_attention_backward",
                                double_backward_error("floyd_attention",
                                                       "a plain PyTorch einsum formulation"))
# torch.func transforms (see _transforms): a vmapped dim is more of the batch B
transformable("floyd_attention", _floyd_setup, _floyd_backward)
transformable("floyd_attention_backward", None,
              double_backward_error("floyd_attention", "a plain PyTorch einsum formulation"))
register_folded_vmap("floyd_attention", 0)
register_folded_vmap("floyd_attention_backward", 0)


class _FloydFunction(torch.autograd.Function):
    """The eager path of ``gradops::floyd_attention`` (see ``takes_eager_path``): the call's plan,
    remembered per signature, run directly; its backward runs the same plan's launches, or,
    building a graph (create_graph), the backward op, whose autograd node refuses a second
    backward."""

    @staticmethod
    def forward(ctx, q, k1, v1, k2, v2, mask, call):
        plan, ctx.scale, ctx.backend = call
        with autocast_off(q):
            out, smax, ssum, ctx.launches = _floyd_ops.run_floyd_attention(plan, q, k1, v1, k2, v2, mask)
        ctx.save_for_backward(q, k1, v1, k2, v2, out, smax, ssum, mask)
        return out

    @staticmethod
    def backward(ctx, dy):
        q, k1, v1, k2, v2, out, smax, ssum, mask = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        if not any(needs):
            return (None,) * 7
        if torch.is_grad_enabled():
            backward_op = transformed(torch.ops.gradops.floyd_attention_backward)
            grads = backward_op(dy, q, k1, v1, k2, v2, out, smax, ssum, mask, ctx.scale, ctx.backend)
        else:
            with autocast_off(q):
                grads = _floyd_ops.run_planned_floyd_attention_grad(ctx.launches, dy, q, k1, v1, k2, v2, smax, ssum,
                                                                    mask)
        dq, dk1, dv1, dk2, dv2 = grads
        return (dq if needs[0] else None, dk1 if needs[1] else None, dv1 if needs[2] else None,
                dk2 if needs[3] else None, dv2 if needs[4] else None, None, None)


def autocast_inputs(tensors):
    """The tensors as the op's autocast rule hands them on: cast to the autocast dtype of their
    device where autocast is on there (the eager path does it before planning, since the call's
    signature holds the dtypes)."""
    if not torch._C._is_any_autocast_enabled():
        return tensors
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if autocast_eligible(t, device_type) else t for t in tensors)


def _check_call(op, q, k1, v1, k2, v2, mask, scale) -> float:
    """The functional's own checks (before the operator's): tensors where tensors belong, a
    float scale; returns the scale."""
    for name, t in (("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2)):
        require_tensor(op, name, t)
    require_tensor(op, "mask", mask, optional=True)
    return check_float_attr(op, "scale", scale)


def eager_call(q, k1, v1, k2, v2, mask, scale, backend):
    """The remembered call of ``floyd_attention`` (plan, scale, backend) for tensors that take the
    eager path, the autocast casts done (:func:`autocast_inputs`); ``backend`` as the caller
    gave it. A call signature met for the first time is checked as the custom op's path checks
    it (the functional's checks, the backend's name, the operator's), then planned."""
    op = "floyd_attention"
    backend = requested(backend)
    plan = _floyd_ops.remembered_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend)
    if plan is None:
        _check_call(op, q, k1, v1, k2, v2, mask, scale)
        plan = _floyd_ops.plan_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend_arg(op, backend))
    return plan, plan.scale, backend


def run_eager(q, k1, v1, k2, v2, mask, call):
    """Floyd attention of an :func:`eager_call`: the output, differentiable."""
    return _FloydFunction.apply(q, k1, v1, k2, v2, mask, call)


def floyd_attention(q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, mask: Optional[Tensor] = None,
                    scale: float = 1.0, *, backend: Optional[str] = None) -> Tensor:
    """Floyd (pivotal) attention with gradops' forward and backward operators; returns the
    output only (the softmax statistics are saved for the backward).

    q ``[B,H,N,M,D]``, k1/v1 ``[B,H,N,K,D]``, k2/v2 ``[B,H,K,M,D]``, mask None or
    ``[B,1,N,1,K]`` bool/uint8 (True removes the pivot), ``scale`` (CANN's default 1.0).
    For FloydNet's argument order, default scale and general masks use
    :func:`gradops.pivotal_attention`.
    """
    if takes_eager_path(q):
        q, k1, v1, k2, v2 = autocast_inputs((q, k1, v1, k2, v2))
        return run_eager(q, k1, v1, k2, v2, mask, eager_call(q, k1, v1, k2, v2, mask, scale, backend))
    op = "floyd_attention"
    scale = _check_call(op, q, k1, v1, k2, v2, mask, scale)
    dtensor_arguments(op, ("q", "k1", "v1", "k2", "v2", "mask"), (q, k1, v1, k2, v2, mask))
    out, _, _ = transformed(torch.ops.gradops.floyd_attention)(q, k1, v1, k2, v2, mask, scale,
                                                               backend_arg(op, backend))
    return out


register_autocast("floyd_attention", True)  # matmul-like, as scaled_dot_product_attention
register_autocast("floyd_attention_backward", False)
