"""NSA key/value compression in plain PyTorch (OPERATORS.md section 4).

Canonical arguments (docs/backends.md): ``x [T, N, D]``, ``weight [l, N]``, ``cu_seqlens`` a
host list ``[0, e_0, ..., T]`` and ``num_blocks`` = C. The loops run over the l positions of
a block (at most a few hundred), never over blocks or tokens, and each step touches
``[C, N, D]`` elements, so memory stays O(inputs + outputs).

The only data taken from the host is the packing; its block starts are built once per
packing and device and cached (``packing_tables``), so that a call with a packing already
seen does no host-to-device copy and reads nothing back: it can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
from typing import Dict, List

import torch

from ..ops._checks import stat_dtype


def blocks_per_sequence(lengths, block_size: int, stride: int) -> List[int]:
    """``n_b = (S_b - l)//s + 1`` when a sequence holds at least one block, else 0."""
    return [(s - block_size) // stride + 1 if s >= block_size else 0 for s in lengths]


# ---------------------------------------------------------------------------------------
# Per-packing device tables, shared with gradops.kernels.nsa_compress
#
# A training step calls every layer's forward and backward with the same packing, so its
# small index tables are built on the host and copied to the device once (the first call),
# then reused. Reuse is also what CUDA graphs need: a captured graph keeps the *addresses*
# of the tables it read, and replays read them again. The LRU below may drop a table (it
# holds 64 packings) and the caching allocator would then hand its memory to another
# tensor; so a table looked up while a CUDA graph is being captured is also kept here, for
# the life of the process (one entry per table a capture read; they are small: C or
# 3 x (B + 1) int64 values).
# A packing seen for the first time during a capture cannot work (its copy from pageable
# host memory synchronises, which capture forbids): warm up with the same packing first,
# as CUDA graphs require anyway.
_GRAPH_TABLES: Dict[int, object] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def packing_tables(cache, cu_seqlens: tuple, block_size: int, stride: int,
                   device: torch.device, *options):
    """``cache(cu_seqlens, block_size, stride, device, *options)``, an lru_cache of device
    tables, pinned for good when a CUDA graph being captured reads them (see above)."""
    tables = cache(cu_seqlens, block_size, stride, device, *options)
    if _capturing(device):
        _GRAPH_TABLES[id(tables)] = tables  # pinned entries stay alive, so ids stay unique
    return tables


def block_starts(cu_seqlens, block_size: int, stride: int, device) -> torch.Tensor:
    """First token of every compressed block, in batch order: int64 ``[C]`` on ``device``,
    computed on the host (no loop over blocks) and sent in one copy."""
    cu = torch.as_tensor(list(cu_seqlens), dtype=torch.int64)
    n = torch.as_tensor(blocks_per_sequence((cu[1:] - cu[:-1]).tolist(), block_size, stride),
                        dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(n.numel()), n)  # sequence of every block
    first_block = torch.cumsum(n, 0) - n  # index of each sequence's first block
    index_in_seq = torch.arange(seq.numel()) - first_block[seq]
    return (cu[:-1][seq] + stride * index_in_seq).to(device)


@functools.lru_cache(maxsize=64)
def _cached_block_starts(cu_seqlens: tuple, block_size: int, stride: int,
                         device: torch.device) -> torch.Tensor:
    return block_starts(cu_seqlens, block_size, stride, device)


def _starts(cu_seqlens, block_size, stride, device) -> torch.Tensor:
    return packing_tables(_cached_block_starts, tuple(cu_seqlens), block_size, stride, device)


def nsa_compress(x, weight, block_size, stride, cu_seqlens, num_blocks):
    acc = stat_dtype(x.dtype)
    starts = _starts(cu_seqlens, block_size, stride, x.device)
    out = torch.zeros((num_blocks,) + tuple(x.shape[1:]), dtype=acc, device=x.device)
    w = weight.to(acc)
    for j in range(block_size):
        out += w[j][None, :, None] * x[starts + j].to(acc)
    return out.to(x.dtype)


def nsa_compress_grad(dout, x, weight, block_size, stride, cu_seqlens, num_blocks):
    acc = stat_dtype(x.dtype)
    starts = _starts(cu_seqlens, block_size, stride, x.device)
    doutf = dout.to(acc)
    w = weight.to(acc)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device)
    dweight = torch.zeros(weight.shape, dtype=acc, device=x.device)
    for j in range(block_size):
        rows = starts + j  # distinct within one j (stride >= 1), so index_add_ has no collisions
        dx.index_add_(0, rows, w[j][None, :, None] * doutf)
        dweight[j] = (doutf * x[rows].to(acc)).sum(dim=(0, 2))
    return dx.to(x.dtype), dweight.to(x.dtype)
