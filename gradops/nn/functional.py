"""Differentiable functionals whose gradients are gradops' backward operators.

Each functional is a ``torch.library`` custom op in the ``gradops`` namespace (forward op +
backward op), so that

- autograd calls the library's backward operator (``layer_norm_backward``, ``rms_norm_grad``,
  ``nsa_compress_grad``, ``floyd_attention_grad``), fed with the statistics the forward op
  saved (mean/rstd, softmax max/sum): gradients are the library's, not PyTorch's
  re-derivation;
- ``torch.compile(fullgraph=True)`` traces them without graph breaks: every op has a fake
  (meta) implementation, and that implementation is the ops layer's own ``prepare_*``
  (which validates and plans without reading tensor data), so shapes, dtypes and errors
  are decided in one place for eager and compiled code alike;
- double backward (gradients of gradients) raises a clear error instead of silently
  differentiating the wrong thing: the backward operators have no derivative of their own.

``backend=None`` is resolved (to gradops' default backend, see ``gradops.use_backend``) when
the forward is called and saved for the backward, so both run on the same backend.

Autocast policy (see docs/nn.md): the norms are autocast-neutral (they run in the dtype
their input arrives in, always computing in float32 inside, as torch does on CPU);
``nsa_compress`` and ``floyd_attention`` are matmul-like and, like ``torch.matmul`` and
``scaled_dot_product_attention``, cast their floating inputs to the autocast dtype. Inside
every op autocast is switched off, so the backend's float32 arithmetic is never silently
lowered.

This file deliberately avoids ``from __future__ import annotations``: ``custom_op`` reads
the type hints to build each operator's schema.
"""
import contextlib
import threading
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .._backend import _check_name, requested, triton_available, triton_interpreter_on
from ..aclnn import renamed_errors
from ..errors import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, AclnnError
from ..ops import floyd_attention as _floyd_ops
from ..ops import layer_norm as _ln_ops
from ..ops import nsa_compress as _nsa_ops
from ..ops import _plans
from ..ops import rms_norm as _rms_ops
from ..ops._checks import check_companion, check_float_attr, check_int_attr, require_tensor, short_repr, stat_dtype
from ..ops._shapes import as_int_tuple, check_trailing

__all__ = ["layer_norm", "rms_norm", "fused_add_layer_norm", "fused_add_rms_norm", "nsa_compress",
           "floyd_attention"]

_LIB = torch.library.Library("gradops", "FRAGMENT")

# A masked-out gradient of a backward op: custom ops cannot return None, so an empty tensor
# stands for "not computed" and the autograd formula maps it back to None.
_NOT_COMPUTED = (0,)


def _fresh(t: Tensor) -> Tensor:
    # The fake implementations promise contiguous outputs; keep the real ones to that promise
    # (a no-op for the backends, which return contiguous tensors). A reshaped result is a
    # view of the backend's [rows, cols] tensor; detached (no copy) it is a tensor of its own,
    # which autograd lets the caller modify in place, as torch's own outputs.
    t = t.contiguous()
    return t.detach() if t._base is not None else t


def _empty_like_spec(spec, like: Tensor) -> Tensor:
    shape, dtype = spec
    return like.new_empty(shape, dtype=dtype)


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


def _autocast_off(device_type: str):
    """``_no_autocast`` where autocast is on, else nothing (entering the context costs a few
    microseconds, which a tiny eager call notices)."""
    return _no_autocast(device_type) if torch.is_autocast_enabled(device_type) else contextlib.nullcontext()


def _eager(x: Tensor) -> bool:
    """Whether a norm call takes the eager path (a ``torch.autograd.Function``) rather than its
    custom op. The custom ops exist for whatever traces or transforms the call: torch.compile
    and torch.export, make_fx and fake or meta tensors (a dispatch mode, a tensor subclass, the
    meta device: they need the op's fake implementation, not the backend's code), vmap and
    the other torch.func transforms. Run eagerly on real tensors, the ops' dispatch (the
    autograd, autocast and dynamo wrappers of ``torch.library``) costs several times what a
    small norm computes. Both paths validate with the same ``prepare_*`` and run the same
    backend code."""
    return (type(x) in (Tensor, torch.nn.Parameter) and x.device.type in ("cpu", "cuda")
            and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active())


def _double_backward_error(name: str, alternative: str):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"gradops.nn.functional.{name}: double backward (a gradient of a gradient, e.g. "
            f"torch.autograd.grad(..., create_graph=True) followed by another backward) is not "
            f"supported: the backward is gradops' fused backward operator, which has no derivative "
            f"of its own. Use {alternative} where higher-order gradients are needed.")
    return backward


def autocast_eligible(t, device_type: str) -> bool:
    """Whether torch's autocast would cast ``t`` for an op on ``device_type``: a floating
    tensor on that device, float64 excepted (autocast never lowers float64)."""
    return (isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == device_type)


def _register_autocast(op_name: str, cast_to_autocast_dtype: bool):
    """Autocast kernels for ``gradops::<op_name>`` on CPU and CUDA.

    With ``cast_to_autocast_dtype`` the floating tensor arguments are cast to the active
    autocast dtype (bf16 or fp16, whichever the user chose) before the op runs, float64
    excepted (torch's autocast leaves float64 alone too); without it they pass unchanged. Either way the op itself then runs with autocast excluded, so the
    backend's internal float32 math is not lowered by autocast.
    """
    op = getattr(torch.ops.gradops, op_name).default
    for device_type in ("cpu", "cuda"):
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def kernel(_keyset, *args, _op=op, _device_type=device_type, _key=key):
            if cast_to_autocast_dtype:
                dtype = torch.get_autocast_dtype(_device_type)
                args = tuple(
                    a.to(dtype) if autocast_eligible(a, _device_type) else a
                    for a in args)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return _op(*args)

        _LIB.impl(op_name, kernel, key_name, with_keyset=True)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------
# Each functional checks its arguments before the dispatcher sees them (which would refuse a
# wrong Python type with its own RuntimeError), under the functional's parameter names:
# torch's for the norms (input, normalized_shape, weight, bias, eps, residual), their own for
# nsa_compress and floyd_attention. None where a tensor is required is AclnnError 161001; a
# wrong Python type is AclnnTypeError (161002, also the TypeError torch raises); a broken
# rule has the status the Python API gives it. These checks read Python values and tensor
# metadata only, so torch.compile traces them without a graph break. The dtype and shape
# rules of the operators themselves are decided by the ops layer's prepare_*, which the
# custom ops run (real and fake implementations alike) with their errors renamed to the
# functional's parameter names and naming the functional.

# ops-layer parameter name -> the norm functionals' (torch's)
_NORM_NAMES = {"x": "input", "gamma": "weight"}


def _backend_arg(op: str, backend) -> str:
    """The backend the call asks for (its own argument, else the default), checked."""
    return _check_name(op, requested(backend))


def _norm_op(family: str, residual) -> str:
    """The functional a norm op call serves, which its errors name."""
    return family if residual is None else f"fused_add_{family}"


def _checked_norm(op: str, input, residual, normalized_shape, weight, bias, eps, backend, *, fused: bool,
                  shape_status: int, eps_optional: bool):
    """The norm functionals' arguments: returns (normalized_shape as a tuple, eps, backend).
    ``fused``: the residual is required; ``eps_optional``: None stays None (torch's default).
    The callers remember what they conclude per call signature (``gradops.ops._plans``)."""
    require_tensor(op, "input", input)
    if fused:
        check_companion(op, "residual", residual, "input", input, status=shape_status)
    shape = _normalized_shape(op, normalized_shape)
    check_trailing(op, "normalized_shape", input, "input", tuple(shape), status=shape_status)
    require_tensor(op, "weight", weight, optional=True)
    require_tensor(op, "bias", bias, optional=True)
    if eps is not None or not eps_optional:
        eps = check_float_attr(op, "eps", eps)
    return tuple(shape), eps, _backend_arg(op, backend)


# --------------------------------------------------------------------------------------------
# LayerNorm
# --------------------------------------------------------------------------------------------
# One op serves each norm with and without the fused residual add: ``residual`` is None or
# the tensor added to the input first, and the op returns h = input + residual last. Custom
# ops cannot return None, so without a residual h is an empty tensor.

def _with_h(outputs: tuple, n: int, like: Tensor) -> tuple:
    """The first ``n`` results, then h (results[n]) or, without a residual, an empty tensor."""
    h = outputs[n] if len(outputs) > n else like.new_empty(_NOT_COMPUTED)
    return tuple(outputs[:n]) + (h,)


def _prepare_layer_norm(x, residual, normalized_shape, weight, bias, eps, backend):
    with renamed_errors(_NORM_NAMES):
        return _ln_ops.prepare_layer_norm(x, normalized_shape, weight, bias, eps, residual=residual,
                                          backend=backend, op=_norm_op("layer_norm", residual))


def _layer_norm_plan(x, residual, normalized_shape, weight, bias, eps, backend):
    with renamed_errors(_NORM_NAMES):
        return _ln_ops.plan_layer_norm(x, normalized_shape, weight, bias, eps, residual=residual, backend=backend,
                                       op=_norm_op("layer_norm", residual))


def _run_layer_norm_op(p, x) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    with _no_autocast(x.device.type):
        out = p.run()
    return _with_h(tuple(_fresh(t) for t in out), 3, x)


@torch.library.custom_op("gradops::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, residual: Optional[Tensor], normalized_shape: List[int],
                   weight: Optional[Tensor], bias: Optional[Tensor], eps: float, backend: Optional[str]
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_layer_norm_op(_prepare_layer_norm(x, residual, normalized_shape, weight, bias, eps, backend), x)


@_layer_norm_op.register_fake
def _layer_norm_fake(x, residual, normalized_shape, weight, bias, eps, backend):
    p = _prepare_layer_norm(x, residual, normalized_shape, weight, bias, eps, backend)
    return _with_h(tuple(_empty_like_spec(s, x) for s in p.outputs), 3, x)


@torch.library.custom_op("gradops::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: Tensor, dresidual: Optional[Tensor], x: Tensor, normalized_shape: List[int],
                            mean: Tensor, rstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                            output_mask: List[bool], backend: Optional[str]
                            ) -> Tuple[Tensor, Tensor, Tensor]:
    with _no_autocast(x.device.type):
        grads = _ln_ops.prepare_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias,
                                                    output_mask, dresidual=dresidual, backend=backend).run()
    return tuple(x.new_empty(_NOT_COMPUTED) if g is None else _fresh(g) for g in grads)


@_layer_norm_backward_op.register_fake
def _(dy, dresidual, x, normalized_shape, mean, rstd, weight, bias, output_mask, backend):
    p = _ln_ops.prepare_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias,
                                            output_mask, dresidual=dresidual, backend=backend)
    return tuple(x.new_empty(_NOT_COMPUTED) if s is None else _empty_like_spec(s, x) for s in p.outputs)


def _layer_norm_setup(ctx, inputs, output):
    x, residual, normalized_shape, weight, bias, eps, backend = inputs
    _, mean, rstd, h = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.has_residual = residual is not None
    if not ctx.has_residual:
        ctx.mark_non_differentiable(h)
    # the backward needs what was normalised: h with a residual, else x
    ctx.save_for_backward(h if ctx.has_residual else x, weight, bias, mean, rstd)
    ctx.normalized_shape = normalized_shape
    ctx.backend = backend


def _layer_norm_grads(ctx, dy, dh, need_x, need_res, need_w, need_b, impl=None):
    """(dx, dresidual, dweight, dbias) for both LayerNorm paths, None where not needed.
    ``dh``: h's gradient from its other uses (None: unused, or no residual). ``impl``: the
    eager path's backend module, run directly (the forward validated every input, and
    autograd gives dy and dh its outputs' metadata); else, and always with create_graph, the
    backward op runs, whose autograd node refuses a second backward."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need_input = bool(need_x or (ctx.has_residual and need_res))
    mask = [need_input, bool(need_w and weight is not None), bool(need_b and bias is not None)]
    if not any(mask):
        return None, None, None, None
    if dy is None:
        dy = torch.zeros_like(x)
    if impl is not None and not torch.is_grad_enabled():
        with _autocast_off(x.device.type):
            dx, dw, db = _ln_ops.run_layer_norm_backward(impl, dy, x, ctx.normalized_shape, mean, rstd, weight,
                                                         mask, dresidual=dh)
    else:
        lead = x.shape[: x.dim() - len(ctx.normalized_shape)]  # (the eager path keeps them flat)
        dx, dw, db = torch.ops.gradops.layer_norm_backward(dy, dh, x, ctx.normalized_shape, mean.reshape(lead),
                                                           rstd.reshape(lead), weight, bias, mask, ctx.backend)
    dx = dx if mask[0] else None
    # bias is accepted by the backward operator only for its shape check; db = sum(dy) needs no bias
    return dx, dx if ctx.has_residual else None, dw if mask[1] else None, db if mask[2] else None


def _layer_norm_backward(ctx, dy, _dmean, _drstd, dh):
    need_x, need_res, _, need_w, need_b = ctx.needs_input_grad[:5]
    dx, dres, dw, db = _layer_norm_grads(ctx, dy, dh if ctx.has_residual else None, need_x, need_res, need_w, need_b)
    return dx, dres, None, dw, db, None, None


torch.library.register_autograd("gradops::layer_norm", _layer_norm_backward, setup_context=_layer_norm_setup)
torch.library.register_autograd("gradops::layer_norm_backward",
                                _double_backward_error("layer_norm", "torch.nn.functional.layer_norm"))


class _LayerNormFunction(torch.autograd.Function):
    """The eager path of ``gradops::layer_norm`` (see ``_eager``): the same plan, backend and
    backward operator, from a plan the call's signature already holds. Returns y, and h as
    well with a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, plan, backend):
        with _autocast_off(x.device.type):
            y, mean, rstd, h = _ln_ops.run_layer_norm(plan, x, weight, bias, residual)
        ctx.has_residual = h is not None
        ctx.save_for_backward(h if ctx.has_residual else x, weight, bias, mean, rstd)
        ctx.normalized_shape = plan.normalized_shape
        ctx.backend = backend
        ctx.impl = plan.impl
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros to add)
        return (_fresh(y), _fresh(h)) if ctx.has_residual else _fresh(y)

    @staticmethod
    def backward(ctx, dy, dh=None):
        need_x, need_res, need_w, need_b = ctx.needs_input_grad[:4]
        return _layer_norm_grads(ctx, dy, dh, need_x, need_res, need_w, need_b, ctx.impl) + (None, None)


def _normalized_shape(op: str, normalized_shape) -> List[int]:
    return list(as_int_tuple(op, "normalized_shape", normalized_shape))


def _eager_plan(key, plan: tuple, make):
    """The ops-layer plan of an eager call: the last item of its signature's ``plan``, else
    ``make()``, remembered beside the rest (a call first traced, then run eagerly, makes it then)."""
    if plan[-1] is None:
        plan = _plans.remember(key, plan[:-1] + (make(),))
    return plan[-1]


def _layer_norm(op: str, input, residual, normalized_shape, weight, bias, eps, backend):
    """layer_norm and fused_add_layer_norm: (y, h), h None without a residual. One key per call
    signature holds what the checks concluded and, once the call runs eagerly, the ops
    layer's plan: a training step's calls skip both."""
    key = _plans.signature("gradops.nn.functional." + op, requested(backend), (input, residual, weight, bias),
                           (normalized_shape, eps))
    plan = _plans.lookup(key)
    if plan is None:
        shape, eps, backend = _checked_norm(op, input, residual, normalized_shape, weight, bias, eps, backend,
                                            fused=op != "layer_norm", shape_status=ACLNN_ERR_PARAM_INVALID,
                                            eps_optional=False)
        plan = _plans.remember(key, (shape, eps, backend, None))
    shape, eps, backend = plan[:3]
    if _eager(input):
        ln_plan = _eager_plan(key, plan, lambda: _layer_norm_plan(input, residual, shape, weight, bias, eps, backend))
        out = _LayerNormFunction.apply(input, residual, weight, bias, ln_plan, backend)
        return out if residual is not None else (out, None)
    op = torch.ops.gradops.triton_layer_norm if _takes_triton_op(input, backend) else torch.ops.gradops.layer_norm
    out = op(input, residual, list(shape), weight, bias, eps, backend)
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
    with renamed_errors(_NORM_NAMES):
        return _rms_ops.prepare_rms_norm(x, gamma, eps, offset=offset, casting_mode=casting_mode,
                                         residual=residual, backend=backend, op=_norm_op("rms_norm", residual))


def _rms_norm_plan(x, residual, gamma, eps, offset, casting_mode, backend):
    with renamed_errors(_NORM_NAMES):
        return _rms_ops.plan_rms_norm(x, gamma, eps, offset=offset, casting_mode=casting_mode, residual=residual,
                                      backend=backend, op=_norm_op("rms_norm", residual))


def _run_rms_norm_op(p, x) -> Tuple[Tensor, Tensor, Tensor]:
    with _no_autocast(x.device.type):
        out = p.run()
    return _with_h(tuple(_fresh(t) for t in out), 2, x)


@torch.library.custom_op("gradops::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, residual: Optional[Tensor], gamma: Tensor, eps: float, offset: float,
                 casting_mode: str, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    return _run_rms_norm_op(_prepare_rms_norm(x, residual, gamma, eps, offset, casting_mode, backend), x)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, residual, gamma, eps, offset, casting_mode, backend):
    p = _prepare_rms_norm(x, residual, gamma, eps, offset, casting_mode, backend)
    return _with_h(tuple(_empty_like_spec(s, x) for s in p.outputs), 2, x)


@torch.library.custom_op("gradops::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, dresidual: Optional[Tensor], x: Tensor, rstd: Tensor, gamma: Tensor,
                          offset: float, casting_mode: str, backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    with _no_autocast(x.device.type):
        dx, dgamma = _rms_ops.prepare_rms_norm_grad(dy, x, rstd, gamma, offset=offset, casting_mode=casting_mode,
                                                    dresidual=dresidual, backend=backend).run()
    return _fresh(dx), _fresh(dgamma)


@_rms_norm_backward_op.register_fake
def _(dy, dresidual, x, rstd, gamma, offset, casting_mode, backend):
    p = _rms_ops.prepare_rms_norm_grad(dy, x, rstd, gamma, offset=offset, casting_mode=casting_mode,
                                       dresidual=dresidual, backend=backend)
    return tuple(_empty_like_spec(s, x) for s in p.outputs)


def _rms_norm_setup(ctx, inputs, output):
    x, residual, gamma, eps, offset, casting_mode, backend = inputs
    _, rstd, h = output
    ctx.mark_non_differentiable(rstd)
    ctx.has_residual = residual is not None
    if not ctx.has_residual:
        ctx.mark_non_differentiable(h)
    ctx.save_for_backward(h if ctx.has_residual else x, gamma, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode
    ctx.backend = backend


def _rms_norm_grads(ctx, dy, dh, need_x, need_res, need_gamma, impl=None):
    """(dx, dresidual, dgamma) for both RMSNorm paths, None where not needed; ``dh`` and
    ``impl`` as in ``_layer_norm_grads``."""
    x, gamma, rstd = ctx.saved_tensors
    if not (need_x or need_gamma or (ctx.has_residual and need_res)):
        return None, None, None
    if dy is None:
        dy = torch.zeros_like(x)
    if impl is not None and not torch.is_grad_enabled():
        with _autocast_off(x.device.type):
            dx, dgamma = _rms_ops.run_rms_norm_grad(
                impl, dy, x, rstd, gamma, offset=ctx.offset,
                round_xhat=ctx.casting_mode == "llama", dresidual=dh,  # (the forward validated it)
                grad_dtype=gamma.dtype)
    else:
        lead = x.shape[: x.dim() - gamma.dim()]  # (the eager path keeps rstd flat)
        dx, dgamma = torch.ops.gradops.rms_norm_backward(dy, dh, x, rstd.reshape(lead), gamma, ctx.offset,
                                                         ctx.casting_mode, ctx.backend)
    # the operator accumulates dgamma in float32; the parameter's gradient has its own dtype
    return dx, dx if ctx.has_residual else None, dgamma.to(gamma.dtype)


def _rms_norm_backward(ctx, dy, _drstd, dh):
    need_x, need_res, need_gamma = ctx.needs_input_grad[:3]
    return _rms_norm_grads(ctx, dy, dh if ctx.has_residual else None, need_x, need_res, need_gamma) + (None,) * 4


torch.library.register_autograd("gradops::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("gradops::rms_norm_backward",
                                _double_backward_error("rms_norm", "torch.nn.functional.rms_norm"))


class _RmsNormFunction(torch.autograd.Function):
    """The eager path of ``gradops::rms_norm`` (see ``_eager``), from a plan the call's
    signature already holds. Returns y, and h as well with a residual."""

    @staticmethod
    def forward(ctx, x, residual, gamma, plan, casting_mode, backend):
        with _autocast_off(x.device.type):
            y, rstd, h = _rms_ops.run_rms_norm(plan, x, gamma, residual)
        ctx.has_residual = h is not None
        ctx.save_for_backward(h if ctx.has_residual else x, gamma, rstd)
        ctx.offset, ctx.casting_mode, ctx.backend = plan.offset, casting_mode, backend
        ctx.impl = plan.impl
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros to add)
        return (_fresh(y), _fresh(h)) if ctx.has_residual else _fresh(y)

    @staticmethod
    def backward(ctx, dy, dh=None):
        need_x, need_res, need_gamma = ctx.needs_input_grad[:3]
        return _rms_norm_grads(ctx, dy, dh, need_x, need_res, need_gamma, ctx.impl) + (None,) * 3


def _rms_norm_call(key, plan, input, residual, weight, casting_mode, backend):
    """(y, h) of an RMSNorm whose signature's ``plan`` ((eps, offset, the ops layer's plan or
    None)) holds what the checks concluded: the eager path or, traced, the custom op."""
    eps, offset = plan[:2]
    if _eager(input):
        rms_plan = _eager_plan(key, plan, lambda: _rms_norm_plan(input, residual, weight, eps, offset, casting_mode,
                                                                 backend))
        out = _RmsNormFunction.apply(input, residual, weight, rms_plan, casting_mode, backend)
        return out if residual is not None else (out, None)
    op = torch.ops.gradops.triton_rms_norm if _takes_triton_op(input, backend) else torch.ops.gradops.rms_norm
    out = op(input, residual, weight, eps, offset, casting_mode, backend)
    return out[0], (out[-1] if residual is not None else None)


def _rms_norm(op: str, input, residual, normalized_shape, weight, eps, offset, casting_mode, backend):
    """rms_norm and fused_add_rms_norm: (y, h), h None without a residual."""
    # A signature seen before whose weight went to the operator as it is (the common case)
    # skips the checks and the dtype rules below: they concluded (eps, offset) for it.
    key = _plans.signature("gradops.nn.functional." + op, requested(backend), (input, residual, weight),
                           (normalized_shape, eps, offset, casting_mode))
    plan = _plans.lookup(key)
    if plan is not None:
        return _rms_norm_call(key, plan, input, residual, weight, casting_mode, requested(backend))
    # RMSNorm's shape rules are tiling rules (561002)
    shape, eps, backend = _checked_norm(op, input, residual, normalized_shape, weight, None, eps, backend,
                                        fused=op != "rms_norm", shape_status=ACLNN_ERR_INNER_TILING_ERROR,
                                        eps_optional=True)
    shape = tuple(shape)
    weight_given = weight
    offset = check_float_attr(op, "offset", offset)
    _rms_ops.check_casting_mode(op, casting_mode)
    if eps is None:
        # torch takes the machine eps of the dtype it computes in, float32 for half inputs
        # (not bf16's 2**-7, which would visibly shift small-magnitude rows)
        eps = torch.finfo(stat_dtype(input.dtype)).eps if input.is_floating_point() else 0.0
    if weight is None:
        if offset != 0:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                             f"{op}: offset is {short_repr(offset)} but weight is None, expected a weight for the offset "
                             f"to shift (offset + weight scales the row)")
        # float32 gamma beside half input is in CANN's dtype table; float32/float64 input keep their own
        gamma_dtype = stat_dtype(input.dtype) if input.is_floating_point() else torch.float32
        weight = torch.ones(shape, dtype=gamma_dtype, device=input.device)
    elif tuple(weight.shape) != shape:
        raise AclnnError(ACLNN_ERR_INNER_TILING_ERROR,
                         f"{op}: weight has shape {tuple(weight.shape)}, expected normalized_shape == {shape}")
    elif weight.is_floating_point() and input.is_floating_point() and weight.dtype != input.dtype:
        if input.dtype in (torch.float32, torch.float64) and weight.dtype.itemsize < input.dtype.itemsize:
            # torch (and HF's norms) compute a float32/float64 input with a half weight in
            # the input's precision; CANN's table has no such pair, so widen the weight
            # (exactly; its gradient flows back through the cast)
            weight = weight.to(input.dtype)
        elif casting_mode == "llama":
            # Llama multiplies the rounded half x-hat by a weight of another dtype (a float32
            # master weight, or the other half type) in their promoted dtype and returns that:
            # the operator returns the rounded x-hat, torch scales it
            y, h = _rms_norm(op, input, residual, shape, None, eps, 0.0, casting_mode, backend)
            return (weight + offset if offset else weight) * y, h
        elif weight.dtype in (torch.float16, torch.bfloat16):
            # the other half type (fp16 beside bf16): "gemma" computes in float32 anyway, so
            # the exactly widened weight gives the same result in CANN's dtype table
            weight = weight.float()
    if weight is not weight_given:
        key = None  # a weight made or converted here is this call's own: the call is not remembered
    return _rms_norm_call(key, _plans.remember(key, (float(eps), offset, None)), input, residual, weight,
                          casting_mode, backend)


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


# --------------------------------------------------------------------------------------------
# NSA compression
# --------------------------------------------------------------------------------------------

def _nsa_forward(x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    with _no_autocast(x.device.type):
        out = _nsa_ops.prepare_nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type,
                                            backend=backend).run()
    return _fresh(out)


def _nsa_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    with _no_autocast(x.device.type):
        dx, dw = _nsa_ops.prepare_nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens,
                                                    seq_lens_type, backend=backend).run()
    return _fresh(dx), _fresh(dw)


@torch.library.custom_op("gradops::nsa_compress", mutates_args=())
def _nsa_compress_op(x: Tensor, weight: Tensor, block_size: int, stride: int, seq_lens: List[int],
                     seq_lens_type: str, backend: Optional[str]) -> Tensor:
    return _nsa_forward(x, weight, block_size, stride, seq_lens, seq_lens_type, backend)


def _specialized(seq_lens: List[int]) -> List[int]:
    # Under torch.compile dynamo turns a list's ints into symbolic ints once it has seen them
    # change (automatic dynamic shapes) or with dynamic=True. The block plan needs their
    # values: int() guards on each one, so the list stays a compile-time constant and a new
    # list recompiles (as documented) instead of failing validation.
    return [int(v) for v in seq_lens]


@_nsa_compress_op.register_fake
def _(x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    seq_lens = _specialized(seq_lens)
    p = _nsa_ops.prepare_nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type, backend=backend)
    return _empty_like_spec(p.outputs[0], x)


@torch.library.custom_op("gradops::nsa_compress_backward", mutates_args=())
def _nsa_compress_backward_op(dout: Tensor, x: Tensor, weight: Tensor, block_size: int, stride: int,
                              seq_lens: List[int], seq_lens_type: str, backend: Optional[str]
                              ) -> Tuple[Tensor, Tensor]:
    return _nsa_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend)


@_nsa_compress_backward_op.register_fake
def _(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    seq_lens = _specialized(seq_lens)
    p = _nsa_ops.prepare_nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type,
                                           backend=backend)
    return tuple(_empty_like_spec(s, x) for s in p.outputs)


# The same pair with seq_lens as an integer tensor. The number of compressed blocks then
# depends on the tensor's values, so the fake implementation gives the output an unbacked
# (data-dependent) first dimension: torch.compile traces it without a graph break, and the
# values are read on the host only when the op really runs.
@torch.library.custom_op("gradops::nsa_compress_seqlens_tensor", mutates_args=())
def _nsa_compress_t_op(x: Tensor, weight: Tensor, block_size: int, stride: int, seq_lens: Tensor,
                       seq_lens_type: str, backend: Optional[str]) -> Tensor:
    return _nsa_forward(x, weight, block_size, stride, _nsa_ops.seq_lens_to_list("nsa_compress", seq_lens),
                        seq_lens_type, backend)


@_nsa_compress_t_op.register_fake
def _(x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    op = "nsa_compress"
    block_size, stride = _nsa_ops._check_common(op, x, weight, block_size, stride)
    _nsa_ops.seq_lens_type_code(op, seq_lens_type)
    if seq_lens.dim() != 1 or seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: seq_lens is a {seq_lens.dtype} tensor of shape "
                                                  f"{tuple(seq_lens.shape)}, expected a 1-D integer tensor")
    num_blocks = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((num_blocks,) + tuple(x.shape[1:]))


@torch.library.custom_op("gradops::nsa_compress_seqlens_tensor_backward", mutates_args=())
def _nsa_compress_t_backward_op(dout: Tensor, x: Tensor, weight: Tensor, block_size: int, stride: int,
                                seq_lens: Tensor, seq_lens_type: str, backend: Optional[str]
                                ) -> Tuple[Tensor, Tensor]:
    return _nsa_grad(dout, x, weight, block_size, stride,
                     _nsa_ops.seq_lens_to_list("nsa_compress_grad", seq_lens), seq_lens_type, backend)


@_nsa_compress_t_backward_op.register_fake
def _(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(weight, memory_format=torch.contiguous_format)


def _nsa_setup(ctx, inputs, output):
    x, weight, block_size, stride, seq_lens, seq_lens_type, backend = inputs
    if isinstance(seq_lens, Tensor):
        ctx.save_for_backward(x, weight, seq_lens)
    else:
        ctx.save_for_backward(x, weight)
        ctx.seq_lens = seq_lens
    ctx.args = (block_size, stride, seq_lens_type, backend)


def _nsa_backward(ctx, dout):
    block_size, stride, seq_lens_type, backend = ctx.args
    saved = ctx.saved_tensors
    if len(saved) == 3:
        x, weight, seq_lens = saved
        grad_op = torch.ops.gradops.nsa_compress_seqlens_tensor_backward
    else:
        (x, weight), seq_lens = saved, ctx.seq_lens
        grad_op = torch.ops.gradops.nsa_compress_backward
    need_x, need_w = ctx.needs_input_grad[:2]
    if not (need_x or need_w):
        return (None,) * 7
    dx, dw = grad_op(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend)
    return dx if need_x else None, dw if need_w else None, None, None, None, None, None


class _NsaCompressFunction(torch.autograd.Function):
    """The eager path of ``gradops::nsa_compress`` (as the norms', see ``_eager``): the same
    validation and backend code without the custom op's dispatch layers, which cost a small
    call more host time than its kernels take on a GPU."""

    @staticmethod
    def forward(ctx, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
        out = _nsa_forward(x, weight, block_size, stride, seq_lens, seq_lens_type, backend)
        ctx.save_for_backward(x, weight)
        ctx.seq_lens = seq_lens
        ctx.args = (block_size, stride, seq_lens_type, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # create_graph: the op's autograd says why it cannot
            return _nsa_backward(ctx, dout)
        need_x, need_w = ctx.needs_input_grad[:2]
        if not (need_x or need_w):
            return (None,) * 7
        (x, weight), (block_size, stride, seq_lens_type, backend) = ctx.saved_tensors, ctx.args
        dx, dw = _nsa_grad(dout, x, weight, block_size, stride, ctx.seq_lens, seq_lens_type, backend)
        return dx if need_x else None, dw if need_w else None, None, None, None, None, None


for _name in ("nsa_compress", "nsa_compress_seqlens_tensor"):
    torch.library.register_autograd(f"gradops::{_name}", _nsa_backward, setup_context=_nsa_setup)
    torch.library.register_autograd(f"gradops::{_name}_backward",
                                    _double_backward_error("nsa_compress", "a plain PyTorch formulation"))


def nsa_compress(x: Tensor, weight: Tensor, block_size: int, stride: int,
                 seq_lens: Union[Sequence[int], Tensor], seq_lens_type: str = "cumsum", *,
                 backend: Optional[str] = None) -> Tensor:
    """NSA key/value compression of packed sequences, differentiable in ``x`` and ``weight``.

    ``x [T, N, D]``, ``weight [block_size, N]`` (x's dtype) -> ``[C, N, D]``. ``seq_lens``:
    cumulative ends (``"cumsum"``) or lengths (``"lengths"``); a list of ints (under
    torch.compile a list is a compile-time constant: a new list recompiles) or a 1-D integer
    tensor (under torch.compile the output's first dimension is then data-dependent, so
    nothing recompiles).

    The number of blocks, hence the output's shape, depends on the values, so they are read
    on the host: a CUDA tensor costs a device-to-host copy (a synchronisation, and no CUDA
    graph capture); a list or a CPU tensor costs none. In eager mode a tensor is read once,
    in the forward; the backward reuses the values.
    """
    op = "nsa_compress"
    require_tensor(op, "x", x)
    require_tensor(op, "weight", weight)
    block_size = check_int_attr(op, "block_size", block_size, 1)
    stride = check_int_attr(op, "stride", stride, 1)
    code = _nsa_ops.seq_lens_type_code(op, seq_lens_type)
    type_name = "lengths" if code == 1 else "cumsum"
    backend = _backend_arg(op, backend)
    if isinstance(seq_lens, Tensor) and torch.compiler.is_compiling():
        require_tensor(op, "seq_lens", seq_lens)
        return torch.ops.gradops.nsa_compress_seqlens_tensor(x, weight, block_size, stride, seq_lens,
                                                             type_name, backend)
    seq_lens = _nsa_ops.seq_lens_to_list(op, seq_lens)
    if _eager(x) and not torch.is_autocast_enabled(x.device.type):  # (autocast casts through the op)
        return _NsaCompressFunction.apply(x, weight, block_size, stride, seq_lens, type_name, backend)
    return torch.ops.gradops.nsa_compress(x, weight, block_size, stride, seq_lens, type_name, backend)


# --------------------------------------------------------------------------------------------
# Floyd attention
# --------------------------------------------------------------------------------------------

@torch.library.custom_op("gradops::floyd_attention", mutates_args=())
def _floyd_op(q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, mask: Optional[Tensor],
              scale: float, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    with _no_autocast(q.device.type):
        out, smax, ssum = _floyd_ops.prepare_floyd_attention(q, k1, v1, k2, v2, mask, scale,
                                                             backend=backend).run()
    return _fresh(out), _fresh(smax), _fresh(ssum)


@_floyd_op.register_fake
def _(q, k1, v1, k2, v2, mask, scale, backend):
    p = _floyd_ops.prepare_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend)
    return tuple(_empty_like_spec(s, q) for s in p.outputs)


@torch.library.custom_op("gradops::floyd_attention_backward", mutates_args=())
def _floyd_backward_op(dy: Tensor, q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, out: Tensor,
                       softmax_max: Tensor, softmax_sum: Tensor, mask: Optional[Tensor], scale: float,
                       backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with _no_autocast(q.device.type):
        grads = _floyd_ops.prepare_floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum,
                                                        mask, scale, backend=backend).run()
    return tuple(_fresh(g) for g in grads)


@_floyd_backward_op.register_fake
def _(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask, scale, backend):
    p = _floyd_ops.prepare_floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask,
                                                scale, backend=backend)
    return tuple(_empty_like_spec(s, q) for s in p.outputs)


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
    grads = torch.ops.gradops.floyd_attention_backward(dy, q, k1, v1, k2, v2, out, smax, ssum, mask,
                                                       ctx.scale, ctx.backend)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None, None, None)


torch.library.register_autograd("gradops::floyd_attention", _floyd_backward, setup_context=_floyd_setup)
torch.library.register_autograd("gradops::floyd_attention_backward",
                                _double_backward_error("floyd_attention",
                                                       "a plain PyTorch einsum formulation"))


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
        from ..distributed import dtensor

        dtensor.register()
    out, _, _ = torch.ops.gradops.floyd_attention(q, k1, v1, k2, v2, mask, scale, _backend_arg(op, backend))
    return out


# --------------------------------------------------------------------------------------------
# The norm forwards as Triton ops, for torch.compile on a GPU
# --------------------------------------------------------------------------------------------
# Traced on CUDA (static shapes, the Triton kernels), a norm forward is a
# ``torch.library.triton_op``: AOTAutograd traces its body, whose launches are recorded
# through ``wrap_triton`` (``gradops.kernels._traceable``), so Inductor compiles and launches
# the forward kernel itself, with no gradops Python at run time, and CUDA graphs capture it.
# Same schema, fake implementation (shapes only), autograd and autocast as the custom ops.
# The backwards stay opaque custom ops: Inductor compiles a user kernel with its own
# options, and the backwards' exact results need floating-point contraction off
# (``norm_config.fp_fusion``), which it cannot ask for. Symbolic shapes (``dynamic=True``)
# take the custom ops: the launch configuration is decided from sizes.

_TRITON_OPS: Optional[bool] = None  # registered; None: not tried yet (see _register_triton_ops)
_TRITON_OPS_LOCK = threading.Lock()
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _takes_triton_op(x: Tensor, backend: str) -> bool:
    """Whether a traced (not eager) norm call makes its Triton op, which Inductor can compile
    (see above), rather than its custom op."""
    return (x.device.type == "cuda" and backend != "reference" and all(type(s) is int for s in x.shape)
            and _triton_ops_usable())


def _triton_ops_usable() -> bool:
    """Whether the Triton ops can be traced here, registering them on the first CUDA call that
    would take one (registering imports triton, which at gradops' import would keep ``gradops
    selftest`` from switching the interpreter on for a CPU run). Not under the Triton
    interpreter (its kernels cannot be traced), nor for ``torch.export``: an exported
    program keeps the custom op, which loads wherever gradops imports, with triton or
    without. (Run, not traced, by dynamo: see below; so ``is_exporting`` is read for real,
    which the dynamo of older torch folds to True while it traces.)"""
    return not triton_interpreter_on() and not _is_exporting() and _register_triton_ops()


# Where dynamo meets it, it runs the function rather than tracing it and takes the result as
# a constant of the graph: what ``torch.compiler.assume_constant_result`` marks, marked here
# without it, since importing it imports dynamo, and dynamo imports triton.
_triton_ops_usable._dynamo_marked_constant = True


def _register_triton_ops() -> bool:
    """Registers ``gradops::triton_layer_norm`` and ``gradops::triton_rms_norm`` once, where
    torch has ``triton_op`` and triton is installed; returns whether they are registered."""
    if _TRITON_OPS is None:
        with _TRITON_OPS_LOCK:  # (calls in several threads: one registers, the others wait)
            if _TRITON_OPS is None:
                _define_triton_ops()
    return _TRITON_OPS


def _define_triton_ops() -> None:
    global _TRITON_OPS
    if not hasattr(torch.library, "triton_op") or not triton_available():
        _TRITON_OPS = False
        return
    from ..kernels._traceable import traced_launches

    @torch.library.triton_op("gradops::triton_layer_norm", mutates_args=())
    def _triton_layer_norm_op(x: Tensor, residual: Optional[Tensor], normalized_shape: List[int],
                              weight: Optional[Tensor], bias: Optional[Tensor], eps: float, backend: Optional[str]
                              ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        p = _prepare_layer_norm(x, residual, normalized_shape, weight, bias, eps, backend)
        if p.backend_name != "triton":  # (no reference op is ever traced into the graph)
            return torch.ops.gradops.layer_norm(x, residual, normalized_shape, weight, bias, eps, backend)
        with traced_launches():
            return _run_layer_norm_op(p, x)

    @torch.library.triton_op("gradops::triton_rms_norm", mutates_args=())
    def _triton_rms_norm_op(x: Tensor, residual: Optional[Tensor], gamma: Tensor, eps: float, offset: float,
                            casting_mode: str, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
        p = _prepare_rms_norm(x, residual, gamma, eps, offset, casting_mode, backend)
        if p.backend_name != "triton":
            return torch.ops.gradops.rms_norm(x, residual, gamma, eps, offset, casting_mode, backend)
        with traced_launches():
            return _run_rms_norm_op(p, x)

    # Outside AOTAutograd's decomposition (dynamo's fake pass, FakeTensorMode) the custom ops'
    # fake implementations: shapes only, no launch configuration (no GPU needed to plan one).
    _triton_layer_norm_op.register_fake(_layer_norm_fake)
    _triton_rms_norm_op.register_fake(_rms_norm_fake)
    torch.library.register_autograd("gradops::triton_layer_norm", _layer_norm_backward,
                                    setup_context=_layer_norm_setup)
    torch.library.register_autograd("gradops::triton_rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
    _register_autocast("triton_layer_norm", False)
    _register_autocast("triton_rms_norm", False)
    # The kernels each op launches, for AOTAutograd's cache key (torch finds them by reading
    # the op's source, which cannot follow a launch made through the plan)
    kernels_of = getattr(torch._library.triton, "triton_ops_to_kernels", None)
    if kernels_of is not None:
        from ..kernels import layer_norm as kln, rms_norm as krn

        kernels_of["gradops::triton_layer_norm"] = [kln._ln_fwd_fused_kernel, kln._ln_fwd_wide_kernel]
        kernels_of["gradops::triton_rms_norm"] = [krn._rms_fwd_fused_kernel, krn._rms_fwd_wide_kernel]
    _TRITON_OPS = True


# --------------------------------------------------------------------------------------------
# Autocast: norms pass through untouched, matmul-like ops take the autocast dtype.
# --------------------------------------------------------------------------------------------

for _name, _cast in (("layer_norm", False), ("layer_norm_backward", False),
                     ("rms_norm", False), ("rms_norm_backward", False),
                     ("nsa_compress", True), ("nsa_compress_seqlens_tensor", True),
                     ("nsa_compress_backward", False), ("nsa_compress_seqlens_tensor_backward", False),
                     ("floyd_attention", True), ("floyd_attention_backward", False)):
    _register_autocast(_name, _cast)
del _name, _cast
