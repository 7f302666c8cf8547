"""NSA key/value compression in plain PyTorch (OPERATORS.md section 4).

Canonical arguments (docs/backends.md): ``x [T, N, D]``, ``weight [l, N]``, ``cu_seqlens`` a
host list ``[0, e_0, ..., T]`` and ``num_blocks`` = C. The loops run over the l positions of
a block (at most a few hundred), never over blocks or tokens, and each step touches
``[C, N, D]`` elements, so memory stays O(inputs + outputs).
"""
from __future__ import annotations

from typing import List

import torch

from ..ops._checks import stat_dtype


def blocks_per_sequence(lengths, block_size: int, stride: int) -> List[int]:
    """``n_b = (S_b - l)//s + 1`` when a sequence holds at least one block, else 0."""
    return [(s - block_size) // stride + 1 if s >= block_size else 0 for s in lengths]


def block_starts(cu_seqlens, block_size: int, stride: int, device) -> torch.Tensor:
    """First token of every compressed block, in batch order: int64 ``[C]``."""
    starts = []
    for b in range(len(cu_seqlens) - 1):
        n_b = blocks_per_sequence([cu_seqlens[b + 1] - cu_seqlens[b]], block_size, stride)[0]
        if n_b:
            starts.append(cu_seqlens[b] + stride * torch.arange(n_b, dtype=torch.int64, device=device))
    if not starts:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat(starts)


def nsa_compress(x, weight, block_size, stride, cu_seqlens, num_blocks):
    acc = stat_dtype(x.dtype)
    starts = block_starts(cu_seqlens, block_size, stride, x.device)
    out = torch.zeros((num_blocks,) + tuple(x.shape[1:]), dtype=acc, device=x.device)
    w = weight.to(acc)
    for j in range(block_size):
        out += w[j][None, :, None] * x[starts + j].to(acc)
    return out.to(x.dtype)


def nsa_compress_grad(dout, x, weight, block_size, stride, cu_seqlens, num_blocks):
    acc = stat_dtype(x.dtype)
    starts = block_starts(cu_seqlens, block_size, stride, x.device)
    doutf = dout.to(acc)
    w = weight.to(acc)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device)
    dweight = torch.zeros(weight.shape, dtype=acc, device=x.device)
    for j in range(block_size):
        rows = starts + j  # distinct within one j (stride >= 1), so index_add_ has no collisions
        dx.index_add_(0, rows, w[j][None, :, None] * doutf)
        dweight[j] = (doutf * x[rows].to(acc)).sum(dim=(0, 2))
    return dx.to(x.dtype), dweight.to(x.dtype)
