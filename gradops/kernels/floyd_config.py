"""Launch parameters of the Floyd attention kernels: the one place that chooses them.

Every kernel works on a 3-D tile of the score cube ``S[n, m, k]`` (see
docs/kernels-floyd.md). Two tile sides are the program's output tile and stay in registers;
the third is the axis the program loops over. ``block_d`` is the head dim rounded up to a
power of two (at least 16, the smallest contraction ``tl.dot`` accepts for 16-bit inputs).

Why these sizes: the accumulator of a program is ``side_a * side_b * block_d`` float32
values, and every ``tl.dot`` here is batched (3-D), which Triton lowers to ``mma.sync``
with the batch axis spread over warps. Each of the three sides is also the M or N of one
of the batched products, so none may drop below 16. With 16 x 16 output tiles the
accumulator of a D=128 program is 32K floats (128 registers a thread at 8 warps), which is
the most an H100 SM holds for one program without spilling; smaller D leaves room for a
longer loop step, which halves the loop overhead and the online-softmax rescales.

These values are chosen by construction, not tuned on a GPU (none was available when they
were written): tune them here, nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

# The kernels: forward; backward dQ (also writes Dr = rowsum(dY*Y)); backward dK1/dV1;
# backward dK2/dV2.
KERNELS = ("fwd", "bwd_dq", "bwd_dk1", "bwd_dk2")


@dataclass(frozen=True)
class FloydConfig:
    """Tile sizes for one kernel launch.

    ``block_n``, ``block_m``, ``block_k``: tile sides along N, M and the pivot K; the looped
    axis is K for "fwd" and "bwd_dq", M for "bwd_dk1", N for "bwd_dk2".
    ``block_d``: the head dim padded to a power of two (>= 16); lanes past D are masked.
    ``group``: how many consecutive tiles of the first output axis share a column of
    programs, so programs that reuse the same K1/V1 rows and K2/V2 columns run together
    and find them in L2 (the matmul "grouped ordering").
    """

    block_n: int
    block_m: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    group: int


def padded_head_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(max(int(d), 1)))


def floyd_config(kernel: str, head_dim: int) -> FloydConfig:
    """The launch parameters of ``kernel`` (one of KERNELS) for head dim ``head_dim``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown Floyd kernel {kernel!r}; expected one of {KERNELS}")
    block_d = padded_head_dim(head_dim)
    # The looped side: as long as registers allow (see the module docstring).
    if block_d <= 32:
        step = 64
    elif block_d <= 64:
        step = 32
    else:
        step = 16
    num_warps = 4 if block_d <= 32 else 8
    num_stages = 2
    if kernel in ("fwd", "bwd_dq"):
        return FloydConfig(16, 16, step, block_d, num_warps, num_stages, group=8)
    if kernel == "bwd_dk1":
        return FloydConfig(16, step, 16, block_d, num_warps, num_stages, group=8)
    return FloydConfig(step, 16, 16, block_d, num_warps, num_stages, group=8)
