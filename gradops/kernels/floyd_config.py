"""Launch parameters of the Floyd attention kernels: the one place that chooses them.

Every kernel works on a 3-D tile of the score cube ``S[n, m, k]`` (see
docs/kernels-floyd.md). Two tile sides are the program's output tile and stay in registers;
the third is the axis the program loops over. ``block_d`` is the head dim rounded up to a
power of two (at least 16, the smallest contraction ``tl.dot`` accepts for 16-bit inputs).

Why these sizes: the accumulator of a program is ``side * side * block_d`` float32
values, and every ``tl.dot`` here is batched (3-D), which Triton lowers to ``mma.sync``
(m16n8k16) with the batch axis spread over warps; each tile side is the M or N of one of
the batched products, so sides below 16 pad the MMA and waste part of it. With 16 x 16
output tiles the accumulator of a D=128 program is 32K floats (128 registers a thread at 8
warps), about the most an H100 SM holds for one program. Each loop step loads four
operand tiles (K1, K2, V1, V2 slices of ``side * step * block_d`` elements) that pass
through shared memory on their way to the tensor cores; keeping each under 64 KiB keeps
all four under the 227 KiB of an H100 SM even if they are live together. Smaller D leaves
room for a longer loop step, which cuts the loop overhead and the online-softmax
rescales; wider elements (float32, float64) or D=256 shrink the tile instead.

These values are chosen by construction, not tuned on a GPU (none was available when they
were written): tune them here, nowhere else.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict

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


# Bounds every config respects (see the module docstring): one operand tile (e.g. K1 as
# [side, block_d, step]) at most OPERAND_BYTES, so the four a loop step loads fit in shared
# memory together; one accumulator (side * side * block_d float32) at most ACC_ELEMENTS.
OPERAND_BYTES = 64 * 1024
ACC_ELEMENTS = 32 * 1024
STEPS = (64, 32, 16)
SIDES = (16, 8, 4)

# Manual overrides for tuning on a GPU: {"fwd": {"block_k": 32, "num_warps": 4}, ...}, also
# read (as JSON) from the environment variable GRADOPS_FLOYD_CONFIG.
OVERRIDES: Dict[str, Dict[str, int]] = {}


def _overrides(kernel: str) -> Dict[str, int]:
    merged: Dict[str, int] = {}
    env = os.environ.get("GRADOPS_FLOYD_CONFIG")
    if env:
        merged.update(json.loads(env).get(kernel, {}))
    merged.update(OVERRIDES.get(kernel, {}))
    return merged


def floyd_config(kernel: str, head_dim: int, element_size: int = 2) -> FloydConfig:
    """The launch parameters of ``kernel`` (one of KERNELS) for head dim ``head_dim`` and
    inputs of ``element_size`` bytes."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown Floyd kernel {kernel!r}; expected one of {KERNELS}")
    block_d = padded_head_dim(head_dim)
    # The output tile is side x side; the looped axis advances by step. Both as large as the
    # operand and accumulator bounds allow, the loop step first (it only costs operand bytes).
    side, step = SIDES[-1], STEPS[-1]
    for side_try in SIDES:
        fits = [st for st in STEPS if side_try * st * block_d * element_size <= OPERAND_BYTES]
        if fits and side_try * side_try * block_d <= ACC_ELEMENTS:
            side, step = side_try, fits[0]
            break
    num_warps = 4 if side * side * block_d <= 8 * 1024 else 8
    # One stage: the operand tiles are too large to double-buffer in shared memory.
    num_stages = 1
    if kernel in ("fwd", "bwd_dq"):
        sizes = dict(block_n=side, block_m=side, block_k=step)
    elif kernel == "bwd_dk1":
        sizes = dict(block_n=side, block_m=step, block_k=side)
    else:
        sizes = dict(block_n=step, block_m=side, block_k=side)
    fields = dict(sizes, block_d=block_d, num_warps=num_warps, num_stages=num_stages, group=8)
    fields.update(_overrides(kernel))
    return FloydConfig(**fields)
