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
from ._rows import as_dtype, row_block


def _scale(gamma, offset, acc):
    if gamma is None:
        return None
    g = as_dtype(gamma, acc)
    return g + offset if offset else g


def _forward_rows(xb, g, eps, round_dtype, rstd_out=None, scratch=None):
    """y (in acc, before the final rounding) and rstd of the rows ``xb`` (acc): into
    ``scratch`` and ``rstd_out`` when given (the blocked path's reused buffers)."""
    rstd = torch.rsqrt(torch.mul(xb, xb, out=scratch).mean(dim=1).add_(eps), out=rstd_out)
    y = torch.mul(xb, rstd[:, None], out=scratch)
    if round_dtype is not None:  # Llama: x-hat rounded to x's dtype before the scale
        y.copy_(y.to(round_dtype))
    return y if g is None else y.mul_(g), rstd


def _grad_rows(dyb, xb, r, g, round_dtype, dres=None, dx_out=None, scratch=(None, None, None)):
    """dx (+ dres) and dgamma's sum over the rows ``xb`` (acc) with rstd ``r [rows, 1]``. dx
    is computed in acc and rounded once: into ``dx_out`` when given, else returned in acc.
    Intermediates go into the three ``scratch`` buffers when given."""
    xh_out, t_out, u_out = scratch
    xh = torch.mul(xb, r, out=xh_out)
    # dgamma against the x-hat the forward multiplied by gamma: rounded in Llama's mode
    scaled = xh if round_dtype is None else xh.to(round_dtype).to(xh.dtype)
    dgamma = torch.mul(dyb, scaled, out=t_out).sum(dim=0)
    gb = dyb if g is None else torch.mul(dyb, g, out=u_out)
    # dx = rstd * g - rstd^3 * x * mean_n(g * x) = rstd * (g - xhat * mean_n(g * xhat))
    c = torch.mul(gb, xh, out=t_out).mean(dim=1, keepdim=True)
    d = torch.addcmul(gb, xh, c, value=-1, out=t_out)
    # the rstd scale (and dres) in the pass that writes dx
    dx = torch.mul(d, r, out=dx_out) if dres is None else torch.addcmul(dres, d, r, out=dx_out)
    return dx, dgamma


def rms_norm(x, gamma, eps, offset=0.0, round_xhat=False, residual=None, h_out=None):
    # residual: normalise h = x + residual (in x's dtype, as torch adds), written to h_out
    if residual is not None:
        x = torch.add(x, residual, out=h_out)
    acc = stat_dtype(x.dtype)
    m, n = x.shape
    g = _scale(gamma, offset, acc)
    round_dtype = x.dtype if round_xhat and x.dtype != acc else None
    rows = row_block(x)
    if rows >= m:  # one block: fresh results, no buffers to set up (the cost of a small call)
        y, rstd = _forward_rows(as_dtype(x, acc), g, eps, round_dtype)
        return as_dtype(y, x.dtype), rstd
    # Row blocks whose float32 buffers stay in cache, reused from block to block (see _rows)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=acc, device=x.device)
    xf = torch.empty((rows, n), dtype=acc, device=x.device) if x.dtype != acc else None
    t = torch.empty((rows, n), dtype=acc, device=x.device)
    for s in range(0, m, rows):
        e = min(s + rows, m)
        xb = x[s:e] if xf is None else xf[: e - s].copy_(x[s:e])
        y[s:e] = _forward_rows(xb, g, eps, round_dtype, rstd[s:e], t[: e - s])[0]
    return y, rstd


def rms_norm_grad(dy, x, rstd, gamma, dx_out=None, offset=0.0, round_xhat=False, dres=None, grad_dtype=None):
    # grad_dtype: the dtype of dgamma (acc when None)
    dx, dgamma = _rms_norm_grad(dy, x, rstd, gamma, dx_out, offset, round_xhat, dres)
    return dx, dgamma if grad_dtype is None else as_dtype(dgamma, grad_dtype)


def _rms_norm_grad(dy, x, rstd, gamma, dx_out, offset, round_xhat, dres):
    acc = stat_dtype(x.dtype)
    m, n = x.shape
    g = _scale(gamma, offset, acc)
    round_dtype = x.dtype if round_xhat and x.dtype != acc else None
    rows = row_block(x)
    if rows >= m:  # one block: fresh results (dgamma before dx lands in dy's memory, in_place)
        dx, dgamma = _grad_rows(as_dtype(dy, acc), as_dtype(x, acc), as_dtype(rstd, acc)[:, None], g, round_dtype,
                                dres, dx_out)
        return (dx if dx_out is not None else as_dtype(dx, x.dtype)), dgamma
    # Row blocks, as in rms_norm; dgamma's per-block sums are summed in one cascade, and dx
    # lands in dx_out (dy's memory, in_place) only after the block's dgamma was taken
    dx = dx_out if dx_out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    starts = range(0, m, rows)
    dgammas = torch.empty((len(starts), n), dtype=acc, device=x.device)
    scratch = tuple(torch.empty((rows, n), dtype=acc, device=x.device) for _ in range(3))
    xf, dyf = ((torch.empty((rows, n), dtype=acc, device=x.device) for _ in range(2)) if x.dtype != acc
               else (None, None))
    for i, s in enumerate(starts):
        e = min(s + rows, m)
        xb = x[s:e] if xf is None else xf[: e - s].copy_(x[s:e])
        dyb = dy[s:e] if dyf is None else dyf[: e - s].copy_(dy[s:e])
        _, dgammas[i] = _grad_rows(dyb, xb, rstd[s:e, None], g, round_dtype, None if dres is None else dres[s:e],
                                   dx[s:e], [b[: e - s] for b in scratch])
    return dx, dgammas.sum(dim=0)
