"""Make the Triton interpreter round float32 -> bfloat16 as the GPU does, and compute each
element of a ``tl.dot`` independently of the tile's other sides, as a GPU's MMA does; and
leave out two costs of the interpreter that change nothing it computes.

The interpreter (Triton 3.x) converts float32 to bfloat16 by dropping the low 16 bits
(round toward zero), where every NVIDIA GPU rounds to nearest even (``cvt.rn.bf16.f32``) and
so does torch. Truncation doubles the worst rounding error and biases it, so a bf16 result
of a kernel run on CPU would look up to twice as far from the float64 value as the same
kernel on a GPU. gradops.kernels._interpreter.round_bfloat16_to_nearest replaces that one
conversion with round-to-nearest-even (the CPU accuracy benchmark uses it too); every other
cast is left to the interpreter.

The interpreter's ``tl.dot`` is NumPy's ``matmul``, i.e. OpenBLAS, whose kernels sum an
element's products in an order that depends on the matrix shapes and the CPU (on an AMD EPYC,
OpenBLAS 0.3.31, a [16, 8] tile gives other last bits than the same rows of a [16, 16] one,
under every core type): the same score computed in two passes with different tiles then
differs in its last bit, and the exact zeros that Floyd attention promises for a one-hot
softmax (OPERATORS.md section 5) came out as 1e-6 on that machine and 0 on another. A GPU
computes an element of an MMA from its own row and column alone. ``_dot_in_order`` sums each
element's products in order of the contraction, whatever the tile, so the CPU tests see
what a GPU does.

Two changes for speed alone (together half the time of an interpreted Floyd call; what runs is
unchanged). The interpreter checks every 32-bit integer add, sub and mul for overflow
(``InterpreterOptions.sanitize_overflow``: the operands widened to 64 bits, the result compared
with the type's bounds), then drops the check's assertion, as its options never say ``debug``:
``_skip_dropped_checks`` leaves out a check whose assertion would be dropped. And the
interpreter patches ``triton.language`` (about 1.5 ms, walking every member of the module) at
each launch and again at every call of a ``@triton.jit`` helper inside it, though the launch's
patch is still in place: helpers called per program (``floyd_gemm._gemm_tile``, ``tl.zeros``)
cost more than the kernel's own work. ``_patch_lang_once`` patches a module a helper sees only
when the launch has not already patched it.

Applied by tests/conftest.py for CPU runs only.
"""
import dataclasses
import functools
import inspect
import threading

import numpy as np


def _dot_in_order(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """``a @ b`` ([..., R, T] @ [..., T, C]) in ``dtype``, each element the sum of its products
    in order t = 0, 1, ..., T - 1: the same bits for an element whatever R, C and the batch."""
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    out = a[..., :, 0:1] * b[..., 0:1, :]
    for t in range(1, a.shape[-1]):
        out = out + a[..., :, t:t + 1] * b[..., t:t + 1, :]
    return out


class _LaunchPatches(threading.local):
    """The ``triton.language`` modules patched during this thread's current launch (None:
    no launch running)."""

    modules = None


def _patch_lang_once(original_patch_lang, language_modules):
    """``interpreter._patch_lang`` that leaves out what the running launch has patched."""
    launch = _LaunchPatches()
    no_patch = type("NoPatch", (), {"restore": lambda self: None})()

    @functools.lru_cache(maxsize=None)
    def modules_of(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in language_modules)

    def patch_lang(fn):
        modules = modules_of(fn)
        if launch.modules is not None:  # a helper's call inside a launch
            if modules <= launch.modules:
                return no_patch
            launch.modules |= modules
            return original_patch_lang(fn)  # kept, as the interpreter keeps a helper's patch
        scope = original_patch_lang(fn)  # a launch: undone when the launch ends
        launch.modules = set(modules)
        restore = scope.restore

        def restore_and_end():
            launch.modules = None
            restore()

        scope.restore = restore_and_end
        return scope

    patch_lang._gradops_original = original_patch_lang
    return patch_lang


def _skip_dropped_checks(interpreter) -> None:
    """The interpreter's overflow checks off where its options drop their assertions."""
    options = getattr(getattr(interpreter, "interpreter_builder", None), "options", None)
    if dataclasses.is_dataclass(options) and {"debug", "sanitize_overflow"} <= set(vars(options)):
        if options.sanitize_overflow and not options.debug:
            interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


def install() -> bool:
    """Patch the interpreter's cast and dot and its patching of the language; False when this
    Triton's interpreter is not the shape this patch knows (the tests then see the
    interpreter's own truncation and BLAS)."""
    try:
        from triton.runtime import interpreter

        from gradops.kernels._interpreter import round_bfloat16_to_nearest
    except Exception:
        return False
    if round_bfloat16_to_nearest() is None:
        return False
    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle
    original_dot = getattr(builder, "create_dot", None)
    if original_dot is not None and not getattr(original_dot, "_gradops_in_order", False):
        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if a.data.shape[-1] == 0 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
                return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
            return handle(_dot_in_order(a.data, b.data, d.data.dtype) + d.data, d.dtype.scalar)

        create_dot._gradops_in_order = True
        builder.create_dot = create_dot
    _skip_dropped_checks(interpreter)
    original_patch_lang = getattr(interpreter, "_patch_lang", None)
    if original_patch_lang is not None and not hasattr(original_patch_lang, "_gradops_original"):
        import triton.language as tl

        interpreter._patch_lang = _patch_lang_once(original_patch_lang, (tl, tl.core))
    return True
