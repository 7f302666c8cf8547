"""gradops' Floyd attention on DTensors: a model written with DTensor calls
``gradops.nn.functional.floyd_attention`` / ``gradops.pivotal_attention`` as on plain
tensors, and they run row-sharded (``floyd.py``, ``grid.py``). ``pivotal_attention`` takes
its DTensors to ``grid.pivotal_attention`` (below); the ops, whichever way they are reached,
go through the rule that follows.

The rule, registered for both ops (``torch.library.register_torch_dispatch``): on a 1-D mesh,
every tensor argument is taken as ``Shard(2)`` (the rows n of q, k1, v1, dY, Y, the statistics
and the mask; the pivots' rows of k2 and v2), redistributed there first when it is placed
otherwise (a ``Replicate`` mask or upstream gradient: a local slice, no communication); the
outputs are ``Shard(2)``. The ranks agree on their shards' sizes as on the plain path (one
exchange per op call: ``DTensor.from_local`` may split otherwise than ``distribute_tensor``,
and a rank whose rows differ from the others' expectation must not enter a collective they
skip). DTensor's own rules would gather k2/v2 as ``Replicate`` and sum
dK2/dV2 as ``Partial`` through a reduce-scatter in the input dtype; this rule sums float32
partials on the owners in a fixed order, as the plain path does.
"""
from __future__ import annotations

import torch

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ._collectives import refuse
from .sharding import same_mesh
from .floyd import OP, RowPlan, agree, row_sharded_backward, row_sharded_forward

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch < 2.5: no public DTensor
    DTensor = None

_registered = False


def _mesh_of(op: str, names, tensors):
    """The one 1-D mesh of a call's DTensor arguments (``sharding.same_mesh``: every tensor a
    DTensor on one mesh, or AclnnError naming the first that is not)."""
    same_mesh(op, dict(zip(names, tensors)))
    mesh = next(t.device_mesh for t in tensors if t is not None)
    if mesh.ndim != 1:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: the DTensor arguments are on a {mesh.ndim}-D mesh, "
                                                  f"expected a 1-D mesh (rows over its ranks)")
    return mesh


def _local_rows(t, mesh):
    """This rank's rows (dim 2) of a DTensor argument; None stays None."""
    if t is None:
        return None
    if t.placements != (Shard(2),):
        t = t.redistribute(mesh, [Shard(2)])
    return t.to_local()


def _as_dtensor(local, mesh, shape):
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=torch.Size(shape), stride=stride)


def _plan(q, k1, v1, k2, v2, mask, scale, backend, global_q, global_k2, mesh) -> RowPlan:
    """The rows every rank holds, agreed as on the plain path (``floyd.agree``: the local shards
    as they are, which ``DTensor.from_local`` may have split otherwise than torch.chunk), and
    checked to make up the DTensors' global rows, on every rank alike."""
    plan = agree(OP, q, k1, v1, k2, v2, mask, scale, backend, mesh.get_group())
    for name, sizes, whole in (("q", plan.n_sizes, global_q.shape[2]), ("k2", plan.k_sizes, global_k2.shape[2])):
        if sum(sizes) != whole:
            refuse(OP, f"the ranks' local shards of {name} hold {list(sizes)} rows, {sum(sizes)} in all, expected its "
                       f"global {whole} (a DTensor's Shard(2))")
    return plan


def _arguments(func, args, kwargs):
    """The op's arguments in its schema's order, however they were passed."""
    names = [a.name for a in func._schema.arguments]
    return list(args) + [(kwargs or {})[name] for name in names[len(args):]]


def _forward_rule(_mode, func, _types, args, kwargs=None):
    q, k1, v1, k2, v2, mask, scale, backend = _arguments(func, args, kwargs)
    mesh = _mesh_of(OP, ("q", "k1", "v1", "k2", "v2", "mask"), (q, k1, v1, k2, v2, mask))
    local = [_local_rows(t, mesh) for t in (q, k1, v1, k2, v2, mask)]
    plan = _plan(*local, scale, backend, q, k2, mesh)
    out, smax, ssum = row_sharded_forward(*local, scale, plan, backend)
    b, h, n, m, _ = q.shape
    return _as_dtensor(out, mesh, q.shape), _as_dtensor(smax, mesh, (b, h, n, m)), _as_dtensor(ssum, mesh, (b, h, n, m))


def _backward_rule(_mode, func, _types, args, kwargs=None):
    dy, q, k1, v1, k2, v2, out, smax, ssum, mask, scale, backend = _arguments(func, args, kwargs)
    tensors = (dy, q, k1, v1, k2, v2, out, smax, ssum, mask)
    mesh = _mesh_of(OP, ("dy", "q", "k1", "v1", "k2", "v2", "out", "softmax_max", "softmax_sum", "mask"), tensors)
    local = [_local_rows(t, mesh) for t in tensors]
    plan = _plan(*local[1:6], local[9], scale, backend, q, k2, mesh)
    grads = row_sharded_backward(*local, scale, plan, backend)
    return tuple(_as_dtensor(g, mesh, t.shape) for g, t in zip(grads, (q, k1, v1, k2, v2)))


def pivotal_attention(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask, dropout, scale, inf, softmax_cap):
    """``gradops.pivotal_attention`` on DTensors, every path (the fused one, and the chunked one
    that DTensor's own rules would run on replicated scores): this rank's rows of each
    (redistributed to ``Shard(2)`` first, differentiably) through ``grid.pivotal_attention``
    on the mesh's group; the output ``Shard(2)``. The mask is sharded along its L_i dim
    (``Replicate`` where that dim has size 1, or it has fewer than 3 dims)."""
    from .grid import PIVOTAL_OP, pivotal_attention as row_sharded

    tensors = (q_ik, k_ij, k_jk, v_ij, v_jk)
    mesh = _mesh_of(PIVOTAL_OP, ("q_ik", "k_ij", "k_jk", "v_ij", "v_jk", "attn_mask"), tensors + (attn_mask,))
    local = [_local_rows(t, mesh) for t in tensors]
    mask = None
    if attn_mask is not None:
        rows = attn_mask.dim() - 3
        placement = Shard(rows) if rows >= 0 and attn_mask.shape[rows] > 1 else Replicate()
        mask = attn_mask.redistribute(mesh, [placement]).to_local()
    y = row_sharded(*local, attn_mask=mask, dropout=dropout, scale=scale, inf=inf, softmax_cap=softmax_cap,
                    group=mesh.get_group())
    return _as_dtensor(y, mesh, q_ik.shape)


def register() -> bool:
    """Register the rule for gradops::floyd_attention and its backward (once); False where
    this torch has no public DTensor or no ``register_torch_dispatch``."""
    global _registered
    if _registered:
        return True
    if DTensor is None or not hasattr(torch.library, "register_torch_dispatch"):
        return False
    import gradops.nn.functional  # noqa: F401  (defines the ops)

    torch.library.register_torch_dispatch("gradops::floyd_attention", DTensor, _forward_rule)
    torch.library.register_torch_dispatch("gradops::floyd_attention_backward", DTensor, _backward_rule)
    _registered = True
    return True
