"""Launch parameters of the Floyd attention kernels: the one place that chooses them
(docs/kernels-floyd.md, "Strategies"), and what the strategy rule (``floyd_strategy.py``)
may choose from (:func:`runnable`, the strategy forced for benchmarks and tests).

Three strategies implement the backend: ``"fused"`` (``floyd_attention.py``: flash-style
kernels over 3-D tiles of the score cube, configured by :func:`floyd_config` below),
``"chunked"`` (``floyd_chunked.py``: the scores of a chunk of (n, m) rows built by batched
tensor-core GEMMs, the softmax and dS in Triton row kernels, configured by
:func:`chunk_budget`, :func:`chunk_plan`, :func:`gemm_config` and :func:`row_config`) and
``"hybrid"`` (``floyd_hybrid.py``: the n-side half of each score on chip, the m-side half
through memory, configured by :func:`plan_rows` and :func:`hybrid_config`).

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
- where the rule (``floyd_strategy.strategy``) still gives a width to the fused kernels (16-bit
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

import functools
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, Optional, Tuple

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


def settings() -> tuple:
    """Every setting of this module that a call's launches depend on beside its shapes: the
    strategy forced, the halves' bits, the chunk budget, the tile overrides (each as set and as
    read from the environment). A plan made under other settings is remade
    (floyd_attention.Launches)."""
    env = os.environ.get
    return (STRATEGY, env("GRADOPS_FLOYD_STRATEGY"), HALF_BITS, env("GRADOPS_FLOYD_HALF_BITS"), CHUNK_BUDGET_BYTES,
            env("GRADOPS_FLOYD_CONFIG"), repr(OVERRIDES) if OVERRIDES else None)


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
# What the strategy rule (floyd_strategy.py) chooses from
# ----------------------------------------------------------------------------------------------
STRATEGIES = ("fused", "chunked", "hybrid")
# Manual override for benchmarks and tests: "fused" or "chunked" forces that strategy for
# every call it can run (float64 always runs fused). Also read from GRADOPS_FLOYD_STRATEGY.
STRATEGY: Optional[str] = None

# Widths as in the tile table (block_d * element_size / 2). Past FUSED_MAX_WIDTH the fused
# kernels spill registers at every tile that fits shared memory (the sm_90 compile check): the
# rule does not give them such a call. Float32 at D = 32 (width 64) spills in the forward too,
# hence its own limit.
FUSED_MAX_WIDTH = {2: 64, 4: 32}

# Forward + backward of two strategies measured in one run on an H100, which the rule would
# follow where they are both strategies of today (none yet: these are the fused kernels against
# the chunked strategy before issue 25, per-chunk bmm calls, which no longer exists;
# shared/gpu/h100-2026-11-25, bench/floyd.json and floyd-large.json; Triton 3.6, bf16).
# (B, H, N=M=K, D, element size): (fused ms, that chunked strategy's ms). The fused times are
# those a roofline of the fused kernels must stay under (tests/test_floyd_roofline.py).
MEASURED: Dict[Tuple[int, int, int, int, int], Tuple[float, float]] = {
    (1, 8, 512, 32, 2): (8.69 + 36.71, 76.15 + 90.76),
    (1, 8, 512, 64, 2): (12.86 + 83.20, 57.04 + 68.50),
    (1, 8, 512, 128, 2): (38.34 + 194.88, 38.88 + 80.10),
    (1, 4, 1024, 128, 2): (149.63 + 762.55, 159.22 + 274.71),
}


def forced_strategy() -> Optional[str]:
    """The strategy STRATEGY or GRADOPS_FLOYD_STRATEGY forces, or None (the rule decides)."""
    forced = os.environ.get("GRADOPS_FLOYD_STRATEGY") or None
    forced = STRATEGY if STRATEGY is not None else forced
    if forced is not None and forced not in STRATEGIES:
        raise ValueError(f"unknown Floyd strategy {forced!r}; expected one of {STRATEGIES}")
    return forced


FUSED_MAX_HEAD_DIM = {2: 256, 4: 256, 8: 128}  # past these no fused tile fits shared memory


def runnable(d: int, element_size: int) -> Tuple[str, ...]:
    """The strategies that can take a call of head dim ``d`` (16-bit or float32 inputs), in the
    order the rule prefers on a tie: the fused kernels up to FUSED_MAX_WIDTH (past it they
    spill), the hybrid one up to HYBRID_MAX_HEAD_DIM, the chunked one always."""
    width = padded_head_dim(d) * element_size // 2
    return tuple(name for name, fits in (("fused", width <= FUSED_MAX_WIDTH.get(element_size, 64)),
                                         ("hybrid", padded_head_dim(d) <= HYBRID_MAX_HEAD_DIM),
                                         ("chunked", True)) if fits)


# ----------------------------------------------------------------------------------------------
# The chunked strategy: the chunk budget, the chunks, the GEMM tiles and the row kernels' blocks
# ----------------------------------------------------------------------------------------------
# The workspace of one chunk (the backward's: S and dP in float32, P and dS in the input dtype,
# the float32 partial dQ) is at most the smaller of the device's total memory /
# CHUNK_MEMORY_DIVISOR (1.3 GiB on an H100, 81559 MiB) and the whole problem's workspace /
# CHUNK_PROBLEM_DIVISOR, and at least MIN_CHUNK_BUDGET_BYTES. Never the free memory at call
# time: a forward and its backward must walk the same chunks (bitwise the same scores). The
# two divisors trade memory for launches (7 or 14 per chunk, at about 124 us of host time each
# on the H200 of 2026-11-28: floyd_roofline.LAUNCH_SECONDS): on an H100, B = 1, H = 8,
# N = M = K = 512, D = 128 (bf16) takes 16 chunks of 384 or 128 rows of n, a peak of about
# 4.5 GiB with Y and the gradients, half of torch.compile(FloydNet)'s 9 GiB; N = M = K = 256
# takes 4 chunks of 2 slices (1.2 GiB against its 1.75: docs/kernels-floyd.md, "Roofline",
# says why not fewer bytes there).
#
# A small grid (N, M and K at most SMALL_GRID: FloydNet's training grids of 20-100 nodes, its
# graphs of tens to a hundred) is not divided: its workspace is small beside the memory a step
# holds anyway, and at these sizes a call's launches cost the host more than its kernels cost
# the GPU, so it takes one chunk wherever the device's share holds it (and the rule then
# prefers a strategy that launches each kernel once: floyd_strategy.py).
CHUNK_MEMORY_DIVISOR = 64
CHUNK_PROBLEM_DIVISOR = 3
MIN_CHUNK_BUDGET_BYTES = 64 << 20
SMALL_GRID = 128
# A budget that replaces the one above, for tests and benchmarks (bytes), or None.
CHUNK_BUDGET_BYTES: Optional[int] = None


def small_grid(n: int, m: int, k: int) -> bool:
    """Whether a call of N = ``n``, M = ``m``, K = ``k`` is a small grid (see SMALL_GRID)."""
    return max(n, m, k) <= SMALL_GRID


def score_bytes(element_size: int) -> int:
    """Workspace bytes per score of a chunk: S and dP in float32, P and dS in the input dtype
    (the backward's; the forward holds S and P)."""
    return 8 + 2 * element_size


def pair_bytes(k: int, d: int, element_size: int) -> int:
    """Workspace bytes per (n, m) row of a chunk: its K scores and its float32 partial Y or dQ."""
    return k * score_bytes(element_size) + 4 * d


@functools.lru_cache(maxsize=64)
def total_memory(device: torch.device) -> int:
    """The device's total memory in bytes (a CPU's: the machine's physical memory); asked once
    per device (every call plans with it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: assume a small machine
        return 8 << 30


def chunk_budget(device_total_bytes: int, problem_bytes: int, small: bool) -> int:
    """Bytes of workspace a chunk may take, on a device with this much memory, for a problem
    whose whole workspace (every (slice, n, m) row at ``pair_bytes``) is ``problem_bytes``
    (``small``: a small grid, :func:`small_grid`): CHUNK_BUDGET_BYTES when set, else
    :func:`device_budget`."""
    if CHUNK_BUDGET_BYTES is not None:
        return max(1, int(CHUNK_BUDGET_BYTES))
    return device_budget(device_total_bytes, problem_bytes, small)


def device_budget(device_total_bytes: int, problem_bytes: int, small: bool) -> int:
    """:func:`chunk_budget` without the CHUNK_BUDGET_BYTES override: what a device of this much
    memory plans with (the strategy rule's roofline plans with it): the smaller of
    ``device_total_bytes / CHUNK_MEMORY_DIVISOR`` and the problem's workspace (divided by
    CHUNK_PROBLEM_DIVISOR unless ``small``), at least MIN_CHUNK_BUDGET_BYTES."""
    share = problem_bytes if small else problem_bytes // CHUNK_PROBLEM_DIVISOR
    return max(MIN_CHUNK_BUDGET_BYTES, min(device_total_bytes // CHUNK_MEMORY_DIVISOR, share))


@dataclass(frozen=True)
class ChunkPlan:
    """How the chunked strategy walks the score cube of one call: chunks of ``groups`` (b, h)
    slices x ``block_n`` rows of n x ``block_m`` rows of m, with every pivot. ``groups`` > 1
    only when whole slices fit (``block_n`` = N, ``block_m`` = M); ``block_m`` < M only
    when not even 16 rows of n with every m fit."""

    groups: int
    block_n: int
    block_m: int

    def chunks(self, bh: int, n: int, m: int) -> Iterator[Tuple[int, int, int, int, int, int]]:
        """``(g0, g1, n0, n1, m0, m1)``: slices outermost, then n, then m (the order the
        backward's sums over chunks run in: dK1/dV1 over the m-chunks of an n range, dK2/dV2
        over the n ranges of a group of slices)."""
        for g0 in range(0, bh, self.groups):
            for n0 in range(0, n, self.block_n):
                for m0 in range(0, m, self.block_m):
                    yield g0, min(bh, g0 + self.groups), n0, min(n, n0 + self.block_n), m0, min(m, m0 + self.block_m)

    def count(self, bh: int, n: int, m: int) -> int:
        """How many chunks :meth:`chunks` walks."""
        return -(-bh // self.groups) * -(-n // self.block_n) * -(-m // self.block_m)


def _round_down_16(x: int) -> int:
    """Multiples of 16 keep the GEMMs' rows aligned to the tensor-core tiles."""
    return x - x % 16 if x >= 32 else x


def strategy_plan(name: str, bh: int, n: int, m: int, k: int, d: int, dtype: torch.dtype,
                  budget: Callable[[int], int]) -> ChunkPlan:
    """The chunks the memory strategy ``name`` ("hybrid" or "chunked") walks a call in: rows of
    its workspace (:func:`hybrid_pair_bytes` or :func:`pair_bytes`) as many as ``budget(the whole
    problem's workspace bytes)`` holds (:func:`plan_rows`). The launchers, the roofline and the
    rule's one-chunk test all plan here."""
    pair = hybrid_pair_bytes(k, d, dtype) if name == "hybrid" else pair_bytes(k, d, dtype.itemsize)
    return plan_rows(bh, n, m, pair, budget(bh * n * m * pair))


def chunk_plan(bh: int, n: int, m: int, k: int, element_size: int, budget: int, *, head_dim: int = 0) -> ChunkPlan:
    """The chunked strategy's chunks: :func:`plan_rows` at ``pair_bytes`` per (n, m) row."""
    return plan_rows(bh, n, m, pair_bytes(k, head_dim, element_size), budget)


def plan_rows(bh: int, n: int, m: int, pair: int, budget: int) -> ChunkPlan:
    """The chunks of a call: as many (n, m) rows per chunk as ``budget`` bytes hold at
    ``pair`` bytes each. Whole slices, as many as fit, when one fits; else rows of n with
    every m (dK1/dV1 then need no sum across chunks), as many as fit (a multiple of 16 from
    32 on); else (M * K alone too large) (n, m) tiles as square as N and M allow. A function
    of its arguments alone: a forward and its backward plan the same chunks, and their GEMMs
    compute bitwise the same scores."""
    pairs = max(1, budget // pair)  # (n, m) rows per chunk
    if pairs >= n * m:
        return ChunkPlan(max(1, min(bh, pairs // (n * m))), n, m)
    if pairs >= 16 * m:
        return ChunkPlan(1, min(n, _round_down_16(pairs // m)), m)
    cm = min(m, max(1, _round_down_16(math.isqrt(pairs))))
    cn = min(n, max(1, _round_down_16(pairs // cm)))
    if cn == n:  # N is short: the rest of the budget goes to M
        cm = min(m, max(1, _round_down_16(pairs // n)))
    return ChunkPlan(1, cn, cm)


# The chunked strategy's GEMM (floyd_chunked._gemm_kernel): output tiles of at most
# GEMM_BLOCK x GEMM_BLOCK, the contraction GEMM_STEP at a time. From sm_90 compiles
# (``gradops bench floyd --compile-check``, tests/test_bench_floyd.py), Triton 3.9: 16-bit
# operands at 128 x 128 x 64, 8 warps, 3 stages lower to wgmma (HGMMA) with 96 KiB of shared
# memory, 106-180 registers and no spills, accumulating variants included; float32 (IEEE
# products: FMA) at 64 x 64 x 16, 4 warps, 2 stages has no spills where 64 x 64 x 32 spilled
# in one variant. Not timed on a GPU yet: tune here.
GEMM_BLOCK = {2: 128, 4: 64}
GEMM_STEP = {2: 64, 4: 16}
GEMM_STAGES = {2: 3, 4: 1}


@functools.lru_cache(maxsize=1024)
def gemm_config(rows: int, cols: int, inner: int, element_size: int, split: bool = False) -> Dict[str, int]:
    """Blocks of one GEMM of the chunked strategy: ``rows`` x ``cols`` outputs per batch
    entry, ``inner`` the contraction, ``element_size`` the (16-bit) b operand's. A function of
    these alone, so that the same product of the forward and the backward is computed the same
    way, bitwise. ``split`` (a float32 a split in two halves: floyd_gemm's SPLIT) halves the
    contraction step: a step holds a's float32 tile and both halves, and at 32 x 64 x 32 that
    spilled 1-3 register pairs (sm_90 compile, 3-Floyd's dQ/dK1/dV1 launch at D = 64), none at
    a step of 16. Cached (a call launches 14 per chunk): read-only."""
    widest, step = GEMM_BLOCK[min(element_size, 4)], GEMM_STEP[min(element_size, 4)]
    block_r = min(widest, max(16, triton.next_power_of_2(rows)))
    block_c = min(widest, max(16, triton.next_power_of_2(cols)))
    block_t = min(step, max(16, triton.next_power_of_2(inner)))
    if split:
        block_t = max(16, block_t // 2)
    warps = 8 if block_r * block_c >= 128 * 128 else 4
    return dict(BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_T=block_t, num_warps=warps,
                num_stages=GEMM_STAGES[min(element_size, 4)])


# Scores a row-kernel program holds per step: 16 per thread at 4 warps. At 4096 (32 per
# thread) the float32 dS kernel spilled (253 registers, 8-30 spill pairs, sm_90 compile
# check) and the bf16 softmax at K = 1024 one pair; at 2048 neither spills (Triton 3.9 and
# 3.6, K from 16 to 4096), at 54-143 registers: three programs, 12 warps, per SM for these
# memory-bound kernels (8 warps and 4096 did not spill either, but fit one program per SM).
ROW_WARPS = 4
ROW_ELEMENTS = 2048
ROW_MAX_ROWS = 256  # 2048 x 1 tiles (K = 1) spilled: the per-row vectors grow with BLOCK_R
# No FMA contraction in the row kernels: P = 1 exactly for a single or dominant pivot rests on
# exp(S * scale - max) being exp(0), with max the rounded product. Contracted (Triton's
# default), the GPU computes fma(S, scale, -max), the product's rounding error, wherever no
# select stands between the product and the subtraction: at K = 1 (specialised to a constant,
# the pivot mask folds away) P was exp(error) / sum, not 1, and dQ, dK1, dK2 rounding noise
# (sm_90 PTX; the interpreter never contracts). These kernels are memory-bound: rounding each
# product costs no traffic.
ROW_FP_FUSION = False


@functools.lru_cache(maxsize=256)
def row_config(k: int) -> Dict[str, int]:
    """Blocks of the chunked strategy's row kernels (softmax forward, dS backward): a
    program takes BLOCK_R consecutive rows of a chunk's [rows, K] score buffers and walks
    the pivots BLOCK_K at a time. Rows of up to ROW_ELEMENTS pivots are one tile
    (ONE_TILE): each score is read once per pass; longer rows are read twice (the max and
    sum, or Dr, then P and dS). With the launch options (warps, no contraction)."""
    block_k = min(triton.next_power_of_2(max(1, k)), ROW_ELEMENTS)
    block_r = max(1, min(ROW_ELEMENTS // block_k, ROW_MAX_ROWS))
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, ONE_TILE=block_k >= k, num_warps=ROW_WARPS,
                enable_fp_fusion=ROW_FP_FUSION)


# ----------------------------------------------------------------------------------------------
# The hybrid strategy (floyd_hybrid.py): the m-side halves in memory, the row kernels' tiles
# ----------------------------------------------------------------------------------------------
# Bits an m-side half of a score (S2, dP2: float32 sums from the GEMMs) keeps in memory for
# 16-bit inputs: 24 (the default: the float32 rounded to nearest at 16 bits of mantissa, a
# relative error of at most 2^-16, 256 times finer than a bfloat16 input's; the worst of 5
# seeds 0.44x FloydNet eager's error, as with 32), 32 (the float32 sum itself, as exact as the
# chunked strategy) or, for bfloat16 inputs, 16 (a bfloat16: at 0.46-0.67x FloydNet eager's
# error; float16 inputs keep 24 then: a bfloat16 half has 3 bits less than their mantissa, and
# gave 2.4-4.4x FloydNet's error). Why 24 and not 32 by default: a 16-bit P or dS written over
# float32 halves lands on halves of other pivots, so the row kernels' second sweeps need a
# CTA-wide barrier per step, and Triton's software pipeliner leaves a loop with a barrier
# alone: every load of those sweeps then waits for memory at every step (the sm_90 compile
# check counts them). Over 24 or 16 bits P takes its own half's element: no barrier, every
# sweep pipelined, and 1 byte less per half and pass (docs/kernels-floyd.md, "Halves in
# memory"). Each format keeps float32's exponent range: no underflow without loss scaling.
# float32 inputs keep all 32 whatever is set. Also read from GRADOPS_FLOYD_HALF_BITS; a
# backward must run with its forward's setting.
HALF_BITS: Optional[int] = None
HALF_BITS_DEFAULT = 24


def half_bits(dtype: torch.dtype) -> int:
    """Bits of an m-side half in memory for inputs of ``dtype``: 32 for float32, else HALF_BITS
    (or GRADOPS_FLOYD_HALF_BITS), 24 unless set to 32 or 16 (24 for float16 inputs set to 16)."""
    if dtype == torch.float32:
        return 32
    bits = HALF_BITS if HALF_BITS is not None else int(os.environ.get("GRADOPS_FLOYD_HALF_BITS") or HALF_BITS_DEFAULT)
    if bits not in (16, 24, 32):
        raise ValueError(f"GRADOPS_FLOYD_HALF_BITS / floyd_config.HALF_BITS must be 16, 24 or 32, got {bits}")
    return 24 if bits == 16 and dtype == torch.float16 else bits


def hybrid_pair_bytes(k: int, d: int, dtype: torch.dtype) -> int:
    """Workspace bytes per (n, m) row of a hybrid chunk (the backward's): its two m-side halves
    (S2, dP2; P and dS are written over them) and its float32 partial dQ1."""
    return 2 * k * half_bits(dtype) // 8 + 4 * d


# The row kernels' tiles (floyd_hybrid._rows_forward / _rows_backward), per padded head dim and
# element size: (BLOCK_M rows of m per program, BLOCK_K pivots per step, warps). The same for
# both kernels: a score's n-side product is the same dot in every sweep of both, so the
# backward recomputes the forward's scores bitwise. Chosen from sm_90 compiles (``gradops
# bench floyd --compile-check``): the largest tile whose backward compiles without spills.
HYBRID_TILES: Dict[int, Dict[int, Tuple[int, int, int]]] = {
    2: {16: (64, 64, 4), 32: (64, 64, 4), 64: (128, 64, 8), 128: (128, 32, 8), 256: (64, 16, 8)},
    4: {16: (32, 32, 4), 32: (32, 32, 4), 64: (32, 32, 8), 128: (64, 16, 8), 256: (16, 16, 8)},
}
HYBRID_MAX_HEAD_DIM = 256  # past it the chunked strategy takes the call
# Stages of the row kernels' tl.range loops (and their launch's num_stages): every load of a
# step issued STAGES - 1 steps ahead (docs/kernels-floyd.md, "Pipelining").
HYBRID_STAGES = 3


@functools.lru_cache(maxsize=64)
def hybrid_config(d: int, dtype: torch.dtype) -> Dict[str, int]:
    """The hybrid row kernels' constexprs and launch options for head dim ``d`` and inputs of
    ``dtype`` (16-bit or float32), without FMA contraction (ROW_FP_FUSION)."""
    block_d = padded_head_dim(d)
    if block_d > HYBRID_MAX_HEAD_DIM:
        raise ValueError(f"the hybrid strategy takes head dims up to {HYBRID_MAX_HEAD_DIM}, got {d}")
    block_m, block_k, warps = HYBRID_TILES[min(dtype.itemsize, 4)][block_d]
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d, STAGES=HYBRID_STAGES, num_warps=warps,
                num_stages=HYBRID_STAGES, enable_fp_fusion=ROW_FP_FUSION)
