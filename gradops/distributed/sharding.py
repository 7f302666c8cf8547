"""DTensor sharding rules for gradops' norm and NSA ops: tensor and sequence parallelism
(``parallelize_module``, FSDP2 with TP on a 2-D mesh) run them as they run torch's own norms.

Each rule lists the placements, on one mesh dimension, under which the op computes correctly on
the local shards; DTensor expands them over every mesh dimension, redistributes the inputs to
the cheapest of them, and calls the op on the local tensors, which runs gradops' own kernels
(``register_sharding``, torch's public registration). The rules:

- **the norms** (``layer_norm``, ``rms_norm``, their Triton ops and both backwards; the fused
  residual add, the offset and the llama cast are arguments of these ops): every row dim
  (outside the normalized dims) may be sharded, ``Shard(d)`` on x, the residual, y, h, the
  statistics, dy and dx alike, with the weight and bias ``Replicate``. Their gradients are
  then each rank's sums over its own rows, returned ``Partial`` (sum): DTensor reduces them
  where they are used (an optimizer step, FSDP2's reduce-scatter), and the norm itself adds
  no collective. A normalized dim sharded is **redistributed** (x all-gathered, or moved to
  a row dim by an all-to-all, whichever DTensor prices lower): a row's statistics need the
  whole row, and one row spans several ranks only when the hidden dim is sharded, which no
  tensor-parallel plan does at a norm.
- **NSA compression**: heads sharded (x ``Shard(1)``, weight ``Shard(1)``, the output and
  both gradients ``Shard(1)``) runs locally: heads are independent. Tokens sharded
  (``Shard(0)``) are redistributed: a compression block may span two ranks' tokens.
- everything ``Replicate``: each rank computes the whole op.

Floyd attention has its own row-sharded rule (``dtensor.py``), registered with these.

One caveat of ``register_sharding`` under torch 2.11 is corrected here: DTensor caches an
op's decision under its tensor arguments and, as ``register_sharding`` declares it, its
arguments from the first ``int`` one on, and these ops' placements also depend on list and
bool arguments (``normalized_shape``; ``output_mask``, which empties gradients not asked for).
Every argument is put into the cache key instead (torch 2.13 keys them all already).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Set

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError

_R = Replicate()
_registered: Set[str] = set()


def _row_dims(ndim: int, normalized: int) -> range:
    """The dims of a norm's input that index rows (may be sharded): those before the normalized."""
    return range(ndim - normalized)


def _placed(t, placement):
    """The placement of an optional tensor argument: None stays None (no DTensor there)."""
    return None if t is None else placement


def _layer_norm(x, residual, normalized_shape, weight, bias, eps, backend):
    # outputs: y, mean, rstd (x's rank, size 1 on the normalized dims), h (empty without a residual)
    def rule(p):
        h = p if residual is not None else _R
        return [p, p, p, h], [p, _placed(residual, p), None, _placed(weight, _R), _placed(bias, _R), None, None]
    return [rule(_R)] + [rule(Shard(d)) for d in _row_dims(x.ndim, len(normalized_shape))]


def _layer_norm_backward(dy, dresidual, x, normalized_shape, mean, rstd, weight, bias, output_mask, backend):
    # outputs: dx, dweight, dbias, each empty (Replicate) where output_mask leaves it out
    def rule(p, summed):
        outs = [p if output_mask[0] else _R, summed if output_mask[1] else _R, summed if output_mask[2] else _R]
        return outs, [p, _placed(dresidual, p), p, None, p, p, _placed(weight, _R), _placed(bias, _R), None, None]
    return [rule(_R, _R)] + [rule(Shard(d), Partial()) for d in _row_dims(x.ndim, len(normalized_shape))]


def _rms_norm(x, residual, gamma, eps, offset, casting_mode, backend):
    # outputs: y, rstd (x's rank, size 1 on the normalized dims), h (empty without a residual)
    def rule(p):
        return [p, p, p if residual is not None else _R], [p, _placed(residual, p), _R, None, None, None, None]
    return [rule(_R)] + [rule(Shard(d)) for d in _row_dims(x.ndim, gamma.ndim)]


def _rms_norm_backward(dy, dresidual, x, rstd, gamma, offset, casting_mode, backend):
    # outputs: dx, dgamma
    def rule(p, summed):
        return [p, summed], [p, _placed(dresidual, p), p, p, _R, None, None, None]
    return [rule(_R, _R)] + [rule(Shard(d), Partial()) for d in _row_dims(x.ndim, gamma.ndim)]


_HEADS = Shard(1)  # x [T, N, D] and weight [block_size, N]: N is dim 1 of both


def _nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    return [([p], [p, p, None, None, None, None, None]) for p in (_R, _HEADS)]


def _nsa_compress_backward(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    return [([p, p], [p, p, p, None, None, None, None, None]) for p in (_R, _HEADS)]


# gradops op -> its rule (the Triton norm ops take their custom op's arguments)
RULES: Dict[str, Callable] = {
    "layer_norm": _layer_norm,
    "triton_layer_norm": _layer_norm,
    "layer_norm_backward": _layer_norm_backward,
    "rms_norm": _rms_norm,
    "triton_rms_norm": _rms_norm,
    "rms_norm_backward": _rms_norm_backward,
    "nsa_compress": _nsa_compress,
    "nsa_compress_backward": _nsa_compress_backward,
}
# (NSA's twin ops taking seq_lens as a tensor, for torch.compile, have no rule: the output's
# size is data-dependent there, which DTensor cannot shard; nn refuses such a call on DTensors)


def _defined(name: str) -> Optional[torch._ops.OpOverload]:
    """``gradops::<name>.default`` where it is defined (the Triton ops are defined on the first
    traced CUDA call that takes one), else None."""
    packet = getattr(torch.ops.gradops, name, None)
    return None if packet is None else packet.default


def _keyed_by_every_argument(op) -> None:
    """See the module's docstring: the propagator's cache key of ``op`` holds all its arguments.
    (torch 2.11's cache needs it; 2.13's keys every argument already. It writes a private
    table: drop it with 2.11.)"""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_argnum=1, needs_pytree=True)


def register() -> None:
    """Registers the rule of every gradops op defined so far that has none yet (the Triton ops
    may come later, and get theirs when they are defined)."""
    for name, rule in RULES.items():
        if name in _registered:
            continue
        op = _defined(name)
        if op is None:
            continue
        register_sharding(op)(rule)
        _keyed_by_every_argument(op)
        _registered.add(name)


def same_mesh(op: str, tensors: Dict[str, object]) -> None:
    """A call's tensors (name -> tensor or None) are DTensors on one device mesh, or it is
    refused with ``AclnnError`` naming the first that is not (DTensor would raise a
    RuntimeError, after the call's other checks)."""
    first = None  # (name, mesh) of the first DTensor
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, DTensor):
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: {name} is a plain tensor beside DTensor arguments, "
                                                      f"expected a DTensor on their mesh (distribute_tensor, or "
                                                      f"DTensor.from_local with Replicate())")
        if first is None:
            first = (name, t.device_mesh)
        elif t.device_mesh != first[1]:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: {name} is on the device mesh {t.device_mesh}, "
                                                      f"{first[0]} on {first[1]}, expected one mesh")
