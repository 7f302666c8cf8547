"""``pivotal_attention3``: FloydNet's 3-pivot attention, differentiable, in O(L^3) memory.

Signature and semantics of ``floydnet.pivotal_attention3`` (github.com/ocx-lab/FloydNet,
``src/floydnet/functional.py``): for each triple (i, j, k) the softmax runs over the pivot p,

    s[b,h,i,j,k,p] = scale * q_ijk[i,j,k] . (k_pjk[p,j,k] + k_ipk[i,p,k] + k_ijp[i,j,p])
    s = softmax_cap * tanh(s / softmax_cap)            if softmax_cap > 0
    s = s.masked_fill(attn_mask, -inf)                 if attn_mask is boolean
    s = s + attn_mask                                  otherwise (additive)
    p = softmax_p(s);  p = dropout(p)                  if dropout > 0 (always applied, as FloydNet)
    y[i,j,k] = sum_p p[i,j,k,p] * (v_pjk[p,j,k] + v_ipk[i,p,k] + v_ijp[i,j,p])

``attn_mask`` broadcasts to ``[B, H, L_i, L_j, L_k, L_p]`` (pivot last); ``scale`` defaults
to ``1/sqrt(3 D)``. FloydNet builds the whole ``[B,H,L_i,L_j,L_k,L_p]`` score tensor (L^4);
neither path here does.

Two paths, chosen as ``pivotal_attention`` chooses:
- fused: gradops' 3-Floyd operator (``gradops.nn.functional.floyd3_attention``), when there is
  no dropout, no cap, and the mask is None or boolean and constant over heads, with a finite
  ``inf >= FUSED_MIN_INF`` (the operator removes a masked pivot exactly, FloydNet writes
  ``-inf``: the two agree when ``exp(-inf - max)`` underflows and ``inf`` is finite:
  ``pivotal.excludes_masked_pivots``);
- chunked: everything else. Plain PyTorch autograd over tiles of (i, j), every k and pivot,
  whose scores stay under ``TILE_ELEMENTS``, each tile under activation checkpointing, so
  neither pass holds more than a tile of scores. Half inputs compute in float32 there.

Autocast as ``pivotal_attention``: floating inputs are cast to the autocast dtype first
(float64 stays float64), then everything computes in float32 inside.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..ops._checks import dtype_name, require_tensor
from ._custom_ops import autocast_eligible, backend_arg
from ._floyd3 import checked_call, refuse_dtensors
from .pivotal import _autocast_dtype, _fail, broadcast_mask, check_floats, excludes_masked_pivots, floydnet_weights

__all__ = ["pivotal_attention3", "TILE_ELEMENTS"]

# Scores per tile of the chunked path (float32: 2 MiB per score-sized temporary; autograd of a
# tile holds a few).
TILE_ELEMENTS = 1 << 19

_OP = "pivotal_attention3"
_MASK_LAYOUT = "(B, H, L_i, L_j, L_k, L_p)"


def _check_inputs(tensors):
    """Rank 6, one floating dtype and one device, FloydNet's shapes; returns (B, H, I, J, K, P, D)."""
    names = ("q_ijk", "k_pjk", "k_ipk", "k_ijp", "v_pjk", "v_ipk", "v_ijp")
    for name, t in zip(names, tensors):  # None -> 161001, a non-tensor -> AclnnTypeError, first
        require_tensor(_OP, name, t)
    refuse_dtensors(_OP, names, tensors)
    q = tensors[0]
    for name, t in zip(names, tensors):
        if t.dim() != 6:
            _fail(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}), expected 6 dims (B, H, ., ., ., D)", op=_OP)
        if not t.is_floating_point():
            _fail(f"{name} has dtype {dtype_name(t.dtype)}, expected a floating dtype", op=_OP)
        if t.dtype != q.dtype:
            _fail(f"{name} has dtype {dtype_name(t.dtype)}, expected the dtype of q_ijk ({dtype_name(q.dtype)})",
                  op=_OP)
        if t.device != q.device:
            _fail(f"{name} is on {t.device}, expected the device of q_ijk ({q.device})", op=_OP)
    b, h, i, j, k, d = q.shape
    p = tensors[1].shape[2]
    layouts = {"pjk": ((b, h, p, j, k, d), "(B, H, L_p, L_j, L_k, D)"),
               "ipk": ((b, h, i, p, k, d), "(B, H, L_i, L_p, L_k, D)"),
               "ijp": ((b, h, i, j, p, d), "(B, H, L_i, L_j, L_p, D)")}
    for name, t in zip(names[1:], tensors[1:]):
        shape, rule = layouts[name[2:]]
        if tuple(t.shape) != shape:
            _fail(f"{name} has shape {tuple(t.shape)}, expected {rule} == {shape} (q_ijk is "
                  f"(B, H, L_i, L_j, L_k, D) == {tuple(q.shape)}, L_p from k_pjk)", op=_OP)
    if p < 1 and b * h * i * j * k > 0:
        _fail(f"k_pjk has L_p = {p} pivots, expected at least 1 (a softmax over no pivots is undefined)", op=_OP)
    return b, h, i, j, k, p, d


def _tile(q, k1, k2, k3, v1, v2, v3, mask, scale: float, softmax_cap: float, inf: float, dropout: float):
    """FloydNet's formula on one tile of (i, j), in float32 for half inputs; returns q's dtype."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qs = q.to(compute) * scale
    k1, k2, k3, v1, v2, v3 = (t.to(compute) for t in (k1, k2, k3, v1, v2, v3))
    s = (torch.einsum("bhijkd,bhpjkd->bhijkp", qs, k1) + torch.einsum("bhijkd,bhipkd->bhijkp", qs, k2)
         + torch.einsum("bhijkd,bhijpd->bhijkp", qs, k3))
    p = floydnet_weights(s, mask, softmax_cap, inf, dropout)
    y = (torch.einsum("bhijkp,bhpjkd->bhijkd", p, v1) + torch.einsum("bhijkp,bhipkd->bhijkd", p, v2)
         + torch.einsum("bhijkp,bhijpd->bhijkd", p, v3))
    return y.to(q.dtype)


def _chunked(tensors, mask, scale, softmax_cap, inf, dropout):
    q, k1, k2, k3, v1, v2, v3 = tensors
    b, h, li, lj, lk, _ = q.shape
    if li * lj == 0:  # no (i, j) row: one empty tile (FloydNet's empty result, and its graph)
        return _tile(*tensors, mask, scale, softmax_cap, inf, dropout)
    lp = k1.shape[2]
    per_j = max(1, b * h * lk * lp)  # scores of one (i, j) pair
    cj = lj if per_j * lj <= TILE_ELEMENTS else max(1, TILE_ELEMENTS // per_j)
    ci = max(1, TILE_ELEMENTS // (per_j * cj))
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in tensors + ((mask,) if mask is not None else ()))
    rows = []
    for i0 in range(0, li, ci):
        it = slice(i0, min(li, i0 + ci))
        cols = []
        for j0 in range(0, lj, cj):
            jt = slice(j0, min(lj, j0 + cj))
            tile_mask = None
            if mask is not None:
                tile_mask = mask[:, :, it] if mask.shape[2] != 1 else mask
                tile_mask = tile_mask[:, :, :, jt] if mask.shape[3] != 1 else tile_mask
            args = (q[:, :, it, jt], k1[:, :, :, jt], k2[:, :, it], k3[:, :, it, jt],
                    v1[:, :, :, jt], v2[:, :, it], v3[:, :, it, jt], tile_mask, scale, softmax_cap, inf, dropout)
            # checkpointed: a tile keeps only its inputs for backward, its scores are recomputed
            cols.append(checkpoint(_tile, *args, use_reentrant=False) if tracked else _tile(*args))
        rows.append(cols[0] if len(cols) == 1 else torch.cat(cols, dim=3))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)


def pivotal_attention3(
    q_ijk: torch.Tensor,
    k_pjk: torch.Tensor,
    k_ipk: torch.Tensor,
    k_ijp: torch.Tensor,
    v_pjk: torch.Tensor,
    v_ipk: torch.Tensor,
    v_ijp: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout: float = 0.0,
    scale: Optional[float] = None,
    inf: float = 1e9,
    softmax_cap: float = -1,
) -> torch.Tensor:
    """FloydNet's 3-pivot attention (``floydnet.pivotal_attention3``'s signature and semantics).

    Shapes: ``q_ijk (B,H,L_i,L_j,L_k,D)``, ``k_pjk, v_pjk (B,H,L_p,L_j,L_k,D)``, ``k_ipk, v_ipk
    (B,H,L_i,L_p,L_k,D)``, ``k_ijp, v_ijp (B,H,L_i,L_j,L_p,D)``; ``attn_mask`` broadcastable
    to ``(B,H,L_i,L_j,L_k,L_p)``: boolean (True removes the pivot: its score becomes ``-inf``)
    or additive. ``dropout`` applies to the attention weights whenever it is > 0; ``scale``
    defaults to ``1/sqrt(3 D)``; ``softmax_cap > 0`` caps the scores with ``cap * tanh(s /
    cap)`` before the mask. Returns ``(B,H,L_i,L_j,L_k,D)`` in q_ijk's dtype. No path holds
    the L^4 score tensor: see the module docstring.
    """
    tensors = (q_ijk, k_pjk, k_ipk, k_ijp, v_pjk, v_ipk, v_ijp)
    b, h, i, j, k, p, d = _check_inputs(tensors)
    # with D = 0 every score is 0 whatever the scale: any finite one will do
    dropout, scale, inf, softmax_cap = check_floats(_OP, dropout, scale, inf, softmax_cap,
                                                    1.0 / math.sqrt(3.0 * d) if d else 1.0)
    mask = None
    if attn_mask is not None:
        mask = broadcast_mask(attn_mask, (b, h, i, j, k, p), _MASK_LAYOUT, q_ijk.device, _OP)
    fusable_mask = mask is None or (mask.dtype == torch.bool and mask.shape[1] == 1 and excludes_masked_pivots(inf))
    if dropout == 0.0 and not softmax_cap > 0 and fusable_mask:
        # gradops' argument order is (q, k1, v1, k2, v2, k3, v3); the tensors are checked above
        return checked_call((q_ijk, k_pjk, v_pjk, k_ipk, v_ipk, k_ijp, v_ijp), mask, scale, backend_arg(_OP, None))
    dtype = _autocast_dtype(q_ijk.device.type)
    if dtype is not None:
        tensors = tuple(t.to(dtype) if autocast_eligible(t, q_ijk.device.type) else t for t in tensors)
    with torch.autocast(device_type=q_ijk.device.type, enabled=False):
        return _chunked(tensors, mask, scale, softmax_cap, inf, dropout)
