"""What the ``gradops`` custom ops of every operator family share (``gradops.nn.functional``
is their public face; ``_norms``, ``_nsa`` and ``_floyd`` define them, ``_triton_ops`` the
norm forwards Inductor compiles).

Each functional is a ``torch.library`` custom op in the ``gradops`` namespace (forward op +
backward op), so that

- autograd calls the library's backward operator (the ``gradops::<name>_backward`` ops run
  ``layer_norm_backward``, ``rms_norm_grad``, ``nsa_compress_grad``, ``floyd_attention_grad``),
  fed with the statistics the forward op saved (mean/rstd, softmax max/sum): gradients are the
  library's, not PyTorch's re-derivation;
- ``torch.compile(fullgraph=True)`` traces them without graph breaks: every op has a fake
  (meta) implementation, and that implementation is the ops layer's own ``prepare_*``
  (which validates and plans without reading tensor data), so shapes, dtypes and errors
  are decided in one place for eager and compiled code alike;
- torch.func transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``) go through autograd.Functions
  with ``setup_context`` and the ops' batching rules (``_transforms``: ``transformable``,
  ``register_rows_vmap``, ``register_folded_vmap``);
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

The modules that define ops deliberately avoid ``from __future__ import annotations``:
``custom_op`` reads the type hints to build each operator's schema.
"""
import contextlib
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

from .._backend import _check_name, requested
from ..errors import AclnnError

LIB = torch.library.Library("gradops", "FRAGMENT")


# A masked-out gradient of a backward op: custom ops cannot return None, so an empty tensor
# stands for "not computed" and the autograd formula maps it back to None.
NOT_COMPUTED = (0,)


def fresh(t: Tensor) -> Tensor:
    # The fake implementations promise contiguous outputs; keep the real ones to that promise
    # (a no-op for the backends, which return contiguous tensors). A reshaped result is a
    # view of the backend's [rows, cols] tensor; detached (no copy) it is a tensor of its own,
    # which autograd lets the caller modify in place, as torch's own outputs.
    t = t.contiguous()
    return t.detach() if t._base is not None else t


def empty_like_spec(spec, like: Tensor) -> Tensor:
    shape, dtype = spec
    return like.new_empty(shape, dtype=dtype)


def no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


_NOTHING = contextlib.nullcontext()


def autocast_off(t: Tensor):
    """``no_autocast`` for ``t``'s device where autocast is on, else nothing (entering a context,
    even reading a tensor's device, costs a tiny eager call time it notices)."""
    if not torch._C._is_any_autocast_enabled():
        return _NOTHING
    device_type = t.device.type
    return no_autocast(device_type) if torch.is_autocast_enabled(device_type) else _NOTHING


def takes_eager_path(x: Tensor) -> bool:
    """Whether a norm call takes the eager path (a ``torch.autograd.Function``) rather than its
    custom op. The custom ops exist for whatever traces or transforms the call: torch.compile
    and torch.export, make_fx and fake or meta tensors (a dispatch mode, a tensor subclass, the
    meta device: they need the op's fake implementation, not the backend's code), vmap and
    the other torch.func transforms. Run eagerly on real tensors, the ops' dispatch (the
    autograd, autocast and dynamo wrappers of ``torch.library``) costs several times what a
    small norm computes. Both paths validate with the same checks (the eager norms through
    ``gradops.ops.norm_functional``'s remembered plan) and run the same backend code."""
    return (type(x) in (Tensor, torch.nn.Parameter) and (x.is_cpu or x.is_cuda)
            and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active())


def double_backward_error(name: str, alternative: str):
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


def register_autocast(op_name: str, cast_to_autocast_dtype: bool):
    """Autocast kernels for ``gradops::<op_name>`` on CPU and CUDA.

    With ``cast_to_autocast_dtype`` the floating tensor arguments are cast to the active
    autocast dtype (bf16 or fp16, whichever the user chose) before the op runs, float64
    excepted (torch's autocast leaves float64 alone too); without it they pass unchanged.
    Either way the op itself then runs with autocast excluded, so the backend's internal
    float32 math is not lowered by autocast.
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

        LIB.impl(op_name, kernel, key_name, with_keyset=True)


# DTensor arguments are gradops.distributed's work: the ops' sharding rules (the norms' and
# NSA's row and head shards, Floyd's row-sharded rule) and pivotal_attention's row-sharded call.
# It builds on nn (nn never imports it) and, when it is imported (``import gradops`` imports
# it), registers here what a DTensor call is handed to: "rules": registers every gradops op's
# DTensor rule not yet registered, after which the ops run on DTensors as on any tensor;
# "same_mesh": checks a call's tensors are DTensors on one mesh; "pivotal_attention": the call
# itself. DTensor, about a second to import, is imported only once the first DTensor arrives.
DTENSOR_HANDLERS: Dict[str, Callable] = {}


def dtensor_arguments(op: str, names: Tuple[str, ...], tensors: tuple) -> bool:
    """Before a gradops op meets a call's tensors (each None or a tensor, named by ``names``):
    whether any is a DTensor. Then the ops' DTensor rules are registered (once), and every
    tensor is checked to be a DTensor on one mesh (``AclnnError`` 161002 naming the first that
    is not: DTensor's own error would be a RuntimeError). False, and nothing done, where none
    is a DTensor (no import of DTensor to tell). Every eager norm call pays this: tuples and a
    loop (a dict, or any() over a generator, cost it twice as much)."""
    for t in tensors:
        if type(t).__name__ == "DTensor":
            break
    else:
        return False
    _register_dtensor_rules()
    if not torch.compiler.is_compiling():  # (traced, DTensor's checks run when the graph is made)
        DTENSOR_HANDLERS["same_mesh"](op, dict(zip(names, tensors)))
    return True


@contextlib.contextmanager
def _aclnn_errors_unwrapped():
    try:
        yield
    except RuntimeError as error:
        cause = error.__cause__
        while cause is not None and not isinstance(cause, AclnnError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def dtensor_errors(dtensors: bool):
    """Around an op's call on DTensors (``dtensors``, as :func:`dtensor_arguments` said): the
    op's checks run in DTensor's sharding propagation (its fake implementation, on the global
    shapes), which wraps their ``AclnnError`` in a RuntimeError; this raises the AclnnError."""
    return _aclnn_errors_unwrapped() if dtensors else _NOTHING


_dtensor_rules_registered = False


def _register_dtensor_rules() -> None:
    global _dtensor_rules_registered
    if not _dtensor_rules_registered:
        DTENSOR_HANDLERS["rules"]()
        _dtensor_rules_registered = True


def register_dtensor_rules_of_new_ops() -> None:
    """Ops defined after the first DTensor call registered the rules (the Triton norm ops, on
    the first traced CUDA call) get their DTensor rules at once."""
    if _dtensor_rules_registered:
        DTENSOR_HANDLERS["rules"]()


# Under torch.compile dynamo runs it for real while tracing rather than tracing it (it returns
# nothing the graph needs): what ``torch.compiler.assume_constant_result`` marks, marked
# without importing dynamo (see _triton_ops)
_register_dtensor_rules._dynamo_marked_constant = True


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


def backend_arg(op: str, backend) -> str:
    """The backend the call asks for (its own argument, else the default), checked."""
    return _check_name(op, requested(backend))
