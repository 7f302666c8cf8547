"""Floyd (pivotal) attention in plain PyTorch, in bounded memory (OPERATORS.md section 5).

``S[n,m,k] = scale * (Q[n,m]·K1[n,k] + Q[n,m]·K2[k,m])``, softmax over the pivot k,
``Y[n,m] = sum_k P[n,m,k] (V1[n,k] + V2[k,m])``. The whole score tensor ``[B,H,N,M,K]`` is
cubic, so both passes walk tiles of (n, m) whose score block stays under
``CHUNK_ELEMENTS``; every gradient is either local to a tile (dQ) or a sum over tiles
(dK1/dV1 over m, dK2/dV2 over n), so one walk suffices for the backward too. The walk is
m-tile by m-tile, so the pivot-major copies of K2/V2 (and their gradients) are one m-slice at
a time: extra memory is a few tiles, independent of N*M*K.
"""
from __future__ import annotations

import math

import torch

from ..ops._checks import stat_dtype

FLT_MAX = 3.4028234663852886e38  # CANN fills masked scores with -FLT_MAX in every dtype
CHUNK_ELEMENTS = 1 << 20  # score elements per tile: 4 MiB in float32


def tiles(b, h, n, m, k, budget=None):
    """``(m0, m1, [(n0, n1), ...])``: m-tiles, each with the n-tiles that cover N, such that
    a tile holds at most ~budget scores.

    Tiles are as square as N and M allow: the backward contracts over m inside a tile (dK1,
    dV1) and over n (dK2, dV2), and a thin tile would make one of those contractions short.
    """
    if b * h * n * m == 0:  # nothing to compute (and no pivot axis to reduce when K = 0 too)
        return
    budget = CHUNK_ELEMENTS if budget is None else budget
    pairs = max(1, budget // max(1, b * h * k))  # (n, m) pairs per tile
    cm = min(m, max(1, math.isqrt(pairs)))
    cn = min(n, max(1, pairs // cm))
    if cn == n:  # N is short: give the rest of the budget to M
        cm = min(m, max(1, pairs // cn))
    n_tiles = [(n0, min(n, n0 + cn)) for n0 in range(0, n, cn)]
    for m0 in range(0, m, cm):
        yield m0, min(m, m0 + cm), n_tiles


def _pivot_major(t):
    """An m-slice of K2/V2 ``[B,H,K,cm,D]`` -> ``[B,H,cm,K,D]`` (contiguous): the K2/V2
    products are batched over m, so with m leading they are plain batched matmuls."""
    return t.permute(0, 1, 3, 2, 4).contiguous()


def _scores(qc, k1c, k2c, maskc, scale):
    """Scores of one tile ``[B,H,cn,cm,K]``: qc ``[B,H,cn,cm,D]``, k1c ``[B,H,cn,K,D]``,
    k2c ``[B,H,cm,K,D]`` (pivot-major); masked scores are -FLT_MAX."""
    s = torch.matmul(qc, k1c.transpose(-1, -2))
    s += torch.matmul(qc.transpose(2, 3), k2c.transpose(-1, -2)).transpose(2, 3)
    s *= scale
    if maskc is not None:
        s.masked_fill_(maskc, -FLT_MAX)
    return s


def _pv(p, v1c, v2c):
    """``sum_k P[n,m,k] (V1[n,k] + V2[k,m])`` for one tile; v2c pivot-major."""
    return torch.matmul(p, v1c) + torch.matmul(p.transpose(2, 3), v2c).transpose(2, 3)


def floyd_attention(q, k1, v1, k2, v2, mask, scale):
    dtype = q.dtype
    acc = stat_dtype(dtype)
    q, k1, v1, k2, v2 = (t.to(acc) for t in (q, k1, v1, k2, v2))
    b, h, n, m, d = q.shape
    kk = k1.shape[3]
    out = torch.empty((b, h, n, m, v1.shape[-1]), dtype=acc, device=q.device)
    smax = torch.empty((b, h, n, m), dtype=acc, device=q.device)
    ssum = torch.empty((b, h, n, m), dtype=acc, device=q.device)
    for m0, m1, n_tiles in tiles(b, h, n, m, kk):
        mt = slice(m0, m1)
        k2m, v2m = _pivot_major(k2[:, :, :, mt]), _pivot_major(v2[:, :, :, mt])
        for n0, n1 in n_tiles:
            nt = slice(n0, n1)
            s = _scores(q[:, :, nt, mt], k1[:, :, nt], k2m, None if mask is None else mask[:, :, nt], scale)
            mx = s.amax(dim=-1)
            p = torch.exp(s - mx[..., None])
            l = p.sum(dim=-1)
            out[:, :, nt, mt] = _pv(p, v1[:, :, nt], v2m) / l[..., None]
            smax[:, :, nt, mt] = mx
            ssum[:, :, nt, mt] = l
    return out.to(dtype), smax, ssum


def floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask, scale, kv2_dtype=None):
    """As the kernels' (``kv2_dtype``: dK2/dV2's dtype, q's by default)."""
    dtype = q.dtype
    acc = stat_dtype(dtype)
    kv2_dtype = dtype if kv2_dtype is None else kv2_dtype
    # ``out`` (Y) is not read: Dr = sum_k P dP below (OPERATORS.md section 5, "Dr and precision")
    dy, q, k1, v1, k2, v2 = (t.to(acc) for t in (dy, q, k1, v1, k2, v2))
    smax, ssum = softmax_max.to(acc), softmax_sum.to(acc)
    b, h, n, m, d = q.shape
    kk = k1.shape[3]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk1 = torch.zeros(k1.shape, dtype=acc, device=q.device)
    dv1 = torch.zeros(v1.shape, dtype=acc, device=q.device)
    dk2 = torch.zeros(k2.shape, dtype=acc, device=q.device)
    dv2 = torch.zeros(v2.shape, dtype=acc, device=q.device)
    for m0, m1, n_tiles in tiles(b, h, n, m, kk):
        mt = slice(m0, m1)
        k2m, v2m = _pivot_major(k2[:, :, :, mt]), _pivot_major(v2[:, :, :, mt])
        dk2m, dv2m = torch.zeros_like(k2m), torch.zeros_like(v2m)  # pivot-major, summed over n
        for n0, n1 in n_tiles:
            nt = slice(n0, n1)
            qc, dyc = q[:, :, nt, mt], dy[:, :, nt, mt]
            k1c, v1c = k1[:, :, nt], v1[:, :, nt]
            maskc = None if mask is None else mask[:, :, nt]
            p = torch.exp(_scores(qc, k1c, k2m, maskc, scale) - smax[:, :, nt, mt, None])
            p /= ssum[:, :, nt, mt, None]
            dp = torch.matmul(dyc, v1c.transpose(-1, -2))
            dp += torch.matmul(dyc.transpose(2, 3), v2m.transpose(-1, -2)).transpose(2, 3)
            # Dr = sum_k P dP in acc, not dY.Y: equal in exact arithmetic, but Y is the output
            # rounded to the input dtype, and with values of a large common mean dP - dY.Y
            # cancels down to that rounding. From P and dP, dS is exactly zero where P is
            # one-hot (a single pivot): the exact derivative.
            dr = (p * dp).sum(dim=-1, keepdim=True)
            ds = p * (dp - dr) * scale
            del dp
            if maskc is not None:
                ds.masked_fill_(maskc, 0.0)  # a masked score is a constant: no gradient
            # the K2/V2 products are batched over m: lay ds and p out m-major once, use twice
            ds_m, p_m = ds.transpose(2, 3).contiguous(), p.transpose(2, 3).contiguous()  # [B,H,cm,cn,K]
            dq[:, :, nt, mt] = torch.matmul(ds, k1c) + torch.matmul(ds_m, k2m).transpose(2, 3)
            dk1[:, :, nt] += torch.matmul(ds.transpose(-1, -2), qc)  # sum over m
            dv1[:, :, nt] += torch.matmul(p.transpose(-1, -2), dyc)
            dk2m += torch.matmul(ds_m.transpose(-1, -2), qc.transpose(2, 3))  # sum over n
            dv2m += torch.matmul(p_m.transpose(-1, -2), dyc.transpose(2, 3))
        dk2[:, :, :, mt] = dk2m.permute(0, 1, 3, 2, 4)
        dv2[:, :, :, mt] = dv2m.permute(0, 1, 3, 2, 4)
    return tuple(t.to(dtype) for t in (dq, dk1, dv1)) + tuple(t.to(kv2_dtype) for t in (dk2, dv2))


def plan(q, k1, v1, k2, v2, mask, scale):
    """The backend's ``plan`` (docs/backends.md): this backend works a call out as it runs it, so
    its plan keeps the scale only."""
    return _Launches(scale)


class _Launches:
    """``forward`` and ``backward`` of calls at one scale; ``current()`` is itself."""

    def __init__(self, scale):
        self._scale = scale

    def current(self):
        return self

    def forward(self, q, k1, v1, k2, v2, mask):
        return floyd_attention(q, k1, v1, k2, v2, mask, self._scale)

    def backward(self, dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, kv2_dtype=None):
        return floyd_attention_grad(dy, q, k1, v1, k2, v2, None, softmax_max, softmax_sum, mask, self._scale,
                                    kv2_dtype)
