"""Launch parameters of the norm kernels (LayerNorm, RMSNorm), chosen from the shape.

This is the one place that decides block widths, rows per tile, warps, grid sizes, software
pipeline depth and register caps for ``gradops.kernels.layer_norm`` and
``gradops.kernels.rms_norm``; the kernels themselves contain no tuning constants.

Two regimes per direction, split at ``max_fused_n(device, kind)``:

* **fused rows** (N <= max_fused_n): a tile of ``block_m`` whole rows lives in registers,
  so each element is read from memory exactly once. Both directions run on a *persistent*
  grid (programs per SM chosen from the register budget of the tile's width); every
  program loops over row tiles, and the loop is software pipelined (``num_stages``): the
  next tiles' loads are in flight, through shared memory (cp.async), while the current
  tile is reduced. The backward keeps its dgamma/dbeta partial sums in registers and
  writes one float32 partial row per program.
* **split rows** (N > max_fused_n): a row does not fit in registers without spilling, so
  the work is split: the forward takes one row per program in two passes (the second from
  L2), the backward a row-sums kernel and a column-tiled kernel whose programs each walk
  every row of their columns, writing dx and finishing dweight/dbias: two launches at any
  width and row count, never a loop of launches in Python.
  See docs/kernels-norm.md for the byte cost.

On the CPU (Triton interpreter) every program runs sequentially in Python, so the limits
are chosen small: the point there is correctness, not speed.

Every GPU figure below comes from ahead-of-time sm_90 compiles (ptxas register and spill
reports, Triton's shared-memory size; tests/test_kernels_norm.py checks them), not from a
GPU run: the budgets are what the compiles fit in, the choices between them still need
measuring (docs/kernels-norm.md, "On a GPU").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

# Widest row the backward keeps whole in registers. x and dy of a 16384-wide row need 32
# warps (1024 threads, at most 64 registers each): ptxas spills 108-196 bytes there, so the
# limit stays at 8192 (16 warps, ~115 registers, no spills).
GPU_MAX_FUSED_N = 8192
# The forward holds one tensor (x) per row, plus weight and bias loaded once per persistent
# program: 16384 over 32 warps compiles to 64 registers and no spills with a 3-stage
# pipeline; 32768 spills (36-232 bytes) even unpipelined, so wider rows take two passes.
GPU_MAX_FUSED_FWD_N = 16384
# Elements per register tile of the narrow-row kernels: 4096 over 8 warps is 16 values per
# thread per tensor. Wider rows take one row per tile (warps grow with the row, up to 32).
GPU_TILE_ELEMS = 4096
GPU_MAX_WARPS = 32
# Register budget per thread: ptxas is capped here (``maxnreg``) and the programs per SM
# follow from it (65536 registers per SM). The backward at 8 warps fits in 128 (2 programs
# per SM, one's reductions overlapping the other's loads); the forward in 64.
REGS_PER_SM = 65536
GPU_BWD_MAX_REGS = 128
GPU_FWD_MAX_REGS = 64
# The LayerNorm forward with the fused residual spills 4-8 bytes at 64 with Triton 3.6
# (none at 72); at 32 warps the cap stays 64, where it fits.
GPU_FWD_RES_MAX_REGS = 72
GPU_MAX_PROGRAMS_PER_SM = 4
# Shared memory the pipelined loads may take per SM (sm_90: 228 KB, 227 KB per block),
# leaving room for reduction scratch; split between the programs of an SM.
GPU_SMEM_BUDGET = 200 * 1024
# Deepest software pipeline: stages - 1 tiles in flight ahead of the one being reduced.
GPU_MAX_STAGES = 3
# Column block of the one-row-per-program kernels (the wide forward, the row sums).
GPU_SPLIT_BLOCK_N = 2048
# Narrowest column block of a column-tiled program that walks every row (the split
# backward): 32 bf16 values are 64 bytes of a row, two full 32-byte sectors.
GPU_MIN_COLUMN_BLOCK = 32

# The interpreter runs programs one after another; small limits keep tests quick while
# still taking every code path (the tests lower ``max_fused_n`` further to force the split
# path at small widths).
CPU_MAX_FUSED_N = 1024
CPU_TILE_ELEMS = 1024
CPU_PROGRAMS = 3
CPU_SPLIT_BLOCK_N = 64

# Tests may set this to force the split-row path at small widths (None = the default).
MAX_FUSED_N_OVERRIDE = None


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _on_gpu(device: torch.device) -> bool:
    return (device if isinstance(device, torch.device) else torch.device(device)).type == "cuda"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_PROGRAMS
    return _sm_count(_index(device))


def max_fused_n(device: torch.device, kind: str = "bwd") -> int:
    """Widest row kept whole in registers: ``kind`` "bwd" (x and dy) or "fwd" (x only)."""
    if MAX_FUSED_N_OVERRIDE is not None:
        return int(MAX_FUSED_N_OVERRIDE)
    if not _on_gpu(device):
        return CPU_MAX_FUSED_N
    return GPU_MAX_FUSED_FWD_N if kind == "fwd" else GPU_MAX_FUSED_N


def _warps_for(tile_elems: int) -> int:
    # ~16 elements per thread per tensor: 8 warps for 4K elements, 16 for 8K, 32 beyond.
    return max(1, min(GPU_MAX_WARPS, next_pow2(tile_elems) // 512))


def _stages(tile_elems: int, elem_bytes: int, streams: int, programs_per_sm: int) -> int:
    """Pipeline depth whose buffers (stages - 1 tiles of every streamed tensor) fit the
    shared-memory budget of one program."""
    stage_bytes = max(1, tile_elems * elem_bytes * streams)
    fit = 1 + (GPU_SMEM_BUDGET // programs_per_sm) // stage_bytes
    return max(1, min(GPU_MAX_STAGES, fit))


def fp_fusion(kind: str) -> bool:
    """Whether the kernels of ``kind`` ("fwd", "bwd") may contract ``a * b + c`` into one FMA,
    Triton's default.

    The backwards may not. Their dx is a difference of products, ``g - c2 - xhat * c1`` with
    ``g = w * dy`` and ``c2`` the row mean of the rounded g: contracted, the GPU computes
    ``fma(w, dy, -c2)``, whose unrounded product no longer cancels the rounded one in c2, so
    LayerNorm's dx at width 1 (where it must be exactly 0) becomes rstd times a rounding error
    (1.5e-5 at eps = 1e-5 on an H100; AscendC's pd_x at H = 1 likewise). Without contraction
    every product is rounded as the formulas (and the reference) write it. What the separate
    multiply and add cost in time is not measured on a GPU yet (the H100 run of 2026-11-25
    profiled the fused LayerNorm and RMSNorm backwards with contraction: 87-88 % of peak DRAM
    throughput at bf16 32768x4096); the sm_90 compile test shows they still fit their
    register budgets without spills.

    The forwards may: no exact result of theirs rests on a rounded product (a constant row
    centres to exact zeros before any multiply, so y = bias and the variance is 0 either
    way), and without contraction the LayerNorm forward at 8192 columns spills under Triton
    3.6's ptxas."""
    return kind == "fwd"


def launch_options(num_warps: int, maxnreg, kind: str) -> dict:
    """Options of a norm kernel launch: warps, the register cap the programs-per-SM count
    assumes, and :func:`fp_fusion` (the interpreter ignores all three)."""
    opts = dict(num_warps=num_warps, enable_fp_fusion=fp_fusion(kind))
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    return opts


@dataclass(frozen=True)
class FusedConfig:
    """Whole rows in registers: tiles of ``block_m`` x ``block_n`` (block_n >= N)."""
    block_m: int
    block_n: int
    num_warps: int
    num_tiles: int
    grid: int  # persistent programs
    tiles_per_program: int  # loop trip count of a persistent program (last ones mask the tail)
    num_stages: int = 1  # software pipeline depth of the tile loop
    maxnreg: int | None = None  # ptxas register cap (None on the CPU)
    kind: str = "bwd"  # of the kernels it launches: "fwd" or "bwd"

    def __post_init__(self):
        object.__setattr__(self, "_launch", launch_options(self.num_warps, self.maxnreg, self.kind))

    def launch(self) -> dict:
        return self._launch

    def for_rows(self, m) -> "FusedConfig":
        """This tile for ``m`` rows given as a symbol (``torch.SymInt``, see ``SYMBOLIC_ROWS``):
        the loop counts computed from it, with no guard on its value."""
        num_tiles = (m + self.block_m - 1) // self.block_m
        grid = torch.sym_min(num_tiles, self.grid)
        return replace(self, num_tiles=num_tiles, grid=grid, tiles_per_program=(num_tiles + grid - 1) // grid)


# A call traced under torch.compile with dynamic shapes knows its row count only as a symbol
# (the GPU run of 2026-11-28: an lru_cache of configs cannot hash it). Its tile and launch
# options are those of this many rows, where they depend on N alone, and its loop counts follow
# the symbol (``FusedConfig.for_rows``): one compiled graph serves every M, with no guard on M.
SYMBOLIC_ROWS = 1 << 20


def config_rows(m) -> int:
    """``m``, or ``SYMBOLIC_ROWS`` for a symbolic row count."""
    return m if isinstance(m, int) else SYMBOLIC_ROWS


@dataclass(frozen=True)
class SplitConfig:
    """Rows wider than a register tile, in column blocks."""
    block_n: int        # columns per program of the column-tiled kernels
    block_m: int        # rows per step of the column-tiled kernels
    num_warps: int
    col_blocks: int
    row_groups: int     # programs along the rows in the column-tiled kernels
    row_tiles: int      # tiles of block_m rows
    tiles_per_group: int  # loop trip count of a row group (the last ones mask the tail)
    row_num_warps: int  # warps of the one-row-per-program kernels (row sums, the wide forward)
    row_block_n: int    # columns per step of the one-row-per-program kernels
    num_stages: int = 1
    maxnreg: int | None = None
    row_segments: int = 1  # programs per row of the row-sums kernel (column segments)
    segment_blocks: int = 1  # column blocks (of row_block_n) per segment
    kind: str = "bwd"  # of the kernels it launches: "fwd" or "bwd"

    def __post_init__(self):
        object.__setattr__(self, "_launch", launch_options(self.num_warps, self.maxnreg, self.kind))
        object.__setattr__(self, "_row_launch", launch_options(self.row_num_warps, None, self.kind))

    def launch(self) -> dict:
        """Options of the column-tiled kernels."""
        return self._launch

    def row_launch(self) -> dict:
        """Options of the one-row-per-program kernels (row sums, the wide forward)."""
        return self._row_launch


@dataclass(frozen=True)
class ReduceConfig:
    block_r: int
    block_n: int
    num_warps: int
    grid: int

    def __post_init__(self):  # the backwards' dweight/dbias sums
        object.__setattr__(self, "_launch", launch_options(self.num_warps, None, "bwd"))

    def launch(self) -> dict:
        return self._launch


def is_fused(n: int, device, kind: str = "bwd") -> bool:
    return n <= max_fused_n(device, kind)


@lru_cache(maxsize=4096)  # decided once per signature, not per call
def fused_config(m: int, n: int, device, *, persistent: bool = True, kind: str = "bwd",
                 elem_bytes: int = 2, streams: int = 2) -> FusedConfig:
    """``kind``: "bwd" (the norm backward: x and dy held), "fwd" (x held). ``streams``: the
    row-sized tensors the tile loop loads (their bytes fill the pipeline's buffers).
    ``persistent=False``: one program per tile, no loop (the AscendC kernels), in a tile that
    does not depend on ``m``: a row's reductions then run in the same order whatever rows come
    with it, so the AscendC kernel API, which calls the kernel once per tiling step, gives the
    rows the bits the whole-tensor call gives them."""
    gpu = _on_gpu(device)
    block_n = max(16, next_pow2(n))
    tile = GPU_TILE_ELEMS if gpu else CPU_TILE_ELEMS
    # Narrow rows are stacked so that every tile carries about `tile` elements; never more
    # rows than there are (the tail tile is masked), except where the tile must not depend on m.
    block_m = max(1, min(tile // block_n, next_pow2(max(m, 1)) if persistent else tile, 128))
    num_tiles = -(-m // block_m)
    if not gpu:
        grid = max(1, min(num_tiles, CPU_PROGRAMS)) if persistent else max(1, num_tiles)
        return FusedConfig(block_m, block_n, 1, num_tiles, grid, -(-num_tiles // grid), kind=kind)
    num_warps = _warps_for(block_m * block_n)
    if not persistent:
        return FusedConfig(block_m, block_n, num_warps, num_tiles, max(1, num_tiles), 1, kind=kind)
    if elem_bytes > 4:
        # float64 (no speed goal): twice the registers per value would spill under the caps
        # below, so it keeps the compiler's own register choice, one program per SM and a
        # plain loop
        regs, stages, per_sm = None, 1, 1
    else:
        regs = GPU_BWD_MAX_REGS
        if kind == "fwd":
            regs = GPU_FWD_RES_MAX_REGS if streams > 1 else GPU_FWD_MAX_REGS
        regs = min(regs, REGS_PER_SM // (32 * num_warps))  # one program must fit
        per_sm = max(1, min(GPU_MAX_PROGRAMS_PER_SM, REGS_PER_SM // (regs * 32 * num_warps)))
        stages = _stages(block_m * block_n, elem_bytes, streams, per_sm)
    grid = max(1, min(num_tiles, sm_count(device) * per_sm))
    return FusedConfig(block_m, block_n, num_warps, num_tiles, grid, -(-num_tiles // grid), stages, regs, kind)


@lru_cache(maxsize=4096)  # decided once per signature, not per call
def split_config(m: int, n: int, device, *, elem_bytes: int = 2, streams: int = 2,
                 whole_columns: bool = False, kind: str = "bwd") -> SplitConfig:
    """Rows wider than a register tile. ``whole_columns``: every column-tiled program walks
    all ``m`` rows (``row_groups`` 1), so it finishes its columns' sums itself and no
    partial rows are left to reduce (the norm backwards' split path: one launch for the row
    sums, one for dx and dweight/dbias); the column block then narrows until the column
    programs alone fill the device. Else the rows are shared between row groups as well
    (LayerNormGradBeta, AscendC LayerNormGrad). ``kind``: of the kernels launched, "fwd"
    (the wide forward) or "bwd"."""
    gpu = _on_gpu(device)
    row_block_n = min(GPU_SPLIT_BLOCK_N if gpu else CPU_SPLIT_BLOCK_N, max(16, next_pow2(n)))
    tile = GPU_TILE_ELEMS if gpu else CPU_TILE_ELEMS
    if gpu:
        per_sm = max(1, min(GPU_MAX_PROGRAMS_PER_SM, REGS_PER_SM // (GPU_BWD_MAX_REGS * 32 * _warps_for(tile))))
        target = sm_count(device) * per_sm  # one wave of column-tiled programs
    else:
        per_sm, target = 1, sm_count(device) * 4
    block_n = row_block_n
    if whole_columns and gpu:
        # columns per program so that there are between target / 2 and target programs
        block_n = max(GPU_MIN_COLUMN_BLOCK, min(row_block_n, next_pow2(-(-n // target))))
    block_m = max(1, min(tile // block_n, next_pow2(max(m, 1))))
    col_blocks = -(-n // block_n)
    if gpu:
        num_warps = _warps_for(block_m * block_n)
        stages = _stages(block_m * block_n, elem_bytes, streams, per_sm)
        maxnreg = GPU_BWD_MAX_REGS
        if elem_bytes > 4:  # float64: as in fused_config
            stages, maxnreg = 1, None
    else:
        num_warps, stages, maxnreg = 1, 1, None
    # Enough (row group x column block) programs to fill every SM, but no more row groups
    # than row tiles: each row group writes one float32 partial row.
    row_tiles = -(-max(m, 1) // block_m)
    row_groups = 1 if whole_columns else max(1, min(row_tiles, -(-target // col_blocks)))
    # one-row-per-program kernels: 8 values per thread per tensor (at 16, 4 warps for 2048
    # columns, Triton 3.6 spills 8 bytes in the LayerNorm forward with the residual)
    row_num_warps = min(GPU_MAX_WARPS, 2 * _warps_for(row_block_n)) if gpu else 1
    # The row-sums kernel splits each row into column segments (their sums are added in a
    # fixed order by the column-tiled kernel) so that few wide rows still put programs on
    # every SM: one program per row would leave most SMs idle at 64K columns.
    # (on the CPU two segments per row, to take that path in the tests)
    row_col_blocks = -(-n // row_block_n)
    row_programs = sm_count(device) * 2 * GPU_MAX_PROGRAMS_PER_SM if gpu else 2 * max(m, 1)
    segments = max(1, min(row_col_blocks, -(-row_programs // max(m, 1))))
    segment_blocks = -(-row_col_blocks // segments)
    segments = -(-row_col_blocks // segment_blocks)
    return SplitConfig(block_n, block_m, num_warps, col_blocks, row_groups, row_tiles,
                       -(-row_tiles // row_groups), row_num_warps, row_block_n, stages, maxnreg,
                       segments, segment_blocks, kind)


@lru_cache(maxsize=4096)  # decided once per signature, not per call
def reduce_config(rows: int, n: int, device) -> ReduceConfig:
    """Column sums of a ``[rows, n]`` float partial buffer, one program per column block."""
    gpu = _on_gpu(device)
    block_n = min(256 if gpu else 128, max(16, next_pow2(n)))
    block_r = min(32 if gpu else 8, next_pow2(max(rows, 1)))
    num_warps = 4 if gpu else 1
    return ReduceConfig(block_r, block_n, num_warps, -(-n // block_n))
