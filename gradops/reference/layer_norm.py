"""LayerNorm in plain PyTorch: the native_layer_norm forward/backward and the AscendC
LayerNormGrad/LayerNormGradBeta semantics (OPERATORS.md sections 1 and 2).

Arguments are canonical (docs/backends.md): rows ``[M, N]``, statistics ``[M]``.
Half precision is computed in float32, float64 in float64.
"""
from __future__ import annotations

import torch

from ..ops._checks import stat_dtype
from ._rows import as_dtype, row_block


def _aten_statistics(device: torch.device) -> bool:
    """Whether the forward takes its statistics from ATen's ``native_layer_norm`` on this
    device, or computes them itself (:func:`_statistics`). The one place that decides.

    On the CPU ATen's kernel computes the contract's statistics (Welford's mean, exact for a
    constant row, which is then centred to exact zeros; the biased variance; rstd =
    1/sqrt(var + eps)), and it is the fastest CPU path (docs/backends.md, "The CPU path").
    ATen's CUDA kernel is not exact on constant rows: its vectorised Welford merges partial
    results as ``(nA / n) * meanA + (nB / n) * meanB``, which moves a constant row's mean by
    an ulp, and the squared deltas of the later merges then give it a variance (a row of
    1234.57 got rstd 1.7e4 instead of 1e6 at eps = 1e-12 on an H100), so everywhere else the
    reference, being the golden, computes them itself."""
    return device.type == "cpu"


_ATEN_BACKWARD = torch.ops.aten.native_layer_norm_backward.default


def _statistics(x, eps):
    """mean, rstd ``[M, 1]`` and the centred rows of ``x [M, N]`` (acc), as the contract
    defines them (docs/operators.md section 1): the corrected two-pass mean (the first pass's
    rounding removed by the mean deviation from it: a constant row gets its value back
    exactly, and centres to exact zeros), the biased variance of the centred rows, and rstd =
    1/sqrt(var + eps) with an IEEE square root and division. An empty row gets mean 0 and
    rstd NaN (the variance 0/0), as native_layer_norm."""
    m, n = x.shape
    if n == 0:
        return x.new_zeros((m, 1)), x.new_full((m, 1), float("nan")), x
    mean = x.mean(dim=1, keepdim=True)
    mean += (x - mean).mean(dim=1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(dim=1, keepdim=True)
    return mean, torch.sqrt(var + eps).reciprocal_(), xc


def layer_norm(x, weight, bias, eps, residual=None, h_out=None):
    # residual: normalise h = x + residual (in x's dtype, as torch adds), written to h_out
    if residual is not None:
        x = torch.add(x, residual, out=h_out)
    acc = stat_dtype(x.dtype)
    m, n = x.shape
    w = None if weight is None else as_dtype(weight, acc)
    b = None if bias is None else as_dtype(bias, acc)
    if not _aten_statistics(x.device):
        mean, rstd, y = _statistics(x.to(acc), eps)
        y = y * rstd  # (x - mean) * rstd * w + b, y rounded once
        if w is not None:
            y.mul_(w)
        if b is not None:
            y.add_(b)
        return y.to(x.dtype), mean.view(m), rstd.view(m)
    # ATen's float32/float64 kernel: Welford's mean (exact for a constant row, which is then
    # centred to exact zeros), the biased variance, y = (x * rstd - mean * rstd) * w + b; an
    # empty row gets mean 0 and rstd NaN. Half rows go through it as float32 copies (of row
    # blocks, when they are many), y rounded once: ATen's half kernel fuses x * rstd - mean *
    # rstd into one multiply-add, which leaves constant rows off zero.
    rows = row_block(x)
    if x.dtype == acc or rows >= m:
        y, mean, rstd = torch.native_layer_norm(as_dtype(x, acc), [n], w, b, eps)
        return as_dtype(y, x.dtype), mean.view(m), rstd.view(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = torch.empty((m, 1), dtype=acc, device=x.device)
    rstd = torch.empty_like(mean)
    xf = torch.empty((rows, n), dtype=acc, device=x.device)
    for s in range(0, m, rows):
        e = min(s + rows, m)
        y[s:e], mean[s:e], rstd[s:e] = torch.native_layer_norm(xf[: e - s].copy_(x[s:e]), [n], w, b, eps)
    return y, mean.view(m), rstd.view(m)


def layer_norm_backward(dy, x, mean, rstd, weight, output_mask, dx_out=None, dres=None, grad_dtype=None):
    # dres: the gradient that reaches x (the h of a fused residual add) from elsewhere, added to dx;
    # grad_dtype: the dtype of dw and db (acc when None)
    acc = stat_dtype(x.dtype)
    m, n = x.shape
    want_dx, want_dw, want_db = output_mask
    w = None if weight is None else as_dtype(weight, acc)
    if w is None and want_dw:  # ATen shapes dweight like the weight
        w = torch.ones(n, dtype=acc, device=x.device)
    # and dbias like the bias, which its math never reads: any [N] tensor will do
    b = (w if w is not None else torch.empty(n, dtype=acc, device=x.device)) if want_db else None
    # ATen's kernel computes dx = a * dy * w + b * x + c, which cancels on rows whose mean is
    # large beside their deviation (a row of mean 1e3 and deviation 0.1 loses 1e-4 of dx in
    # float32, a row of width 1 gets dx != 0). Given the centred rows x - mean and a mean of 0
    # it computes this module's formula, dx = rstd * (g - mean_n(g) - xhat * mean_n(g * xhat)),
    # up to rounding, with nothing to cancel; a row of width 1 gets rstd * (g - g) here (see
    # _grad_rows): exactly 0, NaN where g is not finite. Half dy goes in as float32 too:
    # ATen's half kernel sums dweight/dbias in half precision (5-11 % off at 8192 rows). In
    # row blocks (see _rows); dres is added in float32, dx rounded once, and with in_place dx
    # lands in dx_out (dy's memory) after ATen has read the block's dy. The blocks'
    # dweight/dbias are summed in one cascade, so their rounding grows with the block, not
    # with M.
    rows = row_block(x)
    if rows >= m:  # one block: fresh results, no buffers to set up (the cost of a small call)
        dx, dw, db = _grad_rows(as_dtype(dy, acc), x, mean, rstd, w, b, output_mask, dres, dx_out)
        if want_dx and dx_out is None:
            dx = as_dtype(dx, x.dtype)
    else:
        starts = range(0, m, rows)
        dx = None
        if want_dx:
            dx = dx_out if dx_out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
        dws = torch.empty((len(starts), n), dtype=acc, device=x.device) if want_dw else None
        dbs = torch.empty((len(starts), n), dtype=acc, device=x.device) if want_db else None
        centred = torch.empty((rows, n), dtype=acc, device=x.device)
        dyf = torch.empty((rows, n), dtype=acc, device=x.device) if dy.dtype != acc else None
        for i, s in enumerate(starts):
            e = min(s + rows, m)
            dyb = dy[s:e] if dyf is None else dyf[: e - s].copy_(dy[s:e])
            _, dwb, dbb = _grad_rows(dyb, x[s:e], mean[s:e], rstd[s:e], w, b, output_mask,
                                     None if dres is None else dres[s:e], None if dx is None else dx[s:e],
                                     centred[: e - s])
            if want_dw:
                dws[i] = dwb
            if want_db:
                dbs[i] = dbb
        dw = None if dws is None else dws.sum(dim=0)
        db = None if dbs is None else dbs.sum(dim=0)
    if grad_dtype is not None:
        dw = None if dw is None else as_dtype(dw, grad_dtype)
        db = None if db is None else as_dtype(db, grad_dtype)
    return dx, dw, db


def _grad_rows(dyb, xb, mean, r, w, b, output_mask, dres=None, dx_out=None, centred_out=None):
    """dx (+ dres), dweight and dbias of the rows ``xb`` with statistics ``mean``, ``r``
    ``[rows]``; dy ``dyb`` in acc. dx is computed in acc and rounded once: into ``dx_out``
    when given, else returned in acc. The centred rows go into ``centred_out`` when given (the
    blocked path's reused buffer)."""
    centred = torch.sub(xb, mean[:, None], out=centred_out)
    k, n = centred.shape
    # (ATen reads rstd as one value per row in memory order: a strided rstd goes in contiguous)
    dx, dw, db = _ATEN_BACKWARD(dyb, centred, [n], centred.new_zeros(k), r.contiguous(), w, b,
                                output_mask)
    if dx is not None:
        if n == 1:  # the formula's rstd * (g - mean(g)): exactly 0, NaN where g or rstd is not finite
            g = dyb if w is None else dyb * w
            dx.copy_((g - g).mul_(r[:, None]))
        if dres is not None:
            dx = torch.add(dx, dres, out=dx_out)
        elif dx_out is not None:
            dx = dx_out.copy_(dx)
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
