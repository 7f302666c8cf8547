"""Launch parameters of the norm kernels (LayerNorm, RMSNorm), chosen from the shape.

This is the one place that decides block widths, rows per tile, warps and grid sizes for
``gradops.kernels.layer_norm`` and ``gradops.kernels.rms_norm``; the kernels themselves
contain no tuning constants.

Two regimes, split at ``max_fused_n(device)``:

* **fused rows** (N <= max_fused_n): a tile of ``block_m`` whole rows lives in registers,
  so each element of x and dy is read from memory exactly once. The backward runs on a
  *persistent* grid (a small multiple of the SM count); every program loops over many row
  tiles and keeps its dgamma/dbeta partial sums in registers, writing one float32 partial
  row at the end.
* **split rows** (N > max_fused_n): a row does not fit in registers without spilling, so
  the work is split by columns: a row-statistics kernel, then a 2-D grid of
  (row group x column block) tiles. See docs/kernels-norm.md for the byte cost.

On the CPU (Triton interpreter) every program runs sequentially in Python, so the limits
are chosen small: the point there is correctness, not speed.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

# Widest row kept whole in registers on a GPU: one row is one register tile (below).
GPU_MAX_FUSED_N = 8192
# Elements per register tile on a GPU. A tile of 8192 elements over 16 warps is 16 values
# per thread per live tensor: ptxas (sm_90) gives the LayerNorm backward 128 registers and
# no spills at 8192 x 1 and narrower-row shapes alike, and 16384 spills. 8192 bf16 values
# of x and dy are 32 KB of loads in flight per SM, about what Little's law asks for
# (3.35 TB/s x ~0.7 us / 132 SMs ~ 18 KB).
GPU_TILE_ELEMS = 8192
# Persistent backward programs per SM: at 128 registers x 512 threads one program fills an
# SM's 64K registers, so a second one could only run after the first (a wasted partial row).
GPU_PROGRAMS_PER_SM = 1
# Column block of the split-row kernels and of the partial-sum reduction.
GPU_SPLIT_BLOCK_N = 2048

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
    return torch.device(device).type == "cuda"


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_PROGRAMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def max_fused_n(device: torch.device) -> int:
    if MAX_FUSED_N_OVERRIDE is not None:
        return int(MAX_FUSED_N_OVERRIDE)
    return GPU_MAX_FUSED_N if _on_gpu(device) else CPU_MAX_FUSED_N


def _warps_for(tile_elems: int) -> int:
    # ~16 elements per thread per tensor: 4 warps for 2K elements, 16 for 8K.
    return max(1, min(16, next_pow2(tile_elems) // 512))


@dataclass(frozen=True)
class FusedConfig:
    """Whole rows in registers: tiles of ``block_m`` x ``block_n`` (block_n >= N)."""
    block_m: int
    block_n: int
    num_warps: int
    num_tiles: int
    grid: int  # programs; the backward's persistent grid, or one program per tile
    tiles_per_program: int  # loop trip count of a persistent program (last ones mask the tail)


@dataclass(frozen=True)
class SplitConfig:
    """Rows wider than a register tile: column blocks of ``block_n``."""
    block_n: int        # columns per step / per program
    block_m: int        # rows per step of the column-tiled kernels
    num_warps: int
    col_blocks: int
    row_groups: int     # programs along the rows in the column-tiled kernels
    row_tiles: int      # tiles of block_m rows
    tiles_per_group: int  # loop trip count of a row group (the last ones mask the tail)
    row_num_warps: int  # warps of the one-row-per-program kernels (row statistics)


@dataclass(frozen=True)
class ReduceConfig:
    block_r: int
    block_n: int
    num_warps: int
    grid: int


def is_fused(n: int, device) -> bool:
    return n <= max_fused_n(device)


def fused_config(m: int, n: int, device, *, persistent: bool) -> FusedConfig:
    gpu = _on_gpu(device)
    block_n = max(16, next_pow2(n))
    tile = GPU_TILE_ELEMS if gpu else CPU_TILE_ELEMS
    # Narrow rows are stacked so that every tile carries about `tile` elements; never more
    # rows than there are (the tail tile is masked).
    block_m = max(1, min(tile // block_n, next_pow2(max(m, 1)), 128))
    num_warps = _warps_for(block_m * block_n) if gpu else 1
    num_tiles = -(-m // block_m)
    if persistent:
        programs = sm_count(device) * (GPU_PROGRAMS_PER_SM if gpu else 1)
        grid = max(1, min(num_tiles, programs))
    else:
        grid = max(1, num_tiles)
    return FusedConfig(block_m, block_n, num_warps, num_tiles, grid, -(-num_tiles // grid))


def split_config(m: int, n: int, device) -> SplitConfig:
    gpu = _on_gpu(device)
    block_n = GPU_SPLIT_BLOCK_N if gpu else CPU_SPLIT_BLOCK_N
    block_n = min(block_n, max(16, next_pow2(n)))
    tile = GPU_TILE_ELEMS if gpu else CPU_TILE_ELEMS
    block_m = max(1, min(tile // block_n, next_pow2(max(m, 1))))
    num_warps = _warps_for(block_m * block_n) if gpu else 1
    col_blocks = -(-n // block_n)
    # Enough (row group x column block) programs to fill every SM a few times over, but no
    # more row groups than row tiles: each row group writes one float32 partial row.
    target = sm_count(device) * 4
    row_tiles = -(-m // block_m)
    row_groups = max(1, min(row_tiles, -(-target // col_blocks)))
    row_num_warps = _warps_for(block_n) if gpu else 1
    return SplitConfig(block_n, block_m, num_warps, col_blocks, row_groups, row_tiles,
                       -(-row_tiles // row_groups), row_num_warps)


def reduce_config(rows: int, n: int, device) -> ReduceConfig:
    """Column sums of a ``[rows, n]`` float partial buffer, one program per column block."""
    gpu = _on_gpu(device)
    block_n = min(256 if gpu else 128, max(16, next_pow2(n)))
    block_r = min(32 if gpu else 8, next_pow2(max(rows, 1)))
    num_warps = 4 if gpu else 1
    return ReduceConfig(block_r, block_n, num_warps, -(-n // block_n))
