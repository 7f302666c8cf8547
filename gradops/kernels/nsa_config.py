"""Launch parameters of the NSA compression kernels: the one place that picks them from the
shape. Nothing here reads tensor data.

Both kernels work on register tiles of fp32 accumulators; ``TILE_ELEMS`` bounds a tile so
that a program's live state (accumulator, the loaded input tile, the product being
reduced) stays in registers at 4 warps: 4096 fp32 values over 128 threads is 32 registers
per tensor per thread. Heads are packed into a tile until it is full, so that small head
dims still move wide, coalesced rows (heads are adjacent in memory in the TND layout).

These values are chosen by construction, not measured: no GPU was available when they
were written (see docs/kernels-nsa.md for how to tune them on one).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

TILE_ELEMS = 4096
# The backward holds more live tiles (x, the dx accumulator, the dOut row, the product),
# so its tiles are half as large: 2048 elements at 4 warps compile to about 80 registers
# per thread for sm_90 (checked offline with ptxas), so six programs fit on an SM.
BWD_TILE_ELEMS = 2048
NUM_WARPS = 4
# Widest slice of the head dim one program handles; wider heads are split over programs
# (the forward has nothing to reduce over D; the backward's dweight partials simply gain
# one partial row per slice).
MAX_BLOCK_D = 256
# Programs the backward aims to launch per SM: enough resident programs to keep loads in
# flight (memory-bound), few enough that the dweight partials stay a negligible fraction
# of the traffic.
BWD_PROGRAMS_PER_SM = 16
# Bounds on stride groups per backward program: at least one; at most so many that the
# dweight partials (one [block_size, heads] row per program) stay cheap to reduce.
MAX_GROUPS_PER_CHUNK = 1024


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; on CPU (the Triton interpreter, where
    every program runs in turn) a small number keeps grids, and so test times, small."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 2


@dataclass(frozen=True)
class ForwardConfig:
    block_c: int  # compressed blocks per program
    block_h: int  # heads per program
    block_d: int  # head-dim elements per program (power of two, masked)
    num_warps: int


@dataclass(frozen=True)
class BackwardConfig:
    rows: int  # rows of a stride group per program (power of two, masked against stride)
    block_h: int
    block_d: int
    groups_per_chunk: int  # stride groups (of `stride` tokens) one program walks through
    num_warps: int
    reduce_block_p: int  # partial rows summed per step by the dweight reduction
    reduce_block_w: int  # dweight elements per reduction program


def forward_config(num_heads: int, head_dim: int, block_size: int, stride: int) -> ForwardConfig:
    block_d = min(next_pow2(head_dim), MAX_BLOCK_D)
    block_h = min(next_pow2(num_heads), max(1, TILE_ELEMS // (16 * block_d)))
    # Consecutive blocks of a program overlap by block_size - stride rows, so a taller
    # tile re-reads more of its input from L1 instead of L2.
    block_c = max(1, min(64, TILE_ELEMS // (block_h * block_d)))
    return ForwardConfig(block_c, block_h, block_d, NUM_WARPS)


def backward_config(num_tokens: int, num_heads: int, head_dim: int, block_size: int,
                    stride: int, device: torch.device) -> BackwardConfig:
    block_d = min(next_pow2(head_dim), MAX_BLOCK_D)
    rows = min(next_pow2(stride), max(1, BWD_TILE_ELEMS // block_d))
    block_h = min(next_pow2(num_heads), max(1, BWD_TILE_ELEMS // (rows * block_d)))
    programs_per_chunk = (-(-stride // rows)) * (-(-num_heads // block_h)) * (-(-head_dim // block_d))
    target_chunks = max(1, BWD_PROGRAMS_PER_SM * sm_count(device) // programs_per_chunk)
    groups = -(-num_tokens // stride)
    groups_per_chunk = max(1, min(MAX_GROUPS_PER_CHUNK, -(-groups // target_chunks)))
    return BackwardConfig(rows, block_h, block_d, groups_per_chunk, NUM_WARPS,
                          reduce_block_p=32, reduce_block_w=128)
