"""Launch parameters of the Floyd attention kernels, and which strategy runs a call: the one
place that chooses them (docs/kernels-floyd.md, "Strategies").

Two strategies implement the backend: ``"fused"`` (``floyd_attention.py``: flash-style
kernels over 3-D tiles of the score cube, configured by :func:`floyd_config` below) and
``"chunked"`` (``floyd_chunked.py``: the scores of a chunk of (n, m) rows built by batched
tensor-core GEMMs, the softmax and dS in Triton row kernels, configured by
:func:`chunk_plan` and :func:`row_config`). :func:`strategy` is the rule.

The fused kernels' tiles:

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
  steps of 32 spilled wherever 16 did not gain a tile size, except the forward at width 16
  (16-bit D <= 16), where 32 removes the 3 spill pairs that 16 left;
- where the rule (``strategy`` below) still gives a width to the fused kernels (16-bit
  D <= 64, float32 D <= 16), the kept tile is one without spills: hence dK1/dV1 at width 64
  takes 8x8 (16x8 spilled 3 pairs), its mirror dK2/dV2 keeps 16x8 (no spills), and dQ
  grows from 8x8 to 16x8 (no spills, 160 KiB; the 16-row side fills the m16 MMA rows);
  dK2/dV2 takes 16x8 at width 32 too: it transposes S and dP, which the other kernels do
  not (every pass sums a score's two products in one order, floyd_attention._pair_dot),
  and 16x16 spilled 4 pairs at float32 D = 16.

Wider elements are looked up by their byte width: float32 at D = 64 uses the bf16 row of
D = 128 (``width = block_d * element_size / 2``). The sizes are not tuned for speed on a
GPU (none was available): tune them here, nowhere else.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import triton

# The kernel launches: forward; backward dQ (also writes Dr = sum_k P dP); backward dK1/dV1
# and backward dK2/dV2 (two launches of one kernel, mirror images of each other).
KERNELS = ("fwd", "bwd_dq", "bwd_dk1", "bwd_dk2")

# (major, minor, step) per kernel and width = block_d * element_size / 2, from the
# ahead-of-time compiles described above; widths past the table use its last entry.
TABLE: Dict[str, Dict[int, Tuple[int, int, int]]] = {
    "fwd": {16: (16, 16, 32), 32: (16, 16, 16), 64: (16, 16, 16), 128: (8, 8, 16), 256: (8, 4, 16),
            512: (4, 4, 16)},
    "bwd_dq": {32: (16, 16, 16), 64: (16, 8, 16), 128: (8, 8, 16), 256: (4, 4, 16), 512: (2, 2, 16)},
    "bwd_dk1": {32: (16, 16, 16), 64: (8, 8, 16), 128: (8, 8, 16), 256: (4, 4, 16), 512: (2, 2, 16)},
    "bwd_dk2": {32: (16, 8, 16), 64: (16, 8, 16), 128: (8, 8, 16), 256: (4, 4, 16), 512: (2, 2, 16)},
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


# ----------------------------------------------------------------------------------------------
# The strategy rule
# ----------------------------------------------------------------------------------------------
STRATEGIES = ("fused", "chunked")
# Manual override for benchmarks and tests: "fused" or "chunked" forces that strategy for
# every call it can run (float64 always runs fused). Also read from GRADOPS_FLOYD_STRATEGY.
STRATEGY: Optional[str] = None

# The rule, from estimates (no GPU has measured either strategy; docs/kernels-floyd.md has
# the arithmetic). Widths as in the tile table (block_d * element_size / 2).
# - Past FUSED_MAX_WIDTH the fused kernels spill registers at every tile that fits shared
#   memory (the sm_90 compile check): chunked at any size. Float32 at D = 32 (width 64)
#   spills in the forward too, hence its own limit.
FUSED_MAX_WIDTH = {2: 64, 4: 32}
# - From CHUNKED_MIN_WIDTH on, the chunked GEMMs bring more FLOP per byte than the fused
#   tiles (an estimated HBM bound of ~80 TFLOP/s backward at D = 64 against 25-40 for the fused
#   kernels), once the problem is large enough that a chunk's ~20 launches are hidden behind
#   its GEMMs: CHUNKED_MIN_WORK units of B*H*N*M*K*D (about 1 GFLOP forward).
CHUNKED_MIN_WIDTH = 64
CHUNKED_MIN_WORK = 1 << 27


def forced_strategy() -> Optional[str]:
    """The strategy STRATEGY or GRADOPS_FLOYD_STRATEGY forces, or None (the rule decides)."""
    forced = os.environ.get("GRADOPS_FLOYD_STRATEGY") or None
    forced = STRATEGY if STRATEGY is not None else forced
    if forced is not None and forced not in STRATEGIES:
        raise ValueError(f"unknown Floyd strategy {forced!r}; expected one of {STRATEGIES}")
    return forced


FUSED_MAX_HEAD_DIM = {2: 256, 4: 256, 8: 128}  # past these no fused tile fits shared memory


def cublas_refuses_determinism() -> bool:
    """Whether torch would raise in a cuBLAS GEMM of this process: deterministic algorithms
    asked for (torch.use_deterministic_algorithms) without a deterministic cuBLAS workspace
    (CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8)."""
    return (torch.are_deterministic_algorithms_enabled()
            and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"))


def strategy(b: int, h: int, n: int, m: int, k: int, d: int, element_size: int, *, cuda: bool = False) -> str:
    """"fused" or "chunked" for a call of this shape and element size (bytes per input
    element), on a GPU when ``cuda``. Float64 (element size 8) is always "fused": the chunked
    path's GEMMs and row kernels are for the 16-bit and float32 inputs tensor cores and
    cuBLAS serve. On a GPU where torch would refuse cuBLAS for determinism
    (:func:`cublas_refuses_determinism`), the fused kernels (always deterministic) take what
    they can."""
    if element_size == 8:
        return "fused"
    forced = forced_strategy()
    if forced is not None:
        return forced
    if cuda and cublas_refuses_determinism() and d <= FUSED_MAX_HEAD_DIM[element_size]:
        return "fused"
    width = padded_head_dim(d) * element_size // 2
    if width > FUSED_MAX_WIDTH.get(element_size, 64):
        return "chunked"
    if width >= CHUNKED_MIN_WIDTH and b * h * n * m * k * d >= CHUNKED_MIN_WORK:
        return "chunked"
    return "fused"


# ----------------------------------------------------------------------------------------------
# The chunked strategy: chunk sizes and the row kernels' blocks
# ----------------------------------------------------------------------------------------------
# Workspace for one chunk's score-sized buffers (the backward's: S and dP, each as two
# float32 halves, and P and dS in the input dtype, each in an n-major and an m-major copy).
# Less when the device's free memory is short (``budget``).
CHUNK_BUDGET_BYTES = 256 << 20


def score_bytes(element_size: int) -> int:
    """Workspace bytes per score of a chunk: 4 float32 buffers and 4 in the input dtype."""
    return 16 + 4 * element_size


def chunk_budget(free_bytes: Optional[int]) -> int:
    """CHUNK_BUDGET_BYTES, or a quarter of ``free_bytes`` (the device's free memory) when that
    is smaller: the fp32 accumulators and the allocator's rounding need the rest."""
    if free_bytes is None:
        return CHUNK_BUDGET_BYTES
    return max(1, min(CHUNK_BUDGET_BYTES, free_bytes // 4))


@dataclass(frozen=True)
class ChunkPlan:
    """How the chunked strategy walks the score cube of one call: chunks of ``groups`` (b, h)
    slices x ``block_n`` rows of n x ``block_m`` rows of m, with every pivot. ``groups`` > 1
    only when whole slices fit (``block_n`` = N, ``block_m`` = M)."""

    groups: int
    block_n: int
    block_m: int

    def chunks(self, bh: int, n: int, m: int) -> Iterator[Tuple[int, int, int, int, List[Tuple[int, int]]]]:
        """``(g0, g1, m0, m1, [(n0, n1), ...])``: slices, then m outer, n inner (the order
        the chunked backward accumulates dK1/dV1 over m in)."""
        n_ranges = [(n0, min(n, n0 + self.block_n)) for n0 in range(0, n, self.block_n)]
        for g0 in range(0, bh, self.groups):
            for m0 in range(0, m, self.block_m):
                yield g0, min(bh, g0 + self.groups), m0, min(m, m0 + self.block_m), n_ranges


def _round_down_16(x: int) -> int:
    """Multiples of 16 keep the GEMMs' rows aligned to the tensor-core tiles."""
    return x - x % 16 if x >= 32 else x


def slice_bytes(n: int, m: int, k: int, d: int, element_size: int) -> int:
    """Workspace of one whole (b, h) slice taken as a chunk: its scores at ``score_bytes``,
    plus what grows with the head dim: float32 accumulators of dK1/dV1 and dK2/dV2, the
    float32 partial Y or dQ, and the copies of the m-batched operands (Q, dY, K2, V2)."""
    return (n * m * k * score_bytes(element_size) + 8 * (n + m) * k * d
            + n * m * d * (4 + 2 * element_size) + 2 * m * k * d * element_size)


def chunk_plan(bh: int, n: int, m: int, k: int, element_size: int, budget: Optional[int] = None,
               *, head_dim: int = 0) -> ChunkPlan:
    """The chunks of a call: as many scores per chunk as ``budget`` bytes (default
    CHUNK_BUDGET_BYTES) hold at ``score_bytes`` each, in (n, m) tiles as square as N and M
    allow (the rows of the n-batched GEMMs are m and those of the m-batched ones n: a thin
    chunk starves one of them); whole slices, as many as fit at ``slice_bytes`` each
    (``head_dim`` counts the bytes that grow with D), when one fits. The plan depends on the
    shape and budget alone, so a forward and its backward with the same budget walk the
    same chunks and their GEMMs compute bitwise the same scores."""
    budget = CHUNK_BUDGET_BYTES if budget is None else budget
    pairs = max(1, budget // score_bytes(element_size) // max(1, k))  # (n, m) rows per chunk
    if pairs >= n * m:
        per_slice = max(1, slice_bytes(n, m, k, head_dim, element_size))
        return ChunkPlan(max(1, min(bh, budget // per_slice)), n, m)
    cm = min(m, max(1, _round_down_16(math.isqrt(pairs))))
    cn = min(n, max(1, _round_down_16(pairs // cm)))
    if cn == n:  # N is short: the rest of the budget goes to M
        cm = min(m, max(1, _round_down_16(pairs // n)))
    return ChunkPlan(1, cn, cm)


# Scores a row-kernel program holds per step: 16 per thread at 4 warps. At 4096 (32 per
# thread) the float32 dS kernel spilled (253 registers, 8-30 spill pairs, sm_90 compile
# check) and the bf16 softmax at K = 1024 one pair; at 2048 neither spills (Triton 3.9 and
# 3.6, K from 16 to 4096), at 54-143 registers: three programs, 12 warps, per SM for these
# memory-bound kernels (8 warps and 4096 did not spill either, but fit one program per SM).
ROW_WARPS = 4
ROW_ELEMENTS = 2048


ROW_MAX_ROWS = 256  # 2048 x 1 tiles (K = 1) spilled: the per-row vectors grow with BLOCK_R


def row_config(k: int, block_m: int) -> Dict[str, int]:
    """Blocks of the chunked strategy's row kernels (softmax forward, dS backward): a
    program takes BLOCK_R consecutive m rows of one (slice, n) and walks the pivots BLOCK_K
    at a time, loading contiguous runs of the float32 score buffers."""
    block_k = min(triton.next_power_of_2(max(1, k)), 1024)
    block_r = max(1, min(triton.next_power_of_2(max(1, block_m)), ROW_ELEMENTS // block_k, ROW_MAX_ROWS))
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, num_warps=ROW_WARPS)
