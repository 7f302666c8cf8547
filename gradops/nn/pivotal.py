"""``pivotal_attention``: FloydNet's functional API, differentiable, in bounded memory.

Signature and semantics of ``floydnet.pivotal_attention`` (github.com/ocx-lab/FloydNet,
``src/floydnet/functional.py``), with FloydNet's index names: for each pair (i, k) the
softmax runs over the pivot j,

    s[b,h,i,k,j] = scale * (q_ik[i,k] . k_ij[i,j] + q_ik[i,k] . k_jk[j,k])
    s = softmax_cap * tanh(s / softmax_cap)            if softmax_cap > 0
    s = s.masked_fill(attn_mask, -inf)                 if attn_mask is boolean
    s = s + attn_mask                                  otherwise (any other dtype is additive)
    p = softmax_j(s);  p = dropout(p)                  if dropout > 0 (always applied: the
                                                       caller passes 0.0 in eval, as FloydNet's
                                                       blocks do)
    y[i,k] = sum_j p[i,k,j] * (v_ij[i,j] + v_jk[j,k])

``attn_mask`` broadcasts to ``[B, H, L_i, L_k, L_j]`` (pivot last); ``scale`` defaults to
``1/sqrt(2 D)``; ``inf`` is the magnitude a boolean mask writes.

Two paths:
- fused: gradops' Floyd attention operator (``gradops.nn.functional.floyd_attention``),
  taken when there is no dropout, no cap, and the mask is None or boolean and constant over
  heads and over k (it then reduces to the operator's ``[B,1,N,1,K]``). The operator excludes
  a masked pivot exactly, where FloydNet writes the finite ``-inf`` value; the two agree
  whenever ``exp(-inf - max)`` underflows, so the fused path also requires
  ``inf >= FUSED_MIN_INF``, and a finite ``inf`` (FloydNet's fully masked row is NaN at
  ``inf = float("inf")``, the operator's uniform).
- chunked: everything else (dropout, the cap, additive masks, masks varying over heads or
  over k, a small ``inf``). Plain PyTorch autograd over tiles of (i, k) whose scores stay
  under ``TILE_ELEMENTS``; each tile is wrapped in activation checkpointing, so neither the
  forward nor the backward ever holds the whole ``[B,H,L_i,L_k,L_j]`` tensor (dropout masks
  are regenerated identically in the recomputation: checkpoint restores the RNG state).
  Half-precision inputs compute in float32 there, as in the fused operator.

Under ``torch.autocast`` both paths first cast the floating inputs to the autocast dtype
(attention is matmul-like, as ``scaled_dot_product_attention``; float64 inputs stay float64,
as torch's autocast leaves them) and then compute in float32 inside.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as torch_F
from torch.utils.checkpoint import checkpoint

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ..ops import _plans
from ..ops._checks import check_float_attr, dtype_name, require_tensor, short_repr
from ._custom_ops import DTENSOR_HANDLERS, autocast_eligible, takes_eager_path
from ._floyd import autocast_inputs, eager_call, floyd_attention, run_eager

__all__ = ["pivotal_attention", "TILE_ELEMENTS", "FUSED_MIN_INF"]

# Scores per tile of the chunked path (float32: 8 MiB per score-sized temporary).
TILE_ELEMENTS = 1 << 21
# Below this mask magnitude a masked pivot may keep a visible share of the softmax, which the
# fused operator (exact exclusion) would not reproduce: take the literal chunked path.
FUSED_MIN_INF = 1e4

_OP = "pivotal_attention"


def _fail(message: str, status: int = ACLNN_ERR_PARAM_INVALID, op: str = _OP):
    raise AclnnError(status, f"{op}: {message}")


def _check_inputs(q_ik, k_ij, k_jk, v_ij, v_jk, op):
    named = (("q_ik", q_ik), ("k_ij", k_ij), ("k_jk", k_jk), ("v_ij", v_ij), ("v_jk", v_jk))
    for name, t in named:  # None -> 161001, a non-tensor -> AclnnTypeError, before any other rule
        require_tensor(op, name, t)
    for name, t in named:
        if t.dim() != 5:
            _fail(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}), expected 5 dims (B, H, ., ., D)", op=op)
        if not t.is_floating_point():
            _fail(f"{name} has dtype {dtype_name(t.dtype)}, expected a floating dtype", op=op)
        if t.dtype != q_ik.dtype:
            _fail(f"{name} has dtype {dtype_name(t.dtype)}, expected the dtype of q_ik ({dtype_name(q_ik.dtype)})",
                  op=op)
        if t.device != q_ik.device:
            _fail(f"{name} is on {t.device}, expected the device of q_ik ({q_ik.device})", op=op)
    b, h, li, lk, d = q_ik.shape
    lj = k_ij.shape[3]
    for name, t, shape, rule in (("k_ij", k_ij, (b, h, li, lj, d), "(B, H, L_i, L_j, D)"),
                                 ("v_ij", v_ij, (b, h, li, lj, d), "(B, H, L_i, L_j, D) of k_ij"),
                                 ("k_jk", k_jk, (b, h, lj, lk, d), "(B, H, L_j, L_k, D)"),
                                 ("v_jk", v_jk, (b, h, lj, lk, d), "(B, H, L_j, L_k, D) of k_jk")):
        if tuple(t.shape) != shape:
            _fail(f"{name} has shape {tuple(t.shape)}, expected {rule} == {shape} "
                  f"(q_ik is (B, H, L_i, L_k, D) == {tuple(q_ik.shape)})", op=op)
    return b, h, li, lk, lj, d


def broadcast_mask(attn_mask, full_shape, layout, device, op):
    """The mask with leading singleton dims added, checked to broadcast to ``full_shape``
    (``layout`` names its dims in messages, e.g. "(B, H, L_i, L_k, L_j)")."""
    require_tensor(op, "attn_mask", attn_mask)  # not None here: a non-tensor is an AclnnTypeError
    if attn_mask.is_complex():
        _fail(f"attn_mask has dtype {dtype_name(attn_mask.dtype)}, expected bool (True removes the pivot) or a "
              f"real dtype (an additive mask)", op=op)
    if attn_mask.device != device:
        _fail(f"attn_mask is on {attn_mask.device}, expected the device of the query ({device})", op=op)
    rank = len(full_shape)
    if attn_mask.dim() > rank:
        _fail(f"attn_mask has {attn_mask.dim()} dims, expected at most {rank}, broadcastable to "
              f"{layout} == {tuple(full_shape)}", op=op)
    mask = attn_mask.reshape((1,) * (rank - attn_mask.dim()) + tuple(attn_mask.shape))
    for size, full in zip(mask.shape, full_shape):
        if size not in (1, full):
            _fail(f"attn_mask has shape {tuple(attn_mask.shape)}, expected a shape broadcastable to "
                  f"{layout} == {tuple(full_shape)}", op=op)
    return mask


def check_floats(op, dropout, scale, inf, softmax_cap, default_scale):
    """``(dropout, scale, inf, softmax_cap)`` of a call, checked, as Python floats; a None
    ``scale`` is ``default_scale``."""
    dropout = check_float_attr(op, "dropout", dropout)
    if not 0.0 <= dropout <= 1.0:
        _fail(f"dropout is {short_repr(dropout)}, expected a float in [0, 1]", op=op)
    scale = default_scale if scale is None else check_float_attr(op, "scale", scale)
    inf = check_float_attr(op, "inf", inf)
    softmax_cap = check_float_attr(op, "softmax_cap", softmax_cap)
    return float(dropout), float(scale), float(inf), float(softmax_cap)


def excludes_masked_pivots(inf: float) -> bool:
    """Whether FloydNet's boolean mask at this ``inf`` removes a masked pivot as the fused
    operators do: ``exp(-inf - max)`` underflows (``inf >= FUSED_MIN_INF``) and a fully masked
    row is uniform, not NaN (``inf`` finite: FloydNet's ``-inf`` row softmaxes to NaN)."""
    return FUSED_MIN_INF <= inf < math.inf


def _operator_mask(attn_mask, b, li, lj):
    """The operator's ``[B,1,L_i,1,L_j]`` mask of a boolean ``attn_mask`` constant over heads and
    k: ``attn_mask`` itself when it is that already (contiguous), else expanded and copied."""
    if tuple(attn_mask.shape) == (b, 1, li, 1, lj) and attn_mask.is_contiguous():
        return attn_mask
    mask = attn_mask.reshape((1,) * (5 - attn_mask.dim()) + tuple(attn_mask.shape))
    return mask.expand(b, 1, li, 1, lj).contiguous()


def _autocast_dtype(device_type: str):
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _tile(q, k1, v1, k2, v2, mask, scale: float, softmax_cap: float, inf: float, dropout: float):
    """FloydNet's formula on one tile, in float32 for half inputs; returns the input dtype."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qs = q.to(compute) * scale
    k1, v1, k2, v2 = (t.to(compute) for t in (k1, v1, k2, v2))
    s = torch.einsum("bhikd,bhijd->bhikj", qs, k1) + torch.einsum("bhikd,bhjkd->bhikj", qs, k2)
    p = floydnet_weights(s, mask, softmax_cap, inf, dropout)
    y = torch.einsum("bhikj,bhijd->bhikd", p, v1) + torch.einsum("bhikj,bhjkd->bhikd", p, v2)
    return y.to(q.dtype)


def floydnet_weights(s, mask, softmax_cap: float, inf: float, dropout: float):
    """FloydNet's attention weights from a tile's scores ``s`` (pivot last, in the compute
    dtype), as both ``pivotal_attention`` and ``pivotal_attention3`` compute them: the cap,
    the mask, the softmax over the pivot, dropout."""
    if softmax_cap > 0:
        s = softmax_cap * torch.tanh(s / softmax_cap)
    if mask is not None:
        # an additive mask is added in the compute dtype (a float64 mask beside float32 scores
        # would otherwise promote the scores to float64 and fail against the float32 values)
        s = s.masked_fill(mask, -inf) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    p = torch.softmax(s, dim=-1)
    if dropout > 0.0:
        p = torch_F.dropout(p, p=dropout)  # training=True, as FloydNet: the caller decides
    return p


def _chunked(q, k1, k2, v1, v2, mask, scale, softmax_cap, inf, dropout):
    b, h, li, lk, d = q.shape
    lj = k1.shape[3]
    if li * lk == 0:  # no (i, k) row: one empty tile (FloydNet's empty result, and its graph)
        return _tile(q, k1, v1, k2, v2, mask, scale, softmax_cap, inf, dropout)
    per_k = max(1, b * h * lj)
    ck = lk if per_k * lk <= TILE_ELEMENTS else max(1, TILE_ELEMENTS // per_k)
    ci = max(1, TILE_ELEMENTS // (per_k * ck))
    tracked = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k1, k2, v1, v2) + ((mask,) if mask is not None else ()))
    rows = []
    for i0 in range(0, li, ci):
        i1 = min(li, i0 + ci)
        cols = []
        for k0 in range(0, lk, ck):
            k1_ = min(lk, k0 + ck)
            tile_mask = None
            if mask is not None:
                tile_mask = mask[:, :, i0:i1] if mask.shape[2] != 1 else mask
                tile_mask = tile_mask[:, :, :, k0:k1_] if mask.shape[3] != 1 else tile_mask
            args = (q[:, :, i0:i1, k0:k1_], k1[:, :, i0:i1], v1[:, :, i0:i1],
                    k2[:, :, :, k0:k1_], v2[:, :, :, k0:k1_], tile_mask,
                    scale, softmax_cap, inf, dropout)
            if tracked:
                # keep only the tile's inputs for backward; scores are recomputed tile by tile
                cols.append(checkpoint(_tile, *args, use_reentrant=False))
            else:
                cols.append(_tile(*args))
        rows.append(cols[0] if len(cols) == 1 else torch.cat(cols, dim=3))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)


class PivotalCall(NamedTuple):
    """A checked call: its path (``fused``), the operator's ``[B,1,L_i,1,L_j]`` mask on the fused
    path, the 5-d mask on the chunked one, and the float arguments."""

    fused: bool
    mask: Optional[torch.Tensor]
    scale: float
    inf: float
    softmax_cap: float
    dropout: float


def resolve(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask, dropout, scale, inf, softmax_cap, op: str = _OP) -> PivotalCall:
    """Every check of a call, and which path takes it (the module docstring's rules)."""
    b, h, li, lk, lj, d = _check_inputs(q_ik, k_ij, k_jk, v_ij, v_jk, op)
    # with D = 0 every score is 0 whatever the scale: any finite one will do
    dropout, scale, inf, softmax_cap = check_floats(op, dropout, scale, inf, softmax_cap,
                                                    1.0 / math.sqrt(2.0 * d) if d else 1.0)
    full_shape = (b, h, li, lk, lj)
    mask = None if attn_mask is None else broadcast_mask(attn_mask, full_shape, "(B, H, L_i, L_k, L_j)", q_ik.device, op)

    fusable_mask = mask is None or (mask.dtype == torch.bool and mask.shape[1] == 1 and mask.shape[3] == 1
                                    and excludes_masked_pivots(inf))
    if dropout == 0.0 and not softmax_cap > 0 and fusable_mask:
        fused_mask = None if mask is None else _operator_mask(attn_mask, b, li, lj)
        return PivotalCall(True, fused_mask, scale, inf, softmax_cap, dropout)
    return PivotalCall(False, mask, scale, inf, softmax_cap, dropout)


def chunked(call: PivotalCall, q_ik, k_ij, k_jk, v_ij, v_jk) -> torch.Tensor:
    """The chunked path of a resolved call (autocast as the module docstring says)."""
    dtype = _autocast_dtype(q_ik.device.type)
    tensors = (q_ik, k_ij, k_jk, v_ij, v_jk)
    if dtype is not None:
        tensors = tuple(t.to(dtype) if autocast_eligible(t, q_ik.device.type) else t for t in tensors)
    with torch.autocast(device_type=q_ik.device.type, enabled=False):
        return _chunked(*tensors, call.mask, call.scale, call.softmax_cap, call.inf, call.dropout)


def pivotal_attention(
    q_ik: torch.Tensor,
    k_ij: torch.Tensor,
    k_jk: torch.Tensor,
    v_ij: torch.Tensor,
    v_jk: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout: float = 0.0,
    scale: Optional[float] = None,
    inf: float = 1e9,
    softmax_cap: float = -1,
) -> torch.Tensor:
    """FloydNet's pivotal attention (``floydnet.pivotal_attention``'s signature and semantics).

    Shapes: ``q_ik (B,H,L_i,L_k,D)``, ``k_ij, v_ij (B,H,L_i,L_j,D)``, ``k_jk, v_jk
    (B,H,L_j,L_k,D)``; ``attn_mask`` broadcastable to ``(B,H,L_i,L_k,L_j)``: boolean (True
    removes the pivot: its score becomes ``-inf``) or additive (any other dtype). ``dropout``
    is applied to the attention weights whenever it is > 0; ``scale`` defaults to
    ``1/sqrt(2 D)``; ``softmax_cap > 0`` caps the scores with ``cap * tanh(s / cap)`` before
    the mask. Returns ``(B,H,L_i,L_k,D)`` in q_ik's dtype. Views (permuted, non-contiguous)
    are accepted as they are.

    Uses gradops' fused operator when it can (no dropout, no cap, mask None or boolean of
    shape broadcastable to ``(B,1,L_i,1,L_j)``), else a bounded-memory chunked path; see the
    module docstring.
    """
    eager = takes_eager_path(q_ik)
    if eager:
        key = _plans.signature(_OP, None, (q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask),
                               (dropout, scale, inf, softmax_cap, _autocast_dtype(q_ik.device.type)))
        remembered = _plans.lookup(key)
        if remembered is not None:
            return remembered.run(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask)
    if type(q_ik).__name__ == "DTensor":  # row-sharded over its mesh, every path (docs/distributed.md)
        return DTENSOR_HANDLERS["pivotal_attention"](q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask, dropout, scale, inf,
                                                     softmax_cap)
    call = resolve(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask, dropout, scale, inf, softmax_cap)
    if not call.fused:
        return chunked(call, q_ik, k_ij, k_jk, v_ij, v_jk)
    if not eager:
        return _fused(q_ik, k_ij, k_jk, v_ij, v_jk, call.mask, call.scale)
    cast = autocast_inputs((q_ik, k_ij, k_jk, v_ij, v_jk))
    fused = _FusedCall(call.mask is attn_mask or attn_mask is None, q_ik.shape[0], q_ik.shape[2], k_ij.shape[3],
                       eager_call(cast[0], cast[1], cast[3], cast[2], cast[4], call.mask, call.scale, None))
    return _plans.remember(key, fused).run(q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask)


def _fused(q_ik, k_ij, k_jk, v_ij, v_jk, mask, scale: float, eager=None):
    """The fused path: gradops' Floyd attention operator, through its remembered ``eager`` call
    where there is one (``eager_call``; the tensors then cast as autocast casts them)."""
    # gradops' argument order is (q, k1, v1, k2, v2); FloydNet's is (q, k_ij, k_jk, v_ij, v_jk)
    if eager is not None:
        return run_eager(q_ik, k_ij, v_ij, k_jk, v_jk, mask, eager)
    return floyd_attention(q_ik, k_ij, v_ij, k_jk, v_jk, mask=mask, scale=scale)


class _FusedCall(NamedTuple):
    """A call signature :func:`pivotal_attention` has seen take the fused path, remembered:
    whether its ``attn_mask`` is the operator's mask as it is (or None), the sizes a broadcast
    one is expanded to, and the operator's eager call."""

    mask_as_is: bool
    b: int
    li: int
    lj: int
    floyd: tuple

    def run(self, q_ik, k_ij, k_jk, v_ij, v_jk, attn_mask):
        q_ik, k_ij, k_jk, v_ij, v_jk = autocast_inputs((q_ik, k_ij, k_jk, v_ij, v_jk))
        mask = attn_mask if self.mask_as_is else _operator_mask(attn_mask, self.b, self.li, self.lj)
        return _fused(q_ik, k_ij, k_jk, v_ij, v_jk, mask, self.floyd[1], self.floyd)
