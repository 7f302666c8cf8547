"""Launch parameters of the NSA compression kernels: the one place that picks them from the
shape. Nothing here reads tensor data.

Both kernels work on register tiles with float32 accumulators. Heads are packed into a
tile until it is full, so that small head dims still move wide, coalesced rows (the heads
of a token are adjacent in memory in the TND layout).

The values are chosen by construction and checked by compiling for sm_90 offline (register
counts from ptxas, see docs/kernels-nsa.md), not by timing: no GPU was available when they
were written. docs/kernels-nsa.md says how to tune them on one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

NUM_WARPS = 4
# Forward tile (blocks x heads x head dim): 4096 float32 accumulators over 128 threads,
# 64 registers per thread on sm_90.
FWD_TILE_ELEMS = 4096
# The backward holds more live tiles (x, the dx and dweight accumulators, the dOut rows),
# so its tiles are half as large: 2048 elements.
BWD_TILE_ELEMS = 2048
# The backward's group loop is software-pipelined when its covering blocks (ceil(l/s) of
# them) are unrolled, which is done up to MAX_UNROLLED_COVER: past that the unrolled dOut
# rows push the sm_90 compile over the register budget (ptxas keeps every block's row live:
# 120-200 registers for 5-8 blocks even on 512-element tiles), and the kernel keeps a
# run-time loop over the blocks, not pipelined. BWD_PIPELINE_STAGES[ceil(l/s)] is the
# `num_stages` of the group loop (stages - 1 groups of x and dOut in flight per program,
# in shared memory). More than 2 blocks use half tiles: 3 and 4 unrolled blocks then fit
# the budget, and so does the run-time loop (96 registers and a spill under Triton 3.6 on
# a full tile).
# The stage counts are those whose sm_90 compiles fit the budget without spilling under
# both Triton 3.6 and 3.9 (e.g. 1 block at 3 stages spills 8 bytes under 3.9; 2 blocks at
# 4 stages need up to 117 registers).
MAX_UNROLLED_COVER = 4
BWD_PIPELINE_STAGES = {1: 4, 2: 3, 3: 4, 4: 3}
# Registers per thread the backward may use (checked by the sm_90 compile test), and the
# programs of NUM_WARPS warps that then fit an SM's 64K registers: 4. Pipelining replaces
# occupancy as the way to keep loads in flight (each program has stages - 1 groups of x in
# flight, 2 x 4 KB at l/s = 2: 32 KB per SM, above the ~18 KB that HBM bandwidth times
# latency asks of an H100 SM), so the budget is 128 rather than the 96 of 5 programs: the
# 2048-element pipelined tile compiles to 88-102 registers depending on the head dim and
# the Triton version, too close to 96 to hold.
BWD_MAX_REGISTERS = 128
RESIDENT_PER_SM = 65536 // (BWD_MAX_REGISTERS * 32 * NUM_WARPS)
# Widest slice of the head dim one program handles; wider heads are split over programs
# (the forward has nothing to reduce over D; the backward's dweight partials gain one
# partial row per slice).
MAX_BLOCK_D = 256
# The backward launches about this many waves of resident programs, so that the last,
# partial wave costs little; each program walks at least MIN_GROUPS_PER_CHUNK stride
# groups, so that its fixed costs (the sequence search, the dweight partial row it writes
# and the reduction reads back) stay small against the rows it moves.
BWD_WAVES = 8
MIN_GROUPS_PER_CHUNK = 4
MAX_GROUPS_PER_CHUNK = 4096
# The dweight reduction sums [REDUCE_TILE] float32 partials per step.
REDUCE_TILE = 8192


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; on CPU (the Triton interpreter, where
    programs run one after another) a small number keeps grids, and test times, small."""
    device = torch.device(device)
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
    reduce_num_warps: int = NUM_WARPS
    # ceil(l/s) up to this is unrolled in the kernel and its group loop pipelined over
    # num_stages stages; 0 keeps the run-time loop over covering blocks for every l/s.
    max_unrolled_cover: int = MAX_UNROLLED_COVER
    num_stages: int = 3


def forward_config(num_heads: int, head_dim: int, block_size: int, stride: int) -> ForwardConfig:
    block_d = min(next_pow2(head_dim), MAX_BLOCK_D)
    block_h = min(next_pow2(num_heads), max(1, FWD_TILE_ELEMS // (16 * block_d)))
    # Consecutive blocks of a program share block_size - stride rows, so a taller tile
    # serves more of its re-reads from L1.
    block_c = max(1, min(64, FWD_TILE_ELEMS // (block_h * block_d)))
    return ForwardConfig(block_c, block_h, block_d, NUM_WARPS)


def backward_config(num_tokens: int, num_heads: int, head_dim: int, block_size: int,
                    stride: int, device: torch.device) -> BackwardConfig:
    block_d = min(next_pow2(head_dim), MAX_BLOCK_D)
    covering = cdiv(block_size, stride)
    tile = BWD_TILE_ELEMS if covering <= 2 else BWD_TILE_ELEMS // 2
    rows = min(next_pow2(stride), max(1, tile // block_d))
    block_h = min(next_pow2(num_heads), max(1, tile // (rows * block_d)))
    d_tiles = cdiv(head_dim, block_d)
    # At least one program per chunk even when N or D is 0: the launcher does not launch
    # an empty problem, but the configuration must still be defined for it.
    programs_per_chunk = max(1, cdiv(stride, rows) * cdiv(num_heads, block_h) * d_tiles)
    target_programs = BWD_WAVES * RESIDENT_PER_SM * sm_count(device)
    target_chunks = max(1, target_programs // programs_per_chunk)
    groups = cdiv(num_tokens, stride)
    groups_per_chunk = min(MAX_GROUPS_PER_CHUNK, max(MIN_GROUPS_PER_CHUNK, cdiv(groups, target_chunks)))
    # The reduction: rows are (about) chunks x head-dim slices, width is block_size x heads.
    partial_rows = max(1, cdiv(groups, groups_per_chunk) * d_tiles)
    reduce_p = min(256, next_pow2(partial_rows))
    reduce_w = max(16, min(1024, REDUCE_TILE // reduce_p, next_pow2(block_size * num_heads)))
    return BackwardConfig(rows, block_h, block_d, groups_per_chunk, NUM_WARPS,
                          reduce_block_p=reduce_p, reduce_block_w=reduce_w,
                          reduce_num_warps=8 if reduce_p * reduce_w >= REDUCE_TILE else NUM_WARPS,
                          num_stages=BWD_PIPELINE_STAGES.get(covering, 1))
