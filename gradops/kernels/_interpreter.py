"""The Triton interpreter (how the kernels run on CPU tensors, with TRITON_INTERPRET=1) made
to work with the NumPy beside it, and (:func:`round_bfloat16_to_nearest`) to round float32 to
bfloat16 as a GPU does.

Triton 3.6's interpreter turns a scalar kernel argument into a Python index with
``int(array)`` of its one-element array (``range(0, tiles_per_program)`` in a kernel does
that), which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
scalars"): every kernel with a loop bound taken from an argument then fails. Triton 3.9 takes
the element itself. Where this Triton's interpreter fails so, ``fix()`` replaces that one
conversion with the element's; nothing else of the interpreter changes. Compiled kernels (a
GPU) never go through it.
"""
from __future__ import annotations

import numpy as np

# Why the fix was applied (None: it was not needed), for `gradops info`.
APPLIED: "str | None" = None


class _Recorder:
    """A stand-in for the interpreter's patch scope: records what it would set."""

    def __init__(self):
        self.attrs = {}

    def set_attr(self, obj, name, value):
        self.attrs[name] = value


def _scalar_index_fails(patch_lang_tensor) -> bool:
    scope = _Recorder()
    patch_lang_tensor(type("Tensor", (), {}), scope)
    index = scope.attrs.get("__index__")
    if index is None:
        return False
    scalar = type("Scalar", (), {"handle": type("Handle", (), {"data": np.ones(1, dtype=np.int32)})()})()
    try:
        index(scalar)
    except TypeError:
        return True
    return False


def fix() -> None:
    global APPLIED
    from triton.runtime import interpreter

    patch_lang_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_lang_tensor is None or getattr(patch_lang_tensor, "_gradops_fixed", False):
        return
    try:
        needed = _scalar_index_fails(patch_lang_tensor)
    except Exception:  # an interpreter of another shape (a private function): leave it as it is
        return
    if not needed:
        return

    def element_index(self):
        data = self.handle.data
        return int(data.reshape(-1)[0]) if data.size == 1 else int(data)

    def fixed(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", element_index)

    fixed._gradops_fixed = True
    interpreter._patch_lang_tensor = fixed
    import triton

    APPLIED = (f"the interpreter of triton {triton.__version__} converts scalars with int() of a one-element "
               f"array, which NumPy {np.__version__} refuses: gradops takes the element instead")


def float32_to_bfloat16_rne(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bits of float32 ``values`` rounded to nearest, ties to even (a GPU's
    ``cvt.rn.bf16.f32``, and torch's), a NaN kept a (quiet) NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # a carry moves into the exponent
    nan = np.isnan(values)
    out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def round_bfloat16_to_nearest():
    """Make the interpreter's float32 -> bfloat16 conversion round to nearest even, where Triton
    3.x's interpreter drops the low 16 bits (round toward zero: twice the worst error of a
    GPU's conversion, and biased); every other cast is left as it is. Returns a function that
    undoes it, a no-op one where it was already done, or None where this interpreter is not
    of the shape this knows (its own truncation stays)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or handle is None:
        return None
    if getattr(original, "_gradops_rne", False):
        return lambda: None

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(float32_to_bfloat16_rne(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._gradops_rne = True
    builder.cast_impl = cast_impl

    def undo():
        builder.cast_impl = original

    return undo
