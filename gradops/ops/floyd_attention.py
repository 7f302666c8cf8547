"""Floyd (pivotal) attention: ``floyd_attention`` / ``floyd_attention_grad``
(aclnnFusedFloydAttention / aclnnFusedFloydAttentionGrad, OPERATORS.md section 5).
CANN checks Floyd's shapes (the mask's and the statistics' included) at tiling: 561002;
dtypes (the mask's included) are 161002."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._backend import implementation
from . import _plans
from ._checks import (
    FLOAT_DTYPES,
    TILING,
    check_dtype,
    check_float_attr,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_shape,
    fail,
    most_common,
    require_tensor,
    stat_dtype,
)
from ._prepared import Prepared

FAMILY = "floyd_attention"
MASK_DTYPES = (torch.bool, torch.uint8)
STAT_REPLICAS = 8  # CANN stores each softmax statistic 8 times: [B,H,N,M,8]


def _require(op, named):
    for name, t in named:
        require_tensor(op, name, t)


def _check_dtypes(op, named):
    """One float dtype for every tensor in ``named`` (the first is the reference)."""
    first_name, first = named[0]
    check_dtype(op, first_name, first, FLOAT_DTYPES)
    for name, t in named[1:]:
        check_same_dtype(op, name, t, first_name, first)


_LAYOUTS = {"q": "BHNMD", "k1": "BHNKD", "v1": "BHNKD", "k2": "BHKMD", "v2": "BHKMD"}


def agreed_sizes(op, named, layouts):
    """Each tensor of ``named`` has the rank of its layout (``layouts[name]``, a letter per
    dim), and one size per letter across the tensors that have it: the size most of them have
    (a tie goes to the first in ``named``). An error (561002) names the tensor off it, the dims
    that differ and the tensors that agree. Returns ``{letter: size}``."""
    for name, t in named:
        rank = len(layouts[name])
        check_rank(op, name, t, rank, rank, status=TILING)
    sizes = {}  # dim -> [(name, size)] in the order of ``named``
    for name, t in named:
        for dim, size in zip(layouts[name], t.shape):
            sizes.setdefault(dim, []).append((name, size))
    agreed = {dim: most_common([size for _, size in pairs]) for dim, pairs in sizes.items()}
    for name, t in named:
        layout = layouts[name]
        wrong = [(dim, size) for dim, size in zip(layout, t.shape) if size != agreed[dim]]
        if wrong:
            rules = "; ".join(f"{dim} = {agreed[dim]} as in "
                              f"{', '.join(o for o, size in sizes[dim] if size == agreed[dim])}"
                              for dim, _ in wrong)
            fail(op, TILING, f"{name} has shape {tuple(t.shape)} ([{', '.join(layout)}]), so "
                             f"{', '.join(f'{dim} = {size}' for dim, size in wrong)}, expected {rules}")
    return agreed


def _check_shapes(op, q, k1, v1, k2, v2):
    """Rank 5 each, and one size per dim (B, H, N, M, K, D): :func:`agreed_sizes` (a tie goes to
    q's, or k1's for K)."""
    agreed = agreed_sizes(op, (("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2)), _LAYOUTS)
    b, h, n, m, d = q.shape
    kk = agreed["K"]
    if kk < 1 and b * h * n * m > 0:
        fail(op, TILING, f"k1 has K = {kk} pivots, expected K >= 1 (a softmax over no pivots is undefined)")
    return b, h, n, m, kk, d


def _check_mask_dtype(op, mask):
    if mask is not None:
        require_tensor(op, "mask", mask)
        check_dtype(op, "mask", mask, MASK_DTYPES)


def _check_mask_shape(op, mask, b, n, kk):
    if mask is not None:
        check_shape(op, "mask", mask, (b, 1, n, 1, kk), "(B, 1, N, 1, K)", status=TILING)


def _as_bool_mask(mask):
    return None if mask is None else (mask if mask.dtype == torch.bool else mask != 0)


class FloydPlan(NamedTuple):
    """What the checks of a ``floyd_attention`` call concluded (kept per call signature): the
    backend module, its launches for calls of this signature (``impl.plan``: a forward and a
    backward given each call's tensors), the outputs' (shape, dtype) and the scale."""

    impl: object
    launches: object
    outputs: tuple
    scale: float  # as checked


def _key(op, q, k1, v1, k2, v2, mask, scale, backend):
    return _plans.signature(op, backend, (q, k1, v1, k2, v2, mask), (scale,))


def remembered_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend, op="floyd_attention"):
    """The plan :func:`plan_floyd_attention` remembered for this call signature, or None (a
    signature not checked yet: the caller checks it, then plans)."""
    return _plans.lookup(_key(op, q, k1, v1, k2, v2, mask, scale, backend))


def plan_floyd_attention(q, k1, v1, k2, v2, mask=None, scale=1.0, *, backend=None,
                         op="floyd_attention") -> FloydPlan:
    """Checks a ``floyd_attention`` call (once per call signature) and plans it."""
    key = _key(op, q, k1, v1, k2, v2, mask, scale, backend)
    plan = _plans.lookup(key)
    if plan is not None:
        return plan
    # None -> 161001, then every dtype rule (161002), then the shapes CANN checks at tiling
    qkv = (("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2))
    _require(op, qkv)
    _check_dtypes(op, qkv)
    _check_mask_dtype(op, mask)
    b, h, n, m, kk, d = _check_shapes(op, q, k1, v1, k2, v2)
    _check_mask_shape(op, mask, b, n, kk)
    scale = check_float_attr(op, "scale", scale)
    check_same_device(op, [("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2), ("mask", mask)])
    impl = implementation(op, FAMILY, backend, q.device, kernel_limit=lambda kernels: kernels.unsupported(q))
    acc = stat_dtype(q.dtype)
    outputs = ((tuple(q.shape), q.dtype), ((b, h, n, m), acc), ((b, h, n, m), acc))
    launches = impl.plan(q, k1, v1, k2, v2, _as_bool_mask(mask), scale)
    return _plans.remember(key, FloydPlan(impl, launches, outputs, scale))


def run_floyd_attention(plan: FloydPlan, q, k1, v1, k2, v2, mask):
    """(out, softmax_max, softmax_sum, launches) of a planned call: ``launches`` ran it, and runs
    its backward (:func:`run_planned_floyd_attention_grad`)."""
    launches = plan.launches.current()
    return (*launches.forward(q, k1, v1, k2, v2, _as_bool_mask(mask)), launches)


def run_planned_floyd_attention_grad(launches, dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask):
    """(dq, dk1, dv1, dk2, dv2) of a planned call's backward (gradops.nn's eager path), by the
    launches that ran its forward: autograd hands it dy with the metadata of the output, and the
    statistics the forward returned."""
    return launches.backward(dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, _as_bool_mask(mask))


def prepare_floyd_attention(q, k1, v1, k2, v2, mask=None, scale=1.0, *, backend=None,
                            op="floyd_attention") -> Prepared:
    plan = plan_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend, op=op)
    return Prepared(op, q.device, plan.impl, plan.outputs,
                    lambda: run_floyd_attention(plan, q, k1, v1, k2, v2, mask)[:3])


def compact_stat(op, name, t, b, h, n, m):
    """Softmax statistic given compact ``[B,H,N,M]`` or CANN's ``[B,H,N,M,8]`` -> compact view."""
    if tuple(t.shape) == (b, h, n, m):
        return t
    if tuple(t.shape) == (b, h, n, m, STAT_REPLICAS):
        return t[..., 0]
    fail(op, TILING, f"{name} has shape {tuple(t.shape)}, expected compact (B, H, N, M) == {(b, h, n, m)} "
                     f"or CANN's {(b, h, n, m, STAT_REPLICAS)}")


def prepare_floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask=None,
                                 scale=1.0, *, backend=None, op="floyd_attention_grad", kv2_partial=False) -> Prepared:
    """``kv2_partial``: dK2/dV2 in the accumulation dtype (float32 for 16-bit inputs), as partial
    sums over this call's rows of n that a caller adds to others' (gradops.distributed)."""
    # None -> 161001, then every dtype rule (161002), then the shapes CANN checks at tiling
    tensors = (("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2), ("dy", dy), ("out", out))
    stats = (("softmax_max", softmax_max), ("softmax_sum", softmax_sum))
    _require(op, tensors + stats)
    _check_dtypes(op, tensors)
    for name, t in stats:
        check_dtype(op, name, t, (stat_dtype(q.dtype),))
    _check_mask_dtype(op, mask)
    b, h, n, m, kk, d = _check_shapes(op, q, k1, v1, k2, v2)
    check_shape(op, "dy", dy, q.shape, "q.shape", status=TILING)
    check_shape(op, "out", out, q.shape, "q.shape", status=TILING)
    smax = compact_stat(op, "softmax_max", softmax_max, b, h, n, m)
    ssum = compact_stat(op, "softmax_sum", softmax_sum, b, h, n, m)
    _check_mask_shape(op, mask, b, n, kk)
    scale = check_float_attr(op, "scale", scale)
    check_same_device(op, [("dy", dy), ("q", q), ("k1", k1), ("v1", v1), ("k2", k2), ("v2", v2),
                           ("out", out), ("softmax_max", smax), ("softmax_sum", ssum), ("mask", mask)])
    impl = implementation(op, FAMILY, backend, q.device, kernel_limit=lambda kernels: kernels.unsupported(q))

    kv2_dtype = stat_dtype(q.dtype) if kv2_partial else q.dtype

    def run():
        # the launches the forward's signature planned (remembered: a compiled graph's backward
        # op runs this every step)
        launches = plan_floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend, op=op).launches
        return launches.backward(dy, q, k1, v1, k2, v2, smax, ssum, _as_bool_mask(mask), kv2_dtype)

    outputs = (tuple((tuple(t.shape), q.dtype) for t in (q, k1, v1))
               + tuple((tuple(t.shape), kv2_dtype) for t in (k2, v2)))
    return Prepared(op, q.device, impl, outputs, run)
