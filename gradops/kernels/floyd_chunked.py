"""Floyd (pivotal) attention, the chunked strategy: a few large Triton GEMMs per chunk of rows.

Same formulas and contract as the fused kernels (``floyd_attention.py``, OPERATORS.md
section 5)::

    S[n,m,k] = scale * (Q[n,m].K1[n,k] + Q[n,m].K2[k,m])     masked -> -FLT_MAX
    Y[n,m]   = sum_k softmax_k(S)[n,m,k] * (V1[n,k] + V2[k,m])

Every product is a GEMM batched over (slice, n) (the K1/V1 side) or over (slice, m) (the
K2/V2 side). ``_gemm_kernel`` computes one such product for a whole chunk in one launch:
16-bit operands (tensor cores) or float32 (IEEE), a float32 accumulator, a two-level batch
with arbitrary strides (so no operand is copied into another layout, and (b, h) are part
of the batch), and optionally the float32 sum of an earlier result added before the store
(``acc``): the second half of a score, of Y or of dQ, and the sums of dK1/dV1 and dK2/dV2
across chunks happen inside the GEMMs, and a result leaves its last GEMM already rounded
to the output dtype. The softmax and dS are Triton row kernels over the float32 scores.
Per chunk of ``floyd_config.chunk_plan`` (slices x n rows x m rows, every pivot):

- forward, 4 GEMMs: ``S = Q K1^T`` (over (g, n)), ``S += Q K2^T`` (over (g, m), into the
  same float32 buffer); ``_softmax_rows`` writes the row max and sum and P (input dtype,
  once); ``Yp = P V1`` (float32), ``Y = Yp + P V2`` rounded once.
- backward, 10 GEMMs: ``S`` again (the same two GEMMs on the same chunks: bitwise the
  forward's scores), ``dP = dY V1^T + dY V2^T`` likewise; ``_grad_rows`` computes P from the
  statistics, ``Dr = sum_k P dP`` and ``dS = P (dP - Dr) scale`` (zero where masked) and
  writes P and dS (input dtype, once each); ``dQ = dS K1 + dS K2`` (two GEMMs, rounded once),
  ``dK1 = dS^T Q``, ``dV1 = P^T dY`` (over (g, n), summed over m), ``dK2 = dS^T Q``,
  ``dV2 = P^T dY`` (over (g, m), summed over n). A sum that spans chunks continues in a
  float32 accumulator through the GEMMs' ``acc``; the chunk that completes it stores the
  rounded result.

The GEMMs execute the nominal 4 + 10 units of B*H*N*M*K*D multiply-adds. Memory beyond
inputs and outputs: one chunk's score buffers and float32 partial Y or dQ
(``floyd_config.pair_bytes`` per (n, m) row, within ``floyd_config.chunk_budget``, which
derives from the device's total memory and the problem), and float32 accumulators only for
sums that span chunks. Deterministic: a fixed walk, no atomics, each GEMM's blocks a
function of its shapes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._floyd_common import _NEG_FLT_MAX, SCALE_ARGS, _mask_arg, _scale_bits, _unpack_scale, tile_max
from ._floyd_memory import Backward, chunks, flat, forward_outputs
from ._launch import bind_launches
from .floyd_gemm import Product, by_m as _by_m, gemm
from .floyd_config import chunk_budget, row_config, small_grid, strategy_plan, total_memory


# Integer arguments of the row kernels the JIT must not specialise: those that change from chunk
# to chunk (the chunk's rows and first slice, n and m), where each value 1 or multiple of 16
# would be a compile of its own in a user's first step, and the scale (its float64 bits). The
# GEMM (floyd_gemm.py) does specialise its sizes and batch strides, although they change at
# tail chunks: without their divisibility the sm_90 compile has no cp.async (the loads' masks
# cannot be vectorised) and, without the batch strides', spills (253 registers); a tail costs a
# compile or two instead.
NOT_SPECIALISED = {
    "_softmax_rows": [*SCALE_ARGS, "rows", "cn", "cm", "g0", "n0", "m0"],
    "_grad_rows": [*SCALE_ARGS, "rows", "cn", "cm", "g0", "n0", "m0"],
}


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, acc: "torch.Tensor | None" = None) -> None:
    """``out = a @ b (+ acc)``: one product, one launch of the shared GEMM."""
    gemm(Product(a, b, out, acc))


# ----------------------------------------------------------------------------------------------
# Row kernels: one program per BLOCK_R consecutive rows of a chunk's [G, cn, cm, K] buffers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rows(rows, cn, cm, g0, n0, m0, H, mask_ptr, smk_b, smk_n, sst_g, sst_n, sst_m, BLOCK_R: tl.constexpr):
    """(row indices in the chunk, rows that exist, each row's mask pointer and statistics
    offset) of this program; a row is (slice, n, m) of the call."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    g = g0 + r // (cn * cm)
    n = n0 + (r // cm) % cn
    m = m0 + r % cm
    mask_rows = mask_ptr + (g // H).to(tl.int64) * smk_b + n.to(tl.int64) * smk_n
    stat = g.to(tl.int64) * sst_g + n.to(tl.int64) * sst_n + m.to(tl.int64) * sst_m
    return r.to(tl.int64), live, mask_rows, stat


@triton.jit
def _scores(s_ptr, mask_rows, smk_k, r, k_idx, inside, K, scale, HAS_MASK: tl.constexpr):
    """``scale * S`` of a [BLOCK_R, BLOCK_K] tile, -FLT_MAX where the user's mask is set (as
    CANN), -inf past K (tail pivots take no part), and where the user's mask is set."""
    s = tl.load(s_ptr + r[:, None] * K + k_idx[None, :], mask=inside, other=0.0) * scale
    if HAS_MASK:
        user = tl.load(mask_rows[:, None] + k_idx[None, :] * smk_k, mask=inside, other=0) != 0
        s = tl.where(user, _NEG_FLT_MAX, s)
    else:
        user = inside & (k_idx < 0)[None, :]  # nothing masked
    return tl.where((k_idx < K)[None, :], s, float("-inf")), user


@triton.jit
def _store(ptr, x, r, k_idx, inside, K):
    """A tile into a [rows, K] buffer in its dtype (2-pivot: the input dtype, P and dS enter
    their GEMMs rounded, as in every flash-attention kernel; 3-Floyd: float32, split by them)."""
    tl.store(ptr + r[:, None] * K + k_idx[None, :], x.to(ptr.dtype.element_ty), mask=inside)


@bind_launches
@triton.jit(do_not_specialize=NOT_SPECIALISED["_softmax_rows"])
def _softmax_rows(
    s_ptr, mask_ptr, p_ptr, max_ptr, sum_ptr, smk_b, smk_n, smk_k, sst_g, sst_n, sst_m,
    rows, cn, cm, K, H, g0, n0, m0, scale_high, scale_low,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """Forward: the row max and sum of exp(S - max) (written to the statistics), and P."""
    r, live, mask_rows, stat = _rows(rows, cn, cm, g0, n0, m0, H, mask_ptr, smk_b, smk_n, sst_g, sst_n, sst_m,
                                     BLOCK_R)
    scale = _unpack_scale(scale_high, scale_low, tl.float32)
    softmax_rows_body(s_ptr, p_ptr, max_ptr, sum_ptr, mask_rows, smk_k, r, live, stat, K, scale,
                      HAS_MASK, BLOCK_R, BLOCK_K, ONE_TILE)


@triton.jit
def _probs_and_dp(s_ptr, dp_ptr, mask_rows, smk_k, r, k_idx, inside, K, row_max, inv_sum, scale,
                  HAS_MASK: tl.constexpr):
    """P (from the saved statistics, as the fused backward: exp(S - max) * (1 / sum)), dP and
    the user's mask of one tile."""
    s, user = _scores(s_ptr, mask_rows, smk_k, r, k_idx, inside, K, scale, HAS_MASK)
    p = tl.exp(s - row_max[:, None]) * inv_sum[:, None]
    dp = tl.load(dp_ptr + r[:, None] * K + k_idx[None, :], mask=inside, other=0.0)
    return p, dp, user


@triton.jit
def _store_grads(p_ptr, ds_ptr, p, dp, dr, user, r, k_idx, inside, K, scale, HAS_MASK: tl.constexpr):
    """dS = P (dP - Dr) scale, zero where masked (a masked score is a constant); P and dS."""
    ds = p * (dp - dr[:, None]) * scale
    if HAS_MASK:
        ds = tl.where(user, 0.0, ds)
    _store(p_ptr, p, r, k_idx, inside, K)
    _store(ds_ptr, ds, r, k_idx, inside, K)


@bind_launches
@triton.jit(do_not_specialize=NOT_SPECIALISED["_grad_rows"])
def _grad_rows(
    s_ptr, dp_ptr, mask_ptr, max_ptr, sum_ptr, p_ptr, ds_ptr, smk_b, smk_n, smk_k, sst_g, sst_n, sst_m,
    rows, cn, cm, K, H, g0, n0, m0, scale_high, scale_low,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """Backward: Dr = sum_k P dP in float32 (not dY.Y from the rounded Y: OPERATORS.md
    section 5), then dS and P, written in the input dtype."""
    r, live, mask_rows, stat = _rows(rows, cn, cm, g0, n0, m0, H, mask_ptr, smk_b, smk_n, sst_g, sst_n, sst_m,
                                     BLOCK_R)
    scale = _unpack_scale(scale_high, scale_low, tl.float32)
    grad_rows_body(s_ptr, dp_ptr, max_ptr, sum_ptr, p_ptr, ds_ptr, mask_rows, smk_k, r, live, stat, K, scale,
                   HAS_MASK, BLOCK_R, BLOCK_K, ONE_TILE)


# The rows' softmax and gradient, whatever a row's (slice, n, m) or 3-Floyd's (g, i, j, k): the
# row kernels above and floyd3_attention's find their rows' mask and statistics, then call these.
@triton.jit
def softmax_rows_body(s_ptr, p_ptr, max_ptr, sum_ptr, mask_rows, smk_p, r, live, stat, NP, scale,
                  HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr):
    """The softmax of a program's rows of NP pivots: the row max and sum of exp(S - max) into
    the statistics, P into ``p_ptr`` (in its dtype: the input dtype for 2-pivot, float32 for
    3-Floyd). One tile per row (each score read once) or, past BLOCK_K pivots, an online max
    and sum, then P. Shared by the 2-pivot ``_softmax_rows``
    and 3-Floyd's ``_softmax_rows3``, which differ in how a row finds its mask and statistics."""
    k_idx = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        inside = live[:, None] & (k_idx < NP)[None, :]
        s, _ = _scores(s_ptr, mask_rows, smk_p, r, k_idx, inside, NP, scale, HAS_MASK)
        row_max = tile_max(s)
        e = tl.exp(s - row_max[:, None])
        row_sum = tl.sum(e, axis=1)
        _store(p_ptr, e * (1.0 / row_sum)[:, None], r, k_idx, inside, NP)
    else:
        row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, NP, BLOCK_K):
            inside = live[:, None] & (k0 + k_idx < NP)[None, :]
            s, _ = _scores(s_ptr, mask_rows, smk_p, r, k0 + k_idx, inside, NP, scale, HAS_MASK)
            new_max = tl.maximum(row_max, tile_max(s), propagate_nan=tl.PropagateNan.ALL)
            # a first tile of -inf scores only leaves the max -inf: shift by 0 there (exp(-inf -
            # -inf) is NaN), as one tile of the whole row would
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(s - shift[:, None]), axis=1)
            row_max = new_max
        inv_sum = 1.0 / row_sum
        for k0 in range(0, NP, BLOCK_K):
            inside = live[:, None] & (k0 + k_idx < NP)[None, :]
            s, _ = _scores(s_ptr, mask_rows, smk_p, r, k0 + k_idx, inside, NP, scale, HAS_MASK)
            _store(p_ptr, tl.exp(s - row_max[:, None]) * inv_sum[:, None], r, k0 + k_idx, inside, NP)
    tl.store(max_ptr + stat, row_max, mask=live)
    tl.store(sum_ptr + stat, row_sum, mask=live)


@triton.jit
def grad_rows_body(s_ptr, dp_ptr, max_ptr, sum_ptr, p_ptr, ds_ptr, mask_rows, smk_p, r, live, stat, NP, scale,
               HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr):
    """The backward rows: P from the saved statistics, Dr = sum_p P dP in float32, dS = P (dP -
    Dr) scale (0 where masked), P and dS into their buffers (in their dtype, as above). Shared by
    the 2-pivot ``_grad_rows`` and 3-Floyd's ``_grad_rows3``."""
    row_max = tl.load(max_ptr + stat, mask=live, other=0.0)
    inv_sum = 1.0 / tl.load(sum_ptr + stat, mask=live, other=1.0)
    k_idx = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        inside = live[:, None] & (k_idx < NP)[None, :]
        p, dp, user = _probs_and_dp(s_ptr, dp_ptr, mask_rows, smk_p, r, k_idx, inside, NP, row_max, inv_sum,
                                    scale, HAS_MASK)
        dr = tl.sum(p * dp, axis=1)
        _store_grads(p_ptr, ds_ptr, p, dp, dr, user, r, k_idx, inside, NP, scale, HAS_MASK)
    else:
        dr = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, NP, BLOCK_K):
            inside = live[:, None] & (k0 + k_idx < NP)[None, :]
            p, dp, _ = _probs_and_dp(s_ptr, dp_ptr, mask_rows, smk_p, r, k0 + k_idx, inside, NP, row_max, inv_sum,
                                     scale, HAS_MASK)
            dr += tl.sum(p * dp, axis=1)
        for k0 in range(0, NP, BLOCK_K):
            inside = live[:, None] & (k0 + k_idx < NP)[None, :]
            p, dp, user = _probs_and_dp(s_ptr, dp_ptr, mask_rows, smk_p, r, k0 + k_idx, inside, NP, row_max,
                                        inv_sum, scale, HAS_MASK)
            _store_grads(p_ptr, ds_ptr, p, dp, dr, user, r, k0 + k_idx, inside, NP, scale, HAS_MASK)


def _launch_rows(kernel, rows, k, *args, **consts):
    cfg = row_config(k)
    kernel[(-(-rows // cfg["BLOCK_R"]),)](*args, **consts, **cfg)


# ----------------------------------------------------------------------------------------------
# Launchers (called by floyd_attention.py's backend functions, which handle empty shapes)
# ----------------------------------------------------------------------------------------------
def _plan(q, k):
    """The chunk plan of a call on ``q`` with K = ``k`` pivots: a function of the shape, the
    dtype and the device's total memory, so that a forward and its backward walk the same
    chunks."""
    if q.dtype == torch.float64:  # the dispatcher keeps float64 on the fused kernels
        raise TypeError("the chunked Floyd strategy takes float16, bfloat16 and float32 inputs")
    bh, n, m, d = q.shape[0] * q.shape[1], q.shape[2], q.shape[3], q.shape[4]
    memory, small = total_memory(q.device), small_grid(n, m, k)
    return strategy_plan("chunked", bh, n, m, k, d, q.dtype, lambda problem: chunk_budget(memory, problem, small))


class _Workspace:
    """One chunk's buffers, allocated once per call at the largest chunk's size and viewed as
    ``[G, cn, cm, x]`` for each chunk (tail chunks use a prefix)."""

    def __init__(self, plan, k, d, dtype, device, names):
        scores = plan.groups * plan.block_n * plan.block_m * k
        sizes = {"s": (scores, torch.float32), "dp": (scores, torch.float32), "p": (scores, dtype),
                 "ds": (scores, dtype), "part": (scores // k * d, torch.float32)}
        self._flat = {name: torch.empty(sizes[name][0], dtype=sizes[name][1], device=device) for name in names}

    def view(self, name, g, cn, cm, x):
        return self._flat[name][:g * cn * cm * x].view(g, cn, cm, x)


def _scores_into(s, q, k1, k2):
    """``s = Q K1^T + Q K2^T`` for a chunk (float32 ``[G, cn, cm, K]``): the n-batched GEMM,
    then the m-batched one accumulated onto it. Both passes build S (and dP) with this."""
    _gemm(q, k1.transpose(2, 3), s)
    _gemm(_by_m(q), k2.permute(0, 2, 3, 1), _by_m(s), acc=_by_m(s))


def _pair_into(out, part, x, y1, y2):
    """``out = x y1 + x y2`` for a chunk (Y from P, dQ from dS): the n-batched product into
    the float32 ``part``, then the m-batched one added to it and rounded once into ``out``."""
    _gemm(x, y1, part)
    _gemm(_by_m(x), y2.transpose(1, 2), _by_m(out), acc=_by_m(part))


def forward(q, k1, v1, k2, v2, mask, scale):
    """``(out, softmax_max, softmax_sum)`` as ``floyd_attention.floyd_attention``; 16-bit
    and float32 inputs, B*H*N*M*K > 0."""
    B, H, N, M, D = q.shape
    K = k1.shape[3]
    dev = q.device
    out, softmax_max, softmax_sum = forward_outputs(q)
    q4, k1_4, v1_4, k2_4, v2_4 = (flat(t) for t in (q, k1, v1, k2, v2))
    out4, max3, sum3 = flat(out), flat(softmax_max), flat(softmax_sum)
    mask_t, mask_strides, has_mask = _mask_arg(mask, q)
    bits = _scale_bits(scale)
    plan = _plan(q, K)
    work = _Workspace(plan, K, D, q.dtype, dev, ("s", "p", "part"))
    for g0, g1, n0, n1, m0, m1 in plan.chunks(B * H, N, M):
        gs, ns, ms = slice(g0, g1), slice(n0, n1), slice(m0, m1)
        g, cn, cm = g1 - g0, n1 - n0, m1 - m0
        s, p, part = work.view("s", g, cn, cm, K), work.view("p", g, cn, cm, K), work.view("part", g, cn, cm, D)
        _scores_into(s, q4[gs, ns, ms], k1_4[gs, ns], k2_4[gs, :, ms])
        _launch_rows(_softmax_rows, g * cn * cm, K, s, mask_t, p, max3, sum3, *mask_strides, *max3.stride(),
                     g * cn * cm, cn, cm, K, H, g0, n0, m0, *bits, HAS_MASK=has_mask)
        _pair_into(out4[gs, ns, ms], part, p, v1_4[gs, ns], v2_4[gs, :, ms])
    return out, softmax_max, softmax_sum


def backward(dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, scale, kv2_dtype):
    """``(dq, dk1, dv1, dk2, dv2)`` in q.dtype (dK2/dV2 in ``kv2_dtype``), as
    ``floyd_attention.floyd_attention_grad``;
    16-bit and float32 inputs, B*H*N*M*K > 0."""
    B, H, N, M, D = q.shape
    K = k1.shape[3]
    q4, dy4, k1_4, v1_4, k2_4, v2_4 = (flat(t) for t in (q, dy, k1, v1, k2, v2))
    mask_t, mask_strides, has_mask = _mask_arg(mask, q)
    bits = _scale_bits(scale)
    plan = _plan(q, K)
    grads = Backward(q, K, softmax_max, softmax_sum, plan, kv2_dtype)
    max3, sum3 = grads.softmax_max, grads.softmax_sum
    work = _Workspace(plan, K, D, q.dtype, q.device, ("s", "dp", "p", "ds", "part"))
    for c in chunks(plan, B * H, N, M):
        gs, ns, ms, g, cn, cm = c.gs, c.ns, c.ms, c.g, c.cn, c.cm
        s, dp, p, ds = (work.view(name, g, cn, cm, K) for name in ("s", "dp", "p", "ds"))
        q_c, dy_c = q4[gs, ns, ms], dy4[gs, ns, ms]
        k1_c, v1_c, k2_c, v2_c = k1_4[gs, ns], v1_4[gs, ns], k2_4[gs, :, ms], v2_4[gs, :, ms]
        _scores_into(s, q_c, k1_c, k2_c)  # the forward's GEMMs on the forward's chunks
        _scores_into(dp, dy_c, v1_c, v2_c)
        g0, n0, m0 = gs.start, ns.start, ms.start
        _launch_rows(_grad_rows, g * cn * cm, K, s, dp, mask_t, max3, sum3, p, ds, *mask_strides, *max3.stride(),
                     g * cn * cm, cn, cm, K, H, g0, n0, m0, *bits, HAS_MASK=has_mask)
        _pair_into(grads.dq[gs, ns, ms], work.view("part", g, cn, cm, D), ds, k1_c, k2_c)
        for product in grads.n_side(c, ds, p, q_c, dy_c) + grads.m_side(c, ds, p, q_c, dy_c):
            gemm(product)  # one launch each: the chunked strategy's launches stay its own
    return tuple(grads.grads)
