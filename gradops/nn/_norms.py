"""LayerNorm and RMSNorm as differentiable functionals (with their fused residual adds): the
custom ops, their fakes, autograd and autocast rules, and the eager path, which asks the ops
layer for the call's remembered plan (``gradops.ops.norm_functional``) and launches it
without the ops' dispatch (see ``_custom_ops.takes_eager_path``)."""
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..ops import layer_norm as _ln_ops
from ..ops import rms_norm as _rms_ops
from ..ops._checks import renamed_errors
from ..ops.norm_functional import NORM_NAMES, layer_norm_call, rms_norm_call
from ._custom_ops import (NOT_COMPUTED, autocast_off, double_backward_error, empty_like_spec, fresh, no_autocast,
                          dtensor_arguments, dtensor_errors, register_autocast, takes_eager_path)
from ._transforms import register_rows_vmap, transformable, transformed
from ._triton_ops import register_triton_op_parts, takes_triton_op


def _norm_op(family: str, residual) -> str:
    """The functional a norm op call serves, which its errors name."""
    return family if residual is None else f"fused_add_{family}"


# --------------------------------------------------------------------------------------------
# LayerNorm
# --------------------------------------------------------------------------------------------
# One op serves each norm with and without the fused residual add: ``residual`` is None or
# the tensor added to the input first, and the op returns h = input + residual last. Custom
# ops cannot return None, so without a residual h is an empty tensor.

def _with_h(outputs: tuple, n: int, like: Tensor) -> tuple:
    """The first ``n`` results, then h (results[n]) or, without a residual, an empty tensor."""
    h = outputs[n] if len(outputs) > n else like.new_empty(NOT_COMPUTED)
    return tuple(outputs[:n]) + (h,)


def _prepare_layer_norm(x, residual, normalized_shape, weight, bias, eps, backend):
    with renamed_errors(NORM_NAMES):
        return _ln_ops.prepare_layer_norm(x, normalized_shape, weight, bias, eps, residual=residual,
                                          backend=backend, op=_norm_op("layer_norm", residual))


def _run_layer_norm_op(p, x) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    with no_autocast(x.device.type):
        out = p.run()
    return _with_h(tuple(fresh(t) for t in out), 3, x)


@torch.library.custom_op("gradops::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, residual: Optional[Tensor], normalized_shape: List[int],
                   weight: Optional[Tensor], bias: Optional[Tensor], eps: float, backend: Optional[str]
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_layer_norm_op(_prepare_layer_norm(x, residual, normalized_shape, weight, bias, eps, backend), x)


@_layer_norm_op.register_fake
def _layer_norm_fake(x, residual, normalized_shape, weight, bias, eps, backend):
    p = _prepare_layer_norm(x, residual, normalized_shape, weight, bias, eps, backend)
    return _with_h(tuple(empty_like_spec(s, x) for s in p.outputs), 3, x)


@torch.library.custom_op("gradops::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: Tensor, dresidual: Optional[Tensor], x: Tensor, normalized_shape: List[int],
                            mean: Tensor, rstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                            output_mask: List[bool], backend: Optional[str]
                            ) -> Tuple[Tensor, Tensor, Tensor]:
    with no_autocast(x.device.type):
        grads = _ln_ops.prepare_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias,
                                                    output_mask, dresidual=dresidual, backend=backend).run()
    return tuple(x.new_empty(NOT_COMPUTED) if g is None else fresh(g) for g in grads)


@_layer_norm_backward_op.register_fake
def _(dy, dresidual, x, normalized_shape, mean, rstd, weight, bias, output_mask, backend):
    p = _ln_ops.prepare_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias,
                                            output_mask, dresidual=dresidual, backend=backend)
    return tuple(x.new_empty(NOT_COMPUTED) if s is None else empty_like_spec(s, x) for s in p.outputs)


def _layer_norm_setup(ctx, inputs, output):
    x, residual, normalized_shape, weight, bias, eps, backend = inputs
    _, mean, rstd, h = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.has_residual = residual is not None
    if not ctx.has_residual:
        ctx.mark_non_differentiable(h)
    else:  # an unused output's gradient stays None: not zeros of a plain tensor beside DTensors
        ctx.set_materialize_grads(False)
    # the backward needs what was normalised: h with a residual, else x
    ctx.save_for_backward(h if ctx.has_residual else x, weight, bias, mean, rstd)
    ctx.normalized_shape = normalized_shape
    ctx.backend = backend


def _layer_norm_grads(ctx, dy, dh, need_x, need_res, need_w, need_b, plan=None):
    """(dx, dresidual, dweight, dbias) for both LayerNorm paths, None where not needed.
    ``dh``: h's gradient from its other uses (None: unused, or no residual). ``plan``: the
    eager path's operator plan, run directly (the forward validated every input, and
    autograd gives dy and dh its outputs' metadata); else, and always with create_graph, the
    backward op runs, whose autograd node refuses a second backward."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need_input = bool(need_x or (ctx.has_residual and need_res))
    mask = [need_input, bool(need_w and weight is not None), bool(need_b and bias is not None)]
    if not any(mask):
        return None, None, None, None
    if dy is None:
        dy = torch.zeros_like(x)
    if plan is not None and not torch.is_grad_enabled():
        with autocast_off(x):
            dx, dw, db = _ln_ops.run_planned_layer_norm_backward(plan, dy, x, mean, rstd, weight, mask, dh)
    else:
        lead = x.shape[: x.dim() - len(ctx.normalized_shape)]  # (the eager path keeps them flat)
        backward_op = transformed(torch.ops.gradops.layer_norm_backward)
        dx, dw, db = backward_op(dy, dh, x, ctx.normalized_shape, mean.reshape(lead), rstd.reshape(lead), weight,
                                 bias, mask, ctx.backend)
    dx = dx if mask[0] else None
    # bias is accepted by the backward operator only for its shape check; db = sum(dy) needs no bias
    return dx, dx if ctx.has_residual else None, dw if mask[1] else None, db if mask[2] else None


def _layer_norm_backward(ctx, dy, _dmean, _drstd, dh):
    need_x, need_res, _, need_w, need_b = ctx.needs_input_grad[:5]
    dx, dres, dw, db = _layer_norm_grads(ctx, dy, dh if ctx.has_residual else None, need_x, need_res, need_w, need_b)
    return dx, dres, None, dw, db, None, None


torch.library.register_autograd("gradops::layer_norm", _layer_norm_backward, setup_context=_layer_norm_setup)
torch.library.register_autograd("gradops::layer_norm_backward",
                                double_backward_error("layer_norm", "torch.nn.functional.layer_norm"))
# torch.func transforms (see _transforms); a Triton op's call under one takes the custom op
transformable("layer_norm", _layer_norm_setup, _layer_norm_backward, aliases=("triton_layer_norm",))
transformable("layer_norm_backward", None, double_backward_error("layer_norm", "torch.nn.functional.layer_norm"))
# a traced static CUDA call takes the Triton op, made of the same parts (_triton_ops)
register_triton_op_parts("layer_norm", _prepare_layer_norm, _run_layer_norm_op, _layer_norm_fake, _layer_norm_setup,
                         _layer_norm_backward)
register_rows_vmap("layer_norm", ("weight", "bias"))
register_rows_vmap("layer_norm_backward", ("weight", "bias"),
                   param_grads_wanted=lambda a: a["output_mask"][1] or a["output_mask"][2])


class _LayerNormFunction(torch.autograd.Function):
    """The eager path of ``gradops::layer_norm`` (see ``takes_eager_path``): the operator's plan
    from the call's remembered plan, the same backend and backward operator. Returns y, and h
    as well with a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, call):
        plan = call.plan
        with autocast_off(x):
            y, mean, rstd, h = _ln_ops.run_layer_norm(plan, x, weight, bias, residual)
        ctx.has_residual = h is not None
        ctx.save_for_backward(h if ctx.has_residual else x, weight, bias, mean, rstd)
        ctx.normalized_shape, ctx.backend, ctx.plan = plan.normalized_shape, call.backend, plan
        if ctx.has_residual:
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros to add)
            return fresh(y), fresh(h)
        return fresh(y)

    @staticmethod
    def backward(ctx, dy, dh=None):
        need_x, need_res, need_w, need_b = ctx.needs_input_grad[:4]
        return _layer_norm_grads(ctx, dy, dh, need_x, need_res, need_w, need_b, ctx.plan) + (None,)


_LAYER_NORM_TENSORS = ("input", "residual", "weight", "bias")


def _layer_norm(op: str, input, residual, normalized_shape, weight, bias, eps, backend):
    """layer_norm and fused_add_layer_norm: (y, h), h None without a residual."""
    eager = takes_eager_path(input)
    call = layer_norm_call(op, input, residual, normalized_shape, weight, bias, eps, backend, eager=eager)
    dtensors = dtensor_arguments(op, _LAYER_NORM_TENSORS, (input, residual, weight, bias))
    if eager:
        out = _LayerNormFunction.apply(input, residual, weight, bias, call)
        return out if residual is not None else (out, None)
    traced = (torch.ops.gradops.triton_layer_norm if takes_triton_op(input, call.backend)
              else torch.ops.gradops.layer_norm)
    with dtensor_errors(dtensors):
        out = transformed(traced)(input, residual, list(call.normalized_shape), weight, bias, call.eps, call.backend)
    return out[0], (out[-1] if residual is not None else None)


def layer_norm(input: Tensor, normalized_shape: Union[int, Sequence[int], torch.Size],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5, *,
               backend: Optional[str] = None) -> Tensor:
    """``torch.nn.functional.layer_norm`` with gradops' forward and backward operators.

    Same arguments and defaults as torch's; ``backend`` (keyword only) picks the gradops
    backend (None/"auto", "reference", "triton"). Half-precision inputs compute in float32.
    A float32 weight/bias beside bf16/fp16 input is accepted (master weights); their
    gradients come back in their own dtype.
    """
    return _layer_norm("layer_norm", input, None, normalized_shape, weight, bias, eps, backend)[0]


def fused_add_layer_norm(input: Tensor, residual: Tensor, normalized_shape: Union[int, Sequence[int], torch.Size],
                         weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5, *,
                         backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """The residual add of a pre-norm block fused into ``layer_norm``: returns
    ``(layer_norm(h, ...), h)`` with ``h = input + residual`` (in input's dtype, as torch
    adds), computed in one pass over memory, forward and backward. ``residual`` has input's
    shape and dtype."""
    return _layer_norm("fused_add_layer_norm", input, residual, normalized_shape, weight, bias, eps, backend)


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------

def _prepare_rms_norm(x, residual, gamma, eps, offset, casting_mode, backend):
    with renamed_errors(NORM_NAMES):
        return _rms_ops.prepare_rms_norm(x, gamma, eps, offset=offset, casting_mode=casting_mode,
                                         residual=residual, backend=backend, op=_norm_op("rms_norm", residual))


def _run_rms_norm_op(p, x) -> Tuple[Tensor, Tensor, Tensor]:
    with no_autocast(x.device.type):
        out = p.run()
    return _with_h(tuple(fresh(t) for t in out), 2, x)


@torch.library.custom_op("gradops::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, residual: Optional[Tensor], gamma: Tensor, eps: float, offset: float,
                 casting_mode: str, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    return _run_rms_norm_op(_prepare_rms_norm(x, residual, gamma, eps, offset, casting_mode, backend), x)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, residual, gamma, eps, offset, casting_mode, backend):
    p = _prepare_rms_norm(x, residual, gamma, eps, offset, casting_mode, backend)
    return _with_h(tuple(empty_like_spec(s, x) for s in p.outputs), 2, x)


@torch.library.custom_op("gradops::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, dresidual: Optional[Tensor], x: Tensor, rstd: Tensor, gamma: Tensor,
                          offset: float, casting_mode: str, backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    with no_autocast(x.device.type):
        dx, dgamma = _rms_ops.prepare_rms_norm_grad(dy, x, rstd, gamma, offset=offset, casting_mode=casting_mode,
                                                    dresidual=dresidual, backend=backend).run()
    return fresh(dx), fresh(dgamma)


@_rms_norm_backward_op.register_fake
def _(dy, dresidual, x, rstd, gamma, offset, casting_mode, backend):
    p = _rms_ops.prepare_rms_norm_grad(dy, x, rstd, gamma, offset=offset, casting_mode=casting_mode,
                                       dresidual=dresidual, backend=backend)
    return tuple(empty_like_spec(s, x) for s in p.outputs)


def _rms_norm_setup(ctx, inputs, output):
    x, residual, gamma, eps, offset, casting_mode, backend = inputs
    _, rstd, h = output
    ctx.mark_non_differentiable(rstd)
    ctx.has_residual = residual is not None
    if not ctx.has_residual:
        ctx.mark_non_differentiable(h)
    else:  # as LayerNorm's
        ctx.set_materialize_grads(False)
    ctx.save_for_backward(h if ctx.has_residual else x, gamma, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode
    ctx.backend = backend


def _rms_norm_grads(ctx, dy, dh, need_x, need_res, need_gamma, plan=None):
    """(dx, dresidual, dgamma) for both RMSNorm paths, None where not needed; ``dh`` and
    ``plan`` as in ``_layer_norm_grads``."""
    x, gamma, rstd = ctx.saved_tensors
    if not (need_x or need_gamma or (ctx.has_residual and need_res)):
        return None, None, None
    if dy is None:
        dy = torch.zeros_like(x)
    if plan is not None and not torch.is_grad_enabled():
        with autocast_off(x):
            dx, dgamma = _rms_ops.run_planned_rms_norm_grad(plan, dy, x, rstd, gamma, dh, gamma.dtype)
    else:
        lead = x.shape[: x.dim() - gamma.dim()]  # (the eager path keeps rstd flat)
        backward_op = transformed(torch.ops.gradops.rms_norm_backward)
        dx, dgamma = backward_op(dy, dh, x, rstd.reshape(lead), gamma, ctx.offset, ctx.casting_mode, ctx.backend)
    # the operator accumulates dgamma in float32; the parameter's gradient has its own dtype
    return dx, dx if ctx.has_residual else None, dgamma if dgamma.dtype == gamma.dtype else dgamma.to(gamma.dtype)


def _rms_norm_backward(ctx, dy, _drstd, dh):
    need_x, need_res, need_gamma = ctx.needs_input_grad[:3]
    return _rms_norm_grads(ctx, dy, dh if ctx.has_residual else None, need_x, need_res, need_gamma) + (None,) * 4


torch.library.register_autograd("gradops::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("gradops::rms_norm_backward",
                                double_backward_error("rms_norm", "torch.nn.functional.rms_norm"))
# the backward op returns dgamma always: whether it is used only the autograd node knows
transformable("rms_norm", _rms_norm_setup, _rms_norm_backward, aliases=("triton_rms_norm",), param_grads=(2,))
transformable("rms_norm_backward", None, double_backward_error("rms_norm", "torch.nn.functional.rms_norm"))
register_triton_op_parts("rms_norm", _prepare_rms_norm, _run_rms_norm_op, _rms_norm_fake, _rms_norm_setup,
                         _rms_norm_backward)
register_rows_vmap("rms_norm", ("gamma",))
register_rows_vmap("rms_norm_backward", ("gamma",), param_grad_outputs=(1,))


class _RmsNormFunction(torch.autograd.Function):
    """The eager path of ``gradops::rms_norm`` (see ``takes_eager_path``), as LayerNorm's.
    Returns y, and h as well with a residual."""

    @staticmethod
    def forward(ctx, x, residual, gamma, call):
        plan = call.plan
        with autocast_off(x):
            y, rstd, h = _rms_ops.run_rms_norm(plan, x, gamma, residual)
        ctx.has_residual = h is not None
        ctx.save_for_backward(h if ctx.has_residual else x, gamma, rstd)
        ctx.offset, ctx.casting_mode, ctx.backend, ctx.plan = plan.offset, call.casting_mode, call.backend, plan
        if ctx.has_residual:
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros to add)
            return fresh(y), fresh(h)
        return fresh(y)

    @staticmethod
    def backward(ctx, dy, dh=None):
        need_x, need_res, need_gamma = ctx.needs_input_grad[:3]
        return _rms_norm_grads(ctx, dy, dh, need_x, need_res, need_gamma, ctx.plan) + (None,)


_RMS_NORM_TENSORS = ("input", "residual", "weight")


def _rms_norm(op: str, input, residual, normalized_shape, weight, eps, offset, casting_mode, backend):
    """rms_norm and fused_add_rms_norm: (y, h), h None without a residual."""
    eager = takes_eager_path(input)
    call = rms_norm_call(op, input, residual, normalized_shape, weight, eps, offset, casting_mode, backend,
                         eager=eager)
    dtensors = dtensor_arguments(op, _RMS_NORM_TENSORS, (input, residual, weight))
    gamma = weight if call.gamma is None else call.gamma
    if eager:
        out = _RmsNormFunction.apply(input, residual, gamma, call)
        y, h = out if residual is not None else (out, None)
    else:
        traced = (torch.ops.gradops.triton_rms_norm if takes_triton_op(input, call.backend)
                  else torch.ops.gradops.rms_norm)
        with dtensor_errors(dtensors):
            out = transformed(traced)(input, residual, gamma, call.eps, call.offset, casting_mode, call.backend)
        y, h = out[0], (out[-1] if residual is not None else None)
    if call.scale_offset is not None:  # the operator returned Llama's rounded x-hat (see RmsNormCall)
        y = (weight + call.scale_offset if call.scale_offset else weight) * y
    return y, h


def rms_norm(input: Tensor, normalized_shape: Union[int, Sequence[int], torch.Size],
             weight: Optional[Tensor] = None, eps: Optional[float] = None, *, offset: float = 0.0,
             casting_mode: str = "gemma", backend: Optional[str] = None) -> Tensor:
    """``torch.nn.functional.rms_norm`` with gradops' forward and backward operators.

    ``eps=None`` means the machine eps of the dtype torch computes in, as in torch:
    ``torch.finfo(torch.float32).eps`` for float16/bfloat16/float32 input, float64's for float64. ``weight=None``
    normalises without a scale (a constant ones gamma, which receives no gradient).

    The variants of real models (keyword only): ``offset`` scales by ``offset + weight``
    (Gemma: ``offset=1.0``); ``casting_mode="gemma"`` (the default) computes everything in
    float32 and rounds once at the end, as torch's own rms_norm and Gemma do;
    ``casting_mode="llama"`` rounds the normalised row to input's dtype before the weight,
    as HF Llama, Mistral, Qwen and Phi-3 do (``weight * hidden.to(input_dtype)``; a float32
    weight beside half input then gives a float32 result, as there).
    """
    return _rms_norm("rms_norm", input, None, normalized_shape, weight, eps, offset, casting_mode, backend)[0]


def fused_add_rms_norm(input: Tensor, residual: Tensor, normalized_shape: Union[int, Sequence[int], torch.Size],
                       weight: Optional[Tensor] = None, eps: Optional[float] = None, *, offset: float = 0.0,
                       casting_mode: str = "gemma", backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """The residual add of a pre-norm block fused into :func:`rms_norm`: returns
    ``(rms_norm(h, ...), h)`` with ``h = input + residual`` (in input's dtype, as torch
    adds), computed in one pass over memory, forward and backward. ``residual`` has input's
    shape and dtype; the other arguments are :func:`rms_norm`'s."""
    return _rms_norm("fused_add_rms_norm", input, residual, normalized_shape, weight, eps, offset, casting_mode,
                     backend)


for _name in ("layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward"):
    register_autocast(_name, False)  # the norms run in the dtype their input arrives in
del _name
