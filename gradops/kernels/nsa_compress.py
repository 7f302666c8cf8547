"""Triton kernels for NSA key/value compression (OPERATORS.md section 4), forward and
backward, on packed variable-length sequences in the TND layout.

    out[c, n, :]      = sum_{j<l} w[j, n] * x[start_c + j, n, :]
    dx[t, n, :]       = sum_{c covering t} w[t - start_c, n] * dout[c, n, :]
    dweight[j, n]     = sum_c sum_d dout[c, n, d] * x[start_c + j, n, d]

The sequences are described by ``cu_seqlens`` (a host list [0, e_0, ..., T]). The launcher
turns it into three small int64 device tensors (cumulative tokens, blocks and backward
chunks per sequence, one copy to the device, once per packing: they are cached, so a later
call with the same packing neither copies nor synchronises); every program finds its
sequence by a binary search over them, so no per-block table is built on the host.

Backward without atomics (docs/kernels-nsa.md has the full picture): tokens are grouped in
*stride groups* of ``stride`` consecutive tokens of a sequence. Token ``p = g*s + r`` (group
g, row r) is covered exactly by blocks ``i = g - k`` at offset ``j = r + k*s`` for
``k = 0 .. ceil(l/s)-1`` (when ``0 <= i < n_b`` and ``j < l``), and every row of a group at a
given k reads the *same* dOut row. Each program owns a run of groups of one sequence (and a
slice of rows, heads and head dim): it reads each x row once, gathers the covering dOut rows
(shared with its neighbours, so they come from cache), writes each dx row once, and in the
same pass accumulates its dweight partial ``[k, r, head] -> dweight[k*s + r, head]`` in
registers. For ceil(l/s) <= 4 the covering blocks are unrolled, so the group loop has no
inner loop and is software-pipelined (the next groups' x tiles and dOut rows arrive by
cp.async while one group computes). A second tiny kernel sums the partials in a fixed order. Results are bitwise
reproducible for a given shape and launch configuration.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl

from ..errors import ACLNN_ERR_INNER, AclnnError
from ..reference.nsa_compress import packing_tables
from . import nsa_config
from ._launch import bind_launches
from .nsa_config import BackwardConfig, ForwardConfig, cdiv, next_pow2

_TL_ACC = {torch.float64: tl.float64}


def _acc_dtype(dtype: torch.dtype):
    """float64 inputs accumulate in float64, every other dtype in float32."""
    return _TL_ACC.get(dtype, tl.float32)


@triton.jit
def _last_le(table_ptr, value, lo, hi, steps):
    """The last index b in [lo, hi] with table[b] <= value (table non-decreasing,
    table[lo] <= value); ``steps`` >= ceil(log2(hi - lo + 1)) iterations. Works on scalars
    and on vectors of values alike."""
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        go_up = tl.load(table_ptr + mid) <= value
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    return lo


@bind_launches
@triton.jit
def _nsa_compress_fwd_kernel(
    x_ptr, w_ptr, out_ptr, cu_seqlens_ptr, cu_blocks_ptr,
    num_blocks, num_heads, head_dim, block_size, stride, num_seqs, search_steps,
    sx_t, sx_n, sx_d, sw_j, sw_n, so_c, so_n, so_d,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_hd = tl.program_id(1)
    d_tiles = tl.cdiv(head_dim, BLOCK_D)
    pid_h = pid_hd // d_tiles
    pid_d = pid_hd % d_tiles

    # int64 block indices: c * so_c may pass 2^31 for large C*N*D.
    c = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < num_blocks
    # Sequence of every block of the tile, then its first token.
    seq = _last_le(cu_blocks_ptr, c, c * 0, c * 0 + (num_seqs - 1), search_steps)
    start = tl.load(cu_seqlens_ptr + seq) + (c - tl.load(cu_blocks_ptr + seq)) * stride

    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    mask = c_ok[:, None, None] & h_ok[None, :, None] & (d < head_dim)[None, None, :]

    # Head and head-dim offsets in int64 too: a heads-major view has a head stride of T*D.
    h64 = h.to(tl.int64)
    d64 = d.to(tl.int64)
    x_ptrs = x_ptr + (start[:, None, None] * sx_t + h64[None, :, None] * sx_n + d64[None, None, :] * sx_d)
    w_ptrs = w_ptr + h * sw_n
    acc = tl.zeros([BLOCK_C, BLOCK_H, BLOCK_D], dtype=ACC)
    for _ in range(block_size):
        w = tl.load(w_ptrs, mask=h_ok, other=0.0).to(ACC)
        xv = tl.load(x_ptrs, mask=mask, other=0.0).to(ACC)
        acc += w[None, :, None] * xv
        x_ptrs += sx_t
        w_ptrs += sw_j

    out_ptrs = out_ptr + (c[:, None, None] * so_c + h64[None, :, None] * so_n + d64[None, None, :] * so_d)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@bind_launches
@triton.jit
def _nsa_compress_bwd_kernel(
    dout_ptr, x_ptr, w_ptr, dx_ptr, part_ptr,
    cu_seqlens_ptr, cu_blocks_ptr, cu_chunks_ptr,
    num_heads, head_dim, block_size, stride, num_seqs, search_steps,
    groups_per_chunk, covering,
    sg_c, sg_n, sg_d, sx_t, sx_n, sx_d, sw_j, sw_n, sdx_t, sdx_n, sdx_d,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, K_PAD: tl.constexpr,
    COVER: tl.constexpr, NUM_STAGES: tl.constexpr, DW_IN_TILE: tl.constexpr, ACC: tl.constexpr,
):
    """COVER > 0 (= ceil(l/s), known at compile time): the covering blocks are unrolled and
    the group loop is software-pipelined over NUM_STAGES stages. COVER = 0: a run-time loop
    over the covering blocks (any l/s), and the group loop is not pipelined."""
    pid_chunk = tl.program_id(0)
    pid_rest = tl.program_id(1)
    d_tiles = tl.cdiv(head_dim, BLOCK_D)
    h_tiles = tl.cdiv(num_heads, BLOCK_H)
    pid_d = pid_rest % d_tiles
    pid_h = (pid_rest // d_tiles) % h_tiles
    pid_r = pid_rest // (d_tiles * h_tiles)

    # This program's sequence and its run of stride groups in it.
    chunk = pid_chunk.to(tl.int64)
    seq = _last_le(cu_chunks_ptr, chunk, chunk * 0, chunk * 0 + (num_seqs - 1), search_steps)
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    first_block = tl.load(cu_blocks_ptr + seq)
    n_blocks = tl.load(cu_blocks_ptr + seq + 1) - first_block
    # Tokens past the last block's end are covered by nothing: dx 0, x not needed.
    covered_len = tl.where(n_blocks > 0, (n_blocks - 1) * stride + block_size, 0)
    g_begin = (chunk - tl.load(cu_chunks_ptr + seq)) * groups_per_chunk
    g_end = tl.minimum(g_begin + groups_per_chunk, tl.cdiv(seq_len, stride))

    r = pid_r * ROWS + tl.arange(0, ROWS)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = r < stride
    h_ok = h < num_heads
    hd_ok = h_ok[:, None] & (d < head_dim)[None, :]
    # Head and head-dim offsets in int64 too: a heads-major view has a head stride of T*D.
    h64 = h.to(tl.int64)
    d64 = d.to(tl.int64)
    hd_x = h64[:, None] * sx_n + d64[None, :] * sx_d
    hd_g = h64[:, None] * sg_n + d64[None, :] * sg_d
    hd_dx = h64[:, None] * sdx_n + d64[None, :] * sdx_d
    kk = tl.arange(0, K_PAD)
    d_local = tl.arange(0, BLOCK_D)
    every_row = (r >= 0)[:, None, None] & hd_ok[None, :, :]

    # dweight partial dweight[k*stride + r, head], accumulated without register shuffles:
    # - unrolled blocks: a [ROWS, BLOCK_H, K_PAD] array, k last, so that its K_PAD values
    #   sit in one thread's registers and every select on k is resolved at compile time;
    # - run-time k: in the layout of the x tile, with the head-dim index standing for k
    #   (when ceil(l/s) fits in BLOCK_D), else as its own [k, r, head] array.
    if COVER > 0:
        dw = tl.zeros([ROWS, BLOCK_H, K_PAD], dtype=ACC)
    elif DW_IN_TILE:
        dw = tl.zeros([ROWS, BLOCK_H, BLOCK_D], dtype=ACC)
    else:
        dw = tl.zeros([K_PAD, ROWS, BLOCK_H], dtype=ACC)
    # With NUM_STAGES > 1 the compiler copies the x tiles and dOut rows of the next groups
    # to shared memory asynchronously (cp.async) while this one computes; it pipelines only
    # a loop without an inner loop, hence the unrolled covering blocks.
    for g in tl.range(g_begin, g_end, num_stages=NUM_STAGES):
        p = g * stride + r  # positions in the sequence
        row_ok = r_ok & (p < seq_len)
        t = seq_start + p
        x_mask = (row_ok & (p < covered_len))[:, None, None] & hd_ok[None, :, :]
        xv = tl.load(x_ptr + (t[:, None, None] * sx_t + hd_x[None, :, :]), mask=x_mask, other=0.0).to(ACC)
        # The zero accumulator is derived from the loaded tile, so that it takes the tile's
        # coalesced register layout; tl.zeros gets a default layout here and the compiler
        # then shuffles it through shared memory each group (sm_90 PTX of a 16x1x128 bf16
        # tile: 220 registers instead of 80). (xv != xv) is 0/1, never NaN, even for inf x.
        dx = (xv != xv).to(ACC) * 0.0
        if COVER > 0:
            for k in tl.static_range(COVER):
                # Block g - k, which exists iff 0 <= g - k < n_blocks; a missing one (the
                # first and last groups of a sequence) is masked, not skipped.
                blk_ok = (g - k >= 0) & (g - k < n_blocks)
                j = r + k * stride
                cov = row_ok & (j < block_size) & blk_ok  # rows block g - k covers
                wv = tl.load(w_ptr + (j[:, None] * sw_j + h[None, :] * sw_n),
                             mask=cov[:, None] & h_ok[None, :], other=0.0).to(ACC)
                # The block's dOut row, loaded once per row of the tile (same address) so
                # that it arrives in the tile's layout, without a shuffle.
                g_off = (first_block + g - k) * sg_c + r * 0
                gv = tl.load(dout_ptr + (g_off[:, None, None] + hd_g[None, :, :]),
                             mask=every_row & blk_ok, other=0.0).to(ACC)
                # Rows the block does not cover are selected out, not multiplied by a zero
                # weight: 0 * NaN is NaN, and a non-finite dOut, x or weight must reach
                # exactly the entries whose formula holds it.
                dx += tl.where(cov[:, None, None], wv[:, :, None] * gv, 0.0)
                part = tl.where(cov[:, None], tl.sum(xv * gv, axis=2), 0.0)
                dw += tl.where((kk == k)[None, None, :], part[:, :, None], 0.0)
        else:
            # Blocks g - k that exist: 0 <= g - k < n_blocks (and k < covering).
            for k in range(tl.maximum(g - n_blocks + 1, 0), tl.minimum(g + 1, covering)):
                j = r + k * stride
                cov = row_ok & (j < block_size)
                wv = tl.load(w_ptr + (j[:, None] * sw_j + h[None, :] * sw_n),
                             mask=cov[:, None] & h_ok[None, :], other=0.0).to(ACC)
                g_off = (first_block + g - k) * sg_c + r * 0
                gv = tl.load(dout_ptr + (g_off[:, None, None] + hd_g[None, :, :]),
                             mask=every_row, other=0.0).to(ACC)
                dx += tl.where(cov[:, None, None], wv[:, :, None] * gv, 0.0)
                part = tl.where(cov[:, None], tl.sum(xv * gv, axis=2), 0.0)
                if DW_IN_TILE:
                    dw += tl.where((d_local == k)[None, None, :], part[:, :, None], 0.0)
                else:
                    dw += tl.where((kk == k)[:, None, None], part[None, :, :], 0.0)
        dx_mask = row_ok[:, None, None] & hd_ok[None, :, :]
        tl.store(dx_ptr + (t[:, None, None] * sdx_t + hd_dx[None, :, :]),
                 dx.to(dx_ptr.dtype.element_ty), mask=dx_mask)

    # Every (j, head) of this program's rows is written, zeros included, so the
    # reduction needs no zero-filled workspace.
    part_base = part_ptr + (chunk * d_tiles + pid_d) * block_size * num_heads
    if COVER > 0:
        j_all = kk[None, None, :] * stride + r[:, None, None]
        part_ok = ((kk < covering)[None, None, :] & r_ok[:, None, None] & (j_all < block_size)
                   & h_ok[None, :, None])
        tl.store(part_base + (j_all * num_heads + h[None, :, None]), dw, mask=part_ok)
    elif DW_IN_TILE:
        j_all = d_local[None, None, :] * stride + r[:, None, None]
        part_ok = ((d_local < covering)[None, None, :] & r_ok[:, None, None] & (j_all < block_size)
                   & h_ok[None, :, None])
        tl.store(part_base + (j_all * num_heads + h[None, :, None]), dw, mask=part_ok)
    else:
        j_all = kk[:, None] * stride + r[None, :]
        part_ok = (kk[:, None] < covering) & r_ok[None, :] & (j_all < block_size)
        tl.store(part_base + (j_all[:, :, None] * num_heads + h[None, None, :]), dw,
                 mask=part_ok[:, :, None] & h_ok[None, None, :])


@bind_launches
@triton.jit
def _sum_rows_kernel(part_ptr, out_ptr, num_rows, width,
                     BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, ACC: tl.constexpr):
    """out[w] = sum over rows of part[row, w], always in the same order."""
    col = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    col_ok = col < width
    acc = tl.zeros([BLOCK_P, BLOCK_W], dtype=ACC)
    for p0 in range(0, num_rows, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        ptrs = part_ptr + (rows[:, None].to(tl.int64) * width + col[None, :])
        acc += tl.load(ptrs, mask=(rows < num_rows)[:, None] & col_ok[None, :], other=0.0)
    tl.store(out_ptr + col, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------
# Launchers


class _SeqTables:
    """Per-sequence cumulative tables on the device, built from the host list with tensor
    ops (no Python loop over blocks): tokens ``cu_seqlens``, blocks ``cu_blocks`` and,
    for the backward, program chunks ``cu_chunks``; all int64, each of length B + 1."""

    def __init__(self, cu_seqlens: Sequence[int], block_size: int, stride: int,
                 device: torch.device, chunk_tokens: Optional[int] = None):
        cu = torch.as_tensor(list(cu_seqlens), dtype=torch.int64)
        lens = cu[1:] - cu[:-1]
        blocks = torch.where(lens >= block_size, (lens - block_size) // stride + 1, torch.zeros_like(lens))
        zero = torch.zeros(1, dtype=torch.int64)
        cu_blocks = torch.cat([zero, torch.cumsum(blocks, 0)])
        tables = [cu, cu_blocks]
        if chunk_tokens is not None:
            chunks = (lens + chunk_tokens - 1) // chunk_tokens
            cu_chunks = torch.cat([zero, torch.cumsum(chunks, 0)])
            tables.append(cu_chunks)
            self.num_chunks = int(cu_chunks[-1])
        self.num_seqs = int(lens.numel())
        self.num_blocks = int(cu_blocks[-1])
        # A binary search over B entries needs ceil(log2(B)) halvings.
        self.search_steps = max(0, self.num_seqs - 1).bit_length()
        packed = torch.stack(tables).to(device)  # one host-to-device copy
        self.cu_seqlens = packed[0]
        self.cu_blocks = packed[1]
        self.cu_chunks = packed[2] if chunk_tokens is not None else None


@functools.lru_cache(maxsize=64)
def _seq_tables(cu_seqlens: tuple, block_size: int, stride: int, device: torch.device,
                chunk_tokens: Optional[int] = None) -> _SeqTables:
    """The tables of one packing, built once: a training step calls every layer's forward
    and backward with the same cu_seqlens, and each build costs a host-to-device copy.
    Looked up through ``packing_tables``, which keeps the tables a CUDA graph captured
    alive even after this LRU drops them (gradops/reference/nsa_compress.py says why)."""
    return _SeqTables(cu_seqlens, block_size, stride, device, chunk_tokens)


def _check_num_blocks(tables: _SeqTables, num_blocks: int, op: str):
    if tables.num_blocks != num_blocks:
        raise AclnnError(ACLNN_ERR_INNER, f"{op}: num_blocks is {num_blocks}, but cu_seqlens gives "
                                          f"{tables.num_blocks} blocks")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Coalesced loads need unit stride along D; other strides are passed through as is.
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def nsa_compress(x: torch.Tensor, weight: torch.Tensor, block_size: int, stride: int,
                 cu_seqlens: List[int], num_blocks: int) -> torch.Tensor:
    """out [C, N, D] in x.dtype (docs/backends.md)."""
    num_tokens, num_heads, head_dim = x.shape
    cfg = nsa_config.forward_config(num_heads, head_dim, block_size, stride)
    return _forward(x, weight, block_size, stride, cu_seqlens, num_blocks, cfg)


def _forward(x, weight, block_size, stride, cu_seqlens, num_blocks, cfg: ForwardConfig):
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_blocks, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    tables = packing_tables(_seq_tables, tuple(cu_seqlens), block_size, stride, x.device)
    _check_num_blocks(tables, num_blocks, "nsa_compress")
    x = _last_dim_contiguous(x)
    grid = (cdiv(num_blocks, cfg.block_c),
            cdiv(num_heads, cfg.block_h) * cdiv(head_dim, cfg.block_d))
    _nsa_compress_fwd_kernel[grid](
        x, weight, out, tables.cu_seqlens, tables.cu_blocks,
        num_blocks, num_heads, head_dim, block_size, stride, tables.num_seqs, tables.search_steps,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_C=cfg.block_c, BLOCK_H=cfg.block_h, BLOCK_D=cfg.block_d, ACC=_acc_dtype(x.dtype),
        num_warps=cfg.num_warps,
    )
    return out


def nsa_compress_grad(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, block_size: int,
                      stride: int, cu_seqlens: List[int], num_blocks: int):
    """(dx [T, N, D], dweight [l, N]), both in x.dtype (docs/backends.md)."""
    num_tokens, num_heads, head_dim = x.shape
    cfg = nsa_config.backward_config(num_tokens, num_heads, head_dim, block_size, stride, x.device)
    return _backward(dout, x, weight, block_size, stride, cu_seqlens, num_blocks, cfg)


def backward_workspace(num_chunks: int, num_heads: int, head_dim: int, block_size: int,
                       cfg: BackwardConfig, dtype: torch.dtype):
    """Shape and dtype of the dweight partials: one [l, N] row per (chunk, head-dim slice)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (num_chunks * cdiv(head_dim, cfg.block_d), block_size, num_heads), acc


def backward_meta(cfg: BackwardConfig, block_size: int, stride: int) -> dict:
    """The compile-time arguments of the backward kernel (the sm_90 compile test builds the
    same kernel from them)."""
    covering = cdiv(block_size, stride)
    unrolled = covering <= cfg.max_unrolled_cover
    return dict(ROWS=cfg.rows, BLOCK_H=cfg.block_h, BLOCK_D=cfg.block_d, K_PAD=next_pow2(covering),
                COVER=covering if unrolled else 0, NUM_STAGES=cfg.num_stages if unrolled else 1,
                DW_IN_TILE=covering <= cfg.block_d)


def _backward(dout, x, weight, block_size, stride, cu_seqlens, num_blocks, cfg: BackwardConfig):
    num_tokens, num_heads, head_dim = x.shape
    device = x.device
    if num_tokens * num_heads * head_dim == 0 or num_blocks == 0:
        # Nothing is covered by any block (or there is nothing to cover).
        return (torch.zeros((num_tokens, num_heads, head_dim), dtype=x.dtype, device=device),
                torch.zeros((block_size, num_heads), dtype=x.dtype, device=device))
    tables = packing_tables(_seq_tables, tuple(cu_seqlens), block_size, stride, device,
                            cfg.groups_per_chunk * stride)
    _check_num_blocks(tables, num_blocks, "nsa_compress_grad")
    x = _last_dim_contiguous(x)
    dout = _last_dim_contiguous(dout)
    dx = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=device)
    part_shape, part_dtype = backward_workspace(tables.num_chunks, num_heads, head_dim, block_size,
                                                cfg, x.dtype)
    partials = torch.empty(part_shape, dtype=part_dtype, device=device)
    covering = cdiv(block_size, stride)
    acc = _acc_dtype(x.dtype)
    grid = (tables.num_chunks,
            cdiv(stride, cfg.rows) * cdiv(num_heads, cfg.block_h)
            * cdiv(head_dim, cfg.block_d))
    _nsa_compress_bwd_kernel[grid](
        dout, x, weight, dx, partials,
        tables.cu_seqlens, tables.cu_blocks, tables.cu_chunks,
        num_heads, head_dim, block_size, stride, tables.num_seqs, tables.search_steps,
        cfg.groups_per_chunk, covering,
        dout.stride(0), dout.stride(1), dout.stride(2), x.stride(0), x.stride(1), x.stride(2),
        weight.stride(0), weight.stride(1), dx.stride(0), dx.stride(1), dx.stride(2),
        **backward_meta(cfg, block_size, stride), ACC=acc, num_warps=cfg.num_warps,
    )
    dweight = torch.empty((block_size, num_heads), dtype=x.dtype, device=device)
    width = block_size * num_heads
    _sum_rows_kernel[(cdiv(width, cfg.reduce_block_w),)](
        partials, dweight, partials.shape[0], width,
        BLOCK_P=cfg.reduce_block_p, BLOCK_W=cfg.reduce_block_w, ACC=acc,
        num_warps=cfg.reduce_num_warps,
    )
    return dx, dweight
