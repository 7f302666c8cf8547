"""The batched GEMM of the Floyd attention strategies that go through memory (``floyd_hybrid.py``,
``floyd_chunked.py``): ``out[i0, i1] = a[i0, i1] @ b[i0, i1] (+ acc[i0, i1])`` over a two-level
batch of strided 4-D views, up to three such products in one launch.

Every product of a score's m-side half is a GEMM batched over (slice, m) and every n-side one a
GEMM batched over (slice, n); the operands are views of the inputs, of the outputs and of the
chunk buffers, transposed and sliced as each product needs (strides only: no operand is copied
into another layout, no Python loop over slices or rows). 16-bit operands go to tensor cores,
float32 ones to IEEE FMA (never TF32), a float32 ``a`` beside a 16-bit ``b`` (3-Floyd's P and
dS) to tensor cores split in two (its rounding to 16 bits and the remainder's), all into a
float32 accumulator; with ``acc`` the kernel
adds a float32 tile to its accumulator before the store: that is how the second half of a Y or
a dQ and a sum that spans chunks are taken inside a GEMM, with no elementwise pass of its own,
and a result is rounded once. The result is stored in ``out``'s dtype, or (``half_bits`` 24 or
16) as a float32 rounded to its top 24 or 16 bits in two planes: the top 16 bits (a bfloat16
bit pattern, ``out``: int16) and the next 8 (``lo``: uint8): how the hybrid strategy keeps the
m-side halves of the scores (docs/kernels-floyd.md, "Halves in memory").

Several products over one batch in one launch (``gemm(p1, p2, p3)``) cost one launch instead
of three; each program computes one output tile of one product, and the programs of a batch
entry (every product's tiles of it) are consecutive, so products that read the same rows share
them in L2. Each product takes the blocks ``floyd_config.gemm_config`` gives its shape (the
launch the most warps any of them asks).

Deterministic and reproducible: each output tile is one program's, summed over the contraction
in a fixed order, and a product's blocks are a function of its shape alone, so the same product
in a forward and its backward gives the same bits.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._floyd_common import dot_constexprs
from ._launch import bind_launches
from .floyd_config import gemm_config


@triton.jit
def _round_to_bits(x, BITS: tl.constexpr):
    """The bits of float32 ``x`` rounded to nearest (ties to even) at its top ``BITS`` bits, as a
    uint32 whose low ``32 - BITS`` bits are to be dropped. A NaN stays a (quiet) NaN whatever
    its payload; a finite value past the largest representable rounds to infinity, as IEEE."""
    u = x.to(tl.uint32, bitcast=True)
    dropped: tl.constexpr = 32 - BITS
    rounded = u + ((1 << (dropped - 1)) - 1) + ((u >> dropped) & 1)
    return tl.where(x != x, u | 0x00400000, rounded)


@triton.jit
def _store_result(out_ptr, lo_ptr, offs, x, inside, HALF_BITS: tl.constexpr):
    """``x`` (float32) into ``out`` in its dtype, or (HALF_BITS 16 or 24) rounded to that many
    bits: the top 16 into ``out`` (int16), for 24 the next 8 into ``lo`` (uint8)."""
    if HALF_BITS == 0:
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        bits = _round_to_bits(x, HALF_BITS)
        tl.store(out_ptr + offs, (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
        if HALF_BITS == 24:
            tl.store(lo_ptr + offs, ((bits >> 8) & 0xFF).to(tl.uint8), mask=inside)


@triton.jit
def load_half(hi_ptr, lo_ptr, offs, inside, HALF_BITS: tl.constexpr):
    """A float32 tile of a half stored by :func:`_store_result` (HALF_BITS 16 or 24), or read as it
    is (32: a float32 buffer); zero where not ``inside``."""
    if HALF_BITS == 32:
        x = tl.load(hi_ptr + offs, mask=inside, other=0.0)
    else:
        bits = tl.load(hi_ptr + offs, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        if HALF_BITS == 24:
            bits = bits | (tl.load(lo_ptr + offs, mask=inside, other=0).to(tl.uint32) << 8)
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _gemm_tile(
    batch, tile, a_ptr, b_ptr, acc_ptr, out_ptr, lo_ptr, B1, R, C, T,
    sa0, sa1, sar, sat, sb0, sb1, sbt, sbc, sc0, sc1, scr, scc, so0, so1, sor, soc,
    ACCUMULATE: tl.constexpr, HALF_BITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Output tile ``tile`` of batch entry ``batch`` = (i0, i1) of one product: [BLOCK_R,
    BLOCK_C], the products accumulated in float32 over the contraction T, BLOCK_T at a time,
    then (when ACCUMULATE) the float32 ``acc`` tile added, then stored. Offsets are int64: a
    strided view's batch and row offsets exceed 2^31 at large shapes."""
    tiles_c = tl.cdiv(C, BLOCK_C)
    i0 = (batch // B1).to(tl.int64)
    i1 = (batch % B1).to(tl.int64)
    rows = (tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    steps = tl.arange(0, BLOCK_T)
    a_ptrs = a_ptr + i0 * sa0 + i1 * sa1 + rows.to(tl.int64)[:, None] * sar + steps.to(tl.int64)[None, :] * sat
    b_ptrs = b_ptr + i0 * sb0 + i1 * sb1 + steps.to(tl.int64)[:, None] * sbt + cols.to(tl.int64)[None, :] * sbc
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    step = tl.full([], BLOCK_T, tl.int64)  # BLOCK_T * a stride passes 2^31 at large shapes
    for t0 in range(0, T, BLOCK_T):
        a = tl.load(a_ptrs, mask=(rows < R)[:, None] & (t0 + steps < T)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(t0 + steps < T)[:, None] & (cols < C)[None, :], other=0.0)
        if UPCAST:  # bfloat16 under the Triton interpreter, whose bf16 tl.dot is wrong (triton#11584)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SPLIT and not UPCAST:
            # a float32 (3-Floyd's P or dS), b 16-bit: a = hi + lo, both in b's dtype, two
            # tensor-core products; hi + lo holds 22 bits of a (fp16; 16 for bf16), where one
            # rounding to 16 bits alone cost 3-Floyd twice the error of the inputs' rounding
            a_hi = a.to(b.dtype)
            acc = tl.dot(a_hi, b, acc, input_precision=PRECISION, out_dtype=tl.float32)
            a = (a - a_hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=tl.float32)
        a_ptrs += step * sat
        b_ptrs += step * sbt
    inside = (rows < R)[:, None] & (cols < C)[None, :]
    if ACCUMULATE:
        acc += tl.load(acc_ptr + i0 * sc0 + i1 * sc1 + rows.to(tl.int64)[:, None] * scr + cols[None, :] * scc,
                       mask=inside, other=0.0)
    offs = i0 * so0 + i1 * so1 + rows.to(tl.int64)[:, None] * sor + cols[None, :] * soc
    _store_result(out_ptr, lo_ptr, offs, acc, inside, HALF_BITS)


@bind_launches
@triton.jit
def _gemm_kernel(
    B1,
    a0, b0, acc0, out0, lo0, R0, C0, T0,
    sa0_0, sa1_0, sar_0, sat_0, sb0_0, sb1_0, sbt_0, sbc_0, sc0_0, sc1_0, scr_0, scc_0, so0_0, so1_0, sor_0, soc_0,
    a1, b1, acc1, out1, lo1, R1, C1, T1,
    sa0_1, sa1_1, sar_1, sat_1, sb0_1, sb1_1, sbt_1, sbc_1, sc0_1, sc1_1, scr_1, scc_1, so0_1, so1_1, sor_1, soc_1,
    a2, b2, acc2, out2, lo2, R2, C2, T2,
    sa0_2, sa1_2, sar_2, sat_2, sb0_2, sb1_2, sbt_2, sbc_2, sc0_2, sc1_2, scr_2, scc_2, so0_2, so1_2, sor_2, soc_2,
    PRODUCTS: tl.constexpr, ACCUMULATE0: tl.constexpr, ACCUMULATE1: tl.constexpr, ACCUMULATE2: tl.constexpr,
    HALF_BITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_R0: tl.constexpr, BLOCK_C0: tl.constexpr, BLOCK_T0: tl.constexpr,
    BLOCK_R1: tl.constexpr, BLOCK_C1: tl.constexpr, BLOCK_T1: tl.constexpr,
    BLOCK_R2: tl.constexpr, BLOCK_C2: tl.constexpr, BLOCK_T2: tl.constexpr,
):
    """Up to three products (PRODUCTS) over one batch, in one launch, each with its own blocks.
    Program ids walk the batch entries; each entry's tiles of every product are consecutive
    (the first product's, then the second's, then the third's), so products that read the same
    rows of an operand (dS for dQ2 and dK2) run side by side and the second reads them from
    L2. The arguments of a product left out are never read."""
    t0 = tl.cdiv(R0, BLOCK_R0) * tl.cdiv(C0, BLOCK_C0)
    t1 = 0
    t2 = 0
    if PRODUCTS > 1:
        t1 = tl.cdiv(R1, BLOCK_R1) * tl.cdiv(C1, BLOCK_C1)
    if PRODUCTS > 2:
        t2 = tl.cdiv(R2, BLOCK_R2) * tl.cdiv(C2, BLOCK_C2)
    pid = tl.program_id(0)
    batch = pid // (t0 + t1 + t2)
    tile = pid % (t0 + t1 + t2)
    if tile < t0:
        _gemm_tile(batch, tile, a0, b0, acc0, out0, lo0, B1, R0, C0, T0,
                   sa0_0, sa1_0, sar_0, sat_0, sb0_0, sb1_0, sbt_0, sbc_0, sc0_0, sc1_0, scr_0, scc_0,
                   so0_0, so1_0, sor_0, soc_0,
                   ACCUMULATE0, HALF_BITS, PRECISION, UPCAST, SPLIT, BLOCK_R0, BLOCK_C0, BLOCK_T0)
    elif PRODUCTS > 1:
        if tile < t0 + t1:
            _gemm_tile(batch, tile - t0, a1, b1, acc1, out1, lo1, B1, R1, C1, T1,
                       sa0_1, sa1_1, sar_1, sat_1, sb0_1, sb1_1, sbt_1, sbc_1, sc0_1, sc1_1, scr_1, scc_1,
                       so0_1, so1_1, sor_1, soc_1,
                       ACCUMULATE1, HALF_BITS, PRECISION, UPCAST, SPLIT, BLOCK_R1, BLOCK_C1, BLOCK_T1)
        elif PRODUCTS > 2:
            _gemm_tile(batch, tile - t0 - t1, a2, b2, acc2, out2, lo2, B1, R2, C2, T2,
                       sa0_2, sa1_2, sar_2, sat_2, sb0_2, sb1_2, sbt_2, sbc_2, sc0_2, sc1_2, scr_2, scc_2,
                       so0_2, so1_2, sor_2, soc_2,
                       ACCUMULATE2, HALF_BITS, PRECISION, UPCAST, SPLIT, BLOCK_R2, BLOCK_C2, BLOCK_T2)


class Product(NamedTuple):
    """One product of a :func:`gemm` launch: ``out = a @ b (+ acc)`` over 4-D views, a
    ``[B0, B1, R, T]``, b ``[B0, B1, T, C]``, out, acc (float32) and lo ``[B0, B1, R, C]``, any
    strides; a and b of one dtype, or a float32 a beside a 16-bit b (split: :func:`gemm`).
    ``lo``: the low plane of a result stored in 24 bits (``out`` its int16 top plane)."""

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    acc: Optional[torch.Tensor] = None
    lo: Optional[torch.Tensor] = None


def _args(p: Product):
    """The kernel arguments of one product."""
    acc = p.out if p.acc is None else p.acc
    lo = p.out if p.lo is None else p.lo
    return [p.a, p.b, acc, p.out, lo, p.a.shape[2], p.b.shape[3], p.a.shape[3],
            *p.a.stride(), *p.b.stride(), *acc.stride(), *p.out.stride()]


def gemm(*products: Product, half_bits: int = 0) -> None:
    """Each product, in one launch (one to three products over one batch ``[B0, B1]``; a
    product with no output element is left out). ``half_bits`` 24 or 16: every result stored
    rounded to that many bits (``out`` an int16 plane, and for 24 ``lo`` a uint8 one); 0: in
    ``out``'s dtype."""
    products = [p for p in products if p.out.numel() > 0]
    if not products:
        return
    if not 1 <= len(products) <= 3:
        raise ValueError(f"one launch takes one to three products, got {len(products)}")
    b0, b1 = products[0].a.shape[:2]
    if any(tuple(p.a.shape[:2]) != (b0, b1) for p in products):
        raise ValueError(f"the products of one launch share their batch: {[tuple(p.a.shape[:2]) for p in products]}")
    first = products[0]
    # a float32 beside a 16-bit b: the products of the launch split a (SPLIT, _gemm_tile)
    split = first.a.dtype == torch.float32 and first.b.dtype != torch.float32
    if any((p.a.dtype, p.b.dtype) != (first.a.dtype, first.b.dtype) for p in products) or \
            (first.a.dtype != first.b.dtype and not split):
        raise ValueError(f"one launch takes one pair of operand dtypes, a float32 a beside a 16-bit b or one dtype: "
                         f"{[(p.a.dtype, p.b.dtype) for p in products]}")
    slots = products + [products[0]] * (3 - len(products))  # unused slots: never read
    configs = [gemm_config(p.a.shape[2], p.b.shape[3], p.a.shape[3], p.b.element_size(), split) for p in slots]
    tiles = sum(-(-p.a.shape[2] // c["BLOCK_R"]) * -(-p.b.shape[3] // c["BLOCK_C"])
                for p, c in zip(products, configs))
    blocks = {f"{key}{i}": c[key] for i, c in enumerate(configs) for key in ("BLOCK_R", "BLOCK_C", "BLOCK_T")}
    accumulate = {f"ACCUMULATE{i}": i < len(products) and products[i].acc is not None for i in range(3)}
    _gemm_kernel[(b0 * b1 * tiles,)](b1, *_args(slots[0]), *_args(slots[1]), *_args(slots[2]),
                                      PRODUCTS=len(products), HALF_BITS=half_bits, SPLIT=split, **accumulate,
                                      **blocks, **dot_constexprs(first.b.dtype, first.b.device),
                                      num_warps=max(c["num_warps"] for c in configs[:len(products)]),
                                      num_stages=configs[0]["num_stages"])


def by_m(t: torch.Tensor) -> torch.Tensor:
    """A ``[G, n, m, x]`` view as ``[G, m, n, x]``: the operand or result batched over m."""
    return t.transpose(1, 2)
