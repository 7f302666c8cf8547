"""Floyd (pivotal) attention, the hybrid strategy: the n-side half of every score on chip, the
m-side half through memory.

Same formulas and contract as the other strategies (OPERATORS.md section 5)::

    S[n,m,k] = scale * (Q[n,m].K1[n,k] + Q[n,m].K2[k,m])     masked -> -FLT_MAX
    Y[n,m]   = sum_k softmax_k(S)[n,m,k] * (V1[n,k] + V2[k,m])

The two halves of a score are products over different batch axes: Q.K1, dY.V1 and dS.K1 are
matrix products batched over n, Q.K2, dY.V2, dS.K2 batched over m. For one n, a block of m
rows and a block of pivots, the n-side products are plain 2-D tensor-core products, so a
program that owns (slice, n, block of m) and walks the pivots flash-style keeps S1 and dP1 in
registers, the softmax statistics, Y1 = P.V1 and dQ1 = dS.K1 in its accumulators: no n-side
score ever reaches memory. The m-side halves cannot be had there (per m they are products over
n), so GEMMs batched over (slice, m) (``floyd_gemm.py``) write them once, the row kernels here
read them, and write P and dS once, over them, for the products that need them whole: Y2 =
P.V2 and dQ2 = dS.K2 (with the on-chip half added, rounded once), dK2, dV2 (batched over m,
summed over n) and dK1, dV1 (batched over n, summed over m). Per chunk of
``floyd_config.plan_rows`` (slices x rows of n x rows of m, every pivot):

- forward, 3 launches: ``S2 = Q K2^T`` (over (g, m)); ``_rows_forward`` (per (g, n, m-block),
  two sweeps over the pivots: the row max and sum, then P, written over S2, and Y1 = P V1,
  written as a float32 partial); ``Y = P V2 + Y1`` (over (g, m), rounded once).
- backward, 4 launches: ``S2 = Q K2^T`` and ``dP2 = dY V2^T`` in one launch (the forward's
  product on the forward's chunks: bitwise the forward's S2); ``_rows_backward`` (per (g, n,
  m-block), two sweeps: Dr = sum_k P dP, then dS = P (dP - Dr) scale, P and dS written over
  S2 and dP2, and dQ1 = dS K1 as a float32 partial); ``dQ = dS K2 + dQ1`` (over (g, m),
  rounded once), ``dK2 = dS^T Q``, ``dV2 = P^T dY`` (over (g, m), summed over n) in one
  launch; ``dK1 = dS^T Q``, ``dV1 = P^T dY`` (over (g, n), summed over m) in one launch. A
  sum that spans chunks continues in a float32 accumulator through the GEMMs' ``acc``.

The m-side halves are the GEMMs' float32 sums, kept for 16-bit inputs in 24 bits by default
(``floyd_config.HALF_BITS``: a bfloat16-format top plane and an 8-bit plane below it; opt-in
32, the float32 itself, or for bfloat16 inputs 16, the top plane alone); float32 inputs keep
32. P and dS, in the input dtype, are written over the halves each program has just read (a
16-bit P over float32 halves into the first half of each row's bytes, after a barrier), so a
chunk's workspace is its two halves. Every sweep over the pivots is a ``tl.range`` loop with
``num_stages``, which Triton pipelines whole (a plain ``range`` pipelines only the loads of
a dot's operands): the halves, the K1/V1 tiles and the mask (read as words where it can be,
``mask_words``) are copied steps ahead; a loop holding a barrier is not pipelined, hence the
24-bit default. docs/kernels-floyd.md ("The hybrid strategy") has the bytes each launch moves,
counted, and what the compile shows.

Exactness: S (and dP) of a score is ``dot(Q, K1^T, acc=S2)`` in every sweep of both row
kernels, with the same tiles (``floyd_config.hybrid_config``), on an S2 the same GEMM
computed on the same chunk; so the backward holds bitwise the forward's scores and a one-hot
P gives dS exactly zero. The row kernels run without FMA contraction (``enable_fp_fusion``
off), as the chunked strategy's: P = 1 for a single pivot needs ``S * scale - max`` to be
exactly 0. Deterministic: a fixed walk, no atomics, every sum in one program or one product.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._floyd_common import _NEG_FLT_MAX, SCALE_ARGS, _mask_arg, _scale_bits, _unpack_scale, dot_constexprs, tile_max
from ._floyd_memory import Backward, chunks, flat, forward_outputs
from ._launch import bind_launches
from .floyd_config import chunk_budget, half_bits, hybrid_config, small_grid, strategy_plan, total_memory
from .floyd_gemm import Product, by_m, gemm, load_half

# Integer arguments of the row kernels the JIT must not specialise: the chunk's sizes and first
# slice and row, which change at a tail chunk (each value 1 or multiple of 16 would be a compile
# of its own in a user's first step), and the scale (its float64 bits).
NOT_SPECIALISED = ["cn", "cm", "g0", "n0", *SCALE_ARGS]


# ----------------------------------------------------------------------------------------------
# The row kernels: one program per (slice, n, block of m rows) of a chunk, walking the pivots
# ----------------------------------------------------------------------------------------------
@triton.jit
def _program(cn, cm, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(g, n, first m) of this program inside the chunk, its rows of m and head lanes (and which
    exist): consecutive programs share n (and so the K1/V1 rows they read from L2)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(cm, BLOCK_M)
    row = pid // tiles_m
    m0 = (pid % tiles_m) * BLOCK_M
    m_loc = tl.arange(0, BLOCK_M)
    d_idx = tl.arange(0, BLOCK_D)
    return row // cn, row % cn, m0, m_loc, m0 + m_loc < cm, d_idx, d_idx < D


@triton.jit
def _rows(ptr, s0, s1, s2, s3, g, n, m0, m_loc, m_ok, d_idx, d_ok, UPCAST: tl.constexpr):
    """The [BLOCK_M, BLOCK_D] tile of rows m0 + m_loc of a ``[G, cn, cm, D]`` view at (g, n)."""
    base = ptr + g.to(tl.int64) * s0 + n.to(tl.int64) * s1 + m0.to(tl.int64) * s2
    tile = tl.load(base + m_loc[:, None] * s2 + d_idx[None, :] * s3, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # bfloat16 under the Triton interpreter, whose bf16 tl.dot is wrong (triton#11584)
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _pivots(base, sk, sd, k0, k_ok, d_idx, d_ok, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_D] tile of pivots k0 + [0, BLOCK_K) of one n's K1 or V1 (``base``
    at (g, n); the step's offset in int64, K * D may pass 2^31)."""
    k_loc = tl.arange(0, BLOCK_K)
    tile = tl.load(base + (tl.full([], 0, tl.int64) + k0) * sk + k_loc[:, None] * sk + d_idx[None, :] * sd,
                   mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _half_products(x, pivots, hi_ptr, lo_ptr, offs, inside, HALF_BITS: tl.constexpr, PRECISION: tl.constexpr):
    """``x . pivots^T`` accumulated onto the stored m-side half (its float32 value): a score
    (x = Q, pivots = K1) or a dP (x = dY, pivots = V1), [BLOCK_M, BLOCK_K], in the one order
    every sweep of both row kernels uses."""
    half = load_half(hi_ptr, lo_ptr, offs, inside, HALF_BITS)
    return tl.dot(x, tl.trans(pivots), half, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def _pivot_mask(mask_row, smk_k, k0, K, HAS_MASK: tl.constexpr, MASK_WORDS: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The user's mask of pivots k0 + [0, BLOCK_K) (True: masked; all False without a mask):
    read as bytes, or (MASK_WORDS: the row's bytes contiguous and 4-byte aligned, K a multiple
    of 4) as 4-byte words, each four pivots' bytes: Triton's pipeliner copies a tile of words
    ahead of its step, where a tile of single bytes would wait for memory at every step."""
    k_idx = k0 + tl.arange(0, BLOCK_K)
    if MASK_WORDS:
        w_idx = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        words = tl.load(mask_row.to(tl.pointer_type(tl.int32)) + w_idx, mask=w_idx < K // 4, other=0)
        pivot_bytes = (words[:, None] >> (8 * tl.arange(0, 4))[None, :]) & 0xFF  # little-endian
        user = tl.reshape(pivot_bytes, [BLOCK_K]) != 0
    elif HAS_MASK:
        user = tl.load(mask_row + k_idx * smk_k, mask=k_idx < K, other=0) != 0
    else:
        user = k_idx < 0
    return user


@triton.jit
def _scores(q, k1, hi_ptr, lo_ptr, offs, inside, user, k_ok, scale,
            HAS_MASK: tl.constexpr, HALF_BITS: tl.constexpr, PRECISION: tl.constexpr):
    """``scale * S`` of a [BLOCK_M, BLOCK_K] tile, -FLT_MAX where the user's mask ``user`` is
    set (as CANN), -inf past K (tail pivots take no part)."""
    s = _half_products(q, k1, hi_ptr, lo_ptr, offs, inside, HALF_BITS, PRECISION) * scale
    if HAS_MASK:
        s = tl.where(user[None, :], _NEG_FLT_MAX, s)
    return tl.where(k_ok[None, :], s, float("-inf"))


@triton.jit
def _score_step(k0, q, k1_base, sk2, sk3, s2_hi, s2_lo, mask_row, smk_k, m_loc, m_ok, d_idx, d_ok, K, scale,
                HAS_MASK: tl.constexpr, MASK_WORDS: tl.constexpr, HALF_BITS: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
    """One step of pivots, k0 + [0, BLOCK_K), of a program's rows: ``scale * S`` (``_scores``),
    the user's mask of the pivots, the halves' offsets of the tile and its lanes inside, the
    pivot indices, which exist, and the K1 tile. Every sweep of both row kernels takes its
    scores here."""
    k_idx = k0 + tl.arange(0, BLOCK_K)
    k_ok = k_idx < K
    offs = m_loc[:, None] * K + k_idx[None, :]
    inside = m_ok[:, None] & k_ok[None, :]
    k1 = _pivots(k1_base, sk2, sk3, k0, k_ok, d_idx, d_ok, UPCAST, BLOCK_K)
    user = _pivot_mask(mask_row, smk_k, k0, K, HAS_MASK, MASK_WORDS, BLOCK_K)
    s = _scores(q, k1, s2_hi, s2_lo, offs, inside, user, k_ok, scale, HAS_MASK, HALF_BITS, PRECISION)
    return s, user, offs, inside, k_idx, k_ok, k1


@triton.jit
def _over_half(ptr, x, m_loc, k_idx, inside, K, P_SPREAD: tl.constexpr):
    """Store a [BLOCK_M, BLOCK_K] tile of P or dS over the half this program has read: rows
    P_SPREAD * K elements apart. Where an element of P takes a half's element (P_SPREAD 1) it
    is computed from that very element's value, so the element was read before it is written,
    whichever thread copied it in; where two take one (P_SPREAD 2: a 16-bit P over float32
    halves, into the first half of each row's bytes) a tile's bytes overlap the halves of
    earlier pivots of the same rows, which other threads of the program read, this step or
    before: a barrier first (never another program's rows: a program owns its own)."""
    if P_SPREAD > 1:
        tl.debug_barrier()
    tl.store(ptr + m_loc[:, None] * (K * P_SPREAD) + k_idx[None, :], x, mask=inside)


@bind_launches
@triton.jit(do_not_specialize=NOT_SPECIALISED)
def _rows_forward(
    q_ptr, k1_ptr, v1_ptr, s2_hi, s2_lo, p_ptr, mask_ptr, max_ptr, sum_ptr, y1_ptr,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, smk_b, smk_n, smk_k, sst0, sst1, sst2,
    cn, cm, K, D, H, g0, n0, scale_high, scale_low,
    HAS_MASK: tl.constexpr, MASK_WORDS: tl.constexpr, HALF_BITS: tl.constexpr, P_SPREAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):
    """Forward rows: the row max and sum of exp(S - max) over every pivot (first sweep), then P
    (written over S2's top plane, in the input dtype) and Y1 = P V1 (second sweep), the
    statistics and Y1 (float32, [G, cn, cm, D] contiguous) stored at the end."""
    g, n, m0, m_loc, m_ok, d_idx, d_ok = _program(cn, cm, D, BLOCK_M, BLOCK_D)
    scale = _unpack_scale(scale_high, scale_low, tl.float32)
    q = _rows(q_ptr, sq0, sq1, sq2, sq3, g, n, m0, m_loc, m_ok, d_idx, d_ok, UPCAST)
    k1_base = k1_ptr + g.to(tl.int64) * sk0 + n.to(tl.int64) * sk1
    v1_base = v1_ptr + g.to(tl.int64) * sv0 + n.to(tl.int64) * sv1
    half_row = ((g * cn + n).to(tl.int64) * cm + m0) * K  # the halves: [G, cn, cm, K] contiguous
    s2_hi += half_row
    s2_lo += half_row
    p_ptr += half_row * P_SPREAD  # P rows: P_SPREAD * K elements apart (over a half's bytes)
    mask_row = mask_ptr + ((g0 + g) // H).to(tl.int64) * smk_b + (n0 + n).to(tl.int64) * smk_n

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        s, _, _, _, _, _, _ = _score_step(k0, q, k1_base, sk2, sk3, s2_hi, s2_lo, mask_row, smk_k, m_loc, m_ok,
                                          d_idx, d_ok, K, scale, HAS_MASK, MASK_WORDS, HALF_BITS, PRECISION, UPCAST,
                                          BLOCK_K)
        new_max = tl.maximum(row_max, tile_max(s), propagate_nan=tl.PropagateNan.ALL)
        # a first tile of -inf scores only (infinite inputs) leaves the max -inf: shift by 0
        # there, not by -inf (exp(-inf - -inf) is NaN), as one tile of the whole row would
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(s - shift[:, None]), axis=1)
        row_max = new_max

    inv_sum = 1.0 / row_sum
    y1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        s, _, _, inside, k_idx, k_ok, _ = _score_step(k0, q, k1_base, sk2, sk3, s2_hi, s2_lo, mask_row, smk_k,
                                                      m_loc, m_ok, d_idx, d_ok, K, scale, HAS_MASK, MASK_WORDS,
                                                      HALF_BITS, PRECISION, UPCAST, BLOCK_K)
        # P enters every product rounded to the input dtype, as in every flash-attention kernel
        p = (tl.exp(s - row_max[:, None]) * inv_sum[:, None]).to(p_ptr.dtype.element_ty)
        _over_half(p_ptr, p, m_loc, k_idx, inside, K, P_SPREAD)
        if UPCAST:
            p = p.to(tl.float32)
        v1 = _pivots(v1_base, sv2, sv3, k0, k_ok, d_idx, d_ok, UPCAST, BLOCK_K)
        y1 = tl.dot(p, v1, y1, input_precision=PRECISION, out_dtype=tl.float32)

    stat = g.to(tl.int64) * sst0 + n.to(tl.int64) * sst1 + (m0 + m_loc) * sst2
    tl.store(max_ptr + stat, row_max, mask=m_ok)
    tl.store(sum_ptr + stat, row_sum, mask=m_ok)
    part = ((g * cn + n).to(tl.int64) * cm + m0) * D
    tl.store(y1_ptr + part + m_loc[:, None] * D + d_idx[None, :], y1, mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _probs_and_dp(k0, q, dy, k1_base, v1_base, sk2, sk3, sv2, sv3, s2_hi, s2_lo, dp2_hi, dp2_lo, mask_row, smk_k,
                  m_loc, m_ok, d_idx, d_ok, K, row_max, inv_sum, scale, HAS_MASK: tl.constexpr,
                  MASK_WORDS: tl.constexpr, HALF_BITS: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
    """One step of pivots of the backward: P from the saved statistics (as the fused backward:
    exp(S - max) * (1 / sum)), dP = dY V1^T onto dP2, the user's mask, the lanes inside, the
    pivot indices and the K1 tile. Both sweeps take them here: bitwise the same."""
    s, user, offs, inside, k_idx, k_ok, k1 = _score_step(k0, q, k1_base, sk2, sk3, s2_hi, s2_lo, mask_row, smk_k,
                                                         m_loc, m_ok, d_idx, d_ok, K, scale, HAS_MASK, MASK_WORDS,
                                                         HALF_BITS, PRECISION, UPCAST, BLOCK_K)
    p = tl.exp(s - row_max[:, None]) * inv_sum[:, None]
    v1 = _pivots(v1_base, sv2, sv3, k0, k_ok, d_idx, d_ok, UPCAST, BLOCK_K)
    dp = _half_products(dy, v1, dp2_hi, dp2_lo, offs, inside, HALF_BITS, PRECISION)
    return p, dp, user, inside, k_idx, k1


@bind_launches
@triton.jit(do_not_specialize=NOT_SPECIALISED)
def _rows_backward(
    q_ptr, dy_ptr, k1_ptr, v1_ptr, s2_hi, s2_lo, dp2_hi, dp2_lo, p_ptr, ds_ptr, mask_ptr, max_ptr, sum_ptr,
    dq1_ptr,
    sq0, sq1, sq2, sq3, sdy0, sdy1, sdy2, sdy3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, smk_b, smk_n, smk_k,
    sst0, sst1, sst2,
    cn, cm, K, D, H, g0, n0, scale_high, scale_low,
    HAS_MASK: tl.constexpr, MASK_WORDS: tl.constexpr, HALF_BITS: tl.constexpr, P_SPREAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):
    """Backward rows: P and dP in both sweeps (``_probs_and_dp``); Dr = sum_k P dP in float32
    (first sweep; not dY.Y from the rounded Y: OPERATORS.md section 5), then dS = P (dP - Dr) scale
    (zero where masked: a masked score is a constant), P and dS written over the halves' top
    planes in the input dtype, and dQ1 = dS K1 (float32, [G, cn, cm, D] contiguous)."""
    g, n, m0, m_loc, m_ok, d_idx, d_ok = _program(cn, cm, D, BLOCK_M, BLOCK_D)
    scale = _unpack_scale(scale_high, scale_low, tl.float32)
    q = _rows(q_ptr, sq0, sq1, sq2, sq3, g, n, m0, m_loc, m_ok, d_idx, d_ok, UPCAST)
    dy = _rows(dy_ptr, sdy0, sdy1, sdy2, sdy3, g, n, m0, m_loc, m_ok, d_idx, d_ok, UPCAST)
    k1_base = k1_ptr + g.to(tl.int64) * sk0 + n.to(tl.int64) * sk1
    v1_base = v1_ptr + g.to(tl.int64) * sv0 + n.to(tl.int64) * sv1
    half_row = ((g * cn + n).to(tl.int64) * cm + m0) * K
    s2_hi += half_row
    s2_lo += half_row
    dp2_hi += half_row
    dp2_lo += half_row
    p_ptr += half_row * P_SPREAD
    ds_ptr += half_row * P_SPREAD
    mask_row = mask_ptr + ((g0 + g) // H).to(tl.int64) * smk_b + (n0 + n).to(tl.int64) * smk_n
    stat = g.to(tl.int64) * sst0 + n.to(tl.int64) * sst1 + (m0 + m_loc) * sst2
    row_max = tl.load(max_ptr + stat, mask=m_ok, other=0.0)
    inv_sum = 1.0 / tl.load(sum_ptr + stat, mask=m_ok, other=1.0)

    dr = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        p, dp, _, _, _, _ = _probs_and_dp(k0, q, dy, k1_base, v1_base, sk2, sk3, sv2, sv3, s2_hi, s2_lo, dp2_hi,
                                          dp2_lo, mask_row, smk_k, m_loc, m_ok, d_idx, d_ok, K, row_max, inv_sum,
                                          scale, HAS_MASK, MASK_WORDS, HALF_BITS, PRECISION, UPCAST, BLOCK_K)
        dr += tl.sum(p * dp, axis=1)

    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        p, dp, user, inside, k_idx, k1 = _probs_and_dp(k0, q, dy, k1_base, v1_base, sk2, sk3, sv2, sv3, s2_hi,
                                                       s2_lo, dp2_hi, dp2_lo, mask_row, smk_k, m_loc, m_ok, d_idx,
                                                       d_ok, K, row_max, inv_sum, scale, HAS_MASK, MASK_WORDS,
                                                       HALF_BITS, PRECISION, UPCAST, BLOCK_K)
        ds = p * (dp - dr[:, None]) * scale
        if HAS_MASK:
            ds = tl.where(user[None, :], 0.0, ds)
        ds = ds.to(ds_ptr.dtype.element_ty)
        _over_half(p_ptr, p.to(p_ptr.dtype.element_ty), m_loc, k_idx, inside, K, P_SPREAD)
        _over_half(ds_ptr, ds, m_loc, k_idx, inside, K, P_SPREAD)
        if UPCAST:
            ds = ds.to(tl.float32)
        dq1 = tl.dot(ds, k1, dq1, input_precision=PRECISION, out_dtype=tl.float32)

    part = ((g * cn + n).to(tl.int64) * cm + m0) * D
    tl.store(dq1_ptr + part + m_loc[:, None] * D + d_idx[None, :], dq1, mask=m_ok[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers (called by floyd_attention.py's backend functions, which handle empty shapes)
# ----------------------------------------------------------------------------------------------
def _plan(q, k):
    """The chunk plan of a call on ``q`` with K = ``k`` pivots: a function of the shape, the
    dtype and the device's total memory, so that a forward and its backward walk the same
    chunks (their S2 GEMMs then compute bitwise the same halves)."""
    bh, n, m, d = q.shape[0] * q.shape[1], q.shape[2], q.shape[3], q.shape[4]
    memory, small = total_memory(q.device), small_grid(n, m, k)
    return strategy_plan("hybrid", bh, n, m, k, d, q.dtype, lambda problem: chunk_budget(memory, problem, small))


def p_spread(dtype: torch.dtype) -> int:
    """Elements of P (in ``dtype``, the inputs') that one element of an m-side half holds: 2 for
    16-bit inputs over float32 halves, else 1 (the row kernels' P_SPREAD)."""
    return 4 // dtype.itemsize if half_bits(dtype) == 32 else 1


class _Half(NamedTuple):
    """One chunk's m-side half, ``[G, cn, cm, K]``: its float32 values (HALF_BITS 32) or top
    plane (24, 16: int16) ``hi``, its low plane ``lo`` (uint8, 24 bits only; else ``hi`` again,
    never read), and ``probs``: where P or dS is written over it, in the input dtype (the
    first half of each row's bytes when a 16-bit P goes over float32 values)."""

    hi: torch.Tensor
    lo: torch.Tensor
    probs: torch.Tensor


class _Workspace:
    """One chunk's buffers, allocated once per call at the largest chunk's size and viewed as
    ``[G, cn, cm, x]`` for each chunk (tail chunks use a prefix): each half's planes, and the
    float32 partial Y1 or dQ1."""

    def __init__(self, plan, k, d, dtype, device, halves):
        self.bits = half_bits(dtype)
        self.dtype = dtype
        self.spread = p_spread(dtype)
        rows = plan.groups * plan.block_n * plan.block_m
        top = torch.float32 if self.bits == 32 else torch.int16
        self._halves = {name: (torch.empty(rows * k, dtype=top, device=device),
                               torch.empty(rows * k, dtype=torch.uint8, device=device) if self.bits == 24 else None)
                        for name in halves}
        self._part = torch.empty(rows * d, dtype=torch.float32, device=device)

    def half(self, name, g, cn, cm, k) -> _Half:
        top, low = self._halves[name]
        hi = top[:g * cn * cm * k].view(g, cn, cm, k)
        lo = hi if low is None else low[:g * cn * cm * k].view(g, cn, cm, k)
        probs = hi if hi.dtype == self.dtype else hi.view(self.dtype).view(g, cn, cm, self.spread * k)[..., :k]
        return _Half(hi, lo, probs)

    def part(self, g, cn, cm, d):
        return self._part[:g * cn * cm * d].view(g, cn, cm, d)

    def product(self, a, b, half: _Half) -> Product:
        """The product that stores an m-side half (over (g, m): the half seen by m)."""
        return Product(a, b, by_m(half.hi), lo=by_m(half.lo) if self.bits == 24 else None)

    @property
    def gemm_bits(self) -> int:
        """The GEMM's ``half_bits``: 0 for float32 halves, which are stored as they are."""
        return 0 if self.bits == 32 else self.bits


def mask_words(mask: torch.Tensor, strides, has_mask: bool, k: int) -> bool:
    """Whether the row kernels read the mask (``_mask_arg``'s bytes and its b, n, k strides)
    as 4-byte words (MASK_WORDS): every pivot row's bytes contiguous and 4-byte aligned."""
    return (has_mask and mask.element_size() == 1 and strides[2] == 1 and k % 4 == 0
            and all(x % 4 == 0 for x in (mask.data_ptr(), *strides[:2])))


def _launch_rows(kernel, work, g, cn, cm, d, device, *args, has_mask, words):
    cfg = hybrid_config(d, work.dtype)
    grid = (g * cn * -(-cm // cfg["BLOCK_M"]),)
    kernel[grid](*args, HAS_MASK=has_mask, MASK_WORDS=words, HALF_BITS=work.bits, P_SPREAD=work.spread,
                 **dot_constexprs(work.dtype, device), **cfg)


def forward(q, k1, v1, k2, v2, mask, scale):
    """``(out, softmax_max, softmax_sum)`` as ``floyd_attention.floyd_attention``; 16-bit
    and float32 inputs, B*H*N*M*K > 0."""
    B, H, N, M, D = q.shape
    K = k1.shape[3]
    dev, dtype = q.device, q.dtype
    out, softmax_max, softmax_sum = forward_outputs(q)
    q4, k1_4, v1_4, k2_4, v2_4 = (flat(t) for t in (q, k1, v1, k2, v2))
    out4, max3, sum3 = flat(out), flat(softmax_max), flat(softmax_sum)
    mask_t, mask_strides, has_mask = _mask_arg(mask, q)
    words = mask_words(mask_t, mask_strides, has_mask, K)
    bits = _scale_bits(scale)
    plan = _plan(q, K)
    work = _Workspace(plan, K, D, dtype, dev, ("s2",))
    for c in chunks(plan, B * H, N, M):
        gs, ns, ms, g, cn, cm = c.gs, c.ns, c.ms, c.g, c.cn, c.cm
        q_c, k1_c, v1_c = q4[gs, ns, ms], k1_4[gs, ns], v1_4[gs, ns]
        s2, part = work.half("s2", g, cn, cm, K), work.part(g, cn, cm, D)
        gemm(work.product(by_m(q_c), k2_4[gs, :, ms].permute(0, 2, 3, 1), s2), half_bits=work.gemm_bits)
        stats = max3[gs, ns, ms]
        _launch_rows(_rows_forward, work, g, cn, cm, D, dev,
                     q_c, k1_c, v1_c, s2.hi, s2.lo, s2.probs, mask_t, stats, sum3[gs, ns, ms], part,
                     *q_c.stride(), *k1_c.stride(), *v1_c.stride(), *mask_strides, *stats.stride(),
                     cn, cm, K, D, H, gs.start, ns.start, *bits, has_mask=has_mask, words=words)
        gemm(Product(by_m(s2.probs), v2_4[gs, :, ms].transpose(1, 2), by_m(out4[gs, ns, ms]), acc=by_m(part)))
    return out, softmax_max, softmax_sum


def backward(dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, scale, kv2_dtype):
    """``(dq, dk1, dv1, dk2, dv2)`` in q.dtype (dK2/dV2 in ``kv2_dtype``), as
    ``floyd_attention.floyd_attention_grad``;
    16-bit and float32 inputs, B*H*N*M*K > 0."""
    B, H, N, M, D = q.shape
    K = k1.shape[3]
    dev = q.device
    q4, dy4, k1_4, v1_4, k2_4, v2_4 = (flat(t) for t in (q, dy, k1, v1, k2, v2))
    mask_t, mask_strides, has_mask = _mask_arg(mask, q)
    words = mask_words(mask_t, mask_strides, has_mask, K)
    bits = _scale_bits(scale)
    plan = _plan(q, K)
    grads = Backward(q, K, softmax_max, softmax_sum, plan, kv2_dtype)
    work = _Workspace(plan, K, D, q.dtype, dev, ("s2", "dp2"))
    for c in chunks(plan, B * H, N, M):
        gs, ns, ms, g, cn, cm = c.gs, c.ns, c.ms, c.g, c.cn, c.cm
        q_c, dy_c = q4[gs, ns, ms], dy4[gs, ns, ms]
        k1_c, v1_c, k2_c, v2_c = k1_4[gs, ns], v1_4[gs, ns], k2_4[gs, :, ms], v2_4[gs, :, ms]
        s2, dp2, part = work.half("s2", g, cn, cm, K), work.half("dp2", g, cn, cm, K), work.part(g, cn, cm, D)
        # the forward's product on the forward's chunks (bitwise its S2), and dP2 beside it
        gemm(work.product(by_m(q_c), k2_c.permute(0, 2, 3, 1), s2),
             work.product(by_m(dy_c), v2_c.permute(0, 2, 3, 1), dp2), half_bits=work.gemm_bits)
        stats = grads.softmax_max[gs, ns, ms]
        _launch_rows(_rows_backward, work, g, cn, cm, D, dev,
                     q_c, dy_c, k1_c, v1_c, s2.hi, s2.lo, dp2.hi, dp2.lo, s2.probs, dp2.probs, mask_t, stats,
                     grads.softmax_sum[gs, ns, ms], part,
                     *q_c.stride(), *dy_c.stride(), *k1_c.stride(), *v1_c.stride(), *mask_strides, *stats.stride(),
                     cn, cm, K, D, H, gs.start, ns.start, *bits, has_mask=has_mask, words=words)
        p, ds = s2.probs, dp2.probs
        # over (g, m): dQ = dS K2 + dQ1 (rounded once), dK2 and dV2 summed over n; over (g, n):
        # dK1 and dV1 summed over m
        dq = Product(by_m(ds), k2_c.transpose(1, 2), by_m(grads.dq[gs, ns, ms]), acc=by_m(part))
        gemm(dq, *grads.m_side(c, ds, p, q_c, dy_c))
        gemm(*grads.n_side(c, ds, p, q_c, dy_c))
    return tuple(grads.grads)
