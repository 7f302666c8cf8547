"""3-Floyd (3-pivot) attention, FloydNet's ``pivotal_attention3``: Triton kernels, forward and
backward, in bounded memory. The reference beside every kernel: ``gradops/reference/
floyd3_attention.py`` (plain PyTorch, the same backend functions); the formulas are
docs/operators.md's "3-Floyd attention"::

    S[i,j,k,p] = scale * Q[i,j,k] . (K1[p,j,k] + K2[i,p,k] + K3[i,j,p])    masked -> -FLT_MAX
    Y[i,j,k]   = sum_p softmax_p(S)[i,j,k,p] (V1[p,j,k] + V2[i,p,k] + V3[i,j,p])

(every tensor also indexed by the slice g = (b, h)). The design is the 2-pivot chunked
strategy's (``floyd_chunked.py``, docs/kernels-floyd.md "The chunked strategy") carried over:
each of the three terms of a score, of Y, of dQ and of the key and value gradients is a plain
batched GEMM over strided views, run by the shared GEMM (``floyd_gemm.gemm``, float32
accumulation, an optional float32 ``acc`` added before the store, up to three products of one
batch per launch), and the softmax and dS are row kernels over float32 scores in memory.

**Chunks.** ``chunk_plan`` (the one place that sizes them) cuts the score hypercube into chunks
of (slices g) x (rows i) x (rows j) with every k and every pivot p, as many (i, j) rows as the
budget holds (``floyd_config.plan_rows``, the 2-pivot planner, at ``pair_bytes`` per (i, j):
K rows of P scores and the float32 partial Y/dQ); the budget is ``floyd_config.chunk_budget``
of at most the seven inputs' bytes (its ``CHUNK_BUDGET_BYTES`` overrides it, for tests and
benchmarks). Several slices only where
the chunk covers every i and j; rows of j split only where 16 rows of i with every j do not
fit. With k always whole, every product of a chunk is one strided view per operand (``_side``):

- side 1, the K1/V1 terms (pivot p replaces i): batched over (g, (j, k)), which merge since k
  is whole; rows i, columns p (scores) or d (values), contraction d or p;
- side 2, K2/V2 (p replaces j): batched over ((g, i), k), (g, i) merging where the chunk has
  several slices only because it then has every i; rows j;
- side 3, K3/V3 (p replaces k): batched over ((g, i), j); rows k.

**Per chunk, forward, 7 launches:** S = three GEMMs into one float32 buffer [Gc, Ic, Jc, K, P]
(the second and third add the first's sum through ``acc``); ``_softmax_rows3`` writes the row
max and the sum of exp(S - max) (the statistics) and P, in float32; Y = three GEMMs, the
first two into a float32 partial, the third adds it and stores Y rounded once.

**Per chunk, backward, 7 launches:** S and dP together, side by side (one launch per side: the
forward's GEMMs with the forward's blocks on the forward's chunks, so S is bitwise the
forward's; dP the same pattern with dY for Q and the values for the keys); ``_grad_rows3``: P
from the statistics, Dr = sum_p P dP in float32 (not dY.Y from a rounded Y), dS = P (dP - Dr)
scale (0 where masked), P and dS in float32; then per side one launch of three
products: the side's dQ term (float32 partial, the third rounded), dK = dS^T Q and dV = P^T dY
for that side's keys: dK3/dV3 sum over k (whole in the chunk), dK2/dV2 over j (whole unless j
is split), dK1/dV1 over i (across i-chunks unless the chunk has every i). A sum that spans
chunks continues in a float32 accumulator through ``acc`` (``_floyd_memory.reduction``); the
last chunk of it stores the rounded result.

So a call launches 7 + 7 kernels per chunk: one chunk for small calls, a few at BREC's sizes
(a chunk's workspace is bounded by the inputs' bytes: ``chunk_plan``). FLOP: 6 GEMM units of B*H*I*J*K*P*D multiply-adds forward (3 for S, 3
for Y), 15 backward (S, dP, dQ, dK, dV: 3 each).

**Precision.** Scores, dP, P, dS, Dr and every sum float32. 16-bit inputs go to tensor cores;
P and dS, float32 in memory, enter them split in two (``floyd_gemm``'s SPLIT: their rounding to
the input dtype and the remainder's, 22 bits of the value in float16, 16 in bfloat16), not
rounded once as a flash-attention kernel rounds them: with P and dS rounded to float16 the
error of Y and of the gradients was 2-4x the reference's, up to 0.84x FloydNet's own (float16,
``bench floyd3 --accuracy``), where the goal is 0.5x. It costs 2 bytes per score per read and
write of P and dS, and those GEMMs' tensor-core work twice (they are memory-bound). float32
inputs use IEEE products, never TF32 (``_floyd_common.dot_constexprs``); each output is rounded
once. float64 inputs take the reference (``unsupported``). A fully masked row (every pivot
removed) has S = -FLT_MAX everywhere: a uniform softmax (sum = P) and dS exactly 0, so dQ is
exactly 0 there.

**Memory** beyond inputs and outputs: one chunk's buffers (S, P forward; S, dP, P, dS backward;
the float32 partial Y/dQ) within the budget, and float32 accumulators of the sums that span
chunks (input-sized: one slice's dK1/dV1, one i-chunk's dK2/dV2). A chunk's buffers are at most
the inputs' bytes (64 MiB at least), O(L^3 D): never the L^4 hypercube past L ~ D. An input whose (b, h, ...) rows do not merge as the views need (e.g. its j and k
axes swapped in memory) is copied once (``_rows_merge``); the mask is read through its strides
(an expanded view costs nothing); the statistics too.

**Determinism.** A fixed walk, blocks a function of each product's shape, no atomics, no
split-K: bitwise repeatable.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._floyd_common import FLT_MAX, SCALE_ARGS, _scale_bits, _unpack_scale, tile_max
from ._floyd_memory import chunks, reduction
from ._launch import bind_launches
from .floyd_chunked import grad_rows_body, softmax_rows_body
from .floyd_config import ChunkPlan, chunk_budget, plan_rows, row_config, score_bytes, total_memory
from .floyd_gemm import Product, gemm


# Launches per chunk (module docstring): what the tests and the docs count.
FORWARD_LAUNCHES = 7
BACKWARD_LAUNCHES = 7
# What each launch of a chunk computes, in launch order (bench.traffic labels its counts with them)
FORWARD_NAMES = ("gemm S = Q K1^T", "gemm S += Q K2^T", "gemm S += Q K3^T", "_softmax_rows3 (stats, P)",
                 "gemm Yp = P V1", "gemm Yp += P V2", "gemm Y = Yp + P V3")
BACKWARD_NAMES = ("gemm S, dP side 1 (K1, V1)", "gemm S, dP += side 2", "gemm S, dP += side 3",
                  "_grad_rows3 (P, Dr, dS)", "gemm dQp, dK1, dV1", "gemm dQp +=, dK2, dV2",
                  "gemm dQ = dQp + ..., dK3, dV3")

# Integer arguments of the row kernels the JIT must not specialise: those that change from chunk
# to chunk (the chunk's rows, sizes and first slice/row: each value 1 or multiple of 16 would be
# a compile of its own), and the scale's float64 bits (as floyd_chunked.NOT_SPECIALISED).
NOT_SPECIALISED = {
    "_softmax_rows3": [*SCALE_ARGS, "rows", "ci", "cj", "g0", "i0", "j0"],
    "_grad_rows3": [*SCALE_ARGS, "rows", "ci", "cj", "g0", "i0", "j0"],
}


def unsupported(q) -> "str | None":
    """Why the kernels cannot take a call on ``q`` (None when they can): float64 (the GEMM and
    the row kernels are written for 16-bit and float32 inputs; "auto" runs it on the reference)."""
    if q.dtype == torch.float64:
        return "float64 inputs take the reference backend (the 3-Floyd kernels take float16, bfloat16 and float32)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{str(q.dtype).replace('torch.', '')} inputs: the 3-Floyd kernels take float16, bfloat16 and float32"
    return None


# ----------------------------------------------------------------------------------------------
# The plan: the one place that sizes a chunk
# ----------------------------------------------------------------------------------------------
def pair_bytes(k: int, p: int, d: int) -> int:
    """Workspace bytes per (i, j) row of a chunk: its K rows of P scores (S, dP, P and dS, all
    float32) and their float32 partial Y/dQ (4 D each)."""
    return k * (p * score_bytes(4) + 4 * d)


def chunk_plan(bh: int, i: int, j: int, k: int, p: int, d: int, element_size: int,
               device: torch.device) -> ChunkPlan:
    """The chunks of a call: ``floyd_config.plan_rows`` over (slices, i, j) at :func:`pair_bytes`
    per (i, j) row, within ``floyd_config.chunk_budget`` of a problem whose workspace is taken
    as at most the seven inputs' bytes: a chunk's scores then stay O(L^3 D), as the inputs, and
    never grow into the L^4 hypercube (16 bytes a score, where FloydNet holds 3-4 score tensors),
    while at least ``MIN_CHUNK_BUDGET_BYTES`` keeps small calls in one chunk. The device's
    total memory, never its free memory, bounds it too: a forward and its backward must walk
    the same chunks, so that the backward's scores are bitwise the forward's
    (``floyd_config.CHUNK_BUDGET_BYTES`` overrides it all). A function of the shape, the
    dtype's size and the device alone."""
    pair = pair_bytes(k, p, d)
    inputs = bh * d * element_size * (i * j * k + 2 * (p * j * k + i * p * k + i * j * p))
    return plan_rows(bh, i, j, pair, chunk_budget(total_memory(device), min(bh * i * j * pair, inputs), True))


# ----------------------------------------------------------------------------------------------
# Row kernels: one program per BLOCK_R consecutive rows (g, i, j, k) of a chunk's [rows, P] buffers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rows3(rows, ci, cj, K, H, g0, i0, j0, mask_ptr, smk_b, smk_i, smk_j, smk_k,
           sst_b, sst_h, sst_i, sst_j, sst_k, BLOCK_R: tl.constexpr):
    """(row indices in the chunk, rows that exist, each row's mask pointer and statistics
    offset) of this program. A chunk row is (g, i, j, k) of the call, k fastest, as the chunk's
    [Gc, Ic, Jc, K, P] buffers hold it; the mask ([B, 1, I, J, K, P], any strides: a broadcast
    dim has stride 0) and the statistics ([B, H, I, J, K], any strides) are read in place."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    k = (r % K).to(tl.int64)
    j = (j0 + (r // K) % cj).to(tl.int64)
    i = (i0 + (r // (K * cj)) % ci).to(tl.int64)
    g = g0 + r // (K * cj * ci)
    b = (g // H).to(tl.int64)
    h = (g % H).to(tl.int64)
    mask_rows = mask_ptr + b * smk_b + i * smk_i + j * smk_j + k * smk_k
    stat = b * sst_b + h * sst_h + i * sst_i + j * sst_j + k * sst_k
    return r.to(tl.int64), live, mask_rows, stat


@bind_launches
@triton.jit(do_not_specialize=NOT_SPECIALISED["_softmax_rows3"])
def _softmax_rows3(
    s_ptr, mask_ptr, p_ptr, max_ptr, sum_ptr, smk_b, smk_i, smk_j, smk_k, smk_p,
    sst_b, sst_h, sst_i, sst_j, sst_k, rows, ci, cj, K, NP, H, g0, i0, j0, scale_high, scale_low,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """Forward rows (reference: ``floyd3_attention``'s softmax): statistics and P."""
    r, live, mask_rows, stat = _rows3(rows, ci, cj, K, H, g0, i0, j0, mask_ptr, smk_b, smk_i, smk_j, smk_k,
                                      sst_b, sst_h, sst_i, sst_j, sst_k, BLOCK_R)
    scale = _unpack_scale(scale_high, scale_low, tl.float32)
    softmax_rows_body(s_ptr, p_ptr, max_ptr, sum_ptr, mask_rows, smk_p, r, live, stat, NP, scale,
                          HAS_MASK, BLOCK_R, BLOCK_K, ONE_TILE)


@bind_launches
@triton.jit(do_not_specialize=NOT_SPECIALISED["_grad_rows3"])
def _grad_rows3(
    s_ptr, dp_ptr, mask_ptr, max_ptr, sum_ptr, p_ptr, ds_ptr, smk_b, smk_i, smk_j, smk_k, smk_p,
    sst_b, sst_h, sst_i, sst_j, sst_k, rows, ci, cj, K, NP, H, g0, i0, j0, scale_high, scale_low,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """Backward rows (reference: ``floyd3_attention_grad``'s P, Dr and dS): P and dS."""
    r, live, mask_rows, stat = _rows3(rows, ci, cj, K, H, g0, i0, j0, mask_ptr, smk_b, smk_i, smk_j, smk_k,
                                      sst_b, sst_h, sst_i, sst_j, sst_k, BLOCK_R)
    scale = _unpack_scale(scale_high, scale_low, tl.float32)
    grad_rows_body(s_ptr, dp_ptr, max_ptr, sum_ptr, p_ptr, ds_ptr, mask_rows, smk_p, r, live, stat, NP, scale,
                   HAS_MASK, BLOCK_R, BLOCK_K, ONE_TILE)


def _launch_rows(kernel, rows: int, np_: int, *args, **consts) -> None:
    cfg = row_config(np_)
    kernel[(triton.cdiv(rows, cfg["BLOCK_R"]),)](*args, **consts, **cfg)


# ----------------------------------------------------------------------------------------------
# Views: the inputs as [G, X, Y, Z, D] rows, a chunk's operands as each side's batched GEMM sees them
# ----------------------------------------------------------------------------------------------
def _merge(t: torch.Tensor, first: int, last: int) -> bool:
    """Whether dims ``first``..``last`` of ``t`` merge into one strided dim (sizes 1 aside)."""
    dims = [(t.shape[a], t.stride(a)) for a in range(first, last + 1) if t.shape[a] != 1]
    return all(s0 == n1 * s1 for (_, s0), (n1, s1) in zip(dims, dims[1:]))


# The dims of each [B, H, X, Y, Z, D] input that the chunk views merge: (b, h) always (the
# slices g); (g, x) where the operand is batched over (g, i) (sides 2 and 3, and Q/dY there);
# (y, z) where it is batched over (j, k) (side 1: Q/dY and K1/V1).
_ROWS = {"q": ((0, 2), (3, 4)), "k1": ((0, 1), (3, 4)), "k2": ((0, 2),), "k3": ((0, 2),)}


def _rows_merge(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` [B, H, X, Y, Z, D] as [B*H, X, Y, Z, D], the view itself when its strides let
    every view of ``_side`` be one (any D stride, rows of any uniform stride), else a
    contiguous copy (once per call: e.g. j and k swapped in memory)."""
    if not all(_merge(t, a, b) for a, b in _ROWS[kind]):
        t = t.contiguous()
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


def _side(s: int, t: torch.Tensor) -> torch.Tensor:
    """A chunk tensor indexed like Q, [Gc, Ic, Jc, K, x] (Q, dY, S, P, dS, the partial), as side
    ``s``'s GEMMs take it: [batch0, batch1, rows, x]. ``view`` (never a silent copy: a result
    written into a copy would be lost) merges the batch dims."""
    g, ci, cj, k, x = t.shape
    if s == 1:  # over (g, (j, k)), rows i
        return t.view(g, ci, cj * k, x).transpose(1, 2)
    if s == 2:  # over ((g, i), k), rows j
        return t.view(g * ci, cj, k, x).transpose(1, 2)
    return t.view(g * ci, cj, k, x)  # over ((g, i), j), rows k


def _pivots(s: int, t: torch.Tensor) -> torch.Tensor:
    """A chunk of side ``s``'s key, value or their gradient, [B0, B1, P, D] in that side's
    batch: side 1 [Gc, P, Jc, K, D] (p for i), side 2 [Gc, Ic, P, K, D] (p for j), side 3 [Gc,
    Ic, Jc, P, D] (p for k)."""
    if s == 1:
        g, p, cj, k, d = t.shape
        return t.view(g, p, cj * k, d).transpose(1, 2)
    if s == 2:
        g, ci, p, k, d = t.shape
        return t.view(g * ci, p, k, d).transpose(1, 2)
    g, ci, cj, p, d = t.shape
    return t.view(g * ci, cj, p, d)


def _chunk_of(s: int, t: torch.Tensor, c) -> torch.Tensor:
    """Side ``s``'s key/value tensor ([G, X, Y, Z, D] flat) over chunk ``c``'s slices and rows."""
    if s == 1:
        return t[c.gs, :, c.ms]
    if s == 2:
        return t[c.gs, c.ns]
    return t[c.gs, c.ns, c.ms]


def _mask_args(mask: Optional[torch.Tensor], like: torch.Tensor):
    """(pointer tensor, strides b/i/j/k/p, has_mask): the [B, 1, I, J, K, P] bool mask read in
    place as bytes (an expanded view: stride 0 on its broadcast dims)."""
    if mask is None:
        return like, (0, 0, 0, 0, 0), False
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask, (mask.stride(0), mask.stride(2), mask.stride(3), mask.stride(4), mask.stride(5)), True


class _Workspace:
    """One chunk's buffers, allocated once per call at the largest chunk's size, viewed as
    [Gc, Ic, Jc, K, x] for each chunk (a tail chunk uses a prefix)."""

    def __init__(self, plan: ChunkPlan, k: int, p: int, d: int, device, names: Sequence[str]):
        rows = plan.groups * plan.block_n * plan.block_m * k
        # P and dS in float32 too: the GEMMs that read them split each into two 16-bit halves
        # (floyd_gemm's SPLIT) rather than round it (module docstring, "Precision")
        sizes = {"s": (rows * p, torch.float32), "dp": (rows * p, torch.float32), "p": (rows * p, torch.float32),
                 "ds": (rows * p, torch.float32), "part": (rows * d, torch.float32)}
        self._flat = {name: torch.empty(sizes[name][0], dtype=sizes[name][1], device=device) for name in names}
        self.k = k

    def view(self, name: str, c, x: int) -> torch.Tensor:
        return self._flat[name][:c.g * c.cn * c.cm * self.k * x].view(c.g, c.cn, c.cm, self.k, x)


def _scores_products(x_c, keys_c, s_buf):
    """S (or dP) = three GEMMs into one float32 buffer: side 1 stores, sides 2 and 3 add. The
    same products, in the same order with the same blocks, in a forward and its backward."""
    return [Product(_side(s, x_c), _pivots(s, keys_c[s - 1]).transpose(2, 3), _side(s, s_buf),
                    None if s == 1 else _side(s, s_buf)) for s in (1, 2, 3)]


def _values_products(x_c, vals_c, out_c, part):
    """Y (or dQ) = three GEMMs: side 1 into the float32 ``part``, side 2 adds to it, side 3
    adds it and stores ``out_c`` rounded once."""
    return [Product(_side(s, x_c), _pivots(s, vals_c[s - 1]), _side(s, out_c if s == 3 else part),
                    None if s == 1 else _side(s, part)) for s in (1, 2, 3)]


# ----------------------------------------------------------------------------------------------
# Empty problems (no rows, or D = 0): plain torch
# ----------------------------------------------------------------------------------------------
def _empty_forward(q, p, mask):
    b, h, i, j, k, d = q.shape
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    # D = 0: every score is 0 (a dot over nothing), -FLT_MAX where masked; max 0 and sum the
    # unmasked pivots' count where one is left, else the uniform softmax's -FLT_MAX and P
    if mask is None:
        live = torch.full((b, 1, i, j, k), p, dtype=torch.float32, device=q.device)
    else:
        live = (p - mask.sum(dim=-1, dtype=torch.int64)).to(torch.float32)
    any_live = live > 0
    softmax_max = torch.where(any_live, 0.0, -FLT_MAX).to(torch.float32).expand(b, h, i, j, k).contiguous()
    softmax_sum = torch.where(any_live, live, float(p)).to(torch.float32).expand(b, h, i, j, k).contiguous()
    return out, softmax_max, softmax_sum


# ----------------------------------------------------------------------------------------------
# The backend functions
# ----------------------------------------------------------------------------------------------
def _check_dtype(q):
    reason = unsupported(q)
    if reason is not None:
        raise TypeError(reason)


def floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward: ``(out [B,H,I,J,K,D] q.dtype, softmax_max, softmax_sum [B,H,I,J,K] float32)``
    (reference: gradops/reference/floyd3_attention.py). Inputs valid (ops/), any strides;
    float16, bfloat16 and float32."""
    _check_dtype(q)
    B, H, I, J, K, D = q.shape
    P = k1.shape[2]
    if B * H * I * J * K == 0 or D == 0:
        return _empty_forward(q, P, mask)
    dev = q.device
    q5 = _rows_merge(q, "q")
    keys = (_rows_merge(k1, "k1"), _rows_merge(k2, "k2"), _rows_merge(k3, "k3"))
    vals = (_rows_merge(v1, "k1"), _rows_merge(v2, "k2"), _rows_merge(v3, "k3"))
    out = torch.empty((B, H, I, J, K, D), dtype=q.dtype, device=dev)
    softmax_max = torch.empty((B, H, I, J, K), dtype=torch.float32, device=dev)
    softmax_sum = torch.empty((B, H, I, J, K), dtype=torch.float32, device=dev)
    out5 = out.view(B * H, I, J, K, D)
    mask_t, mask_strides, has_mask = _mask_args(mask, q5)
    bits = _scale_bits(scale)
    plan = chunk_plan(B * H, I, J, K, P, D, q.dtype.itemsize, dev)
    work = _Workspace(plan, K, P, D, dev, ("s", "p", "part"))
    for c in chunks(plan, B * H, I, J):
        s, p, part = work.view("s", c, P), work.view("p", c, P), work.view("part", c, D)
        for product in _scores_products(q5[c.gs, c.ns, c.ms], [_chunk_of(x, keys[x - 1], c) for x in (1, 2, 3)], s):
            gemm(product)  # one launch each: side 2 and 3 read side 1's sum (acc)
        rows = c.g * c.cn * c.cm * K
        _launch_rows(_softmax_rows3, rows, P, s, mask_t, p, softmax_max, softmax_sum, *mask_strides,
                     *softmax_max.stride(), rows, c.cn, c.cm, K, P, H, c.gs.start, c.ns.start, c.ms.start, *bits,
                     HAS_MASK=has_mask)
        for product in _values_products(p, [_chunk_of(x, vals[x - 1], c) for x in (1, 2, 3)],
                                        out5[c.gs, c.ns, c.ms], part):
            gemm(product)
    return out, softmax_max, softmax_sum


def floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, softmax_max, softmax_sum, mask, scale):
    """Backward: ``(dq, dk1, dv1, dk2, dv2, dk3, dv3)`` in q.dtype, deterministic (reference:
    gradops/reference/floyd3_attention.py). The statistics [B,H,I,J,K] float32, any strides."""
    _check_dtype(q)
    B, H, I, J, K, D = q.shape
    P = k1.shape[2]
    dev, dtype = q.device, q.dtype
    shapes = [t.shape for t in (q, k1, v1, k2, v2, k3, v3)]
    if B * H * I * J * K == 0 or D == 0:  # sums over nothing, or nothing to sum into
        return tuple(torch.zeros(shape, dtype=dtype, device=dev) for shape in shapes)
    q5, dy5 = _rows_merge(q, "q"), _rows_merge(dy, "q")
    keys = (_rows_merge(k1, "k1"), _rows_merge(k2, "k2"), _rows_merge(k3, "k3"))
    vals = (_rows_merge(v1, "k1"), _rows_merge(v2, "k2"), _rows_merge(v3, "k3"))
    grads = [torch.empty(shape, dtype=dtype, device=dev) for shape in shapes]
    dq5 = grads[0].view(B * H, I, J, K, D)
    dkeys = [grads[x].view(B * H, *shapes[x][2:]) for x in (1, 3, 5)]
    dvals = [grads[x].view(B * H, *shapes[x][2:]) for x in (2, 4, 6)]
    smax, ssum = (t if t.dtype == torch.float32 else t.float() for t in (softmax_max, softmax_sum))
    if smax.stride() != ssum.stride():  # the row kernel reads both at one offset
        smax, ssum = smax.contiguous(), ssum.contiguous()
    mask_t, mask_strides, has_mask = _mask_args(mask, q5)
    bits = _scale_bits(scale)
    plan = chunk_plan(B * H, I, J, K, P, D, q.dtype.itemsize, dev)
    work = _Workspace(plan, K, P, D, dev, ("s", "dp", "p", "ds", "part"))

    # float32 accumulators of the sums that span chunks: dK1/dV1 over i (one slice's, every j),
    # dK2/dV2 over j (one i-chunk's); none where the chunks hold their sums
    def accumulators(shape, needed):
        return [torch.empty(shape, dtype=torch.float32, device=dev) for _ in range(2)] if needed else [None, None]

    acc1 = accumulators((1, P, J, K, D), plan.block_n < I)
    acc2 = accumulators((1, plan.block_n, P, K, D), plan.block_m < J)
    for c in chunks(plan, B * H, I, J):
        s, dp, p, ds = (work.view(name, c, P) for name in ("s", "dp", "p", "ds"))
        part = work.view("part", c, D)
        q_c, dy_c = q5[c.gs, c.ns, c.ms], dy5[c.gs, c.ns, c.ms]
        keys_c = [_chunk_of(x, keys[x - 1], c) for x in (1, 2, 3)]
        vals_c = [_chunk_of(x, vals[x - 1], c) for x in (1, 2, 3)]
        # S and dP, one launch per side: the forward's products (bitwise its scores), dP beside
        for s_product, dp_product in zip(_scores_products(q_c, keys_c, s), _scores_products(dy_c, vals_c, dp)):
            gemm(s_product, dp_product)
        rows = c.g * c.cn * c.cm * K
        _launch_rows(_grad_rows3, rows, P, s, dp, mask_t, smax, ssum, p, ds, *mask_strides, *smax.stride(),
                     rows, c.cn, c.cm, K, P, H, c.gs.start, c.ns.start, c.ms.start, *bits,
                     HAS_MASK=has_mask)
        # per side: its dQ term, and its keys' and values' gradients (dS^T Q, P^T dY), one launch
        first_last = ((c.first_n, c.last_n), (c.first_m, c.last_m), (True, True))
        acc_c = ([None if a is None else a[:, :, c.ms] for a in acc1],
                 [None if a is None else a[:c.g, :c.cn] for a in acc2], [None, None])
        for x, dq_product in zip((1, 2, 3), _values_products(ds, keys_c, dq5[c.gs, c.ns, c.ms], part)):
            first, last = first_last[x - 1]
            dk, dv = _chunk_of(x, dkeys[x - 1], c), _chunk_of(x, dvals[x - 1], c)
            ak, av = acc_c[x - 1]
            gemm(dq_product,
                 reduction(_side(x, ds).transpose(2, 3), _side(x, q_c), _pivots(x, dk),
                           None if ak is None else _pivots(x, ak), first, last),
                 reduction(_side(x, p).transpose(2, 3), _side(x, dy_c), _pivots(x, dv),
                           None if av is None else _pivots(x, av), first, last))
    return tuple(grads)
