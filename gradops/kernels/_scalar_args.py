"""Float scalars as Triton kernel arguments, without losing float64 precision.

Triton types a Python float kernel argument as fp32 (``triton.runtime.jit.mangle_type(1e-5)
== "fp32"``), so a float64 kernel would compute with a rounded eps, scale or offset (the
interpreter keeps the Python float, so only a GPU shows it). A device tensor instead would
cost a synchronous host-to-device copy per call and could not be captured in a CUDA graph.
So the host passes the IEEE-754 bits of the float64 as two int32 arguments, its high and low
words (:func:`float64_bits`), and the kernel joins and bitcasts them back
(:func:`unpack_float64`) and rounds once to its accumulator dtype: exact for float64 kernels,
the nearest float32 for the others (as a float32 op rounds a Python float, and as the fp32
argument did). Two int32 rather than one int64: Inductor (torch 2.11) cannot type an integer
argument of a user's Triton kernel past 2^31 (``'int' object has no attribute 'xreplace'`` in
``signature_of``, found on the GPU run of 2026-11-28), and the norm forwards are such kernels
under torch.compile (``_traceable``). The kernel side uses ``tl.cast``, not ``.to``: torch's
analysis of a traced kernel (``identify_mutated_tensors``) passes the scalars as Python ints.

A kernel taking such arguments lists both in ``do_not_specialize``: they are ordinary integers
to the JIT, which would otherwise compile a variant per value (equal to 1, divisible by 16).
"""
from __future__ import annotations

import struct
from typing import List, Tuple

import triton
import triton.language as tl


def word_args(*names: str) -> List[str]:
    """The kernel parameters that carry the floats ``names`` (``eps`` -> ``eps_high``,
    ``eps_low``): what a kernel lists in ``do_not_specialize``."""
    return [f"{name}_{word}" for name in names for word in ("high", "low")]


def float64_bits(value: float) -> Tuple[int, int]:
    """``value`` as two kernel arguments: the high and low words of its float64's IEEE-754
    bits, each a signed int32."""
    low, high = struct.unpack("<ii", struct.pack("<d", float(value)))
    return high, low


@triton.jit
def unpack_float64(high, low, ACC: tl.constexpr):
    """The float a :func:`float64_bits` pair carries, rounded to ``ACC``."""
    bits = (tl.cast(high, tl.int64) << 32) | (tl.cast(low, tl.int64) & 0xFFFFFFFF)
    return tl.cast(bits, tl.float64, bitcast=True).to(ACC)
