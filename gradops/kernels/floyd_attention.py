"""Floyd ("pivotal") attention on the Triton backend: the backend functions, and the fused
strategy's flash-style kernels, forward and backward.

``floyd_attention`` / ``floyd_attention_grad`` below run each call by the strategy
``floyd_strategy.strategy`` chooses: these fused kernels, or the chunked GEMM path of
``floyd_chunked.py`` (docs/kernels-floyd.md, "Strategies").

Shapes (OPERATORS.md section 5): Q ``[B,H,N,M,D]``, K1/V1 ``[B,H,N,K,D]``, K2/V2
``[B,H,K,M,D]``, mask ``[B,1,N,1,K]`` (True = masked out)::

    S[n,m,k] = scale * (Q[n,m].K1[n,k] + Q[n,m].K2[k,m])     masked -> -FLT_MAX
    Y[n,m]   = sum_k softmax_k(S)[n,m,k] * (V1[n,k] + V2[k,m])

The first product is batched over n, the second over m, so no 2-D tile of S is a single
matrix product. Every kernel therefore works on a 3-D tile of the score cube
``[BLOCK_N, BLOCK_M, BLOCK_K]`` and computes it as two *batched* ``tl.dot`` (3-D operands,
batch axis first): ``Q[n-tile, m-tile] @ K1[n-tile, k-tile]^T`` batched over the n of the
tile, plus ``Q^T @ K2^T`` batched over the m of the tile, permuted to the same
orientation. Every product of the forward (four) and of the backward runs on tensor cores
with float32 accumulation; the forward executes exactly its nominal 8*B*H*N*M*K*D FLOP (the
backward recomputes S and dP in each kernel: 44, nominal 20). The design note is
docs/kernels-floyd.md.

- ``_fwd_kernel``: one program per (b, h, n-tile, m-tile); loops over k-tiles with an
  online softmax; writes Y and the compact float32 statistics (row max, and the sum of
  exp(S - max): not log-sum-exp).
- backward, without atomics (deterministic: every output element is reduced by exactly one
  program, in a fixed order), each kernel recomputing P = exp(S - max) / sum:
  ``_bwd_dq_kernel`` per (n-tile, m-tile), looping over k twice: first Dr = sum_k P dP
  (in the accumulation dtype, not dY.Y from the rounded Y: OPERATORS.md section 5), which
  it writes for the other two, then dQ; ``_bwd_dkv_kernel``, launched twice: per (n-tile,
  k-tile) looping over m for dK1, dV1, and per (m-tile, k-tile) looping over n for dK2, dV2
  (the problem is symmetric under swapping n and m with the two key/value pairs). All three
  recompute P and dP through one helper, in one orientation and with each score's two
  products summed in one order (``_pair_dot``: the product batched over n accumulated onto
  the one batched over m, written out, because on a GPU a dot's accumulation order is part
  of its result), so every pass holds bitwise the forward's S and the same P and dP, and dS
  is exactly zero in every kernel where it is in the dQ pass (a one-hot P, e.g. a single
  pivot).

Masking: a masked score is -FLT_MAX exactly as CANN, so a fully masked row has max -FLT_MAX,
sum K and a uniform P. Tails (indices past N, M, K, D) are excluded entirely (their
scores are -inf, their P and dS zero). dS is zero wherever the mask is set. A NaN score
makes its row's max NaN, as torch.amax (the reference).

The scale is a scalar argument (the float64's bits, so float64 inputs use it unrounded):
no tensor is made from host data per call.

Inputs: float16 and bfloat16 (tensor-core products, float32 accumulation), float32 (IEEE
products, never TF32: the fp32 path is for exactness, not speed) and float64 (float64
accumulation and statistics, as the reference; slow, for checking; every ``tl.dot`` names
``out_dtype=ACC`` because Triton 3.6 would otherwise give float64 operands a float32
result). Any strides: every tensor's strides are passed to the kernels, so views need no
copy.
"""
from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from . import floyd_chunked, floyd_hybrid
from ._floyd_common import (_ACC, _NEG_FLT_MAX, _TL, FLT_MAX, SCALE_ARGS, _scale_bits, _unpack_scale,
                            dot_constexprs)
from ._launch import bind_launches
from .floyd_config import FUSED_MAX_HEAD_DIM, floyd_config, total_memory
from .floyd_config import settings as config_settings
from .floyd_strategy import strategy



# ----------------------------------------------------------------------------------------------
# Small helpers shared by the kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile3(ptr, i0, i1, i2, s0, s1, s2, n0, n1, n2, UPCAST: tl.constexpr):
    """Load ptr[i0, i1, i2] (strides s*), zero past the bounds n*: a [len(i0), len(i1), len(i2)] tile.

    The index vectors are int32, or int64 when some offset inside one (b, h) slice can pass
    2^31 (the launcher decides: ``IDX``); 64-bit offsets cost registers the tiles need."""
    offs = (i0[:, None, None] * s0 + i1[None, :, None] * s1
            + i2[None, None, :] * s2)
    inside = (i0 < n0)[:, None, None] & (i1 < n1)[None, :, None] & (i2 < n2)[None, None, :]
    tile = tl.load(ptr + offs, mask=inside, other=0.0)
    if UPCAST:  # bfloat16 under the Triton interpreter, whose bf16 tl.dot is wrong (triton#11584)
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _store3(ptr, value, i0, i1, i2, s0, s1, s2, n0, n1, n2):
    offs = (i0[:, None, None] * s0 + i1[None, :, None] * s1
            + i2[None, None, :] * s2)
    inside = (i0 < n0)[:, None, None] & (i1 < n1)[None, :, None] & (i2 < n2)[None, None, :]
    tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=inside)


@triton.jit
def _tile2(ptr, i0, i1, s0, s1, n0, n1, other):
    offs = i0[:, None] * s0 + i1[None, :] * s1
    inside = (i0 < n0)[:, None] & (i1 < n1)[None, :]
    return tl.load(ptr + offs, mask=inside, other=other)


@triton.jit
def _store2(ptr, value, i0, i1, s0, s1, n0, n1):
    offs = i0[:, None] * s0 + i1[None, :] * s1
    inside = (i0 < n0)[:, None] & (i1 < n1)[None, :]
    tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=inside)


@triton.jit
def _masked_out(mask_ptr, i0, i1, s0, s1, n0, n1):
    """True where the user's mask is set, for a [len(i0), len(i1)] tile of (n, k) (or (k, n))."""
    return _tile2(mask_ptr, i0, i1, s0, s1, n0, n1, 0) != 0


@triton.jit
def _pair_dot(a, a_t, x1, x2, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """``r[n, m, k] = a[n, m] . x1[n, :, k] + a[n, m] . x2[m, :, k]``, an [BN, BM, BK] tile.

    The first product is batched over n, the second over m (``a_t`` is ``a`` with n and m
    swapped; its result is permuted back). Every pass computes its scores (a = Q, x = K1
    and K2 transposed) and dP (a = dY, x = V1 and V2) here, in this orientation and in one
    order: the product batched over m from zero, then the product batched over n
    accumulated onto it (it is that dot's ``acc``).

    The order is part of the result: a dot does not round its products before adding them
    to its accumulator (an FMA chain in IEEE float32/float64, tensor-core MMA for 16-bit
    inputs, whose accumulation is not even round-to-nearest), so "Q.K1 onto round(Q.K2)" and
    "Q.K2 onto round(Q.K1)" differ in the last bits. Written as ``dot(a, x1) + dot(a_t,
    x2)`` the order was Triton's: its combiner folds the add into the first dot's
    accumulator when compiling for a GPU (the interpreter never folds), and the dK2/dV2
    launch, whose first operand was K2, computed the other order, so a one-hot P was not
    one-hot there. With the order and the orientation the same in every pass, the forward,
    the dQ pass and both dK/dV launches hold bitwise the same S and dP, on a GPU as in the
    interpreter (tests/test_kernels_floyd.py reads the order in the sm_90 TTIR)."""
    by_m = tl.permute(tl.dot(a_t, x2, input_precision=PRECISION, out_dtype=ACC), (1, 0, 2))
    return tl.dot(a, x1, by_m, input_precision=PRECISION, out_dtype=ACC)


@triton.jit
def _program_tile(pid, tiles_a, tiles_b, GROUP: tl.constexpr):
    """(b*H + h, tile index along a, tile index along b) of program ``pid``.

    Programs of one (b, h) are contiguous; inside, GROUP consecutive a-tiles form a column
    that is walked before moving to the next b-tile, so concurrently running programs share
    their a-side and b-side operand rows in L2 (the grouped ordering of the matmul tutorial).
    """
    tiles = tiles_a * tiles_b
    bh = pid // tiles
    t = pid % tiles
    per_group = GROUP * tiles_b
    first_a = (t // per_group) * GROUP
    group_size = tl.minimum(tiles_a - first_a, GROUP)
    a = first_a + (t % per_group) % group_size
    b = (t % per_group) // group_size
    return bh, a, b


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
@bind_launches
@triton.jit(do_not_specialize=SCALE_ARGS)
def _fwd_kernel(
    q_ptr, k1_ptr, v1_ptr, k2_ptr, v2_ptr, mask_ptr, out_ptr, max_ptr, sum_ptr,
    sq_b, sq_h, sq_n, sq_m, sq_d,
    sk1_b, sk1_h, sk1_n, sk1_k, sk1_d,
    sv1_b, sv1_h, sv1_n, sv1_k, sv1_d,
    sk2_b, sk2_h, sk2_k, sk2_m, sk2_d,
    sv2_b, sv2_h, sv2_k, sv2_m, sv2_d,
    smk_b, smk_n, smk_k,
    so_b, so_h, so_n, so_m, so_d,
    sst_b, sst_h, sst_n, sst_m,
    H, N, M, K, D, scale_high, scale_low,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, IDX: tl.constexpr, UPCAST: tl.constexpr,
):
    bh, tn, tm = _program_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(M, BLOCK_M), GROUP)
    scale = _unpack_scale(scale_high, scale_low, ACC)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n_idx = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(IDX)
    m_idx = (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(IDX)
    d_idx = (tl.arange(0, BLOCK_D)).to(IDX)
    k1_ptr += b * sk1_b + h * sk1_h
    v1_ptr += b * sv1_b + h * sv1_h
    k2_ptr += b * sk2_b + h * sk2_h
    v2_ptr += b * sv2_b + h * sv2_h
    mask_ptr += b * smk_b

    q = _tile3(q_ptr + b * sq_b + h * sq_h, n_idx, m_idx, d_idx, sq_n, sq_m, sq_d, N, M, D, UPCAST)  # [BN,BM,BD]
    q_by_m = tl.permute(q, (1, 0, 2))  # [BM,BN,BD]: the operand of the product batched over m

    row_max = tl.full([BLOCK_N, BLOCK_M], float("-inf"), ACC)
    row_sum = tl.zeros([BLOCK_N, BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_D], ACC)
    for k0 in range(0, K, BLOCK_K):
        k_idx = (k0 + tl.arange(0, BLOCK_K)).to(IDX)
        k1_t = _tile3(k1_ptr, n_idx, d_idx, k_idx, sk1_n, sk1_d, sk1_k, N, D, K, UPCAST)  # [BN,BD,BK]
        k2_t = _tile3(k2_ptr, m_idx, d_idx, k_idx, sk2_m, sk2_d, sk2_k, M, D, K, UPCAST)  # [BM,BD,BK]
        s = _pair_dot(q, q_by_m, k1_t, k2_t, PRECISION, ACC) * scale
        if HAS_MASK:
            user = _masked_out(mask_ptr, n_idx, k_idx, smk_n, smk_k, N, K)  # [BN,BK]
            s = tl.where(user[:, None, :], _NEG_FLT_MAX, s)
        # Tail pivots take no part at all (a masked pivot does: -FLT_MAX, as CANN).
        s = tl.where((k_idx < K)[None, None, :], s, float("-inf"))

        # The row max is NaN as soon as one score is (torch.amax, the reference, propagates
        # NaN; P, the sum and Y are NaN then anyway). tl.max skips NaN (maxnum compiled,
        # nanmax in the interpreter, Triton 3.6 to 3.9), hence the separate test; the running
        # max keeps a NaN with PropagateNan.ALL (the default maxnum would drop it again).
        tile_max = tl.max(s, axis=2)  # not -inf: every k-tile has a real pivot
        tile_max = tl.where(tl.max((s != s).to(tl.int32), axis=2) != 0, float("nan"), tile_max)
        new_max = tl.maximum(row_max, tile_max, propagate_nan=tl.PropagateNan.ALL)
        alpha = tl.exp(row_max - new_max)
        p = tl.exp(s - new_max[:, :, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=2)
        row_max = new_max

        v1 = _tile3(v1_ptr, n_idx, k_idx, d_idx, sv1_n, sv1_k, sv1_d, N, K, D, UPCAST)  # [BN,BK,BD]
        v2 = _tile3(v2_ptr, m_idx, k_idx, d_idx, sv2_m, sv2_k, sv2_d, M, K, D, UPCAST)  # [BM,BK,BD]
        p_in = p.to(v1.dtype)
        acc = acc * alpha[:, :, None]
        acc = tl.dot(p_in, v1, acc, input_precision=PRECISION, out_dtype=ACC)
        acc += tl.permute(tl.dot(tl.permute(p_in, (1, 0, 2)), v2, input_precision=PRECISION, out_dtype=ACC),
                          (1, 0, 2))

    out = acc / row_sum[:, :, None]
    _store3(out_ptr + b * so_b + h * so_h, out, n_idx, m_idx, d_idx, so_n, so_m, so_d, N, M, D)
    stat_off = b * sst_b + h * sst_h
    _store2(max_ptr + stat_off, row_max, n_idx, m_idx, sst_n, sst_m, N, M)
    _store2(sum_ptr + stat_off, row_sum, n_idx, m_idx, sst_n, sst_m, N, M)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _probs_and_dp(q, q_by_m, dy, dy_by_m, k1_t, k2_t, v1_t, v2_t, user, live, mx, inv_sum, scale,
                  HAS_MASK: tl.constexpr, BY_M: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """P and dP of one tile, from S and dP computed in the forward's orientation [BN, BM, BK]
    (``_pair_dot``), returned in it or, with ``BY_M``, as [BM, BN, BK] (the dK2/dV2
    launch's own axis first); ``user`` the mask tile, ``live`` the real pivots and rows,
    ``mx``, ``inv_sum`` the row statistics, all in the returned orientation. The one
    recomputation every backward kernel uses, so their P and dP are bitwise the same;
    masked pivots keep P (a fully masked row is uniform), their dS is zeroed by the caller."""
    s = _pair_dot(q, q_by_m, k1_t, k2_t, PRECISION, ACC)
    if BY_M:
        s = tl.permute(s, (1, 0, 2))
    s = s * scale
    if HAS_MASK:
        s = tl.where(user, _NEG_FLT_MAX, s)
    s = tl.where(live, s, float("-inf"))  # tails: P = 0
    p = tl.exp(s - mx[:, :, None]) * inv_sum[:, :, None]
    dp = _pair_dot(dy, dy_by_m, v1_t, v2_t, PRECISION, ACC)
    if BY_M:
        dp = tl.permute(dp, (1, 0, 2))
    return p, dp


@triton.jit
def _dq_pivot_tile(k0, q, q_by_m, dy, dy_by_m, mx, inv_sum, scale, n_idx, m_idx, d_idx,
                   k1_ptr, v1_ptr, k2_ptr, v2_ptr, mask_ptr, sk1_n, sk1_k, sk1_d, sv1_n, sv1_k, sv1_d,
                   sk2_k, sk2_m, sk2_d, sv2_k, sv2_m, sv2_d, smk_n, smk_k, N, M, K, D,
                   HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_K: tl.constexpr, IDX: tl.constexpr, UPCAST: tl.constexpr):
    """One k-tile of the dQ kernel's two walks: the key tiles, the mask tile, P and dP
    (both walks call this, so the second recomputes the first's P and dP bitwise)."""
    k_idx = (k0 + tl.arange(0, BLOCK_K)).to(IDX)
    k1_t = _tile3(k1_ptr, n_idx, d_idx, k_idx, sk1_n, sk1_d, sk1_k, N, D, K, UPCAST)  # [BN,BD,BK]
    k2_t = _tile3(k2_ptr, m_idx, d_idx, k_idx, sk2_m, sk2_d, sk2_k, M, D, K, UPCAST)  # [BM,BD,BK]
    v1_t = _tile3(v1_ptr, n_idx, d_idx, k_idx, sv1_n, sv1_d, sv1_k, N, D, K, UPCAST)
    v2_t = _tile3(v2_ptr, m_idx, d_idx, k_idx, sv2_m, sv2_d, sv2_k, M, D, K, UPCAST)
    if HAS_MASK:
        user = _masked_out(mask_ptr, n_idx, k_idx, smk_n, smk_k, N, K)[:, None, :]
    else:
        user = tl.zeros([1, 1, BLOCK_K], tl.int1)
    live = (k_idx < K)[None, None, :]
    p, dp = _probs_and_dp(q, q_by_m, dy, dy_by_m, k1_t, k2_t, v1_t, v2_t, user, live, mx, inv_sum,
                          scale, HAS_MASK, False, PRECISION, ACC)
    return k1_t, k2_t, user | ~live, p, dp


@bind_launches
@triton.jit(do_not_specialize=SCALE_ARGS)
def _bwd_dq_kernel(
    q_ptr, k1_ptr, v1_ptr, k2_ptr, v2_ptr, mask_ptr, dy_ptr, max_ptr, sum_ptr,
    dr_ptr, dq_ptr,
    sq_b, sq_h, sq_n, sq_m, sq_d,
    sk1_b, sk1_h, sk1_n, sk1_k, sk1_d,
    sv1_b, sv1_h, sv1_n, sv1_k, sv1_d,
    sk2_b, sk2_h, sk2_k, sk2_m, sk2_d,
    sv2_b, sv2_h, sv2_k, sv2_m, sv2_d,
    smk_b, smk_n, smk_k,
    sdy_b, sdy_h, sdy_n, sdy_m, sdy_d,
    smax_b, smax_h, smax_n, smax_m,
    ssum_b, ssum_h, ssum_n, ssum_m,
    sdq_b, sdq_h, sdq_n, sdq_m, sdq_d,
    H, N, M, K, D, scale_high, scale_low,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, IDX: tl.constexpr, UPCAST: tl.constexpr,
):
    """Dr[n,m] = sum_k P dP, then dQ[n,m] = sum_k dS (K1[n,k] + K2[k,m]): one program per
    (n-tile, m-tile), two loops over k. Dr is written for the dK/dV launches."""
    bh, tn, tm = _program_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(M, BLOCK_M), GROUP)
    scale = _unpack_scale(scale_high, scale_low, ACC)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n_idx = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(IDX)
    m_idx = (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(IDX)
    d_idx = (tl.arange(0, BLOCK_D)).to(IDX)
    k1_ptr += b * sk1_b + h * sk1_h
    v1_ptr += b * sv1_b + h * sv1_h
    k2_ptr += b * sk2_b + h * sk2_h
    v2_ptr += b * sv2_b + h * sv2_h
    mask_ptr += b * smk_b

    q = _tile3(q_ptr + b * sq_b + h * sq_h, n_idx, m_idx, d_idx, sq_n, sq_m, sq_d, N, M, D, UPCAST)
    dy = _tile3(dy_ptr + b * sdy_b + h * sdy_h, n_idx, m_idx, d_idx, sdy_n, sdy_m, sdy_d, N, M, D, UPCAST)
    # Rows past N or M: any finite statistics (their results are never stored).
    mx = _tile2(max_ptr + b * smax_b + h * smax_h, n_idx, m_idx, smax_n, smax_m, N, M, 0.0)
    inv_sum = 1.0 / _tile2(sum_ptr + b * ssum_b + h * ssum_h, n_idx, m_idx, ssum_n, ssum_m, N, M, 1.0)
    q_by_m = tl.permute(q, (1, 0, 2))
    dy_by_m = tl.permute(dy, (1, 0, 2))

    # Dr = sum_k P dP in ACC (= dY.Y in exact arithmetic; the Y the caller passes is rounded
    # to the input dtype, and with values of a large common mean dP - dY.Y cancels to that
    # rounding). A first walk over k; the second recomputes the same P and dP.
    dr = tl.zeros([BLOCK_N, BLOCK_M], ACC)
    for k0 in range(0, K, BLOCK_K):
        k1_t, k2_t, gone, p, dp = _dq_pivot_tile(
            k0, q, q_by_m, dy, dy_by_m, mx, inv_sum, scale, n_idx, m_idx, d_idx,
            k1_ptr, v1_ptr, k2_ptr, v2_ptr, mask_ptr, sk1_n, sk1_k, sk1_d, sv1_n, sv1_k, sv1_d,
            sk2_k, sk2_m, sk2_d, sv2_k, sv2_m, sv2_d, smk_n, smk_k, N, M, K, D,
            HAS_MASK, PRECISION, ACC, BLOCK_K, IDX, UPCAST)
        dr += tl.sum(p * dp, axis=2)
    # Dr is a [B,H,N,M] buffer of the launcher's, contiguous.
    _store2(dr_ptr + bh.to(tl.int64) * N * M, dr, n_idx, m_idx, M, 1, N, M)

    dq = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_D], ACC)
    for k0 in range(0, K, BLOCK_K):
        k1_t, k2_t, gone, p, dp = _dq_pivot_tile(
            k0, q, q_by_m, dy, dy_by_m, mx, inv_sum, scale, n_idx, m_idx, d_idx,
            k1_ptr, v1_ptr, k2_ptr, v2_ptr, mask_ptr, sk1_n, sk1_k, sk1_d, sv1_n, sv1_k, sv1_d,
            sk2_k, sk2_m, sk2_d, sv2_k, sv2_m, sv2_d, smk_n, smk_k, N, M, K, D,
            HAS_MASK, PRECISION, ACC, BLOCK_K, IDX, UPCAST)
        # dS is zero where a pivot is masked (its score is a constant) and on tails.
        ds = tl.where(gone, 0.0, p * (dp - dr[:, :, None]) * scale)
        ds_in = ds.to(q.dtype)
        dq = tl.dot(ds_in, tl.permute(k1_t, (0, 2, 1)), dq, input_precision=PRECISION, out_dtype=ACC)
        dq += tl.permute(tl.dot(tl.permute(ds_in, (1, 0, 2)), tl.permute(k2_t, (0, 2, 1)),
                                input_precision=PRECISION, out_dtype=ACC), (1, 0, 2))
    _store3(dq_ptr + b * sdq_b + h * sdq_h, dq, n_idx, m_idx, d_idx, sdq_n, sdq_m, sdq_d, N, M, D)


@bind_launches
@triton.jit(do_not_specialize=SCALE_ARGS)
def _bwd_dkv_kernel(
    q_ptr, dy_ptr, own_k_ptr, own_v_ptr, other_k_ptr, other_v_ptr, mask_ptr, max_ptr, sum_ptr,
    dr_ptr, dk_ptr, dv_ptr,
    sq_b, sq_h, sq_own, sq_loop, sq_d,
    sdy_b, sdy_h, sdy_own, sdy_loop, sdy_d,
    sok_b, sok_h, sok_own, sok_k, sok_d,
    sov_b, sov_h, sov_own, sov_k, sov_d,
    sxk_b, sxk_h, sxk_loop, sxk_k, sxk_d,
    sxv_b, sxv_h, sxv_loop, sxv_k, sxv_d,
    smk_b, smk_n, smk_k,
    smax_b, smax_h, smax_own, smax_loop,
    ssum_b, ssum_h, ssum_own, ssum_loop,
    sdr_b, sdr_h, sdr_own, sdr_loop,
    sg_b, sg_h, sg_own, sg_k, sg_d,  # dK and dV: the launcher's, same strides
    H, OWN, LOOP, K, D, scale_high, scale_low,
    HAS_MASK: tl.constexpr, N_IS_LOOP: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    BLOCK_OWN: tl.constexpr, BLOCK_LOOP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, IDX: tl.constexpr, UPCAST: tl.constexpr,
):
    """dK[j,k] = sum_l dS Q[j,l], dV[j,k] = sum_l P dY[j,l]: one program per (j-tile, k-tile).

    The gradients of one side's keys and values. The score is symmetric under swapping n
    and m together with (K1, V1)[n,k] and (K2, V2)[k,m], so one kernel serves both sides:
    j is the side's *own* axis (n for dK1/dV1, m for dK2/dV2) and l the *looped* axis (the
    other one); "own" keys/values are indexed [j, k], "other" ones [l, k], and Q, dY, the
    statistics and Dr [j, l], all through the strides the launcher permutes. Only the mask
    [B,1,N,1,K] and the scores' arithmetic break the symmetry: ``N_IS_LOOP`` says that n is
    the looped axis (the dK2/dV2 launch), so the mask is loaded per step rather than once,
    and the scores are computed with the other side's tiles in the K1/V1 role.

    S and dP are computed as in the forward and the dQ pass, through the same
    ``_probs_and_dp``: in the orientation [n, m, k] ([BJ, BL, BK] in the dK1/dV1 launch,
    [BL, BJ, BK] in the dK2/dV2 launch, then transposed to [BJ, BL, BK]), with K1/V1 in
    K1/V1's operand role, so each score's two products are summed in the one order of
    every pass (``_pair_dot``) and P, dP and dS are bitwise the dQ pass's. P and dS are
    then transposed to [BJ, BK, BL] for the two reductions over l (batched products over j).
    The dK2/dV2 launch pays a transposition of S and dP that the dK1/dV1 launch does not:
    its tile is smaller where registers are tight (floyd_config).
    """
    bh, tj, tk = _program_tile(tl.program_id(0), tl.cdiv(OWN, BLOCK_OWN), tl.cdiv(K, BLOCK_K), GROUP)
    scale = _unpack_scale(scale_high, scale_low, ACC)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    j_idx = (tj * BLOCK_OWN + tl.arange(0, BLOCK_OWN)).to(IDX)
    k_idx = (tk * BLOCK_K + tl.arange(0, BLOCK_K)).to(IDX)
    d_idx = (tl.arange(0, BLOCK_D)).to(IDX)
    q_ptr += b * sq_b + h * sq_h
    dy_ptr += b * sdy_b + h * sdy_h
    other_k_ptr += b * sxk_b + h * sxk_h
    other_v_ptr += b * sxv_b + h * sxv_h
    mask_ptr += b * smk_b
    max_ptr += b * smax_b + h * smax_h
    sum_ptr += b * ssum_b + h * ssum_h
    dr_ptr += b * sdr_b + h * sdr_h

    own_k = _tile3(own_k_ptr + b * sok_b + h * sok_h, j_idx, d_idx, k_idx, sok_own, sok_d, sok_k,
                   OWN, D, K, UPCAST)  # [BJ,BD,BK]
    own_v = _tile3(own_v_ptr + b * sov_b + h * sov_h, j_idx, d_idx, k_idx, sov_own, sov_d, sov_k,
                   OWN, D, K, UPCAST)
    # The mask's n is j here (this program's own tile, loaded once) or l (a tile per step).
    own_user = tl.zeros([1, 1, BLOCK_K], tl.int1)
    if not N_IS_LOOP:
        if HAS_MASK:
            own_user = _masked_out(mask_ptr, j_idx, k_idx, smk_n, smk_k, OWN, K)[:, None, :]  # [BJ,1,BK]
    k_ok = (k_idx < K)[None, None, :]

    dk = tl.zeros([BLOCK_OWN, BLOCK_K, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_OWN, BLOCK_K, BLOCK_D], ACC)
    for l0 in range(0, LOOP, BLOCK_LOOP):
        l_idx = (l0 + tl.arange(0, BLOCK_LOOP)).to(IDX)
        q = _tile3(q_ptr, j_idx, l_idx, d_idx, sq_own, sq_loop, sq_d, OWN, LOOP, D, UPCAST)  # [BJ,BL,BD]
        dy = _tile3(dy_ptr, j_idx, l_idx, d_idx, sdy_own, sdy_loop, sdy_d, OWN, LOOP, D, UPCAST)
        # [BL,BD,BK]
        other_k = _tile3(other_k_ptr, l_idx, d_idx, k_idx, sxk_loop, sxk_d, sxk_k, LOOP, D, K, UPCAST)
        other_v = _tile3(other_v_ptr, l_idx, d_idx, k_idx, sxv_loop, sxv_d, sxv_k, LOOP, D, K, UPCAST)
        if N_IS_LOOP:
            user = tl.zeros([1, 1, BLOCK_K], tl.int1)
            if HAS_MASK:
                user = _masked_out(mask_ptr, l_idx, k_idx, smk_n, smk_k, LOOP, K)[None, :, :]  # [1,BL,BK]
        else:
            user = own_user
        mx = _tile2(max_ptr, j_idx, l_idx, smax_own, smax_loop, OWN, LOOP, 0.0)
        inv_sum = 1.0 / _tile2(sum_ptr, j_idx, l_idx, ssum_own, ssum_loop, OWN, LOOP, 1.0)
        dr = _tile2(dr_ptr, j_idx, l_idx, sdr_own, sdr_loop, OWN, LOOP, 0.0)
        live = k_ok & (l_idx < LOOP)[None, :, None]  # rows past the loop's end must add nothing
        # S and dP as the forward computes them: [n, m, k] is [j, l, k] here, or [l, j, k]
        if N_IS_LOOP:
            p, dp = _probs_and_dp(tl.permute(q, (1, 0, 2)), q, tl.permute(dy, (1, 0, 2)), dy, other_k, own_k,
                                  other_v, own_v, user, live, mx, inv_sum, scale, HAS_MASK, True, PRECISION, ACC)
        else:
            p, dp = _probs_and_dp(q, tl.permute(q, (1, 0, 2)), dy, tl.permute(dy, (1, 0, 2)), own_k, other_k,
                                  own_v, other_v, user, live, mx, inv_sum, scale, HAS_MASK, False, PRECISION, ACC)
        ds = tl.where(user, 0.0, p * (dp - dr[:, :, None]) * scale)
        dv = tl.dot(tl.permute(p, (0, 2, 1)).to(dy.dtype), dy, dv, input_precision=PRECISION, out_dtype=ACC)
        dk = tl.dot(tl.permute(ds, (0, 2, 1)).to(q.dtype), q, dk, input_precision=PRECISION, out_dtype=ACC)
    g_off = b * sg_b + h * sg_h
    _store3(dk_ptr + g_off, dk, j_idx, k_idx, d_idx, sg_own, sg_k, sg_d, OWN, K, D)
    _store3(dv_ptr + g_off, dv, j_idx, k_idx, d_idx, sg_own, sg_k, sg_d, OWN, K, D)


# ----------------------------------------------------------------------------------------------
# Launchers (the backend functions of docs/backends.md)
# ----------------------------------------------------------------------------------------------
def _launch_args(dtype: torch.dtype, device: torch.device, scale: float):
    """(accumulation dtype, constexprs shared by every kernel, scale as ``_scale_bits``)."""
    acc = _ACC.get(dtype)
    if acc is None:  # gradops.ops admits only float dtypes; reaching here is a bug
        raise TypeError(f"Floyd attention kernels take float16, bfloat16, float32 or float64, got {dtype}")
    consts = dict(ACC=_TL[acc], **dot_constexprs(dtype, device))
    return acc, consts, _scale_bits(scale)


def _index_dtype(*layouts):
    """tl.int64 when an element offset inside one (b, h) slice of some tensor, given as its
    (shape, strides) (counting the lanes of a tile that overhang an edge), can pass 2^31 - 1,
    else tl.int32."""
    for layout in layouts:
        if layout is None:
            continue
        shape, strides = layout
        span = sum((size + 256) * abs(stride) for size, stride in zip(shape[2:], strides[2:]))
        if span >= 2**31 - 1:
            return tl.int64
    return tl.int32


def _meta(cfg):
    return dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d,
                GROUP=cfg.group, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _dkv_meta(kernel: str, cfg):
    """``_bwd_dkv_kernel``'s constexprs and launch options for its "bwd_dk1" launch (own axis
    n, looped m) or its "bwd_dk2" launch (own axis m, looped n; the mask, indexed by n,
    then belongs to the looped axis)."""
    n_is_loop = kernel == "bwd_dk2"
    block_own, block_loop = (cfg.block_m, cfg.block_n) if n_is_loop else (cfg.block_n, cfg.block_m)
    return dict(N_IS_LOOP=n_is_loop, BLOCK_OWN=block_own, BLOCK_LOOP=block_loop, BLOCK_K=cfg.block_k,
                BLOCK_D=cfg.block_d, GROUP=cfg.group, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _triton_version() -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])


def unsupported(q) -> "str | None":
    """Why the Triton backend cannot take a call on ``q`` (None when it can): a function of
    the call alone, no setting (ops/ remembers its answer per call signature). The chunked
    strategy takes any head dim (a forced "fused" past the fused kernels' widest runs it:
    floyd_strategy); the fused kernels, which run every float64 call, not past these: beyond
    them a program's tiles exceed an H100's shared memory even at the smallest tile of
    floyd_config's table. Triton before 3.9 fails to compile the float64 kernels for a GPU
    (its LLVM lowering of the batched float64 dots; docs/kernels-floyd.md, Limits)."""
    d = q.shape[-1]
    limit = FUSED_MAX_HEAD_DIM[q.dtype.itemsize]
    if q.dtype == torch.float64 and d > limit:
        return f"head dim D = {d} > {limit} for {str(q.dtype).replace('torch.', '')} inputs in the fused kernels"
    if q.dtype == torch.float64 and q.device.type == "cuda" and _triton_version() < (3, 9):
        return f"float64 inputs on a GPU need triton >= 3.9 (installed: {triton.__version__})"
    return None


def _layout(t):
    return tuple(t.shape), t.stride()


def _contiguous(shape):
    """The strides of a contiguous tensor of ``shape`` (the outputs the launchers allocate)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _swap_nm(strides):
    """A [B, H, x, y, ...] tensor's strides seen as [B, H, y, x, ...] (a transposed view: the same
    pointer, so the kernels take the tensor itself with these strides)."""
    return strides[:2] + (strides[3], strides[2]) + strides[4:]


def plan(q, k1, v1, k2, v2, mask, scale) -> "Launches":
    """The launches of a forward and a backward of calls like this one: its tensors' shapes,
    strides, dtype and device, the mask's layout and the scale (docs/backends.md, ``plan``).
    gradops.nn's eager path keeps it per call signature and hands it each call's tensors."""
    return Launches(q, k1, v1, k2, v2, mask, scale)


def floyd_attention(q, k1, v1, k2, v2, mask, scale):
    """Forward: ``(out [B,H,N,M,D] q.dtype, softmax_max, softmax_sum [B,H,N,M] acc)``, by the
    strategy floyd_strategy.strategy chooses."""
    return plan(q, k1, v1, k2, v2, mask, scale).forward(q, k1, v1, k2, v2, mask)


def floyd_attention_grad(dy, q, k1, v1, k2, v2, out, softmax_max, softmax_sum, mask, scale, kv2_dtype=None):
    """Backward: ``(dq, dk1, dv1, dk2, dv2)`` in q.dtype, deterministic (no atomics), by the
    strategy floyd_strategy.strategy chooses (the forward's, for the same shapes). ``kv2_dtype``:
    dK2/dV2's dtype instead (the accumulation dtype, for a caller that adds sums over other
    rows of n to them: gradops.distributed).

    ``out`` (Y) is not read: Dr = sum_k P dP is computed from the recomputed P and dP in
    the accumulation dtype (OPERATORS.md section 5, "Dr and precision")."""
    launches = plan(q, k1, v1, k2, v2, mask, scale)
    return launches.backward(dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, kv2_dtype)


class Launches:
    """What a call signature's forward and backward launch, by the strategy the rule gives it
    (:func:`plan`). It holds the signature's metadata, never a tensor, and is remade when a
    setting that the launches depend on changes (``floyd_config.settings``: a strategy forced,
    the halves' bits, the chunk budget, the tiles)."""

    def __init__(self, q, k1, v1, k2, v2, mask, scale):
        self._layouts = tuple(_layout(t) for t in (q, k1, v1, k2, v2))
        self._mask = None if mask is None else _layout(mask)
        self._dtype, self._device, self._scale = q.dtype, q.device, scale
        self._runs = {}  # settings -> the launches made under them (a benchmark switches back and forth)

    def current(self):
        """The launches of this signature under today's settings: an object with ``forward`` and
        ``backward`` as this one's. A caller that keeps it runs a forward's backward with the
        forward's strategy (and the fused kernels' tiles, worked out in it) whatever settings
        change in between; the memory strategies read the halves' bits and the chunk budget at
        each call, so their backward must run under the forward's (floyd_config.HALF_BITS)."""
        settings = config_settings()
        run = self._runs.get(settings)
        if run is None:
            run = self._runs[settings] = self._make()
        return run

    def _make(self):
        (b, h, n, m, d), (_, _, _, k, _) = self._layouts[0][0], self._layouts[1][0]
        if b * h * n * m == 0 or k == 0:
            return _Empty(self._layouts, self._dtype, self._device)
        module = {"hybrid": floyd_hybrid, "chunked": floyd_chunked}.get(
            strategy(b, h, n, m, k, d, self._dtype.itemsize, total_memory(self._device)))
        if module is not None:
            return _ThroughMemory(module, self._scale)
        return _Fused(self._layouts, self._mask, self._dtype, self._device, self._scale)

    def forward(self, q, k1, v1, k2, v2, mask):
        return self.current().forward(q, k1, v1, k2, v2, mask)

    def backward(self, dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, kv2_dtype=None):
        return self.current().backward(dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, kv2_dtype)


class _Empty:
    """A call with nothing to compute (B*H*N*M*K = 0): zeros, the statistics of no pivot."""

    def __init__(self, layouts, dtype, device):
        self._shapes = [shape for shape, _ in layouts]
        self._dtype, self._device = dtype, device

    def forward(self, q, k1, v1, k2, v2, mask):
        acc = _ACC[self._dtype]
        out = torch.zeros(self._shapes[0], dtype=self._dtype, device=self._device)
        # gradops.ops refuses K = 0; a softmax over no pivot attends to nothing
        stats = self._shapes[0][:4]
        return (out, torch.full(stats, -FLT_MAX, dtype=acc, device=self._device),
                torch.zeros(stats, dtype=acc, device=self._device))

    def backward(self, dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, kv2_dtype=None):
        # every sum is over nothing
        kv2_dtype = self._dtype if kv2_dtype is None else kv2_dtype
        return tuple(torch.zeros(shape, dtype=dtype, device=self._device)
                     for shape, dtype in zip(self._shapes, [self._dtype] * 3 + [kv2_dtype] * 2))


class _ThroughMemory:
    """The hybrid or the chunked strategy (``module``), whose launchers plan their chunks."""

    def __init__(self, module, scale):
        self._module, self._scale = module, scale

    def forward(self, q, k1, v1, k2, v2, mask):
        return self._module.forward(q, k1, v1, k2, v2, mask, self._scale)

    def backward(self, dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, kv2_dtype=None):
        return self._module.backward(dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, self._scale,
                                     q.dtype if kv2_dtype is None else kv2_dtype)


class _Fused:
    """The fused kernels' launches of one call signature: every grid, constexpr and integer
    argument worked out once (the backward's per layout of dY and the statistics it is given
    and dK2/dV2's dtype), so that a call allocates its outputs and launches."""

    def __init__(self, layouts, mask, dtype, device, scale):
        self._layouts, self._mask, self._dtype, self._device = layouts, mask, dtype, device
        acc, self._consts, self._bits = _launch_args(dtype, device, scale)
        self._acc = acc
        (B, H, N, M, D), (_, _, _, K, _) = layouts[0][0], layouts[1][0]
        self._dims = (B, H, N, M, K, D)
        self._shapes = dict(q=(B, H, N, M, D), k1=(B, H, N, K, D), k2=(B, H, K, M, D), stat=(B, H, N, M))
        self._has_mask = mask is not None
        # the mask's strides (b, n, k) of its [B, 1, N, 1, K]
        self._mask_strides = (mask[1][0], mask[1][2], mask[1][4]) if mask is not None else (0, 0, 0)
        out, stat = _contiguous(self._shapes["q"]), _contiguous(self._shapes["stat"])
        cfg = floyd_config("fwd", D, dtype.itemsize)
        consts = dict(self._consts, IDX=_index_dtype(*layouts, mask, (self._shapes["q"], out)))
        self._forward = ((B * H * triton.cdiv(N, cfg.block_n) * triton.cdiv(M, cfg.block_m),),
                         (*(x for _, strides in layouts for x in strides), *self._mask_strides, *out, *stat,
                          H, N, M, K, D, *self._bits),
                         dict(HAS_MASK=self._has_mask, **consts, **_meta(cfg)))
        self._backward = {}

    @staticmethod
    def _mask_pointer(mask, like):
        """The mask as the kernels take it: the bool tensor itself (Triton loads a bool pointer's
        bytes: its int1 loads are int8 loads), any tensor where there is none (never read)."""
        return like if mask is None else mask

    def forward(self, q, k1, v1, k2, v2, mask):
        dev = self._device
        out = torch.empty(self._shapes["q"], dtype=self._dtype, device=dev)
        softmax_max = torch.empty(self._shapes["stat"], dtype=self._acc, device=dev)
        softmax_sum = torch.empty(self._shapes["stat"], dtype=self._acc, device=dev)
        grid, ints, kw = self._forward
        _fwd_kernel[grid](q, k1, v1, k2, v2, self._mask_pointer(mask, q), out, softmax_max, softmax_sum, *ints, **kw)
        return out, softmax_max, softmax_sum

    def _backward_launches(self, dy, softmax_max, softmax_sum, kv2_dtype):
        """(dQ launch, dK1/dV1 launch, dK2/dV2 launch) as (grid, integer arguments, keywords) for
        dY and statistics of these layouts."""
        B, H, N, M, K, D = self._dims
        (q, q_st), (_, k1_st), (_, v1_st), (_, k2_st), (_, v2_st) = self._layouts
        dy_l, max_l, sum_l = _layout(dy), _layout(softmax_max), _layout(softmax_sum)
        q_c, k1_c, k2_c, stat_c = (_contiguous(self._shapes[x]) for x in ("q", "k1", "k2", "stat"))
        consts = dict(self._consts, HAS_MASK=self._has_mask,
                      IDX=_index_dtype(*self._layouts, self._mask, dy_l, max_l, sum_l, (q, q_c),
                                       (self._shapes["k1"], k1_c), (self._shapes["k2"], k2_c)))
        es = self._dtype.itemsize
        cfg = floyd_config("bwd_dq", D, es)  # first: it writes Dr, which the dK/dV launches read
        dq = ((B * H * triton.cdiv(N, cfg.block_n) * triton.cdiv(M, cfg.block_m),),
              (*q_st, *k1_st, *v1_st, *k2_st, *v2_st, *self._mask_strides, *dy_l[1], *max_l[1], *sum_l[1], *q_c,
               H, N, M, K, D, *self._bits),
              dict(consts, **_meta(cfg)))
        # dK/dV one side per launch of the same kernel, in terms of the side's own axis (n for
        # K1/V1, m for K2/V2) and the looped one: its own keys/values are indexed [own, k], the
        # other side's [loop, k], Q, dY and the statistics [own, loop]. The K2/V2 side sees
        # those tensors with n and m swapped (a transposed view: strides only); K2/V2 are stored
        # [k, m], so they are swapped on both sides.
        sides = []
        for name, view, own, other, grad, own_len, loop_len in (
                ("bwd_dk1", tuple, (k1_st, v1_st), (_swap_nm(k2_st), _swap_nm(v2_st)), k1_c, N, M),
                ("bwd_dk2", _swap_nm, (_swap_nm(k2_st), _swap_nm(v2_st)), (k1_st, v1_st), _swap_nm(k2_c), M, N)):
            meta = _dkv_meta(name, floyd_config(name, D, es))
            rows = (*view(q_st), *view(dy_l[1]))
            stats = (*view(max_l[1]), *view(sum_l[1]), *view(stat_c))
            sides.append(((B * H * triton.cdiv(own_len, meta["BLOCK_OWN"]) * triton.cdiv(K, meta["BLOCK_K"]),),
                          (*rows, *own[0], *own[1], *other[0], *other[1], *self._mask_strides, *stats, *grad,
                           H, own_len, loop_len, K, D, *self._bits),
                          dict(consts, **meta)))
        return (dq, *sides)

    def backward(self, dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, kv2_dtype=None):
        kv2_dtype = self._dtype if kv2_dtype is None else kv2_dtype
        key = (dy.stride(), softmax_max.stride(), softmax_sum.stride(), kv2_dtype)
        launches = self._backward.get(key)
        if launches is None:
            launches = self._backward.setdefault(key, self._backward_launches(dy, softmax_max, softmax_sum, kv2_dtype))
        (dq_grid, dq_ints, dq_kw), (dk1_grid, dk1_ints, dk1_kw), (dk2_grid, dk2_ints, dk2_kw) = launches
        dev, dtype, shapes = self._device, self._dtype, self._shapes
        dq = torch.empty(shapes["q"], dtype=dtype, device=dev)
        dk1 = torch.empty(shapes["k1"], dtype=dtype, device=dev)
        dv1 = torch.empty(shapes["k1"], dtype=dtype, device=dev)
        dk2 = torch.empty(shapes["k2"], dtype=kv2_dtype, device=dev)  # the kernel's stores cast
        dv2 = torch.empty(shapes["k2"], dtype=kv2_dtype, device=dev)
        dr = torch.empty(shapes["stat"], dtype=self._acc, device=dev)  # sum_k P dP, contiguous
        mask_t = self._mask_pointer(mask, q)
        _bwd_dq_kernel[dq_grid](q, k1, v1, k2, v2, mask_t, dy, softmax_max, softmax_sum, dr, dq, *dq_ints, **dq_kw)
        # (transposed sides: the tensors themselves, with the swapped strides of the launch)
        _bwd_dkv_kernel[dk1_grid](q, dy, k1, v1, k2, v2, mask_t, softmax_max, softmax_sum, dr, dk1, dv1,
                                  *dk1_ints, **dk1_kw)
        _bwd_dkv_kernel[dk2_grid](q, dy, k2, v2, k1, v1, mask_t, softmax_max, softmax_sum, dr, dk2, dv2,
                                  *dk2_ints, **dk2_kw)
        return dq, dk1, dv1, dk2, dv2
