"""Floyd (pivotal) attention, the chunked strategy: tensor-core GEMMs per chunk of rows.

Same formulas and contract as the fused kernels (``floyd_attention.py``, OPERATORS.md
section 5)::

    S[n,m,k] = scale * (Q[n,m].K1[n,k] + Q[n,m].K2[k,m])     masked -> -FLT_MAX
    Y[n,m]   = sum_k softmax_k(S)[n,m,k] * (V1[n,k] + V2[k,m])

Each product is a batched matrix product, over n (the K1/V1 side) or over m (the K2/V2
side). For a chunk of (n, m) rows with every pivot (``floyd_config.chunk_plan``) this
module computes each of them as one batched GEMM with 16-bit operands and float32 results
(``_mm``: cuBLAS on a GPU; on a CPU float32 products of the same 16-bit values), and does
the rest in two Triton row kernels that read both halves of a score in place:

- forward: ``S1 = Q K1^T`` (batched over n) and ``S2 = Q K2^T`` (batched over m), float32,
  never rounded to 16 bits; ``_softmax_rows`` adds them, scales, masks, writes the row's max
  and sum and ``P = exp(S - max) / sum`` in the input dtype, in an n-major and an m-major
  copy; then ``Y = P V1 + P V2``, two GEMMs, summed in float32 and rounded once.
- backward: ``S1, S2`` again (the same GEMMs on the same chunks: bitwise the forward's S),
  ``dP1 = dY V1^T``, ``dP2 = dY V2^T``; ``_grad_rows`` computes P from the saved statistics,
  ``Dr = sum_k P dP`` and ``dS = P (dP - Dr) scale`` (zero where masked) in float32 and writes
  P and dS in the input dtype, both copies; then ``dQ = dS K1 + dS K2``, ``dK1 += dS^T Q``,
  ``dV1 += P^T dY`` (summed over m, across chunks, in float32), ``dK2 = dS^T Q``,
  ``dV2 = P^T dY`` (summed over n inside the chunk's m range, in float32).

10 GEMMs, each B*H*N*M*K*D multiply-adds: exactly the nominal 20 units of the backward (the
fused kernels execute 44), and 4 (8 units) in the forward. Memory beyond inputs and outputs:
one chunk's workspace (``floyd_config.score_bytes`` per score, under
``floyd_config.CHUNK_BUDGET_BYTES``) and float32 accumulators for one chunk group's dK1/dV1
(``groups * N * K * D``, groups = 1 unless whole slices fit the budget, ``slice_bytes``
each) and one chunk's dK2/dV2: the whole score cube only when it fits the budget, never
more than one chunk of it. Deterministic for a given budget: a fixed walk, no atomics, and
each GEMM's result depends on its shapes only.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._floyd_common import _ACC, _NEG_FLT_MAX, _mask_arg, _scale_bits, _unpack_scale
from .floyd_config import chunk_budget, chunk_plan, row_config


# ----------------------------------------------------------------------------------------------
# Row kernels: one program per BLOCK_R consecutive m rows of one (slice, n) of the chunk
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rows(cn, cm, BLOCK_R: tl.constexpr):
    """(slice in the chunk, n in the chunk, [BLOCK_R] m in the chunk, rows that exist) of
    this program, and the int64 element offsets of those rows in the n-major [g, cn, cm, K]
    and the m-major [g, cm, cn, K] buffers (divided by K)."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(cm, BLOCK_R)
    gi = pid // (cn * blocks)
    i_n = (pid // blocks) % cn
    i_m = (pid % blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = i_m < cm
    by_n = (gi * cn + i_n).to(tl.int64) * cm + i_m
    by_m = (gi * cm + i_m).to(tl.int64) * cn + i_n
    return gi, i_n, i_m, live, by_n, by_m


@triton.jit
def _pair(n_major_ptr, m_major_ptr, by_n, by_m, k_idx, inside, K):
    """The two float32 halves of a [BLOCK_R, BLOCK_K] tile, summed: n-major + m-major."""
    x = tl.load(n_major_ptr + by_n[:, None] * K + k_idx[None, :], mask=inside, other=0.0)
    x += tl.load(m_major_ptr + by_m[:, None] * K + k_idx[None, :], mask=inside, other=0.0)
    return x


@triton.jit
def _scores(s1_ptr, s2_ptr, mask_row_ptr, smk_k, by_n, by_m, k_idx, inside, K, scale, HAS_MASK: tl.constexpr):
    """``scale * (S1 + S2)``, -FLT_MAX where the user's mask is set (as CANN), -inf past K
    (tail pivots take no part): the order of operations of the fused kernels and the
    reference."""
    s = _pair(s1_ptr, s2_ptr, by_n, by_m, k_idx, inside, K) * scale
    if HAS_MASK:
        user = tl.load(mask_row_ptr + k_idx * smk_k, mask=k_idx < K, other=0) != 0
        s = tl.where(user[None, :], _NEG_FLT_MAX, s)
    else:
        user = k_idx < 0  # nothing masked
    return tl.where((k_idx < K)[None, :], s, float("-inf")), user


@triton.jit
def _store_both(n_major_ptr, m_major_ptr, x, by_n, by_m, k_idx, inside, K):
    """Store a tile in both layouts, in the buffers' dtype (the input dtype: P and dS enter
    the following GEMMs rounded, as in every flash-attention kernel)."""
    x = x.to(n_major_ptr.dtype.element_ty)
    tl.store(n_major_ptr + by_n[:, None] * K + k_idx[None, :], x, mask=inside)
    tl.store(m_major_ptr + by_m[:, None] * K + k_idx[None, :], x, mask=inside)


@triton.jit(do_not_specialize=["scale"])
def _softmax_rows(
    s1_ptr, s2_ptr, mask_ptr, p_n_ptr, p_m_ptr, max_ptr, sum_ptr,
    smk_b, smk_n, smk_k, sst_g, sst_n, sst_m,
    cn, cm, K, H, g0, n0, m0, scale,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Forward: the row max and sum of exp(S - max) (written to the statistics), and P."""
    gi, i_n, i_m, live, by_n, by_m = _rows(cn, cm, BLOCK_R)
    scale = _unpack_scale(scale, tl.float32)
    mask_row_ptr = mask_ptr + ((g0 + gi) // H).to(tl.int64) * smk_b + (n0 + i_n).to(tl.int64) * smk_n
    row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        inside = live[:, None] & (k_idx < K)[None, :]
        s, _ = _scores(s1_ptr, s2_ptr, mask_row_ptr, smk_k, by_n, by_m, k_idx, inside, K, scale, HAS_MASK)
        # A NaN score makes the row's max NaN, as torch.amax does (tl.max skips NaN; the
        # fused forward keeps the same rule).
        tile_max = tl.max(s, axis=1)  # not -inf: every k-tile holds a real pivot
        tile_max = tl.where(tl.max((s != s).to(tl.int32), axis=1) != 0, float("nan"), tile_max)
        new_max = tl.maximum(row_max, tile_max, propagate_nan=tl.PropagateNan.ALL)
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        row_max = new_max
    stat = (g0 + gi).to(tl.int64) * sst_g + (n0 + i_n).to(tl.int64) * sst_n + (m0 + i_m).to(tl.int64) * sst_m
    tl.store(max_ptr + stat, row_max, mask=live)
    tl.store(sum_ptr + stat, row_sum, mask=live)
    inv_sum = 1.0 / row_sum
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        inside = live[:, None] & (k_idx < K)[None, :]
        s, _ = _scores(s1_ptr, s2_ptr, mask_row_ptr, smk_k, by_n, by_m, k_idx, inside, K, scale, HAS_MASK)
        p = tl.exp(s - row_max[:, None]) * inv_sum[:, None]
        _store_both(p_n_ptr, p_m_ptr, p, by_n, by_m, k_idx, inside, K)


@triton.jit
def _probs_and_dp(s1_ptr, s2_ptr, dp1_ptr, dp2_ptr, mask_row_ptr, smk_k, by_n, by_m, k_idx, inside, K,
                  row_max, inv_sum, scale, HAS_MASK: tl.constexpr):
    """P (from the saved statistics, as the fused backward: exp(S - max) * (1 / sum)), dP and
    the user's mask of one tile; both passes of ``_grad_rows`` call this, so they agree."""
    s, user = _scores(s1_ptr, s2_ptr, mask_row_ptr, smk_k, by_n, by_m, k_idx, inside, K, scale, HAS_MASK)
    p = tl.exp(s - row_max[:, None]) * inv_sum[:, None]
    dp = _pair(dp1_ptr, dp2_ptr, by_n, by_m, k_idx, inside, K)
    return p, dp, user


@triton.jit(do_not_specialize=["scale"])
def _grad_rows(
    s1_ptr, s2_ptr, dp1_ptr, dp2_ptr, mask_ptr, max_ptr, sum_ptr, p_n_ptr, p_m_ptr, ds_n_ptr, ds_m_ptr,
    smk_b, smk_n, smk_k, sst_g, sst_n, sst_m,
    cn, cm, K, H, g0, n0, m0, scale,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Backward: Dr = sum_k P dP in float32 (not dY.Y from the rounded Y: OPERATORS.md
    section 5), then dS = P (dP - Dr) scale, zero where masked (a masked score is a
    constant), and P; both written in the input dtype."""
    gi, i_n, i_m, live, by_n, by_m = _rows(cn, cm, BLOCK_R)
    scale = _unpack_scale(scale, tl.float32)
    mask_row_ptr = mask_ptr + ((g0 + gi) // H).to(tl.int64) * smk_b + (n0 + i_n).to(tl.int64) * smk_n
    stat = (g0 + gi).to(tl.int64) * sst_g + (n0 + i_n).to(tl.int64) * sst_n + (m0 + i_m).to(tl.int64) * sst_m
    row_max = tl.load(max_ptr + stat, mask=live, other=0.0)
    inv_sum = 1.0 / tl.load(sum_ptr + stat, mask=live, other=1.0)
    dr = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        inside = live[:, None] & (k_idx < K)[None, :]
        p, dp, _ = _probs_and_dp(s1_ptr, s2_ptr, dp1_ptr, dp2_ptr, mask_row_ptr, smk_k, by_n, by_m, k_idx,
                                 inside, K, row_max, inv_sum, scale, HAS_MASK)
        dr += tl.sum(p * dp, axis=1)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        inside = live[:, None] & (k_idx < K)[None, :]
        p, dp, user = _probs_and_dp(s1_ptr, s2_ptr, dp1_ptr, dp2_ptr, mask_row_ptr, smk_k, by_n, by_m, k_idx,
                                    inside, K, row_max, inv_sum, scale, HAS_MASK)
        ds = p * (dp - dr[:, None]) * scale
        if HAS_MASK:
            ds = tl.where(user[None, :], 0.0, ds)
        _store_both(p_n_ptr, p_m_ptr, p, by_n, by_m, k_idx, inside, K)
        _store_both(ds_n_ptr, ds_m_ptr, ds, by_n, by_m, k_idx, inside, K)


# ----------------------------------------------------------------------------------------------
# GEMMs
# ----------------------------------------------------------------------------------------------
_OUT_DTYPE_BMM = [True]  # torch.bmm(..., out_dtype=float32) on CUDA, until a torch refuses it


@contextlib.contextmanager
def _ieee_float32():
    """float32 GEMMs in IEEE float32, never TF32, whatever the caller's torch setting: the
    float32 path is for exactness (as the fused kernels' input_precision="ieee"). Torch >= 2.9
    has ``fp32_precision``, which cuBLAS reads and which round-trips in every state; there
    the legacy ``allow_tf32`` raises once a caller used the new API, and writing it would
    leave ``torch.get_float32_matmul_precision`` broken. The setting is process-wide, as
    torch's own flags: a thread running float32 matmuls meanwhile sees it too."""
    matmul = torch.backends.cuda.matmul
    name, ieee = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    old = getattr(matmul, name)
    setattr(matmul, name, ieee)
    try:
        yield
    finally:
        setattr(matmul, name, old)


def _gemm_precision(q: torch.Tensor):
    """The context every launcher runs its GEMMs in: IEEE float32 on a GPU (``_ieee_float32``,
    entered once per call rather than per GEMM), nothing to set on a CPU."""
    return _ieee_float32() if q.is_cuda else contextlib.nullcontext()


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 3-D operands, as float32: 16-bit operands are multiplied exactly and
    accumulated in float32 (tensor cores on a GPU; on a CPU, float32 products of the same
    values), so no score or partial sum is ever rounded to 16 bits. Float32 products are
    IEEE inside ``_gemm_precision``."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda and _OUT_DTYPE_BMM[0]:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except TypeError:  # torch < 2.8 has no out_dtype (an out-of-memory error is not this)
            _OUT_DTYPE_BMM[0] = False
    return torch.bmm(a.float(), b.float())


def _by_n(t, gs, nt, mt):
    """A [BH, N, M, D] tensor's chunk as [g*cn, cm, D]: the operand batched over n."""
    c = t[gs, nt, mt]
    return c.reshape(c.shape[0] * c.shape[1], c.shape[2], c.shape[3])


def _by_m(t, gs, nt, mt):
    """The same chunk as [g*cm, cn, D]: the operand batched over m."""
    c = t[gs, nt, mt].transpose(1, 2)
    return c.reshape(c.shape[0] * c.shape[1], c.shape[2], c.shape[3])


def _side(t, gs, rows):
    """A key/value tensor's chunk as [g*rows, K, D]: K1/V1 ``[BH, N, K, D]`` sliced in n, or
    K2/V2 already laid out m-major ``[BH, M, K, D]`` sliced in m."""
    c = t[gs, rows]
    return c.reshape(c.shape[0] * c.shape[1], c.shape[2], c.shape[3])


def _flat(t):
    """[B, H, ...] -> [B*H, ...] (a view when the strides allow, else a copy; explicit sizes,
    as torch refuses -1 for a tensor of no elements, e.g. D = 0)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _m_major(t):
    """K2/V2 ``[B, H, K, M, D]`` -> ``[B*H, M, K, D]``: the m-batched GEMMs' operand layout."""
    return _flat(t).transpose(1, 2)


def _plan(q, k):
    """The chunk plan of a call on ``q`` with K = ``k`` pivots: the budget shrinks only when
    the device's free memory is short (then a forward and its backward may plan apart)."""
    if q.dtype == torch.float64:  # the dispatcher keeps float64 on the fused kernels
        raise TypeError("the chunked Floyd strategy takes float16, bfloat16 and float32 inputs (_mm would "
                        "round float64 to float32)")
    bh, n, m = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
    free = None
    if q.is_cuda and not torch.cuda.is_current_stream_capturing():  # a graph replays its capture's plan
        driver_free, _ = torch.cuda.mem_get_info(q.device)
        free = driver_free + torch.cuda.memory_reserved(q.device) - torch.cuda.memory_allocated(q.device)
    return chunk_plan(bh, n, m, k, q.element_size(), chunk_budget(free), head_dim=q.shape[4])


def _launch_rows(kernel, cn, cm, k, g, *args, **consts):
    cfg = row_config(k, cm)
    grid = (g * cn * triton.cdiv(cm, cfg["BLOCK_R"]),)
    kernel[grid](*args, **consts, **cfg)


# ----------------------------------------------------------------------------------------------
# Launchers (called by floyd_attention.py's backend functions, which handle empty shapes)
# ----------------------------------------------------------------------------------------------
def forward(q, k1, v1, k2, v2, mask, scale):
    """``(out, softmax_max, softmax_sum)`` as ``floyd_attention.floyd_attention``; 16-bit
    and float32 inputs, B*H*N*M*K > 0."""
    B, H, N, M, D = q.shape
    K = k1.shape[3]
    dev = q.device
    out = torch.empty((B, H, N, M, D), dtype=q.dtype, device=dev)
    softmax_max = torch.empty((B, H, N, M), dtype=torch.float32, device=dev)
    softmax_sum = torch.empty((B, H, N, M), dtype=torch.float32, device=dev)
    q4, k1_4, v1_4 = _flat(q), _flat(k1), _flat(v1)
    k2_4, v2_4 = _m_major(k2), _m_major(v2)
    out4, max3, sum3 = _flat(out), _flat(softmax_max), _flat(softmax_sum)
    mask_t, mask_strides, has_mask = _mask_arg(mask, q)
    bits = _scale_bits(scale)
    plan = _plan(q, K)
    with _gemm_precision(q):
        for g0, g1, m0, m1, n_ranges in plan.chunks(B * H, N, M):
            gs, mt, g, cm = slice(g0, g1), slice(m0, m1), g1 - g0, m1 - m0
            k2c, v2c = _side(k2_4, gs, mt), _side(v2_4, gs, mt)  # [g*cm, K, D]
            for n0, n1 in n_ranges:
                nt, cn = slice(n0, n1), n1 - n0
                k1c, v1c = _side(k1_4, gs, nt), _side(v1_4, gs, nt)  # [g*cn, K, D]
                s1 = _mm(_by_n(q4, gs, nt, mt), k1c.transpose(1, 2))  # [g*cn, cm, K]
                s2 = _mm(_by_m(q4, gs, nt, mt), k2c.transpose(1, 2))  # [g*cm, cn, K]
                p_n = torch.empty(s1.shape, dtype=q.dtype, device=dev)
                p_m = torch.empty(s2.shape, dtype=q.dtype, device=dev)
                _launch_rows(_softmax_rows, cn, cm, K, g, s1, s2, mask_t, p_n, p_m, max3, sum3,
                             *mask_strides, *max3.stride(), cn, cm, K, H, g0, n0, m0, bits, HAS_MASK=has_mask)
                del s1, s2
                y = _mm(p_n, v1c).view(g, cn, cm, D)
                y += _mm(p_m, v2c).view(g, cm, cn, D).transpose(1, 2)
                out4[gs, nt, mt] = y
                del p_n, p_m, y  # before the next chunk allocates its own: one chunk's workspace at a time
    return out, softmax_max, softmax_sum


def backward(dy, q, k1, v1, k2, v2, softmax_max, softmax_sum, mask, scale):
    """``(dq, dk1, dv1, dk2, dv2)`` in q.dtype, as ``floyd_attention.floyd_attention_grad``;
    16-bit and float32 inputs, B*H*N*M*K > 0."""
    B, H, N, M, D = q.shape
    K = k1.shape[3]
    dev, dtype = q.device, q.dtype
    acc = _ACC[dtype]
    q4, dy4, k1_4, v1_4 = _flat(q), _flat(dy), _flat(k1), _flat(v1)
    k2_4, v2_4 = _m_major(k2), _m_major(v2)
    # contiguous: _grad_rows reads both statistics at one offset, and each may come in its own
    # layout (compact, a view of CANN's [B,H,N,M,8], transposed)
    max3, sum3 = (_flat(t.to(acc)).contiguous() for t in (softmax_max, softmax_sum))
    dq = torch.empty((B, H, N, M, D), dtype=dtype, device=dev)
    dk1 = torch.empty((B, H, N, K, D), dtype=dtype, device=dev)
    dv1 = torch.empty((B, H, N, K, D), dtype=dtype, device=dev)
    dk2 = torch.empty((B, H, K, M, D), dtype=dtype, device=dev)
    dv2 = torch.empty((B, H, K, M, D), dtype=dtype, device=dev)
    dq4, dk1_4, dv1_4 = _flat(dq), _flat(dk1), _flat(dv1)
    dk2_4, dv2_4 = _m_major(dk2), _m_major(dv2)
    mask_t, mask_strides, has_mask = _mask_arg(mask, q)
    bits = _scale_bits(scale)
    plan = _plan(q, K)
    with _gemm_precision(q):
        for g0, g1, m0, m1, n_ranges in plan.chunks(B * H, N, M):
            gs, mt, g, cm = slice(g0, g1), slice(m0, m1), g1 - g0, m1 - m0
            if m0 == 0:  # a new group of slices: dK1/dV1 sum over every m-chunk, in float32
                dk1_acc = torch.zeros((g, N, K, D), dtype=acc, device=dev)
                dv1_acc = torch.zeros((g, N, K, D), dtype=acc, device=dev)
            k2c, v2c = _side(k2_4, gs, mt), _side(v2_4, gs, mt)  # [g*cm, K, D]
            dk2_acc = torch.zeros((g * cm, K, D), dtype=acc, device=dev)  # summed over the n-chunks
            dv2_acc = torch.zeros((g * cm, K, D), dtype=acc, device=dev)
            for n0, n1 in n_ranges:
                nt, cn = slice(n0, n1), n1 - n0
                k1c, v1c = _side(k1_4, gs, nt), _side(v1_4, gs, nt)  # [g*cn, K, D]
                q_n, q_m = _by_n(q4, gs, nt, mt), _by_m(q4, gs, nt, mt)
                dy_n, dy_m = _by_n(dy4, gs, nt, mt), _by_m(dy4, gs, nt, mt)
                s1 = _mm(q_n, k1c.transpose(1, 2))  # the forward's GEMMs on the forward's chunks
                s2 = _mm(q_m, k2c.transpose(1, 2))
                dp1 = _mm(dy_n, v1c.transpose(1, 2))
                dp2 = _mm(dy_m, v2c.transpose(1, 2))
                p_n, ds_n = (torch.empty(s1.shape, dtype=dtype, device=dev) for _ in range(2))
                p_m, ds_m = (torch.empty(s2.shape, dtype=dtype, device=dev) for _ in range(2))
                _launch_rows(_grad_rows, cn, cm, K, g, s1, s2, dp1, dp2, mask_t, max3, sum3, p_n, p_m, ds_n, ds_m,
                             *mask_strides, *max3.stride(), cn, cm, K, H, g0, n0, m0, bits, HAS_MASK=has_mask)
                del s1, s2, dp1, dp2
                dq_c = _mm(ds_n, k1c).view(g, cn, cm, D)
                dq_c += _mm(ds_m, k2c).view(g, cm, cn, D).transpose(1, 2)
                dq4[gs, nt, mt] = dq_c
                dk1_acc[:, nt] += _mm(ds_n.transpose(1, 2), q_n).view(g, cn, K, D)  # sum over m
                dv1_acc[:, nt] += _mm(p_n.transpose(1, 2), dy_n).view(g, cn, K, D)
                dk2_acc += _mm(ds_m.transpose(1, 2), q_m)  # sum over n
                dv2_acc += _mm(p_m.transpose(1, 2), dy_m)
                del p_n, p_m, ds_n, ds_m, dq_c  # before the next chunk allocates: score_bytes per score at most
            dk2_4[gs, mt] = dk2_acc.view(g, cm, K, D)
            dv2_4[gs, mt] = dv2_acc.view(g, cm, K, D)
            if m1 == M:
                dk1_4[gs] = dk1_acc
                dv1_4[gs] = dv1_acc
    return dq, dk1, dv1, dk2, dv2

