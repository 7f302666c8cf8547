"""FloydNet's operations on a grid sharded by rows: ``pivotal_attention`` (FloydNet's signature)
and ``transpose_rows`` (a block's symmetric mix, ``x.transpose(1, 2)``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..errors import AclnnError
from ..nn import pivotal as single_pivotal
from ..ops._checks import require_tensor
from . import _collectives as comm
from .floyd import RowPlan, _autocast_inputs, _RowShardedFloyd, _whole_standin, agree, dtype_code

PIVOTAL_OP = "gradops.distributed.pivotal_attention"
TRANSPOSE_OP = "gradops.distributed.transpose_rows"

# The ``path`` of a pivotal call in the ranks' signatures: the paths issue different collectives
# in their backwards, so every rank must take the same one.
_CHUNKED_PATH = 2


class _GatherRows(torch.autograd.Function):
    """Every rank's rows of a tensor, whole; the backward sums each row's gradient on its owner
    (in the accumulation dtype: float32 for 16-bit gradients)."""

    @staticmethod
    def forward(ctx, shard, dim, plan: RowPlan):
        ctx.dim, ctx.plan = dim, plan
        return comm.gather_rows(shard, dim, plan.k_sizes, plan.group)

    @staticmethod
    def backward(ctx, grad):
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        summed = comm.reduce_rows(grad.to(acc), ctx.dim, ctx.plan.k_sizes, ctx.plan.group)
        return summed.to(grad.dtype), None, None


def _chunked_on_gathered(call, plan, q_ik, k_ij, k_jk, v_ij, v_jk):
    return single_pivotal.chunked(call, q_ik, k_ij, _GatherRows.apply(k_jk, 2, plan), v_ij,
                                  _GatherRows.apply(v_jk, 2, plan))


def pivotal_attention(q_ik: Tensor, k_ij: Tensor, k_jk: Tensor, v_ij: Tensor, v_jk: Tensor,
                      attn_mask: Optional[Tensor] = None, dropout: float = 0.0, scale: Optional[float] = None,
                      inf: float = 1e9, softmax_cap: float = -1, *, group=None) -> Tensor:
    """``gradops.pivotal_attention`` (FloydNet's signature and defaults) on a grid sharded by rows:
    returns this rank's rows ``[B,H,L_i_r,L_k,D]`` of the output, differentiable.

    On rank r of ``group``: q_ik ``[B,H,L_i_r,L_k,D]`` and k_ij, v_ij ``[B,H,L_i_r,L_j,D]`` (its
    rows i), k_jk, v_jk ``[B,H,L_j_r,L_k,D]`` (its rows j, the L_j_r of all ranks summing to
    L_j), attn_mask broadcastable to ``[B,H,L_i_r,L_k,L_j]`` (its rows i, or a size 1 there).
    The fused path runs ``floyd_attention`` row-sharded; the chunked one (dropout, the cap,
    additive masks, masks over heads or k) gathers k_jk and v_jk, runs the single-process
    chunked path on them, and regathers them in the backward (activation checkpointing).
    Every rank must call it in the same order; shards that disagree raise the same
    AclnnError on every rank. A group of one rank is ``gradops.pivotal_attention``.
    """
    _, world = comm.world_of(group)
    if world == 1:
        return single_pivotal.pivotal_attention(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask, dropout, scale, inf,
                                                softmax_cap)
    q_ik, k_ij, k_jk, v_ij, v_jk = _autocast_inputs((q_ik, k_ij, k_jk, v_ij, v_jk),
                                                    q_ik.device.type if isinstance(q_ik, Tensor) else "cpu")
    call, failure = None, None
    try:
        for name, t in (("k_ij", k_ij), ("k_jk", k_jk), ("v_jk", v_jk)):
            require_tensor(PIVOTAL_OP, name, t)
        wholes = [_whole_standin(t, k_ij.shape[3]) if t.dim() == 5 and k_ij.dim() == 5 else t for t in (k_jk, v_jk)]
        call = single_pivotal.resolve(q_ik, k_ij, wholes[0], v_ij, wholes[1], attn_mask, dropout, scale, inf,
                                      softmax_cap, op=PIVOTAL_OP)
    except AclnnError as error:
        failure = error
    fused = call is not None and call.fused
    path = int(call.mask is not None) if fused else _CHUNKED_PATH
    # the operator's checks on the shards; the chunked path never runs the operator, so its
    # backend's limits (the fused kernels' widest head) do not apply: the reference's checks
    plan = agree(PIVOTAL_OP, q_ik, k_ij, v_ij, k_jk, v_jk, call.mask if fused else None,
                 call.scale if call is not None else 1.0, None if fused else "reference", group, path=path,
                 failure=failure)
    if fused:
        return _RowShardedFloyd.apply(q_ik, k_ij, v_ij, k_jk, v_jk, call.mask, call.scale, plan, None)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q_ik, k_ij, k_jk, v_ij, v_jk))
    if not tracked:
        return _chunked_on_gathered(call, plan, q_ik, k_ij, k_jk, v_ij, v_jk)
    # Checkpointed, the gathered k_jk/v_jk live only while the forward runs and again while
    # the backward recomputes it (the gathers run again there, on every rank alike).
    return checkpoint(_chunked_on_gathered, call, plan, q_ik, k_ij, k_jk, v_ij, v_jk, use_reentrant=False)


class _TransposeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim0, dim1, sizes, group):
        ctx.args = (dim0, dim1, sizes, group)
        return comm.transpose_rows(x, dim0, dim1, sizes, group)

    @staticmethod
    def backward(ctx, grad):  # the transpose's adjoint is the transpose, on the same rows
        return (comm.transpose_rows(grad, *ctx.args),) + (None,) * 4


def transpose_rows(x: Tensor, dim0: int = 1, dim1: int = 2, *, group=None) -> Tensor:
    """This rank's rows (along ``dim0``) of the whole grid's ``transpose(dim0, dim1)``, from its
    rows of the grid, differentiable: FloydNet's ``x.transpose(1, 2)`` on a grid
    ``[B, L, L, C]`` sharded by rows. ``dim1`` is whole on every rank and as long as the
    grid's rows (the grid is square), which the ranks' row counts split the same way. One
    all_to_all (forward, and one in the backward); shards that disagree raise the same
    AclnnError on every rank. A group of one rank is ``x.transpose(dim0, dim1)``."""
    _, world = comm.world_of(group)
    if world == 1:
        return x.transpose(dim0, dim1)
    failure, signature = None, [0] * (_TRANSPOSE_FIELDS + 1)
    try:
        dim0, dim1 = _check_transpose(x, dim0, dim1)
        shape = list(x.shape)
        shape[dim0] = 0  # the rows: this rank's own count, the signature's last entry
        grad = int(x.requires_grad and torch.is_grad_enabled())
        signature = ([x.dim(), dim0, dim1, dtype_code(x), int(x.device.type == "cuda"), grad] + shape
                     + [0] * (_MAX_DIMS - x.dim()) + [x.shape[dim0]])
    except AclnnError as error:
        failure = error
    rows = comm.exchange(TRANSPOSE_OP, signature, failure, group)
    if len({tuple(r[:-1]) for r in rows}) > 1:
        comm.refuse(TRANSPOSE_OP, "the ranks' shards disagree on their dims, dtype, device type, requires_grad or "
                                  "sizes off the rows: (dims, dim0, dim1, dtype, cuda, requires_grad, shape with "
                                  f"0 for the rows) = {[tuple(r[:6 + r[0]]) for r in rows]} by rank")
    sizes = tuple(r[-1] for r in rows)
    if sum(sizes) != x.shape[dim1]:
        comm.refuse(TRANSPOSE_OP, f"the ranks hold {list(sizes)} rows along dim {dim0}, {sum(sizes)} in all, "
                                  f"expected x.shape[{dim1}] = {x.shape[dim1]} (a square grid)")
    return _TransposeRows.apply(x, dim0, dim1, sizes, group)


_MAX_DIMS = 8
_TRANSPOSE_FIELDS = 6 + _MAX_DIMS


def _check_transpose(x, dim0, dim1):
    require_tensor(TRANSPOSE_OP, "x", x)
    ndim = x.dim()
    if not 2 <= ndim <= _MAX_DIMS:
        comm.refuse(TRANSPOSE_OP, f"x has {ndim} dims, expected 2 to {_MAX_DIMS}")
    for name, dim in (("dim0", dim0), ("dim1", dim1)):
        if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
            comm.refuse(TRANSPOSE_OP, f"{name} is {dim!r}, expected a dim of x ({ndim} dims)")
    dim0, dim1 = dim0 % ndim, dim1 % ndim
    if dim0 == dim1:
        comm.refuse(TRANSPOSE_OP, f"dim0 and dim1 are both {dim0}, expected two dims (rows, columns)")
    return dim0, dim1
