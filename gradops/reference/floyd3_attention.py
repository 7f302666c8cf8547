"""3-Floyd (3-pivot) attention in plain PyTorch, in bounded memory (docs/operators.md, "3-Floyd").

For every triple (i, j, k) the softmax runs over the pivot p::

    s[i,j,k,p] = scale * q[i,j,k] . (k1[p,j,k] + k2[i,p,k] + k3[i,j,p])    masked -> -FLT_MAX
    y[i,j,k]   = sum_p softmax_p(s)[i,j,k,p] (v1[p,j,k] + v2[i,p,k] + v3[i,j,p])

q ``[B,H,I,J,K,D]``, k1/v1 ``[B,H,P,J,K,D]``, k2/v2 ``[B,H,I,P,K,D]``, k3/v3
``[B,H,I,J,P,D]``. The score tensor ``[B,H,I,J,K,P]`` is quartic, so both passes walk tiles
of (i, j), every k and every pivot, whose scores stay under ``CHUNK_ELEMENTS``. Each term is
a batched matmul over its own pair of axes: (j, k) for k1, (i, k) for k2, (i, j) for k3. In
the backward dQ is local to a tile, dK3/dV3 (a sum over k) and dK2/dV2 (a sum over j within
the tile's j range) are sums within or across the tiles of one i range, dK1/dV1 sums over
i ranges: one walk gives every gradient. Extra memory is a few score tiles, independent of
I*J*K*P.
"""
from __future__ import annotations

import math

import torch

from ..ops._checks import stat_dtype
from .floyd_attention import FLT_MAX

# Score elements per tile: 2 MiB in float32. Smaller than the 2-pivot reference's tile: the
# backward holds five score-sized temporaries, and a 3-Floyd problem's inputs are small
# beside its scores, so the tile is what its memory is made of.
CHUNK_ELEMENTS = 1 << 19


def tiles(b, h, i, j, k, p, budget=None):
    """``[(i0, i1, j0, j1), ...]``: tiles of (i, j) that cover I x J, each holding at most
    ~budget scores (all of k and p), as square as I and J allow (the backward contracts over
    i for dK1/dV1 and over j for dK2/dV2)."""
    if b * h * i * j * k == 0:
        return []
    budget = CHUNK_ELEMENTS if budget is None else budget
    pairs = max(1, budget // max(1, b * h * k * p))  # (i, j) pairs per tile
    cj = min(j, max(1, math.isqrt(pairs)))
    ci = min(i, max(1, pairs // cj))
    if ci == i:  # I is short: give the rest of the budget to J
        cj = min(j, max(1, pairs // ci))
    return [(i0, min(i, i0 + ci), j0, min(j, j0 + cj)) for i0 in range(0, i, ci) for j0 in range(0, j, cj)]


def _terms(x, t1, t2, t3):
    """``x . (t1[p,j,k] + t2[i,p,k] + t3[i,j,p])`` of one tile ``[B,H,ci,cj,K,P]``, summed in
    one order (the forward's scores and the backward's recomputed ones are then bitwise one)."""
    s = torch.einsum("bhijkd,bhpjkd->bhijkp", x, t1)
    s += torch.einsum("bhijkd,bhipkd->bhijkp", x, t2)
    s += torch.einsum("bhijkd,bhijpd->bhijkp", x, t3)
    return s


def _scores(q, k1, k2, k3, mask, scale):
    s = _terms(q, k1, k2, k3)
    s *= scale
    if mask is not None:
        s.masked_fill_(mask, -FLT_MAX)
    return s


def floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale):
    """``(out, softmax_max, softmax_sum)``: out in q's dtype, the statistics ``[B,H,I,J,K]``
    in the accumulation dtype (max of the scores, sum of exp(s - max))."""
    dtype = q.dtype
    acc = stat_dtype(dtype)
    q, k1, v1, k2, v2, k3, v3 = (t.to(acc) for t in (q, k1, v1, k2, v2, k3, v3))
    b, h, i, j, k, d = q.shape
    p = k1.shape[2]
    out = torch.zeros((b, h, i, j, k, d), dtype=acc, device=q.device)
    smax = torch.zeros((b, h, i, j, k), dtype=acc, device=q.device)
    ssum = torch.zeros((b, h, i, j, k), dtype=acc, device=q.device)
    for i0, i1, j0, j1 in tiles(b, h, i, j, k, p):
        it, jt = slice(i0, i1), slice(j0, j1)
        s = _scores(q[:, :, it, jt], k1[:, :, :, jt], k2[:, :, it], k3[:, :, it, jt],
                    None if mask is None else mask[:, :, it, jt], scale)
        mx = s.amax(dim=-1)
        s -= mx[..., None]
        e = s.exp_()
        l = e.sum(dim=-1)
        out[:, :, it, jt] = _values(e, v1[:, :, :, jt], v2[:, :, it], v3[:, :, it, jt]) / l[..., None]
        smax[:, :, it, jt] = mx
        ssum[:, :, it, jt] = l
    return out.to(dtype), smax, ssum


def _values(w, v1, v2, v3):
    """``sum_p w[i,j,k,p] (v1[p,j,k] + v2[i,p,k] + v3[i,j,p])`` of one tile."""
    y = torch.einsum("bhijkp,bhpjkd->bhijkd", w, v1)
    y += torch.einsum("bhijkp,bhipkd->bhijkd", w, v2)
    y += torch.einsum("bhijkp,bhijpd->bhijkd", w, v3)
    return y


def floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, softmax_max, softmax_sum, mask, scale):
    """``(dq, dk1, dv1, dk2, dv2, dk3, dv3)`` in q's dtype, from the forward's statistics
    (Y itself is not read: Dr = sum_p P dP, as the 2-pivot operator)."""
    dtype = q.dtype
    acc = stat_dtype(dtype)
    dy, q, k1, v1, k2, v2, k3, v3 = (t.to(acc) for t in (dy, q, k1, v1, k2, v2, k3, v3))
    smax, ssum = softmax_max.to(acc), softmax_sum.to(acc)
    b, h, i, j, k, d = q.shape
    p = k1.shape[2]
    grads = [torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k1, v1, k2, v2, k3, v3)]
    dq, dk1, dv1, dk2, dv2, dk3, dv3 = grads
    for i0, i1, j0, j1 in tiles(b, h, i, j, k, p):
        it, jt = slice(i0, i1), slice(j0, j1)
        qc, dyc = q[:, :, it, jt], dy[:, :, it, jt]
        k1c, v1c, k2c, v2c = k1[:, :, :, jt], v1[:, :, :, jt], k2[:, :, it], v2[:, :, it]
        k3c, v3c = k3[:, :, it, jt], v3[:, :, it, jt]
        maskc = None if mask is None else mask[:, :, it, jt]
        pr = _scores(qc, k1c, k2c, k3c, maskc, scale)
        pr -= smax[:, :, it, jt, :, None]
        pr = pr.exp_()
        pr /= ssum[:, :, it, jt, :, None]
        dp = _terms(dyc, v1c, v2c, v3c)
        # Dr = sum_p P dP in acc, not dY.Y (Y is rounded to the input dtype; a one-hot P then
        # gives exactly dS = 0, the exact derivative)
        dr = (pr * dp).sum(dim=-1, keepdim=True)
        dp -= dr
        dp *= pr
        dp *= scale
        ds = dp
        if maskc is not None:
            ds.masked_fill_(maskc, 0.0)  # a masked score is a constant: no gradient
        dq[:, :, it, jt] = _values(ds, k1c, k2c, k3c)
        dk1[:, :, :, jt] += torch.einsum("bhijkp,bhijkd->bhpjkd", ds, qc)  # over i: across i ranges
        dv1[:, :, :, jt] += torch.einsum("bhijkp,bhijkd->bhpjkd", pr, dyc)
        dk2[:, :, it] += torch.einsum("bhijkp,bhijkd->bhipkd", ds, qc)  # over j: across j ranges
        dv2[:, :, it] += torch.einsum("bhijkp,bhijkd->bhipkd", pr, dyc)
        dk3[:, :, it, jt] = torch.einsum("bhijkp,bhijkd->bhijpd", ds, qc)  # over k: in the tile
        dv3[:, :, it, jt] = torch.einsum("bhijkp,bhijkd->bhijpd", pr, dyc)
    return tuple(g.to(dtype) for g in grads)
