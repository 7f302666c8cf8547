"""RMSNorm in plain PyTorch (OPERATORS.md section 3). Canonical arguments: rows ``[M, N]``,
rstd ``[M]``; half precision computed in float32, float64 in float64.

The variants real models use (docs/nn.md, "Norm variants"): ``offset`` scales by
``offset + gamma`` (Gemma's ``1 + w``); ``round_xhat`` rounds the normalised row to x's
dtype before the scale (HF Llama's ``weight * hidden.to(input_dtype)``); ``residual`` adds
it to x first (``h = x + residual`` in x's dtype, as torch adds, written to ``h_out``) and
normalises h; in the backward ``dres``, the gradient that reaches h from elsewhere, is
added to dx.
"""
from __future__ import annotations

import torch

from ..ops._checks import stat_dtype
from ._rows import row_block


def _scale(gamma, offset, acc):
    if gamma is None:
        return None
    g = gamma.to(acc)
    return g + offset if offset else g


def rms_norm(x, gamma, eps, offset=0.0, round_xhat=False, residual=None, h_out=None):
    acc = stat_dtype(x.dtype)
    m, n = x.shape
    half = x.dtype != acc
    g = _scale(gamma, offset, acc)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=acc, device=x.device)
    rows = row_block(x)
    k = min(rows, m)
    xf = torch.empty((k, n), dtype=acc, device=x.device) if half else None
    t = torch.empty((k, n), dtype=acc, device=x.device)
    rounded = torch.empty((k, n), dtype=x.dtype, device=x.device) if half and round_xhat else None
    # Row blocks whose float32 buffers stay in cache, reused from block to block
    for s in range(0, m, rows):
        e = min(s + rows, m)
        # residual: normalise h = x + residual (in x's dtype, as torch adds), written to h_out
        xb = x[s:e] if residual is None else torch.add(x[s:e], residual[s:e], out=h_out[s:e])
        if half:
            xb = xf[: e - s].copy_(xb)
        tb = t[: e - s]
        r = torch.rsqrt(torch.mul(xb, xb, out=tb).mean(dim=1).add_(eps), out=rstd[s:e])[:, None]
        if g is None and not half:
            torch.mul(xb, r, out=y[s:e])
            continue
        xhat = torch.mul(xb, r, out=tb)
        if rounded is not None:
            xhat.copy_(rounded[: e - s].copy_(xhat))
        if half:
            y[s:e] = xhat.mul_(g) if g is not None else xhat
        else:
            torch.mul(xhat, g, out=y[s:e])
    return y, rstd


def rms_norm_grad(dy, x, rstd, gamma, dx_out=None, offset=0.0, round_xhat=False, dres=None):
    acc = stat_dtype(x.dtype)
    m, n = x.shape
    half = x.dtype != acc
    g = _scale(gamma, offset, acc)
    dx = dx_out if dx_out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    rows = row_block(x)
    blocks = range(0, m, rows)
    dgammas = torch.empty((len(blocks), n), dtype=acc, device=x.device)
    k = min(rows, m)
    xhat, t, u = (torch.empty((k, n), dtype=acc, device=x.device) for _ in range(3))
    dyf = torch.empty((k, n), dtype=acc, device=x.device) if half else None
    rounded = torch.empty((k, n), dtype=x.dtype, device=x.device) if half and round_xhat else None
    # Row blocks, as in rms_norm; dgamma's per-block sums are summed in one cascade, and dx
    # lands in dx_out (dy's memory, in_place) only after the block's dgamma was taken
    for i, s in enumerate(blocks):
        e = min(s + rows, m)
        r = rstd[s:e, None]
        xb = x[s:e] if not half else xhat[: e - s].copy_(x[s:e])
        xh = torch.mul(xb, r, out=xhat[: e - s])
        dyb = dy[s:e] if not half else dyf[: e - s].copy_(dy[s:e])
        tb, ub = t[: e - s], u[: e - s]
        # dgamma against the x-hat the forward multiplied by gamma: rounded to x's dtype in
        # round_xhat mode
        scaled = xh if rounded is None else tb.copy_(rounded[: e - s].copy_(xh))
        torch.sum(torch.mul(dyb, scaled, out=tb), dim=0, out=dgammas[i])
        gb = torch.mul(dyb, g, out=ub) if g is not None else dyb
        # dx = rstd * g - rstd^3 * x * mean_n(g * x) = rstd * (g - xhat * mean_n(g * xhat))
        c = torch.mul(gb, xh, out=tb).mean(dim=1, keepdim=True)
        d = torch.addcmul(gb, xh, c, value=-1, out=tb)
        if half or dres is not None:
            d.mul_(r)
            if dres is not None:
                d += dres[s:e]
            dx[s:e] = d
        else:
            torch.mul(d, r, out=dx[s:e])
    return dx, dgammas.sum(dim=0)
