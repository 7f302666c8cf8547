"""Floyd attention for grids one device cannot hold: a FloydNet grid sharded by rows over the
ranks of a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs). See
docs/distributed.md: the sharding, the collectives and their volume, memory per rank.

- :func:`floyd_attention`: gradops' operator (argument order ``q, k1, v1, k2, v2``) on row shards;
- :func:`pivotal_attention`: FloydNet's ``pivotal_attention`` signature on row shards;
- :func:`transpose_rows`: the grid's transpose, row-sharded (a block's symmetric mix);
- :class:`RowShardedBlock`: a ``floydnet.PivotalAttentionBlock`` run on this rank's rows;
- :func:`collective_bytes`: the bytes this rank hands to those collectives, tallied;
- DTensors sharded ``Shard(2)`` on a 1-D mesh go through ``gradops.nn.functional.floyd_attention``
  and ``gradops.pivotal_attention`` (fused path) with no special call (``dtensor.py``);
- the norms and NSA compression take DTensors too (``sharding.py``: row-sharded norms, head-sharded
  NSA), so tensor and sequence parallelism run a model patched with gradops.

nn sits below this package and never imports it: importing it (``import gradops`` does) hands
nn the DTensor calls (``gradops.nn._custom_ops.DTENSOR_HANDLERS``).
"""
from ..nn._custom_ops import DTENSOR_HANDLERS
from ._collectives import collective_bytes
from .floyd import floyd_attention
from .floydnet import RowShardedBlock
from .grid import pivotal_attention, transpose_rows

__all__ = ["floyd_attention", "pivotal_attention", "transpose_rows", "RowShardedBlock", "collective_bytes"]


# What nn hands a DTensor call to. dtensor.py and sharding.py import DTensor, about a second:
# the first DTensor call imports it, not this package.
def _register_dtensor_rules():
    from . import dtensor, sharding

    dtensor.register()
    sharding.register()


def _same_mesh(op, tensors):
    from .sharding import same_mesh

    same_mesh(op, tensors)


def _pivotal_attention_on_dtensors(*args):
    from . import dtensor

    return dtensor.pivotal_attention(*args)


DTENSOR_HANDLERS["rules"] = _register_dtensor_rules
DTENSOR_HANDLERS["same_mesh"] = _same_mesh
DTENSOR_HANDLERS["pivotal_attention"] = _pivotal_attention_on_dtensors
