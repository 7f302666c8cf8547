"""Launch parameters of the Floyd attention kernels: the one place that chooses them.

Every kernel works on a 3-D tile of the score cube ``S[n, m, k]`` (docs/kernels-floyd.md).
Two sides of the tile are the program's output tile (``major`` x ``minor``) and stay in
registers; the third is the axis the program loops over, advanced by ``step``.
``block_d`` is the head dim rounded up to a power of two (at least 16, the smallest
contraction ``tl.dot`` accepts for 16-bit inputs in every Triton the project supports).

How the sizes are bounded (chosen by construction for an H100, not tuned on one: none was
available when they were written; tune them here, nowhere else):

- Registers. Every ``tl.dot`` here is batched (3-D), which Triton lowers to ``mma.sync``
  (m16n8k16) with the batch axis spread over warps. A program keeps, per element of its
  output tile times ``block_d``, one float32 accumulator and one or two 16-bit operands
  (the forward holds Q in both orientations; the backward kernels hold two accumulators
  and two operands), so ``major * minor * block_d`` is capped at REGISTER_ELEMENTS
  (16K forward: ~32K of the 64K 32-bit registers of an SM; 12K backward).
- Tensor-core shape. ``major`` is the M of the products that reduce into the output and
  ``minor`` the M of the others; an M below 16 pads the MMA, so the largest tile that
  fits is tried first, 16 x 8 (75 % of the MMA rows used) before 8 x 8 (50 %).
- Shared memory. Each loop step loads four operand tiles of ``major_or_minor * step *
  block_d`` elements that pass through shared memory on their way to the tensor cores;
  each is kept under OPERAND_BYTES (64 KiB) so the four fit in the 227 KiB of an H100 SM
  even if live together, and there is one stage (double buffering would not fit).
- The loop ``step`` is the contraction of the P @ V (and dS @ K) products, so it is >= 16;
  longer steps cut the loop overhead and the online-softmax rescales.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Dict

import triton

# The kernels: forward; backward dQ (also writes Dr = rowsum(dY*Y)); backward dK1/dV1;
# backward dK2/dV2.
KERNELS = ("fwd", "bwd_dq", "bwd_dk1", "bwd_dk2")

OPERAND_BYTES = 64 * 1024
REGISTER_ELEMENTS = {"fwd": 16 * 1024, "bwd_dq": 12 * 1024, "bwd_dk1": 12 * 1024, "bwd_dk2": 12 * 1024}
TILES = ((32, 16), (16, 16), (16, 8), (8, 8), (8, 4), (4, 4))  # (major, minor), best first
STEPS = (64, 32, 16)

# Manual overrides for tuning on a GPU, e.g. {"fwd": {"block_k": 32, "num_warps": 4}}: merged
# over the computed config. Also read (as JSON of the same form) from GRADOPS_FLOYD_CONFIG.
OVERRIDES: Dict[str, Dict[str, int]] = {}


@dataclass(frozen=True)
class FloydConfig:
    """Tile sizes for one kernel launch.

    ``block_n``, ``block_m``, ``block_k``: tile sides along N, M and the pivot K. The looped
    axis is K for "fwd" and "bwd_dq", M for "bwd_dk1", N for "bwd_dk2".
    ``block_d``: the head dim padded to a power of two (>= 16); lanes past D are masked.
    ``group``: how many consecutive tiles of the first output axis are walked before the
    second advances, so programs that run together share K1/V1 rows and K2/V2 columns in L2
    (the grouped ordering of the Triton matmul tutorial).
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


def _overrides(kernel: str) -> Dict[str, int]:
    merged: Dict[str, int] = {}
    env = os.environ.get("GRADOPS_FLOYD_CONFIG")
    if env:
        merged.update(json.loads(env).get(kernel, {}))
    merged.update(OVERRIDES.get(kernel, {}))
    return merged


def _tile(kernel: str, block_d: int, element_size: int):
    """(major, minor, step): the best tile within the bounds, else the smallest one."""
    for major, minor in TILES:
        if major * minor * block_d > REGISTER_ELEMENTS[kernel]:
            continue
        for step in STEPS:
            if major * step * block_d * element_size <= OPERAND_BYTES:
                return major, minor, step
    return TILES[-1][0], TILES[-1][1], STEPS[-1]


def floyd_config(kernel: str, head_dim: int, element_size: int = 2) -> FloydConfig:
    """The launch parameters of ``kernel`` (one of KERNELS) for head dim ``head_dim`` and
    inputs of ``element_size`` bytes."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown Floyd kernel {kernel!r}; expected one of {KERNELS}")
    block_d = padded_head_dim(head_dim)
    major, minor, step = _tile(kernel, block_d, element_size)
    # Which axis is which: the forward and dQ produce (n, m) tiles, where N is the M of the
    # K2/V2 products; dK1/dV1 produce (n, k) tiles and dK2/dV2 (k, m) tiles, where K is the
    # M of every product that reduces into them.
    if kernel in ("fwd", "bwd_dq"):
        sizes = dict(block_n=major, block_m=minor, block_k=step)
    elif kernel == "bwd_dk1":
        sizes = dict(block_n=minor, block_m=step, block_k=major)
    else:
        sizes = dict(block_n=step, block_m=minor, block_k=major)
    num_warps = 4 if major * minor * block_d <= 4 * 1024 else 8
    cfg = FloydConfig(**sizes, block_d=block_d, num_warps=num_warps, num_stages=1, group=8)
    return replace(cfg, **_overrides(kernel))
