"""Every collective gradops.distributed issues, in one place, each tallied (``collective_bytes``).

The row-sharded operators move three kinds of data between the ranks of a process group:

- ``gather_rows``: every rank's rows of a tensor, whole on every rank (k2 and v2, forward and
  backward): one ``all_gather`` when the shards are equal, one ``broadcast`` per rank when not;
- ``reduce_rows``: partial sums of every row, each row summed on the rank that owns it (dK2
  and dV2): W - 1 rounds of paired sends and receives, one owner block per round, added at
  the owner in a fixed order (its own partial, then the ranks before it in ring order), so
  the result has the same bits on every run, which NCCL's reduce-scatter does not promise;
- ``transpose_rows``: the blocks of a square grid's transpose (an ``all_to_all``).

Shapes and dtypes are agreed first (``exchange``): a fixed-size vector of int64 per rank,
all-gathered on a CPU (gloo) group, so that every rank takes the same decision, raises the
same error, and issues the same collectives; a rank that raised alone would leave the others
waiting in a collective forever.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError

_tallies: List[Dict[str, int]] = []
_gloo_twins: Dict[object, object] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def collective_bytes() -> Iterator[Dict[str, int]]:
    """Tally, while the block runs, the bytes this rank hands to the collectives of
    gradops.distributed: ``{"gather_sent", "gather_received", "reduce_sent",
    "reduce_received", "transpose_sent", "transpose_received", "meta": ...}``. Sent and
    received count payload that leaves or reaches this rank (its own block, which a
    collective also copies, is not counted); "meta" is the shape agreement's vectors."""
    tally = {f"{kind}_{way}": 0 for kind in ("gather", "reduce", "transpose") for way in ("sent", "received")}
    tally["meta"] = 0
    _tallies.append(tally)
    try:
        yield tally
    finally:
        _tallies.remove(tally)


def _count(key: str, nbytes: int) -> None:
    for tally in _tallies:
        tally[key] += nbytes


def world_of(group) -> "tuple[int, int]":
    """(rank, world size) of this process in ``group`` (the default group when None); (0, 1)
    when torch.distributed is not initialised: a process alone holds every row."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _meta_group(group):
    """A CPU group over ``group``'s ranks for the shape agreement: the group itself when it is
    gloo's, else a gloo twin made once (with every member: the first call is collective anyway)."""
    if "gloo" in str(dist.get_backend(group)):  # gloo's, or a "cpu:gloo,cuda:nccl" group's
        return group
    key = group if group is not None else "default"
    with _lock:
        twin = _gloo_twins.get(key)
        if twin is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            twin = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            _gloo_twins[key] = twin
    return twin


def exchange(op: str, values: Sequence[int], failure: Optional[AclnnError], group) -> List[List[int]]:
    """Every rank's ``values`` (one int64 vector each, of one length), in rank order. ``failure``:
    this rank's own AclnnError from checking its shards, if any; when any rank has one, every
    rank raises (its own error, or one naming the ranks that failed), so no rank is left in a
    later collective."""
    row = [0 if failure is None else failure.status] + [int(v) for v in values]
    mine = torch.tensor(row, dtype=torch.int64)
    world = dist.get_world_size(group)
    rows = torch.empty(world * len(row), dtype=torch.int64)  # concatenated: all_gather_single's form
    _all_gather_single(rows, mine, _meta_group(group))
    _count("meta", mine.numel() * 8 * (world - 1))
    rows = rows.view(world, len(row)).tolist()
    failed = [r for r, values in enumerate(rows) if values[0]]
    if failed:
        if failure is not None:
            raise failure
        ranks, their = ("ranks", "their") if len(failed) > 1 else ("rank", "its")
        raise AclnnError(rows[failed[0]][0], f"{op}: {ranks} {', '.join(map(str, failed))} of the group refused "
                                             f"{their} shards (see {their} error); no output was written")
    return [values[1:] for values in rows]


def refuse(op: str, message: str) -> None:
    """An error every rank reaches together (after ``exchange``): raised as is."""
    raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: {message}")


def _all_gather_single(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, shard, group=group)


def offsets(sizes: Sequence[int]) -> List[int]:
    """Where each rank's rows start: [0, s0, s0 + s1, ...] (W + 1 entries)."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return starts


def _row_bytes(rows_first: torch.Tensor) -> int:
    """Bytes of one row of a tensor whose rows are its first dim."""
    return int(torch.Size(rows_first.shape[1:]).numel()) * rows_first.element_size()


def gather_rows(shard: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """Every rank's rows of a tensor split along ``dim`` (``sizes[r]`` rows on rank r), whole.
    The result is a view, with ``dim`` outermost in memory: each rank's block lands contiguous
    where the collective writes it, and no copy follows."""
    rank, world = dist.get_rank(group), len(sizes)
    own = shard.movedim(dim, 0).contiguous()
    rest = tuple(own.shape[1:])
    whole = torch.empty((sum(sizes),) + rest, dtype=shard.dtype, device=shard.device)
    row_bytes = _row_bytes(own)
    if len(set(sizes)) == 1:
        _all_gather_single(whole, own, group)
    else:
        starts = offsets(sizes)
        whole[starts[rank]:starts[rank + 1]].copy_(own)
        for src in range(world):
            if sizes[src]:
                dist.broadcast(whole[starts[src]:starts[src + 1]], src=_peer(group, src), group=group)
    _count("gather_sent", sizes[rank] * row_bytes * (world - 1))
    _count("gather_received", (sum(sizes) - sizes[rank]) * row_bytes)
    return whole.movedim(0, dim)


def _peer(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def reduce_rows(partial: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """This rank's rows (along ``dim``) of the sum over ranks of ``partial`` (every rank's
    partial sums of every row, all ranks' tensors of one shape and dtype). W - 1 rounds: in
    round s, rank r sends its partial of rank (r + s)'s rows to it and receives rank
    (r - s)'s partial of its own rows, which it adds to what it holds. So a rank holds its
    own partials and one received block at a time, and each of its rows is summed in one
    fixed order: its own partial, then ranks r - 1, r - 2, ... (mod W)."""
    rank, world = dist.get_rank(group), len(sizes)
    starts = offsets(sizes)
    by_row = partial.movedim(dim, 0)
    # a copy: a contiguous slice would alias ``partial`` (the caller's gradient, in place)
    total = by_row[starts[rank]:starts[rank + 1]].clone(memory_format=torch.contiguous_format)
    received = torch.empty_like(total)
    row_bytes = _row_bytes(total)
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        block = by_row[starts[dst]:starts[dst + 1]].contiguous()
        transfers = []
        if block.numel():
            transfers.append(dist.P2POp(dist.isend, block, _peer(group, dst), group))
        if received.numel():
            transfers.append(dist.P2POp(dist.irecv, received, _peer(group, src), group))
        if transfers:
            for work in dist.batch_isend_irecv(transfers):
                work.wait()
        if received.numel():
            total += received
        _count("reduce_sent", block.numel() * block.element_size())
        _count("reduce_received", sizes[rank] * row_bytes)
    return total.movedim(0, dim)


def transpose_rows(x: torch.Tensor, dim0: int, dim1: int, sizes: Sequence[int], group) -> torch.Tensor:
    """This rank's rows (along ``dim0``) of the whole grid's ``transpose(dim0, dim1)``, from its
    rows of the grid (split along ``dim0`` by ``sizes``; ``dim1`` whole, of the same length,
    split the same way): rank s sends rank r the block of its rows at r's columns, transposed.
    One all_to_all."""
    rank, world = dist.get_rank(group), len(sizes)
    starts = offsets(sizes)
    blocks = [x.narrow(dim1, starts[o], sizes[o]).transpose(dim0, dim1) for o in range(world)]
    counts_out = [b.numel() for b in blocks]
    send = torch.empty(sum(counts_out), dtype=x.dtype, device=x.device)
    for block, chunk in zip(blocks, send.split(counts_out)):  # one copy of each block, laid out for the peer
        chunk.view(block.shape).copy_(block)
    shape_in = [list(blocks[rank].shape) for _ in range(world)]
    for src in range(world):
        shape_in[src][dim1] = sizes[src]
    counts_in = [int(torch.Size(s).numel()) for s in shape_in]
    recv = torch.empty(sum(counts_in), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, counts_in, counts_out, group=group)
    item = x.element_size()
    _count("transpose_sent", (sum(counts_out) - counts_out[rank]) * item)
    _count("transpose_received", (sum(counts_in) - counts_in[rank]) * item)
    parts = [chunk.view(shape) for chunk, shape in zip(recv.split(counts_in), shape_in)]
    return torch.cat(parts, dim=dim1)
