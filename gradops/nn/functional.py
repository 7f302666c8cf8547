"""Differentiable functionals whose gradients are gradops' backward operators: the public
face of the ``gradops`` custom ops. Each family lives in a module of its own (``_norms``:
LayerNorm and RMSNorm, ``_nsa``, ``_floyd``, ``_floyd3``; ``_triton_ops``: the norm forwards Inductor
compiles; ``_custom_ops``: what they share, and why they are custom ops)."""
from ._floyd import floyd_attention
from ._floyd3 import floyd3_attention
from ._norms import fused_add_layer_norm, fused_add_rms_norm, layer_norm, rms_norm
from ._nsa import nsa_compress

__all__ = ["layer_norm", "rms_norm", "fused_add_layer_norm", "fused_add_rms_norm", "nsa_compress",
           "floyd_attention", "floyd3_attention"]
