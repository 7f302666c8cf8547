"""What both Floyd attention strategies share (the fused kernels, ``floyd_attention.py``, and
the chunked GEMM path, ``floyd_chunked.py``): the masked score, the accumulation dtypes, the
scale as a kernel argument, the mask as bytes."""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

FLT_MAX = 3.4028234663852886e38  # the masked score is -FLT_MAX, as CANN writes it
_NEG_FLT_MAX = tl.constexpr(-FLT_MAX)  # kernels may only read globals that are constexpr

# Accumulation dtype per input dtype: float32, or float64 for float64 inputs.
_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
        torch.float64: torch.float64}
_TL = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _unpack_scale(bits, ACC: tl.constexpr):
    """The scale, from the IEEE-754 bits of the caller's float64 (see ``_scale_bits``): exact
    for float64 kernels, rounded to nearest float32 for the others (as the reference's
    float32 multiply rounds a Python float)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(ACC)


def _scale_bits(scale: float) -> int:
    """``scale`` as the kernels take it: the IEEE-754 bits of the float64, as a signed int64
    (``_unpack_scale`` bitcasts them back). A float kernel argument would be rounded to
    float32 on the way in, wrong for float64 inputs; a device tensor (as before) costs a
    synchronous host-to-device copy per call and cannot be captured in a CUDA graph."""
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _mask_arg(mask, like: torch.Tensor):
    """(pointer tensor, strides b/n/k, has_mask) for the kernels; bool is read as bytes."""
    if mask is None:
        return like, (0, 0, 0), False
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask, (mask.stride(0), mask.stride(2), mask.stride(4)), True
