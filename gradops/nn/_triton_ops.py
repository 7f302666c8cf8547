"""The norm forwards as Triton ops, for torch.compile on a GPU.

Traced on CUDA (static shapes, the Triton kernels), a norm forward is a
``torch.library.triton_op``: AOTAutograd traces its body, whose launches are recorded
through ``wrap_triton`` (``gradops.kernels._traceable``), so Inductor compiles and launches
the forward kernel itself, with no gradops Python at run time, and CUDA graphs capture it.
Same schema, fake implementation (shapes only), autograd and autocast as the custom ops.
The backwards stay opaque custom ops: Inductor compiles a user kernel with its own
options, and the backwards' exact results need floating-point contraction off
(``norm_config.fp_fusion``), which it cannot ask for. Symbolic shapes (``dynamic=True``)
take the custom ops: the launch configuration is decided from sizes.

The Triton ops are made of their custom ops' parts (``_norms`` defines them and registers
them here, ``register_triton_op_parts``): ``_norms`` imports this module to route a traced
call, so this one imports nothing of ``_norms``.
"""
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .._backend import triton_available, triton_interpreter_on
from ._custom_ops import register_autocast, register_dtensor_rules_of_new_ops

_TRITON_OPS: Optional[bool] = None  # registered; None: not tried yet (see _register_triton_ops)
_TRITON_OPS_LOCK = threading.Lock()
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


class NormOpParts(NamedTuple):
    """What a norm's Triton op shares with its custom op: ``prepare`` (the op's arguments ->
    the operator's Prepared), ``run`` (that Prepared and x -> the op's outputs), the fake
    implementation, and the autograd's ``setup`` and ``backward``."""
    prepare: Callable
    run: Callable
    fake: Callable
    setup: Callable
    backward: Callable


_PARTS: Dict[str, NormOpParts] = {}  # "layer_norm", "rms_norm" -> its custom op's parts


def register_triton_op_parts(family: str, prepare: Callable, run: Callable, fake: Callable, setup: Callable,
                             backward: Callable) -> None:
    """The parts of ``gradops::<family>`` that ``gradops::triton_<family>`` is made of (``_norms``
    gives them when it defines the custom op, before any call can register the Triton ops)."""
    _PARTS[family] = NormOpParts(prepare, run, fake, setup, backward)


def takes_triton_op(x: Tensor, backend: str) -> bool:
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
    from ._transforms import register_rows_vmap

    ln, rms = _PARTS["layer_norm"], _PARTS["rms_norm"]

    @torch.library.triton_op("gradops::triton_layer_norm", mutates_args=())
    def _triton_layer_norm_op(x: Tensor, residual: Optional[Tensor], normalized_shape: List[int],
                              weight: Optional[Tensor], bias: Optional[Tensor], eps: float, backend: Optional[str]
                              ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        p = ln.prepare(x, residual, normalized_shape, weight, bias, eps, backend)
        if p.backend_name != "triton":  # (no reference op is ever traced into the graph)
            return torch.ops.gradops.layer_norm(x, residual, normalized_shape, weight, bias, eps, backend)
        with traced_launches():
            return ln.run(p, x)

    @torch.library.triton_op("gradops::triton_rms_norm", mutates_args=())
    def _triton_rms_norm_op(x: Tensor, residual: Optional[Tensor], gamma: Tensor, eps: float, offset: float,
                            casting_mode: str, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
        p = rms.prepare(x, residual, gamma, eps, offset, casting_mode, backend)
        if p.backend_name != "triton":
            return torch.ops.gradops.rms_norm(x, residual, gamma, eps, offset, casting_mode, backend)
        with traced_launches():
            return rms.run(p, x)

    # Outside AOTAutograd's decomposition (dynamo's fake pass, FakeTensorMode) the custom ops'
    # fake implementations: shapes only, no launch configuration (no GPU needed to plan one).
    _triton_layer_norm_op.register_fake(ln.fake)
    _triton_rms_norm_op.register_fake(rms.fake)
    torch.library.register_autograd("gradops::triton_layer_norm", ln.backward, setup_context=ln.setup)
    torch.library.register_autograd("gradops::triton_rms_norm", rms.backward, setup_context=rms.setup)
    register_autocast("triton_layer_norm", False)
    register_autocast("triton_rms_norm", False)
    # a compiled vmap traces the op itself (see _transforms.transformed): the custom ops' rule
    register_rows_vmap("triton_layer_norm", ("weight", "bias"))
    register_rows_vmap("triton_rms_norm", ("gamma",))
    # The kernels each op launches, for AOTAutograd's cache key (torch finds them by reading
    # the op's source, which cannot follow a launch made through the plan)
    kernels_of = getattr(torch._library.triton, "triton_ops_to_kernels", None)
    if kernels_of is not None:
        from ..kernels import layer_norm as kln, rms_norm as krn

        kernels_of["gradops::triton_layer_norm"] = [kln._ln_fwd_fused_kernel, kln._ln_fwd_wide_kernel]
        kernels_of["gradops::triton_rms_norm"] = [krn._rms_fwd_fused_kernel, krn._rms_fwd_wide_kernel]
    register_dtensor_rules_of_new_ops()
    _TRITON_OPS = True
