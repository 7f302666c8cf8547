"""NSA key/value compression in plain PyTorch (OPERATORS.md section 4).

Canonical arguments (docs/backends.md): ``x [T, N, D]``, ``weight [l, N]``, ``cu_seqlens`` a
host list ``[0, e_0, ..., T]`` and ``num_blocks`` = C. On a CPU (the CPU path) the blocks are
taken in cache-sized chunks as strided views of x (see "The CPU path" below); elsewhere, and
for packings of many short sequences, the loops run over the l positions of a block, never
over blocks or tokens, each step touching ``[C, N, D]`` elements. Either way the workspace is
O(inputs + outputs), plus ``l`` chunks (a few MiB) on the CPU path.

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


# ---------------------------------------------------------------------------------------
# The CPU path
#
# Within a sequence the blocks are evenly spaced, so position j of blocks c .. c+k-1 is a
# strided slice of rows, ``x[start + j :: stride][:k]``: a view, with no gather copy and no
# index table. The work is cut into chunks of k consecutive blocks of one sequence and, per
# chunk, runs over j as elementwise ops (mul/addcmul_) on [k, N, D]. k is chosen so that one op
# holds fewer elements than PyTorch's intra-op grain (32768), so every op runs on the calling
# thread: the chunk stays in the core's cache across the l steps, and the many small ops never
# wait at an OpenMP barrier (on a loaded machine such a wait costs a scheduler time slice per
# op, which made parallel chunked ops 10-100x slower). It also makes the reduction order
# independent of the thread count. Low-precision rows are widened into a chunk-sized float32
# buffer, so the workspace stays O(chunk).
#
# Other devices (a GPU, the meta device) keep the gather loop below: a few large ops per
# position, which is what a GPU wants, and whose tables are cached for CUDA graphs. So do CPU
# packings of many short sequences, where chunks would be mostly empty (one op per block and
# position); see _cpu_path and _chunks_fill.

_CHUNK_ELEMS = 32767  # most elements of one [k, N, D] op: under at::internal::GRAIN_SIZE (32768)


def _chunk_blocks(heads: int, dim: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, heads * dim))


@functools.lru_cache(maxsize=64)
def _chunks(cu_seqlens: tuple, block_size: int, stride: int, per_chunk: int) -> tuple:
    """``(first row, blocks, first output block)`` of every chunk, in batch order (host data)."""
    chunks, c0 = [], 0
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    for a, n in zip(cu_seqlens[:-1], blocks_per_sequence(lengths, block_size, stride)):
        for k0 in range(0, n, per_chunk):
            chunks.append((a + stride * k0, min(per_chunk, n - k0), c0 + k0))
        c0 += n
    return tuple(chunks)


def _cpu_path(x, weight) -> bool:
    # torch.compile would unroll every chunk and position into its graph, while it fuses the
    # gather loop into one kernel. Autograd through the forward (a caller differentiating the
    # formula) needs ops without out=, so it gets the gather loop too.
    differentiated = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return x.device.type == "cpu" and not differentiated and not torch.compiler.is_compiling()


def _chunks_fill(chunks, per_chunk: int, num_blocks: int) -> bool:
    # Chunks at least half full on average; else (many sequences of a few blocks) the
    # per-block op count of the chunked loop loses to the gather loop's l large ops.
    return 2 * num_blocks >= len(chunks) * per_chunk


def _cpu_plan(x, weight, block_size, stride, cu_seqlens, num_blocks):
    """``(chunks, per_chunk)`` when the call takes the CPU path, else None (the gather loop)."""
    if not _cpu_path(x, weight):
        return None
    per_chunk = _chunk_blocks(x.shape[1], x.shape[2])
    chunks = _chunks(tuple(cu_seqlens), block_size, stride, per_chunk)
    return (chunks, per_chunk) if _chunks_fill(chunks, per_chunk, num_blocks) else None


def _strided_rows(t, row: int, k: int, stride: int):
    """Rows ``row, row + stride, ..., row + (k-1)*stride`` of ``t`` [T, N, D], as a view."""
    st = t.stride()
    return t.as_strided((k,) + tuple(t.shape[1:]), (stride * st[0], st[1], st[2]),
                        t.storage_offset() + row * st[0])


def _strided_forward(x, w, block_size, stride, chunks, per_chunk, num_blocks, acc):
    out = torch.empty((num_blocks,) + tuple(x.shape[1:]), dtype=acc, device=x.device)
    widen = x.dtype != acc
    buf = torch.empty((per_chunk,) + tuple(x.shape[1:]), dtype=acc, device=x.device) if widen else None
    for row0, k, c0 in chunks:
        o = out[c0:c0 + k]
        for j in range(block_size):
            xj = _strided_rows(x, row0 + j, k, stride)
            if widen:
                xj = buf[:k].copy_(xj)
            if j == 0:
                torch.mul(xj, w[0], out=o)
            else:
                o.addcmul_(xj, w[j])
    return out.to(x.dtype)


def _strided_backward(dout, x, w, block_size, stride, chunks, per_chunk, acc):
    shape = tuple(x.shape[1:])
    dx = torch.zeros(x.shape, dtype=acc, device=x.device)  # tokens no block covers stay 0
    # dweight[j] summed over the blocks of a chunk slot first, then over slots and D at the
    # end: each element accumulates in a fixed order, with no per-step reduction op
    partial = torch.zeros((block_size, per_chunk) + shape, dtype=acc, device=x.device)
    widen = x.dtype != acc
    xbuf = torch.empty((per_chunk,) + shape, dtype=acc, device=x.device) if widen else None
    dbuf = torch.empty((per_chunk,) + shape, dtype=acc, device=x.device) if dout.dtype != acc else None
    for row0, k, c0 in chunks:
        d = dout[c0:c0 + k]
        if dbuf is not None:
            d = dbuf[:k].copy_(d)
        for j in range(block_size):
            xj = _strided_rows(x, row0 + j, k, stride)
            if widen:
                xj = xbuf[:k].copy_(xj)
            _strided_rows(dx, row0 + j, k, stride).addcmul_(d, w[j])
            partial[j, :k].addcmul_(d, xj)
    return dx.to(x.dtype), partial.sum(dim=(1, 3)).to(x.dtype)


def nsa_compress(x, weight, block_size, stride, cu_seqlens, num_blocks):
    acc = stat_dtype(x.dtype)
    w = weight.to(acc)
    plan = _cpu_plan(x, weight, block_size, stride, cu_seqlens, num_blocks)
    if plan is not None:
        return _strided_forward(x, w[:, :, None], block_size, stride, *plan, num_blocks, acc)
    starts = _starts(cu_seqlens, block_size, stride, x.device)
    out = torch.zeros((num_blocks,) + tuple(x.shape[1:]), dtype=acc, device=x.device)
    for j in range(block_size):
        out += w[j][None, :, None] * x[starts + j].to(acc)
    return out.to(x.dtype)


def nsa_compress_grad(dout, x, weight, block_size, stride, cu_seqlens, num_blocks):
    acc = stat_dtype(x.dtype)
    w = weight.to(acc)
    plan = _cpu_plan(x, weight, block_size, stride, cu_seqlens, num_blocks)
    if plan is not None:
        return _strided_backward(dout, x, w[:, :, None], block_size, stride, *plan, acc)
    starts = _starts(cu_seqlens, block_size, stride, x.device)
    doutf = dout.to(acc)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device)
    dweight = torch.zeros(weight.shape, dtype=acc, device=x.device)
    for j in range(block_size):
        rows = starts + j  # distinct within one j (stride >= 1), so index_add_ has no collisions
        dx.index_add_(0, rows, w[j][None, :, None] * doutf)
        dweight[j] = (doutf * x[rows].to(acc)).sum(dim=(0, 2))
    return dx.to(x.dtype), dweight.to(x.dtype)
