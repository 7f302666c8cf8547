"""What both Floyd attention strategies share (the fused kernels, ``floyd_attention.py``, and
the chunked GEMM path, ``floyd_chunked.py``): the masked score, the accumulation dtypes, the
scale as a kernel argument, the mask as bytes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._scalar_args import float64_bits, unpack_float64, word_args

FLT_MAX = 3.4028234663852886e38  # the masked score is -FLT_MAX, as CANN writes it
_NEG_FLT_MAX = tl.constexpr(-FLT_MAX)  # kernels may only read globals that are constexpr

# Accumulation dtype per input dtype: float32, or float64 for float64 inputs.
_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
        torch.float64: torch.float64}
_TL = {torch.float32: tl.float32, torch.float64: tl.float64}


# The scale reaches the kernels as the bits of its float64 (a float kernel argument would be
# float32, wrong for float64 inputs): the shared helpers, under the names the Floyd kernels use.
_scale_bits = float64_bits
_unpack_scale = unpack_float64
# The kernels' two arguments that carry it (its high and low words), never specialised by the JIT.
SCALE_ARGS = word_args("scale")


def dot_constexprs(dtype: torch.dtype, device: torch.device) -> dict:
    """The ``tl.dot`` constexprs every Floyd kernel takes for inputs of ``dtype`` on ``device``:
    IEEE products for float32 and float64 (TF32 would lose ~3 decimal digits the reference
    keeps; 16-bit products are exact in float32 anyway), and UPCAST where the kernels run in
    the Triton interpreter, whose bfloat16 tl.dot is wrong (triton#11584): there bfloat16
    tiles are widened to float32 as they are loaded."""
    precision = "ieee" if dtype in (torch.float32, torch.float64) else "tf32"
    return dict(PRECISION=precision, UPCAST=dtype == torch.bfloat16 and device.type == "cpu")


def _mask_arg(mask, like: torch.Tensor):
    """(pointer tensor, strides b/n/k, has_mask) for the kernels; bool is read as bytes."""
    if mask is None:
        return like, (0, 0, 0), False
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask, (mask.stride(0), mask.stride(2), mask.stride(4)), True


@triton.jit
def tile_max(s):
    """The row max of a [rows, pivots] tile, NaN where a score is NaN, as torch.amax (the
    reference) gives it: tl.max skips NaN (maxnum when compiled, nanmax in the interpreter)."""
    row_max = tl.max(s, axis=1)
    return tl.where(tl.max((s != s).to(tl.int32), axis=1) != 0, float("nan"), row_max)
