"""3-Floyd (3-pivot) attention: ``floyd3_attention`` / ``floyd3_attention_grad``
(docs/operators.md, "3-Floyd attention"). CANN has no 3-pivot operator: these follow the
conventions of the 2-pivot one (``ops/floyd_attention.py``): dtypes (the mask's included) are
161002, shapes 561002, None 161001, a float scale, compact float32 statistics (float64 for
float64 inputs), a masked score -FLT_MAX (a fully masked row is a uniform softmax, and gives
q and the keys exactly nothing)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._backend import implementation
from . import _plans
from ._checks import TILING, check_dtype, check_float_attr, check_same_device, fail, require_tensor, stat_dtype
from ._prepared import Prepared
from .floyd_attention import MASK_DTYPES, _check_dtypes, _require, agreed_sizes

FAMILY = "floyd3_attention"
# a letter per dim: q's (i, j, k) triple, the pivot P in the place of the axis it replaces
_LAYOUTS = {"q": "BHIJKD", "k1": "BHPJKD", "v1": "BHPJKD", "k2": "BHIPKD", "v2": "BHIPKD",
            "k3": "BHIJPD", "v3": "BHIJPD"}
_MASK_LAYOUT = "(B, 1, I, J, K, P)"


def _named(q, k1, v1, k2, v2, k3, v3):
    return (("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2), ("k3", k3), ("v3", v3))


def _check_shapes(op, q, k1, v1, k2, v2, k3, v3):
    """Rank 6 each, one size per dim (B, H, I, J, K, P, D) across the tensors that have it, and
    at least one pivot where there are rows. Returns (B, H, I, J, K, P, D)."""
    agreed = agreed_sizes(op, _named(q, k1, v1, k2, v2, k3, v3), _LAYOUTS)
    b, h, i, j, k, d = q.shape
    p = agreed["P"]
    if p < 1 and b * h * i * j * k > 0:
        fail(op, TILING, f"k1 has P = {p} pivots, expected P >= 1 (a softmax over no pivots is undefined)")
    return b, h, i, j, k, p, d


def _check_mask(op, mask, b, i, j, k, p):
    """A bool/uint8 mask broadcastable to ``[B, 1, I, J, K, P]`` (constant over heads) -> that
    shape as a bool view (an expanded one where it broadcasts), or None."""
    if mask is None:
        return None
    full = (b, 1, i, j, k, p)
    if mask.dim() > 6 or any(size not in (1, want) for size, want in zip(reversed(mask.shape), reversed(full))):
        fail(op, TILING, f"mask has shape {tuple(mask.shape)}, expected a shape broadcastable to "
                         f"{_MASK_LAYOUT} == {full} (one mask for every head)")
    return mask_view(mask, full)


def mask_view(mask, full):
    """``mask`` as a bool tensor of shape ``full``: leading dims added, broadcast dims expanded
    (stride 0, no copy), uint8 compared with 0."""
    mask = mask if mask.dtype == torch.bool else mask != 0
    return mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape)).expand(full)


class Floyd3Plan(NamedTuple):
    """What the checks of a ``floyd3_attention`` call concluded (kept per call signature): the
    backend module, the outputs' (shape, dtype), the mask's full shape and the scale."""

    impl: object
    outputs: tuple
    mask_shape: tuple
    scale: float


def plan_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask=None, scale=1.0, *, backend=None,
                          op="floyd3_attention") -> Floyd3Plan:
    """Checks a ``floyd3_attention`` call (once per call signature) and plans it."""
    key = _plans.signature(op, backend, (q, k1, v1, k2, v2, k3, v3, mask), (scale,))
    plan = _plans.lookup(key)
    if plan is not None:
        return plan
    # None -> 161001, then every dtype rule (161002), then the shapes (561002)
    named = _named(q, k1, v1, k2, v2, k3, v3)
    _require(op, named)
    _check_dtypes(op, named)
    if mask is not None:
        require_tensor(op, "mask", mask)
        check_dtype(op, "mask", mask, MASK_DTYPES)
    b, h, i, j, k, p, d = _check_shapes(op, q, k1, v1, k2, v2, k3, v3)
    _check_mask(op, mask, b, i, j, k, p)
    scale = check_float_attr(op, "scale", scale)
    check_same_device(op, named + (("mask", mask),))
    impl = implementation(op, FAMILY, backend, q.device, kernel_limit=lambda kernels: kernels.unsupported(q))
    acc = stat_dtype(q.dtype)
    outputs = ((tuple(q.shape), q.dtype), ((b, h, i, j, k), acc), ((b, h, i, j, k), acc))
    return _plans.remember(key, Floyd3Plan(impl, outputs, (b, 1, i, j, k, p), scale))


def prepare_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask=None, scale=1.0, *, backend=None,
                             op="floyd3_attention") -> Prepared:
    plan = plan_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale, backend=backend, op=op)

    def run():
        m = None if mask is None else mask_view(mask, plan.mask_shape)
        return plan.impl.floyd3_attention(q, k1, v1, k2, v2, k3, v3, m, plan.scale)

    return Prepared(op, q.device, plan.impl, plan.outputs, run)


def prepare_floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, out, softmax_max, softmax_sum, mask=None,
                                  scale=1.0, *, backend=None, op="floyd3_attention_grad") -> Prepared:
    """The forward's checks (remembered with its plan), then dy's, out's and the statistics'."""
    named = _named(q, k1, v1, k2, v2, k3, v3)
    _require(op, named + (("dy", dy), ("out", out), ("softmax_max", softmax_max), ("softmax_sum", softmax_sum)))
    _check_dtypes(op, named + (("dy", dy), ("out", out)))
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        check_dtype(op, name, t, (stat_dtype(q.dtype),))
    plan = plan_floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale, backend=backend, op=op)
    for name, t, (shape, _) in (("dy", dy, plan.outputs[0]), ("out", out, plan.outputs[0]),
                                ("softmax_max", softmax_max, plan.outputs[1]),
                                ("softmax_sum", softmax_sum, plan.outputs[2])):
        if tuple(t.shape) != shape:
            rule = "q.shape" if name in ("dy", "out") else "(B, H, I, J, K)"
            fail(op, TILING, f"{name} has shape {tuple(t.shape)}, expected {rule} == {shape}")
    check_same_device(op, (("q", q), ("dy", dy), ("out", out), ("softmax_max", softmax_max),
                           ("softmax_sum", softmax_sum)))

    def run():
        m = None if mask is None else mask_view(mask, plan.mask_shape)
        return plan.impl.floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, softmax_max, softmax_sum, m,
                                               plan.scale)

    outputs = tuple((tuple(t.shape), q.dtype) for _, t in named)
    return Prepared(op, q.device, plan.impl, outputs, run)
