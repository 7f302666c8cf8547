"""Launch parameters of the Floyd attention kernels: the one place that chooses them.

Every kernel works on a 3-D tile of the score cube ``S[n, m, k]`` (docs/kernels-floyd.md).
Two sides of the tile are the program's output tile (``major`` x ``minor``) and stay in
registers; the third is the axis the program loops over, advanced by ``step``.
``block_d`` is the head dim rounded up to a power of two (at least 16, the smallest
contraction ``tl.dot`` accepts for 16-bit inputs in every Triton the project supports).

How the table below was chosen, without a GPU: each kernel was compiled ahead of time for
an H100 (``triton.compile(..., target=GPUTarget("cuda", 90, 32))``, Triton 3.9, the
signature specialised as the JIT does for contiguous tensors) and its shared memory and
register spills read from the cubin (``gradops bench floyd --compile-check`` repeats
this). The kept tile is the largest with no or few spills and at most ~192 KiB of shared
memory (an H100 SM has 227 KiB):

- shared memory is about the sum of the operand tiles a loop step feeds to ``tl.dot``
  (4 in the forward, up to 8 in a loop of the dQ kernel: its two loops over k reuse the
  same buffers), each ``side * step * block_d`` elements,
  so it grows with ``block_d`` and the element size; one pipeline stage, since double
  buffering would not fit;
- registers: every ``tl.dot`` here is batched (3-D) and lowers to ``mma.sync`` with the
  batch axis over warps; a program holds ``major * minor * block_d`` float32 accumulators
  plus 16-bit operands, so large ``block_d`` forces small output tiles (16 x 16 spills at
  ``block_d`` = 128; 8 x 8 pads the MMA rows to 16, which the tensor cores pay for);
- the loop step is the contraction of the ``P @ V`` and ``dS @ K`` products, so >= 16;
  steps of 32 spilled wherever 16 did not gain a tile size.

Wider elements are looked up by their byte width: float32 at D = 64 uses the bf16 row of
D = 128 (``width = block_d * element_size / 2``). The sizes are not tuned for speed on a
GPU (none was available): tune them here, nowhere else.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Dict, Tuple

import triton

# The kernel launches: forward; backward dQ (also writes Dr = sum_k P dP); backward dK1/dV1
# and backward dK2/dV2 (two launches of one kernel, mirror images of each other).
KERNELS = ("fwd", "bwd_dq", "bwd_dk1", "bwd_dk2")

# (major, minor, step) per kernel and width = block_d * element_size / 2, from the
# ahead-of-time compiles described above; widths past the table use its last entry.
TABLE: Dict[str, Dict[int, Tuple[int, int, int]]] = {
    "fwd": {32: (16, 16, 16), 64: (16, 16, 16), 128: (8, 8, 16), 256: (8, 4, 16), 512: (4, 4, 16)},
    "bwd_dq": {32: (16, 16, 16), 64: (8, 8, 16), 128: (8, 8, 16), 256: (4, 4, 16), 512: (2, 2, 16)},
    "bwd_dk1": {32: (16, 16, 16), 64: (16, 8, 16), 128: (8, 8, 16), 256: (4, 4, 16), 512: (2, 2, 16)},
    "bwd_dk2": {32: (16, 16, 16), 64: (16, 8, 16), 128: (8, 8, 16), 256: (4, 4, 16), 512: (2, 2, 16)},
}
NUM_WARPS = 8  # 4 warps spilled in every kernel at every tile the table keeps

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


def _tile(kernel: str, block_d: int, element_size: int) -> Tuple[int, int, int]:
    """(major, minor, step) for this kernel, head dim and element size."""
    width = block_d * element_size // 2
    rows = TABLE[kernel]
    for w in sorted(rows):
        if width <= w:
            return rows[w]
    return rows[max(rows)]


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
    cfg = FloydConfig(**sizes, block_d=block_d, num_warps=NUM_WARPS, num_stages=1, group=8)
    return replace(cfg, **_overrides(kernel))
