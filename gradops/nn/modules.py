"""Drop-in modules built on :mod:`gradops.nn.functional`.

``LayerNorm`` and ``RMSNorm`` subclass ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` and
replace only ``forward``: constructor arguments, parameters, initialisation, ``extra_repr``
and state_dict keys are torch's own, so a torch.nn checkpoint loads into them and back, and
code that recognises norms with ``isinstance(m, torch.nn.LayerNorm)`` (weight-decay groups,
FSDP wrapping policies) keeps working.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ..ops._checks import (check_float_attr, check_int_attr, dtype_name, invalid, require_tensor,
                           short_repr, wrong_type)
from ..ops._shapes import as_int_tuple
from ..ops.rms_norm import check_casting_mode
from . import functional as F
from .pivotal import pivotal_attention

__all__ = ["LayerNorm", "RMSNorm", "NsaCompress", "FloydAttention"]


def _check_norm_module(cls: str, normalized_shape, eps, device, dtype) -> None:
    """The arguments of a norm module's constructor, checked before torch's (which would raise
    its own TypeError or RuntimeError): what the functional will check on every call, and a
    float dtype for the parameters."""
    shape = as_int_tuple(cls, "normalized_shape", normalized_shape)
    if any(size < 0 for size in shape):
        invalid(cls, f"normalized_shape is {shape}, expected sizes >= 0")
    check_float_attr(cls, "eps", eps)
    _check_factory(cls, device, dtype)  # the flags, as torch's, are taken for their truth value


def _check_factory(cls: str, device, dtype) -> None:
    """``device`` and ``dtype`` of a module's parameters, as torch's factory functions take them."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        wrong = invalid if isinstance(dtype, torch.dtype) else wrong_type
        wrong(cls, f"dtype is {short_repr(dtype)}, expected a floating torch.dtype for the parameters")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            wrong = invalid if isinstance(device, (str, int)) else wrong_type
            wrong(cls, f"device is {short_repr(device)}, expected a torch.device, a device string or index")


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose forward and backward are gradops' operators.

    ``LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None,
    dtype=None)``, exactly torch's. ``forward(input, residual=None)``: with a residual it
    returns ``(output, input + residual)``, the pre-norm block's add fused into the norm
    (:func:`gradops.nn.functional.fused_add_layer_norm`).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        _check_norm_module("LayerNorm", normalized_shape, eps, device, dtype)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)

    def forward(self, input: Tensor, residual: Optional[Tensor] = None):
        if residual is None:
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.fused_add_layer_norm(input, residual, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward and backward are gradops' operators.

    ``RMSNorm(normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *,
    offset=0.0, casting_mode="gemma")``: torch's arguments (``eps=None``: the machine epsilon
    of the dtype torch computes in, float32 for half inputs), and the variants of real
    models: ``offset`` scales by ``offset + weight`` (Gemma's ``1 + w``; the weight then
    starts at ``1 - offset``, so a fresh layer scales by 1), ``casting_mode="llama"`` rounds
    the normalised row to the input's dtype before the weight (see
    :func:`gradops.nn.functional.rms_norm`). ``forward(input, residual=None)``: with a
    residual it returns ``(output, input + residual)``, the pre-norm block's add fused into
    the norm.
    """

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, offset: float = 0.0, casting_mode: str = "gemma"):
        _check_norm_module("RMSNorm", normalized_shape, 0.0 if eps is None else eps, device, dtype)
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.offset = check_float_attr("RMSNorm", "offset", offset)
        if self.offset and self.weight is None:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"RMSNorm: offset is {short_repr(offset)} with "
                                                      f"elementwise_affine=False, "
                                                      f"expected a weight for the offset to shift")
        check_casting_mode("RMSNorm", casting_mode)
        self.casting_mode = casting_mode
        if self.offset:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None and getattr(self, "offset", 0.0):
            with torch.no_grad():
                self.weight.fill_(1.0 - self.offset)

    def forward(self, input: Tensor, residual: Optional[Tensor] = None):
        kwargs = dict(offset=self.offset, casting_mode=self.casting_mode)
        if residual is None:
            return F.rms_norm(input, self.normalized_shape, self.weight, self.eps, **kwargs)
        return F.fused_add_rms_norm(input, residual, self.normalized_shape, self.weight, self.eps, **kwargs)

    def extra_repr(self) -> str:
        variants = "".join(f", {k}={v!r}" for k, v, default in (("offset", self.offset, 0.0),
                                                               ("casting_mode", self.casting_mode, "gemma"))
                           if v != default)
        return super().extra_repr() + variants


class NsaCompress(nn.Module):
    """DeepSeek NSA key/value compression with a learnable per-head block weighting.

    ``weight [block_size, num_heads]`` starts as mean pooling (every entry ``1/block_size``),
    so an untrained layer emits each block's average token. ``forward(x, seq_lens,
    seq_lens_type="cumsum")`` takes packed sequences ``x [T, num_heads, D]`` and returns
    ``[C, num_heads, D]``; see :func:`gradops.nn.functional.nsa_compress`. The weight is cast
    to x's dtype only under autocast (where the op takes the autocast dtype); otherwise it
    must match x's dtype, as ``nn.Linear``'s does.
    """

    def __init__(self, block_size: int, stride: int, num_heads: int, device=None, dtype=None):
        super().__init__()
        op = "NsaCompress"
        self.block_size = check_int_attr(op, "block_size", block_size, 1)
        self.stride = check_int_attr(op, "stride", stride, 1)
        self.num_heads = check_int_attr(op, "num_heads", num_heads, 1)
        block_size, num_heads = self.block_size, self.num_heads
        self.weight = nn.Parameter(torch.empty(block_size, num_heads, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0 / self.block_size)

    def forward(self, x: Tensor, seq_lens, seq_lens_type: str = "cumsum") -> Tensor:
        return F.nsa_compress(x, self.weight, self.block_size, self.stride, seq_lens, seq_lens_type)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, stride={self.stride}, num_heads={self.num_heads}"


def pair_attention(layer: nn.Module, x: Tensor, attn_mask: Optional[Tensor], scale: Optional[float]) -> Tensor:
    """FloydNet's pair attention on ``x [B, N, N, C]`` through ``layer``'s ``c_qkv``,
    ``num_heads``, ``head_dim``, ``dropout`` (on the attention weights, while ``layer`` trains),
    ``c_proj`` and ``dropout_fn``, with :func:`gradops.pivotal_attention`: the forward of
    :class:`FloydAttention`, and the ``attn`` of a FloydNet ``PivotalAttentionBlock`` that
    :func:`gradops.patch` adopted (both hold those attributes under FloydNet's names)."""
    b, n, _, c = x.shape
    # [B, N, N, 5C] -> five [B, H, N, N, D] views (permuted, not copied)
    q_ik, k_ij, k_jk, v_ij, v_jk = (
        t.view(b, n, n, layer.num_heads, layer.head_dim).permute(0, 3, 1, 2, 4)
        for t in layer.c_qkv(x).chunk(5, dim=-1))
    y = pivotal_attention(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask=attn_mask,
                          dropout=layer.dropout if layer.training else 0.0, scale=scale)
    y = y.permute(0, 2, 3, 1, 4).reshape(b, n, n, c)
    return layer.dropout_fn(layer.c_proj(y))


class FloydAttention(nn.Module):
    """FloydNet's pivotal attention layer over a pair representation ``x [B, N, N, C]``.

    The layer a FloydNet user writes (the attention part of FloydNet's
    ``PivotalAttentionBlock``, with the same parameter names, so its ``c_qkv``/``c_proj``
    weights load directly): ``c_qkv`` projects each pair to ``q_ik, k_ij, k_jk, v_ij, v_jk``
    per head (chunked in that order), :func:`gradops.pivotal_attention` mixes pairs through
    every pivot, heads are merged and ``c_proj`` projects back to ``C``.

    ``dropout`` applies to the attention weights and to the output while training (attention
    dropout takes pivotal_attention's chunked path); ``scale`` defaults to ``1/sqrt(2 D)``
    with ``D = embed_dim // num_heads``. ``forward(x, attn_mask=None)``: ``attn_mask``
    broadcastable to ``(B, H, N, N, N)`` (a boolean ``(B, 1, N, 1, N)`` mask stays on the
    fused path).
    """

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = False, dropout: float = 0.0,
                 scale: Optional[float] = None, device=None, dtype=None):
        super().__init__()
        op = "FloydAttention"
        _check_factory(op, device, dtype)
        embed_dim = check_int_attr(op, "embed_dim", embed_dim, 1)
        num_heads = check_int_attr(op, "num_heads", num_heads, 1)
        if embed_dim % num_heads != 0:
            invalid(op, f"embed_dim is {embed_dim}, expected a multiple of num_heads ({num_heads})")
        dropout = check_float_attr(op, "dropout", dropout)
        if not 0.0 <= dropout <= 1.0:
            invalid(op, f"dropout is {short_repr(dropout)}, expected a float in [0, 1]")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.scale = None if scale is None else check_float_attr(op, "scale", scale)
        factory = {"device": device, "dtype": dtype}
        self.c_qkv = nn.Linear(embed_dim, 5 * embed_dim, bias=bias, **factory)
        self.c_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.dropout_fn = nn.Dropout(self.dropout)

    def _check_input(self, x) -> None:
        op = "FloydAttention"
        require_tensor(op, "x", x)
        if x.dim() != 4:
            invalid(op, f"x has {x.dim()} dims (shape {tuple(x.shape)}), expected 4 dims (B, N, N, embed_dim)")
        if x.shape[1] != x.shape[2]:
            invalid(op, f"x has shape {tuple(x.shape)}, expected x.shape[1] == x.shape[2] (the N x N pair grid "
                        f"of (B, N, N, embed_dim)), got {x.shape[1]} != {x.shape[2]}")
        if x.shape[3] != self.embed_dim:
            invalid(op, f"x has shape {tuple(x.shape)}, expected x.shape[3] == embed_dim == {self.embed_dim}, "
                        f"got {x.shape[3]}")
        # what c_qkv (an nn.Linear) needs, said before it raises its own RuntimeError
        weight = self.c_qkv.weight
        if not x.is_floating_point():
            invalid(op, f"x has dtype {dtype_name(x.dtype)}, expected a floating dtype")
        if x.device != weight.device:
            invalid(op, f"x is on {x.device}, expected the device of the parameters ({weight.device})")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            invalid(op, f"x has dtype {dtype_name(x.dtype)}, expected the dtype of the parameters "
                        f"({dtype_name(weight.dtype)}) outside autocast")

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None) -> Tensor:
        self._check_input(x)
        return pair_attention(self, x, attn_mask, self.scale)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"scale={self.scale if self.scale is not None else 1 / math.sqrt(2 * self.head_dim)}")
