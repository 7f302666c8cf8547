"""LayerNorm in plain PyTorch: the native_layer_norm forward/backward and the AscendC
LayerNormGrad/LayerNormGradBeta semantics (OPERATORS.md sections 1 and 2).

Arguments are canonical (docs/backends.md): rows ``[M, N]``, statistics ``[M]``.
Half precision is computed in float32, float64 in float64.
"""
from __future__ import annotations

import torch

from ..ops._checks import stat_dtype


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.to(stat_dtype(t.dtype))


def layer_norm(x, weight, bias, eps, residual=None, h_out=None):
    # residual: normalise h = x + residual (in x's dtype, as torch adds), written to h_out
    if residual is not None:
        x = torch.add(x, residual, out=h_out)
    acc = stat_dtype(x.dtype)
    xf = x.to(acc)
    n = xf.shape[1]
    if n == 0:  # as torch.native_layer_norm: an empty row has mean 0 and variance 0/0
        mean = torch.zeros(xf.shape[0], dtype=acc, device=x.device)
        var = torch.full_like(mean, float("nan"))
    else:
        # The mean, corrected by the mean of the deviations from it (the corrected two-pass
        # algorithm): the correction removes the rounding of the first sum, so a constant row
        # gets its value back exactly and is centred to exact zeros; then the biased variance
        # of the centred row (two-pass: no cancellation).
        mean = xf.mean(dim=1)
        mean = mean + (xf - mean[:, None]).mean(dim=1)
        var = (xf - mean[:, None]).square().mean(dim=1)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype), mean, rstd


def layer_norm_backward(dy, x, mean, rstd, weight, output_mask, dx_out=None, dres=None):
    # dres: the gradient that reaches x (the h of a fused residual add) from elsewhere, added to dx
    acc = stat_dtype(x.dtype)
    want_dx, want_dw, want_db = output_mask
    dyf, xf = dy.to(acc), x.to(acc)
    mean, rstd = mean.to(acc)[:, None], rstd.to(acc)[:, None]
    n = x.shape[1]
    xhat = (xf - mean).mul_(rstd)
    prod = torch.empty_like(xhat)  # one scratch row block for the two products (fewer CPU page faults)
    # weight grads first: with in_place, dx_out is dy's own memory
    dw = torch.mul(dyf, xhat, out=prod).sum(dim=0) if want_dw else None
    db = dyf.sum(dim=0) if want_db else None
    dx = None
    if want_dx:
        g = dyf * weight.to(acc) if weight is not None else dyf.clone()
        if n:
            # dx = rstd * (g - mean_n(g) - xhat * mean_n(g * xhat)), in place on g's buffer
            c2 = torch.mul(g, xhat, out=prod).mean(dim=1, keepdim=True)
            c1 = g.mean(dim=1, keepdim=True)
            g.sub_(c1).sub_(xhat.mul_(c2)).mul_(rstd)
        if dres is not None:
            g.add_(dres.to(acc))
        dx = dx_out.copy_(g) if dx_out is not None else g.to(x.dtype)
    return dx, dw, db


def layer_norm_grad(dy, x, variance, mean, gamma, eps, reuse_source, origin_h=None):
    """AscendC LayerNormGrad, literally: the variance (not rstd) comes in, eps is added here,
    and pd_mean keeps the term CANN computes even though it is analytically zero.

    ``origin_h`` (reference backend only; gradops.ascendc passes it for padded tilings): rows
    are stored ``x.shape[1]`` wide with zero padding, sums run over the stored width and the
    factors 1/H, 2/H use the original width, as CANN's kernel does.
    """
    acc = stat_dtype(x.dtype)
    h = x.shape[1] if origin_h is None else origin_h
    dyf, xf, gf = dy.to(acc), x.to(acc), gamma.to(acc)
    r = torch.rsqrt(variance.to(acc)[:, None] + eps)
    x2 = xf - mean.to(acc)[:, None]
    x1 = dyf * gf
    pd_var = (-0.5 * x1 * x2 * r.pow(3)).sum(dim=1, keepdim=True)
    h = max(h, 1)  # H = 0: every row is empty, and so is every result; nothing to divide
    pd_mean = (-x1 * r).sum(dim=1, keepdim=True) + pd_var * (1.0 / h) * (-2.0 * x2).sum(dim=1, keepdim=True)
    pd_x = x1 * r + pd_var * (2.0 / h) * x2 + pd_mean / h
    res_for_gamma = x2 * r
    if reuse_source:  # CANN's kernel leaves dy*gamma in inputDy and x-mean in inputX
        dy.copy_(x1)
        x.copy_(x2)
    return pd_x.to(x.dtype), res_for_gamma.to(x.dtype)


def layer_norm_grad_beta(res_for_gamma, dy, reuse_source):
    acc = stat_dtype(dy.dtype)
    dyf = dy.to(acc)
    prod = dyf * res_for_gamma.to(acc)
    pd_gamma = prod.sum(dim=0)
    pd_beta = dyf.sum(dim=0)
    if reuse_source:  # CANN's kernel leaves dy*resForGamma in resForGamma
        res_for_gamma.copy_(prod)
    return pd_gamma.to(dy.dtype), pd_beta.to(dy.dtype)
