"""Floyd (pivotal) attention in plain PyTorch, in bounded memory (OPERATORS.md section 5).

``S[n,m,k] = scale * (Q[n,m]·K1[n,k] + Q[n,m]·K2[k,m])``, softmax over the pivot k,
``Y[n,m] = sum_k P[n,m,k] (V1[n,k] + V2[k,m])``. The whole score tensor ``[B,H,N,M,K]`` is
cubic, so both passes walk tiles of (n, m) whose score block stays under
``CHUNK_ELEMENTS``; every gradient is either local to a tile (dQ) or a sum over tiles
(dK1/dV1 over m, dK2/dV2 over n), so one walk suffices for the backward too.
"""
from __future__ import annotations

import torch

from ..ops._checks import stat_dtype

FLT_MAX = 3.4028234663852886e38  # CANN fills masked scores with -FLT_MAX in every dtype
CHUNK_ELEMENTS = 1 << 21  # score elements per tile: 8 MiB in float32


def tiles(b, h, n, m, k, budget=CHUNK_ELEMENTS):
    """(n0, n1, m0, m1) tiles covering N x M with at most ~budget scores each."""
    per_m = max(1, b * h * k)
    cm = m if per_m * m <= budget else max(1, budget // per_m)
    cn = max(1, budget // (per_m * cm))
    for n0 in range(0, n, cn):
        for m0 in range(0, m, cm):
            yield n0, min(n, n0 + cn), m0, min(m, m0 + cm)


def _scores(q, k1, k2, mask, scale, n0, n1, m0, m1):
    """Scores of one tile ``[B,H,cn,cm,K]``, masked ones set to -FLT_MAX."""
    qc = q[:, :, n0:n1, m0:m1]
    s = torch.einsum("bhnmd,bhnkd->bhnmk", qc, k1[:, :, n0:n1])
    s += torch.einsum("bhnmd,bhkmd->bhnmk", qc, k2[:, :, :, m0:m1])
    s *= scale
    if mask is not None:
        s.masked_fill_(mask[:, :, n0:n1], -FLT_MAX)
    return s


def floyd_attention(q, k1, v1, k2, v2, mask, scale):
    dtype = q.dtype
    acc = stat_dtype(dtype)
    q, k1, v1, k2, v2 = (t.to(acc) for t in (q, k1, v1, k2, v2))
    b, h, n, m, d = q.shape
    kk = k1.shape[3]
    out = torch.empty((b, h, n, m, v1.shape[-1]), dtype=acc, device=q.device)
    smax = torch.empty((b, h, n, m), dtype=acc, device=q.device)
    ssum = torch.empty((b, h, n, m), dtype=acc, device=q.device)
    for n0, n1, m0, m1 in tiles(b, h, n, m, kk):
        s = _scores(q, k1, k2, mask, scale, n0, n1, m0, m1)
        mx = s.amax(dim=-1)
        p = torch.exp(s - mx[..., None])
        l = p.sum(dim=-1)
        y = torch.einsum("bhnmk,bhnkd->bhnmd", p, v1[:, :, n0:n1])
        y += torch.einsum("bhnmk,bhkmd->bhnmd", p, v2[:, :, :, m0:m1])
        out[:, :, n0:n1, m0:m1] = y / l[..., None]
        smax[:, :, n0:n1, m0:m1] = mx
        ssum[:, :, n0:n1, m0:m1] = l
    return out.to(dtype), smax, ssum


def floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask, scale):
    dtype = q.dtype
    acc = stat_dtype(dtype)
    dy, q, k1, v1, k2, v2, out = (t.to(acc) for t in (dy, q, k1, v1, k2, v2, out))
    smax, ssum = softmax_max.to(acc), softmax_sum.to(acc)
    b, h, n, m, d = q.shape
    kk = k1.shape[3]
    dr = (dy * out).sum(dim=-1)  # Dr[n,m] = rowsum(dY * Y)
    dq = torch.empty_like(q)
    dk1, dv1 = torch.zeros_like(k1), torch.zeros_like(v1)
    dk2, dv2 = torch.zeros_like(k2), torch.zeros_like(v2)
    for n0, n1, m0, m1 in tiles(b, h, n, m, kk):
        nt, mt = slice(n0, n1), slice(m0, m1)
        s = _scores(q, k1, k2, mask, scale, n0, n1, m0, m1)
        p = torch.exp(s - smax[:, :, nt, mt, None]) / ssum[:, :, nt, mt, None]
        qc, dyc = q[:, :, nt, mt], dy[:, :, nt, mt]
        dp = torch.einsum("bhnmd,bhnkd->bhnmk", dyc, v1[:, :, nt])
        dp += torch.einsum("bhnmd,bhkmd->bhnmk", dyc, v2[:, :, :, mt])
        ds = p * (dp - dr[:, :, nt, mt, None]) * scale
        if mask is not None:
            ds.masked_fill_(mask[:, :, nt], 0.0)  # a masked score is a constant: no gradient
        dq[:, :, nt, mt] = (torch.einsum("bhnmk,bhnkd->bhnmd", ds, k1[:, :, nt])
                            + torch.einsum("bhnmk,bhkmd->bhnmd", ds, k2[:, :, :, mt]))
        dk1[:, :, nt] += torch.einsum("bhnmk,bhnmd->bhnkd", ds, qc)
        dv1[:, :, nt] += torch.einsum("bhnmk,bhnmd->bhnkd", p, dyc)
        dk2[:, :, :, mt] += torch.einsum("bhnmk,bhnmd->bhkmd", ds, qc)
        dv2[:, :, :, mt] += torch.einsum("bhnmk,bhnmd->bhkmd", p, dyc)
    return tuple(t.to(dtype) for t in (dq, dk1, dv1, dk2, dv2))
