"""Float scalars as Triton kernel arguments, without losing float64 precision.

Triton types a Python float kernel argument as fp32 (``triton.runtime.jit.mangle_type(1e-5)
== "fp32"``), so a float64 kernel would compute with a rounded eps, scale or offset (the
interpreter keeps the Python float, so only a GPU shows it). A device tensor instead would
cost a synchronous host-to-device copy per call and could not be captured in a CUDA graph.
So the host passes the IEEE-754 bits of the float64 as an int64 (:func:`float64_bits`), and
the kernel bitcasts them back (:func:`unpack_float64`) and rounds once to its accumulator
dtype: exact for float64 kernels, the nearest float32 for the others (as a float32 op rounds
a Python float, and as the fp32 argument did).

A kernel taking such an argument lists it in ``do_not_specialize``: its bits are an ordinary
integer to the JIT, which would otherwise compile a variant per value (bits equal to 1, bits
divisible by 16).
"""
from __future__ import annotations

import struct

import triton
import triton.language as tl


def float64_bits(value: float) -> int:
    """``value`` as a kernel argument: the IEEE-754 bits of its float64, as a signed int64."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


@triton.jit
def unpack_float64(bits, ACC: tl.constexpr):
    """The float a :func:`float64_bits` argument carries, rounded to ``ACC``."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(ACC)
