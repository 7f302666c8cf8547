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


def rms_norm(x, gamma, eps, offset=0.0, round_xhat=False, residual=None, h_out=None):
    if residual is not None:
        x = torch.add(x, residual, out=h_out)
    acc = stat_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.square().mean(dim=1) + eps)
    y = xf * rstd[:, None]
    if round_xhat:
        y = y.to(x.dtype).to(acc)
    if gamma is not None:
        y = y * (gamma.to(acc) + offset)
    return y.to(x.dtype), rstd


def rms_norm_grad(dy, x, rstd, gamma, dx_out=None, offset=0.0, round_xhat=False, dres=None):
    acc = stat_dtype(x.dtype)
    dyf, xf = dy.to(acc), x.to(acc)
    rstd = rstd.to(acc)[:, None]
    n = x.shape[1]
    xhat = xf * rstd
    # dgamma first (with in_place, dx_out is dy's own memory), against the x-hat the forward
    # multiplied by gamma: rounded to x's dtype in round_xhat mode
    scaled = xhat.to(x.dtype).to(acc) if round_xhat else xhat
    dgamma = (dyf * scaled).sum(dim=0)
    g = dyf * (gamma.to(acc) + offset) if gamma is not None else dyf.clone()
    if n:
        # dx = rstd * g - rstd^3 * x * mean_n(g * x) = rstd * (g - xhat * mean_n(g * xhat)), in place
        c = (g * xhat).mean(dim=1, keepdim=True)
        g.sub_(xhat.mul_(c)).mul_(rstd)
    if dres is not None:
        g.add_(dres.to(acc))
    dx = dx_out.copy_(g) if dx_out is not None else g.to(x.dtype)
    return dx, dgamma
