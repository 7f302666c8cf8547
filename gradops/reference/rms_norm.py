"""RMSNorm in plain PyTorch (OPERATORS.md section 3). Canonical arguments: rows ``[M, N]``,
rstd ``[M]``; half precision computed in float32, float64 in float64."""
from __future__ import annotations

import torch

from ..ops._checks import stat_dtype


def rms_norm(x, gamma, eps):
    acc = stat_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.square().mean(dim=1) + eps)
    y = xf * rstd[:, None] * gamma.to(acc)
    return y.to(x.dtype), rstd


def rms_norm_grad(dy, x, rstd, gamma, dx_out=None):
    acc = stat_dtype(x.dtype)
    dyf, xf = dy.to(acc), x.to(acc)
    rstd = rstd.to(acc)[:, None]
    n = x.shape[1]
    xhat = xf * rstd
    # dgamma first: with in_place, dx_out is dy's own memory
    dgamma = (dyf * xhat).sum(dim=0)
    g = dyf * gamma.to(acc)
    if n:
        # dx = rstd * g - rstd^3 * x * mean_n(g * x) = rstd * (g - xhat * mean_n(g * xhat)), in place
        c = (g * xhat).mean(dim=1, keepdim=True)
        g.sub_(xhat.mul_(c)).mul_(rstd)
    dx = dx_out.copy_(g) if dx_out is not None else g.to(x.dtype)
    return dx, dgamma
