"""Independent float64 oracles: autograd through each operator's *forward* formula, written
as naively as possible, plus PyTorch's own ATen LayerNorm. They share no code with the
reference backend (which implements the analytic backward formulas), so agreement between
the two is evidence, not tautology. Used by the test suite and ``gradops selftest``; meant
for small shapes (the Floyd oracle materialises the cubic score tensor)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

FLT_MAX = 3.4028234663852886e38
F64 = torch.float64


def _leaf(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().to(F64).requires_grad_(True)


def _grads(out: torch.Tensor, dout: torch.Tensor, leaves: Sequence[Optional[torch.Tensor]]):
    live = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, live, dout.to(F64), allow_unused=True))
    result = []
    for t in leaves:
        if t is None:
            result.append(None)
        else:
            g = next(grads)
            result.append(torch.zeros_like(t) if g is None else g)
    return result


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``(y, mean, rstd)`` by ATen in float64, statistics keepdim."""
    w = None if weight is None else weight.to(F64)
    b = None if bias is None else bias.to(F64)
    return torch.native_layer_norm(x.to(F64), list(normalized_shape), w, b, eps)


def layer_norm_backward(dy, x, normalized_shape, weight=None, eps=1e-5):
    """``(dx, dw, db)`` by ATen's native_layer_norm_backward in float64 (statistics recomputed
    from x in float64). dw/db are returned even when weight is None (as ones)."""
    w = torch.ones(normalized_shape, dtype=F64, device=x.device) if weight is None else weight.to(F64)
    b = torch.zeros(normalized_shape, dtype=F64, device=x.device)
    _, mean, rstd = torch.native_layer_norm(x.to(F64), list(normalized_shape), w, b, eps)
    return torch.ops.aten.native_layer_norm_backward(dy.to(F64), x.to(F64), list(normalized_shape),
                                                     mean, rstd, w, b, [True, True, True])


def layer_norm_autograd(dy, x, n_norm, weight=None, eps=1e-5):
    """``(dx, dw)`` by autograd through ``(x - E x) / sqrt(Var x + eps) * w``."""
    xl, wl = _leaf(x), _leaf(weight)
    dims = tuple(range(x.dim() - n_norm, x.dim()))
    mean = xl.mean(dim=dims, keepdim=True)
    var = ((xl - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (xl - mean) / torch.sqrt(var + eps)
    if wl is not None:
        y = y * wl
    dx, dw = _grads(y, dy, [xl, wl])
    return dx, dw


def rms_norm(x, gamma, eps=1e-6):
    """``(y, rstd)`` in float64, rstd keepdim."""
    n = gamma.dim()
    dims = tuple(range(x.dim() - n, x.dim()))
    xd = x.to(F64)
    rstd = 1.0 / torch.sqrt((xd * xd).mean(dim=dims, keepdim=True) + eps)
    return xd * rstd * gamma.to(F64), rstd


def rms_norm_backward(dy, x, gamma, eps=1e-6):
    """``(dx, dgamma)`` by autograd through ``x / sqrt(mean(x^2) + eps) * gamma``."""
    xl, gl = _leaf(x), _leaf(gamma)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    y = xl / torch.sqrt((xl * xl).mean(dim=dims, keepdim=True) + eps) * gl
    return tuple(_grads(y, dy, [xl, gl]))


def nsa_blocks(seq_ends, block_size, stride):
    """(start token of every block) from cumulative ends, by an explicit loop."""
    starts, begin = [], 0
    for end in seq_ends:
        t = begin
        while t + block_size <= end:
            starts.append(t)
            t += stride
        begin = end
    return starts


def nsa_compress(x, weight, block_size, stride, seq_ends):
    """``out[c] = sum_j weight[j] * x[start_c + j]`` in float64, one block at a time."""
    starts = nsa_blocks(seq_ends, block_size, stride)
    xd, wd = x.to(F64), weight.to(F64)
    rows = [(wd[:, :, None] * xd[s:s + block_size]).sum(dim=0) for s in starts]
    if not rows:
        return torch.zeros((0,) + tuple(x.shape[1:]), dtype=F64, device=x.device)
    return torch.stack(rows)


def nsa_compress_backward(dout, x, weight, block_size, stride, seq_ends):
    """``(dx, dweight)`` by autograd through :func:`nsa_compress`."""
    xl, wl = _leaf(x), _leaf(weight)
    out = nsa_compress(xl, wl, block_size, stride, seq_ends)
    if out.numel() == 0 or not out.requires_grad:
        return torch.zeros_like(xl), torch.zeros_like(wl)
    return tuple(_grads(out, dout, [xl, wl]))


def floyd_scores(q, k1, k2, mask, scale):
    s = scale * (torch.einsum("bhnmd,bhnkd->bhnmk", q, k1) + torch.einsum("bhnmd,bhkmd->bhnmk", q, k2))
    if mask is not None:
        s = s.masked_fill(mask.bool(), -FLT_MAX)
    return s


def floyd_attention(q, k1, v1, k2, v2, mask=None, scale=1.0):
    """``(out, softmax_max, softmax_sum)`` in float64 through the full ``[B,H,N,M,K]`` scores."""
    q, k1, v1, k2, v2 = (t.to(F64) for t in (q, k1, v1, k2, v2))
    s = floyd_scores(q, k1, k2, mask, scale)
    mx = s.amax(dim=-1)
    e = torch.exp(s - mx[..., None])
    p = e / e.sum(dim=-1, keepdim=True)
    y = torch.einsum("bhnmk,bhnkd->bhnmd", p, v1) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2)
    return y, mx, e.sum(dim=-1)


def floyd_attention_backward(dy, q, k1, v1, k2, v2, mask=None, scale=1.0):
    """``(dq, dk1, dv1, dk2, dv2)`` by autograd through softmax of the full scores."""
    leaves = [_leaf(t) for t in (q, k1, v1, k2, v2)]
    ql, k1l, v1l, k2l, v2l = leaves
    p = torch.softmax(floyd_scores(ql, k1l, k2l, mask, scale), dim=-1)
    y = torch.einsum("bhnmk,bhnkd->bhnmd", p, v1l) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2l)
    return tuple(_grads(y, dy, leaves))


def floyd3_scores(q, k1, k2, k3, mask, scale):
    """``[B,H,I,J,K,P]`` scores of 3-Floyd in float64, masked ones -FLT_MAX; ``mask``
    broadcastable to them."""
    s = (torch.einsum("bhijkd,bhpjkd->bhijkp", q, k1) + torch.einsum("bhijkd,bhipkd->bhijkp", q, k2)
         + torch.einsum("bhijkd,bhijpd->bhijkp", q, k3)) * scale
    return s if mask is None else s.masked_fill(mask.to(s.device).bool(), -FLT_MAX)


def _floyd3_values(p, v1, v2, v3):
    return (torch.einsum("bhijkp,bhpjkd->bhijkd", p, v1) + torch.einsum("bhijkp,bhipkd->bhijkd", p, v2)
            + torch.einsum("bhijkp,bhijpd->bhijkd", p, v3))


def floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask=None, scale=1.0):
    """``(out, softmax_max, softmax_sum)`` of 3-Floyd in float64 through the full quartic scores
    (small shapes only)."""
    q, k1, v1, k2, v2, k3, v3 = (t.to(F64) for t in (q, k1, v1, k2, v2, k3, v3))
    s = floyd3_scores(q, k1, k2, k3, mask, scale)
    mx = s.amax(dim=-1)
    e = torch.exp(s - mx[..., None])
    return _floyd3_values(e / e.sum(dim=-1, keepdim=True), v1, v2, v3), mx, e.sum(dim=-1)


def floyd3_attention_backward(dy, q, k1, v1, k2, v2, k3, v3, mask=None, scale=1.0):
    """``(dq, dk1, dv1, dk2, dv2, dk3, dv3)`` by float64 autograd through the full scores."""
    leaves = [_leaf(t) for t in (q, k1, v1, k2, v2, k3, v3)]
    ql, k1l, v1l, k2l, v2l, k3l, v3l = leaves
    p = torch.softmax(floyd3_scores(ql, k1l, k2l, k3l, mask, scale), dim=-1)
    return tuple(_grads(_floyd3_values(p, v1l, v2l, v3l), dy, leaves))


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max(|expected|), 0 for empty tensors; NaN positions must match."""
    if expected.numel() == 0:
        return 0.0
    a, e = actual.to(F64), expected.to(F64)
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        return float("inf")
    a, e = a[~nan_e], e[~nan_e]
    if e.numel() == 0:
        return 0.0
    scale = e.abs().max().item()
    return (a - e).abs().max().item() / (scale if scale > 0 else 1.0)


# Relative error (to the oracle's largest magnitude) a result may have in each dtype when the
# inputs are exactly representable in it and the computation runs in float32 (float64 for
# float64): the final rounding to the dtype is at most half a unit in the last place
# (float16 4.9e-4, bfloat16 3.9e-3), so four of those leave room for float32 intermediate
# rounding; float32 allows for reductions over a few thousand terms.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}
