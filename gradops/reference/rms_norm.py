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
    g = dyf * gamma.to(acc)
    dgamma = (dyf * xf * rstd).sum(dim=0)
    if x.shape[1] == 0:
        dxf = g
    else:
        dxf = rstd * g - rstd.pow(3) * xf * (g * xf).mean(dim=1, keepdim=True)
    dx = dx_out.copy_(dxf) if dx_out is not None else dxf.to(x.dtype)
    return dx, dgamma
