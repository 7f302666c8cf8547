"""PyTorch integration: differentiable functionals (``gradops.nn.functional``) whose
gradients are gradops' backward operators, drop-in modules, and FloydNet's
``pivotal_attention`` (``gradops.nn.pivotal``)."""
from . import functional
from .modules import FloydAttention, LayerNorm, NsaCompress, RMSNorm
from .pivotal import pivotal_attention
from .pivotal3 import pivotal_attention3

__all__ = ["functional", "LayerNorm", "RMSNorm", "NsaCompress", "FloydAttention", "pivotal_attention",
           "pivotal_attention3"]
