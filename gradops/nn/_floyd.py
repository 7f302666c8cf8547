"""Floyd (pivotal) attention as a differentiable functional: its custom ops, their fakes,
autograd and autocast rules (see ``_custom_ops``). DTensor inputs go to the row-sharded rule
of ``gradops.distributed`` (``_custom_ops.DTENSOR_HANDLERS``)."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..ops import floyd_attention as _floyd_ops
from ..ops._checks import check_float_attr, require_tensor
from ._custom_ops import (DTENSOR_HANDLERS, backend_arg, double_backward_error, empty_like_spec, fresh, no_autocast,
                          register_autocast)
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


def floyd_attention(q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, mask: Optional[Tensor] = None,
                    scale: float = 1.0, *, backend: Optional[str] = None) -> Tensor:
    """Floyd (pivotal) attention with gradops' forward and backward operators; returns the
    output only (the softmax statistics are saved for the backward).

    q ``[B,H,N,M,D]``, k1/v1 ``[B,H,N,K,D]``, k2/v2 ``[B,H,K,M,D]``, mask None or
    ``[B,1,N,1,K]`` bool/uint8 (True removes the pivot), ``scale`` (CANN's default 1.0).
    For FloydNet's argument order, default scale and general masks use
    :func:`gradops.pivotal_attention`.
    """
    op = "floyd_attention"
    for name, t in (("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2)):
        require_tensor(op, name, t)
    require_tensor(op, "mask", mask, optional=True)
    scale = check_float_attr(op, "scale", scale)
    if type(q).__name__ == "DTensor":  # its rule is registered on first use (importing DTensor takes ~1 s)
        DTENSOR_HANDLERS["floyd_attention"]()
    out, _, _ = transformed(torch.ops.gradops.floyd_attention)(q, k1, v1, k2, v2, mask, scale,
                                                               backend_arg(op, backend))
    return out


register_autocast("floyd_attention", True)  # matmul-like, as scaled_dot_product_attention
register_autocast("floyd_attention_backward", False)
