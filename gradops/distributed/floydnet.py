"""A FloydNet block (``floydnet.PivotalAttentionBlock``, PyPI floydnet 1.1.0) run on this rank's
rows of the grid: the block's own modules and parameters, with its two operations that reach
across rows (the pivotal attention and the symmetric mix's transpose) row-sharded."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from .grid import pivotal_attention, transpose_rows


class RowShardedBlock(nn.Module):
    """``block`` (a ``floydnet.PivotalAttentionBlock``) on the rows of a grid ``[B, L, L, C]``
    sharded along dim 1 over ``group``: ``forward(x, attn_mask)`` takes this rank's rows
    ``[B, L_r, L, C]`` (and of the mask, ``[B, H, L_r, L, L]`` or broadcastable) and returns
    the block's output at those rows. Every other operation of the block (projections,
    norms, FFN) is per cell and runs on the rows as they are; its parameters are replicated:
    all-reduce their gradients (DDP) on a group other than ``group``. Norms that mix cells
    (BatchNorm) would need the whole grid's statistics, and are refused.
    """

    def __init__(self, block: nn.Module, group=None):
        super().__init__()
        norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, "RowShardedBlock: the block has a BatchNorm, whose statistics "
                                                      "span every row of the grid; expected per-cell norms")
        self.block = block
        self.group = group

    def _attention(self, x: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
        block = self.block
        b, rows, cols, c = x.shape
        heads, head_dim = block.num_heads, block.head_dim

        def by_head(t):  # [B, L_r, L, C] -> [B, H, L_r, L, d]
            return t.reshape(b, rows, cols, heads, head_dim).permute(0, 3, 1, 2, 4)

        q_ik, k_ij, k_jk, v_ij, v_jk = (by_head(t) for t in torch.chunk(block.c_qkv(x), 5, dim=-1))
        # this rank's rows of the grid are its rows i of q/k_ij/v_ij and its pivot rows j of k_jk/v_jk
        y = pivotal_attention(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask=attn_mask,
                              dropout=block.dropout if block.training else 0.0, group=self.group)
        y = y.permute(0, 2, 3, 1, 4).reshape(b, rows, cols, c)
        return block.dropout_fn(block.c_proj(y))

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None) -> Tensor:
        block = self.block
        mixed = block.c_mix(transpose_rows(x, 1, 2, group=self.group)) if block.enable_symmetric_mix else 0
        if block.norm_position == "pre":
            x = x + self._attention(block.norm1(x + mixed), attn_mask)
            if block.enable_ffn:
                x = x + block.ffn(block.norm2(x)) * block.ffn_scale
            return x
        x = block.norm1(x + self._attention(x + mixed, attn_mask))
        if block.enable_ffn:
            x = block.norm2(x + block.ffn(x)) * block.ffn_scale
        return x
