"""Floyd attention on a grid sharded by rows over a torch.distributed process group.

Rank r holds rows n of q ``[B,H,N_r,M,D]``, k1 and v1 ``[B,H,N_r,K,D]`` and rows k of k2 and
v2 ``[B,H,K_r,M,D]`` (the pivots' rows; in a FloydNet block, the same rows of the grid). Then
Y's rows n need only this rank's q, k1, v1 and every rank's k2 and v2, and in the backward dQ,
dK1 and dV1 of its rows are local, while dK2 and dV2 are sums over every rank's rows n:

- forward: all-gather k2 and v2 (``gather_rows``), run gradops' operator on the local rows
  (whatever strategy its rule picks), keep only the local shards for the backward;
- backward: all-gather k2 and v2 again (kept instead, they would hold two whole inputs per layer
  from the forward to the backward, the memory the sharding is for), run the operator's
  backward with dK2/dV2 as partial sums in the accumulation dtype (float32 for 16-bit
  inputs), and sum each row's partials on its owner in a fixed order (``reduce_rows``).

``row_sharded_forward`` / ``row_sharded_backward`` are that engine; the autograd Function
below and the DTensor rule (``dtensor.py``) are its two faces.
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..errors import AclnnError
from ..ops import floyd_attention as floyd_ops
from ..ops._checks import TILING, check_float_attr, check_shape, require_tensor
from . import _collectives as comm

OP = "gradops.distributed.floyd_attention"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("B", "H", "M", "K (k1's pivots)", "D", "dtype", "device type",
           "path (0: no mask, 1: a mask, 2: pivotal_attention's chunked path)", "scale",
           "requires_grad of (q, k1, v1, k2, v2)")


class RowPlan(NamedTuple):
    """Who holds which rows: ``n_sizes[r]`` rows of q/k1/v1 and ``k_sizes[r]`` rows of k2/v2
    on rank r of ``group``."""

    group: object
    n_sizes: Tuple[int, ...]
    k_sizes: Tuple[int, ...]


def _whole_standin(t: Tensor, pivots: int) -> Tensor:
    """A tensor shaped as ``t`` [B,H,K_r,M,D] with all K pivots, of no memory (zero strides),
    for the single-process operator's checks."""
    shape = (t.shape[0], t.shape[1], pivots, t.shape[3], t.shape[4])
    return torch.empty_strided(shape, (0,) * 5, dtype=t.dtype, device=t.device)


def _scale_bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", scale))[0]


def dtype_code(t: Tensor) -> int:
    """The dtype of ``t`` as an int of the ranks' signatures (-1: not a float dtype the ops take)."""
    return DTYPES.index(t.dtype) if t.dtype in DTYPES else -1


def _signature(q, k1, v1, k2, v2, path, scale):
    """What every rank must agree on (``_FIELDS``), then the rows it holds: (N_r, K_r)."""
    grads = sum(1 << i for i, t in enumerate((q, k1, v1, k2, v2)) if t.requires_grad and torch.is_grad_enabled())
    b, h, _, m, d = q.shape
    agreed = [b, h, m, k1.shape[3], d, dtype_code(q),
              {"cpu": 0, "cuda": 1}.get(q.device.type, 2), path, _scale_bits(scale), grads]
    return agreed + [q.shape[2], k2.shape[2]]


def check_local(op: str, q, k1, v1, k2, v2, mask, scale, backend, path: int, failure=None):
    """This rank's shards checked by the single-process operator's own rules (k2 and v2 as
    whole stand-ins: their shard sizes are checked across ranks), and its signature; an
    AclnnError (``failure``: one the caller's own checks found) is returned, not raised, for
    ``comm.exchange`` to share."""
    try:
        if failure is not None:
            raise failure
        for name, t in (("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2)):
            require_tensor(op, name, t)
        scale = check_float_attr(op, "scale", scale)
        if k1.dim() == 5 and k2.dim() == 5 and v2.dim() == 5:
            check_shape(op, "v2", v2, k2.shape, "k2.shape (this rank's rows of the pivots)", status=TILING)
            floyd_ops.prepare_floyd_attention(q, k1, v1, _whole_standin(k2, k1.shape[3]),
                                              _whole_standin(v2, k1.shape[3]), mask, scale, backend=backend, op=op)
        else:  # the operator's rank rule, worded for the tensors as given
            floyd_ops.prepare_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend, op=op)
        return _signature(q, k1, v1, k2, v2, path, scale), None
    except AclnnError as error:
        return [0] * (len(_FIELDS) + 2), error


def agree(op: str, q, k1, v1, k2, v2, mask, scale, backend, group, path: Optional[int] = None,
          failure: Optional[AclnnError] = None) -> RowPlan:
    """The plan of a call, agreed by every rank of ``group`` (one exchange of the signatures);
    every rank raises the same AclnnError where any rank's shards are wrong or disagree.
    ``path``: what decides the collectives besides the shapes (by default, whether a mask is
    given; pivotal_attention's paths)."""
    path = int(mask is not None) if path is None else path
    signature, failure = check_local(op, q, k1, v1, k2, v2, mask, scale, backend, path, failure)
    rows = comm.exchange(op, signature, failure, group)
    fields = len(_FIELDS)
    for i, field in enumerate(_FIELDS):
        values = [r[i] for r in rows]
        if len(set(values)) > 1:
            shown = values if field != "scale" else [struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
            comm.refuse(op, f"the ranks' shards disagree on {field}: {shown} by rank, expected one value")
    n_sizes = tuple(r[fields] for r in rows)
    k_sizes = tuple(r[fields + 1] for r in rows)
    pivots = rows[0][3]
    if sum(k_sizes) != pivots:
        comm.refuse(op, f"k2/v2 hold {list(k_sizes)} rows of the pivots by rank, {sum(k_sizes)} in all, "
                        f"expected k1's K = {pivots} (every pivot's row on exactly one rank)")
    return RowPlan(group, n_sizes, k_sizes)


def _no_autocast(t: Tensor):
    return torch.autocast(device_type=t.device.type, enabled=False)


def row_sharded_forward(q, k1, v1, k2, v2, mask, scale, plan: RowPlan, backend):
    """(Y, softmax_max, softmax_sum) of this rank's rows."""
    k2_all = comm.gather_rows(k2, 2, plan.k_sizes, plan.group)
    v2_all = comm.gather_rows(v2, 2, plan.k_sizes, plan.group)
    with _no_autocast(q):
        return floyd_ops.prepare_floyd_attention(q, k1, v1, k2_all, v2_all, mask, scale, backend=backend,
                                                 op=OP).run()


def row_sharded_backward(dy, q, k1, v1, k2, v2, out, smax, ssum, mask, scale, plan: RowPlan, backend,
                         kv2_wanted: bool = True):
    """(dQ, dK1, dV1, dK2, dV2) of this rank's rows; dK2/dV2 None unless ``kv2_wanted`` (which
    every rank must agree on: it decides whether the partial sums are exchanged)."""
    k2_all = comm.gather_rows(k2, 2, plan.k_sizes, plan.group)
    v2_all = comm.gather_rows(v2, 2, plan.k_sizes, plan.group)
    with _no_autocast(q):
        dq, dk1, dv1, dk2_part, dv2_part = floyd_ops.prepare_floyd_attention_grad(
            dy, q, k1, v1, k2_all, v2_all, out, smax, ssum, mask, scale, backend=backend, op=OP,
            kv2_partial=True).run()
    del k2_all, v2_all
    if not kv2_wanted:
        return dq, dk1, dv1, None, None
    dk2 = comm.reduce_rows(dk2_part, 2, plan.k_sizes, plan.group).to(q.dtype)
    del dk2_part
    dv2 = comm.reduce_rows(dv2_part, 2, plan.k_sizes, plan.group).to(q.dtype)
    return dq, dk1, dv1, dk2, dv2


class _RowShardedFloyd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k1, v1, k2, v2, mask, scale, plan, backend):
        out, smax, ssum = row_sharded_forward(q, k1, v1, k2, v2, mask, scale, plan, backend)
        ctx.save_for_backward(q, k1, v1, k2, v2, out, smax, ssum, mask)
        ctx.scale, ctx.plan, ctx.backend = scale, plan, backend
        return out

    @staticmethod
    def backward(ctx, dy):
        q, k1, v1, k2, v2, out, smax, ssum, mask = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        # the same on every rank (agreed with the signature's requires_grad flags)
        grads = row_sharded_backward(dy, q, k1, v1, k2, v2, out, smax, ssum, mask, ctx.scale, ctx.plan,
                                     ctx.backend, kv2_wanted=needs[3] or needs[4])
        return tuple(g if need else None for g, need in zip(grads, needs)) + (None,) * 4


def _autocast_inputs(tensors, device_type: str):
    """The inputs as the single-process op's autocast rule gives them to it: floating inputs
    on the device in the autocast dtype (float64 stays)."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 and t.device.type == device_type else t for t in tensors)


def floyd_attention(q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, mask: Optional[Tensor] = None,
                    scale: float = 1.0, *, group=None, backend: Optional[str] = None) -> Tensor:
    """Floyd attention (gradops' argument order, as ``gradops.nn.functional.floyd_attention``) on
    row shards; returns this rank's rows of Y, differentiable.

    On rank r of ``group`` (the default group when None): q ``[B,H,N_r,M,D]``, k1/v1
    ``[B,H,N_r,K,D]`` (rows n of the whole N, every pivot), k2/v2 ``[B,H,K_r,M,D]`` (rows k
    of the whole K; the K_r of all ranks sum to K), mask None or this rank's rows
    ``[B,1,N_r,1,K]``. Shards may be unequal (a rank may hold none). Every rank must call
    it, in the same order as its other collectives on ``group``. Shards that disagree
    across ranks (B, H, M, K, D, dtype, device type, scale, mask given or not, which inputs
    require grad, or K_r not summing to K) raise the same AclnnError on every rank. A group
    of one rank, or torch.distributed not initialised, is the single-process operator.
    """
    _, world = comm.world_of(group)
    if world == 1:
        from ..nn.functional import floyd_attention as single

        return single(q, k1, v1, k2, v2, mask, scale, backend=backend)
    device_type = q.device.type if isinstance(q, Tensor) else "cpu"
    q, k1, v1, k2, v2 = _autocast_inputs((q, k1, v1, k2, v2), device_type)
    plan = agree(OP, q, k1, v1, k2, v2, mask, scale, backend, group)
    return _RowShardedFloyd.apply(q, k1, v1, k2, v2, mask, float(scale), plan, backend)
