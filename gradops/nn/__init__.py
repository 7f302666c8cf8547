"""PyTorch integration: differentiable functionals (``gradops.nn.functional``) whose
gradients are gradops' backward operators, drop-in modules, and FloydNet's
``pivotal_attention`` (``gradops.nn.pivotal``)."""
from . import functional
from .modules import FloydAttention, LayerNorm, NsaCompress, RMSNorm
from .pivotal import pivotal_attention

__all__ = ["functional", "LayerNorm", "RMSNorm", "NsaCompress", "FloydAttention", "pivotal_attention"]
