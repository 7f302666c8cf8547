"""RMSNorm in Triton: the fused forward and the one-pass backward with a deterministic
dgamma (per-program float partial rows summed by a second small kernel, no atomics).

Same functions and canonical arguments as ``gradops.reference.rms_norm`` (see
docs/backends.md). The organisation mirrors ``gradops.kernels.layer_norm`` (and
docs/kernels-norm.md): whole rows in registers up to ``norm_config.max_fused_n``, column
blocks beyond; int64 row offsets; masked lanes load 0; ACC is float32 (float64 for
float64 inputs); eps and offset come as the bits of their float64 (``_scalar_args``); launch
options from ``norm_config.launch_options``.

The variants (``offset``, ``round_xhat``, ``residual``/``dres``; see the reference) are
flags of the same kernels, so a Gemma, Llama or fused-residual norm costs one pass over
memory like the plain one: HAS_RES reads the residual and writes h beside y, HAS_DRES reads
one more gradient and adds it to dx.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops._checks import stat_dtype
from . import norm_config
from ._launch import bind_launches
from ._norm_common import as_rows, dx_target, fused_launch, load_input, row_stride, sum_partial_rows, tl_acc, vector
from ._scalar_args import float64_bits, unpack_float64, word_args
from ._traceable import launcher


# --------------------------------------------------------------------------- forward
@bind_launches
@triton.jit(do_not_specialize=word_args("eps", "offset"))
def _rms_fwd_fused_kernel(X, R, H, Y, W, Rstd, M, N, stride_x, stride_r, stride_h, stride_y, eps_high, eps_low,
                          offset_high, offset_low, tiles_per_program, num_programs,
                          HAS_W: tl.constexpr, HAS_RES: tl.constexpr, ROUND_XHAT: tl.constexpr,
                          ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          NUM_STAGES: tl.constexpr):
    # Persistent over row tiles p, p + P, ...: gamma is loaded once per program, and the
    # pipelined loop has the next tiles' x (and residual) in flight while this one reduces.
    pid = tl.program_id(0)
    eps = unpack_float64(eps_high, eps_low, ACC)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC) + unpack_float64(offset_high, offset_low, ACC)
    for i in tl.range(0, tiles_per_program, num_stages=NUM_STAGES):
        rows = (pid + i * num_programs) * BLOCK_M + tl.arange(0, BLOCK_M)  # past M: all masked
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x = load_input(X, R, rows64[:, None] * stride_x + cols[None, :], rows64[:, None] * stride_r + cols[None, :],
                       mask, HAS_RES, ACC)
        if HAS_RES:
            tl.store(H + rows64[:, None] * stride_h + cols[None, :], x, mask=mask)
        x = x.to(ACC)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        y = x * rstd[:, None]
        if ROUND_XHAT:
            y = y.to(Y.dtype.element_ty).to(ACC)
        if HAS_W:
            y = y * w[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Rstd + rows, rstd.to(Rstd.dtype.element_ty), mask=rmask)


@bind_launches
@triton.jit(do_not_specialize=word_args("eps", "offset"))
def _rms_fwd_wide_kernel(X, R, H, Y, W, Rstd, N, stride_x, stride_r, stride_h, stride_y, eps_high, eps_low,
                         offset_high, offset_low,
                         HAS_W: tl.constexpr, HAS_RES: tl.constexpr, ROUND_XHAT: tl.constexpr,
                         ACC: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # One row per program: pass 1 sums squares (and writes h), pass 2 re-reads the row (just
    # touched by this program, so mostly from L2; h is recomputed from x and the residual
    # rather than read back, which would need a barrier) and writes y.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    ss = tl.zeros([BLOCK_N], dtype=ACC)
    for c0 in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        cols = c0 + offs
        cmask = cols < N
        h = load_input(X, R, row * stride_x + cols, row * stride_r + cols, cmask, HAS_RES, ACC)
        if HAS_RES:
            tl.store(H + row * stride_h + cols, h, mask=cmask)
        h = h.to(ACC)
        ss += h * h
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / N + unpack_float64(eps_high, eps_low, ACC))
    offset = unpack_float64(offset_high, offset_low, ACC)
    y_row = Y + row * stride_y
    for c0 in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        cols = c0 + offs
        cmask = cols < N
        y = load_input(X, R, row * stride_x + cols, row * stride_r + cols, cmask, HAS_RES, ACC).to(ACC) * rstd
        if ROUND_XHAT:
            y = y.to(Y.dtype.element_ty).to(ACC)
        if HAS_W:
            y = y * (tl.load(W + cols, mask=cmask, other=0.0).to(ACC) + offset)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=cmask)
    tl.store(Rstd + row, rstd.to(Rstd.dtype.element_ty))


def rms_norm(x, gamma, eps, offset=0.0, round_xhat=False, residual=None, h_out=None):
    m, n = x.shape
    x = as_rows(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=stat_dtype(x.dtype), device=x.device)
    if m == 0:
        return y, rstd
    if n == 0:
        return y, rstd.fill_(float("nan"))  # the mean of an empty row, as in the reference
    w = vector(gamma) if gamma is not None else x
    has_res = residual is not None
    r = as_rows(residual) if has_res else x
    h = h_out if has_res else x  # the ops layer passes a fresh contiguous h_out
    flags = (("HAS_W", gamma is not None), ("HAS_RES", has_res), ("ROUND_XHAT", bool(round_xhat)))
    strides = (row_stride(x), row_stride(r), row_stride(h), row_stride(y))
    if norm_config.is_fused(n, x.device, "fwd"):
        launch, cfg, kw = fused_launch(_rms_fwd_fused_kernel, m, n, x.dtype, x.device, "fwd", 1 + has_res, flags)
        launch(x, r, h, y, w, rstd, m, n, *strides, *float64_bits(eps), *float64_bits(offset), cfg.tiles_per_program,
               cfg.grid, **kw)
    else:
        common = dict(flags, ACC=tl_acc(x.dtype))
        shape = dict(elem_bytes=x.element_size(), streams=2 if has_res else 1)
        cfg = norm_config.split_config(norm_config.config_rows(m), n, x.device, kind="fwd", **shape)
        launch, options = launcher(_rms_fwd_wide_kernel, (m,), cfg.row_launch())
        launch(
            x, r, h, y, w, rstd, n, *strides, *float64_bits(eps), *float64_bits(offset),
            BLOCK_N=cfg.row_block_n, NUM_STAGES=cfg.num_stages, **options, **common)
    return y, rstd


# -------------------------------------------------------------------------- backward
@bind_launches
@triton.jit(do_not_specialize=word_args("offset"))
def _rms_bwd_fused_kernel(DY, X, W, Rstd, DRES, DX, DW_P, M, N,
                          stride_dy, stride_x, stride_dres, stride_dx, stride_p, offset_high, offset_low,
                          tiles_per_program, num_programs, HAS_W: tl.constexpr, HAS_DRES: tl.constexpr,
                          ROUND_XHAT: tl.constexpr, ACC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Persistent: program p takes row tiles p, p + P, ...; x and dy are read once, dx is
    # written once, dgamma accumulates in registers and leaves as partial row DW_P[p, :].
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC) + unpack_float64(offset_high, offset_low, ACC)
    acc_dw = tl.zeros([BLOCK_N], dtype=ACC)
    # (a plain trip count, not range(pid, num_tiles, step): Triton 3.6's interpreter needs it;
    # num_stages makes the compiler prefetch the next tiles' loads with cp.async into shared
    # memory while this tile is reduced)
    for i in tl.range(0, tiles_per_program, num_stages=NUM_STAGES):
        rows = (pid + i * num_programs) * BLOCK_M + tl.arange(0, BLOCK_M)  # past M: all masked
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        # dy is read in full before dx is stored: dx may be written into dy's memory.
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0).to(ACC)
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        c = tl.sum(g * x, axis=1) / N
        dx = rstd[:, None] * g - (rstd * rstd * rstd * c)[:, None] * x
        if HAS_DRES:
            dx += tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(ACC)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        xhat = x * rstd[:, None]
        if ROUND_XHAT:  # gamma multiplied the rounded x-hat
            xhat = xhat.to(X.dtype.element_ty).to(ACC)
        acc_dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_P + pid.to(tl.int64) * stride_p + cols, acc_dw, mask=cmask)


@bind_launches
@triton.jit(do_not_specialize=word_args("offset"))
def _rms_bwd_row_sums_kernel(DY, X, W, C, N, stride_dy, stride_x, offset_high, offset_low, segment_blocks, num_segments,
                             HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
    # Wide rows, step 1: program (row, segment) stores sum(dy * gamma * x) over its segment
    # of segment_blocks column blocks in C[row, segment].
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)
    s = tl.zeros([BLOCK_N], dtype=ACC)
    offset = unpack_float64(offset_high, offset_low, ACC)
    for j in tl.range(0, segment_blocks, num_stages=NUM_STAGES):
        cols = (seg * segment_blocks + j) * BLOCK_N + offs
        cmask = cols < N
        dy = tl.load(DY + row * stride_dy + cols, mask=cmask, other=0.0).to(ACC)
        x = tl.load(X + row * stride_x + cols, mask=cmask, other=0.0).to(ACC)
        if HAS_W:
            dy = dy * (tl.load(W + cols, mask=cmask, other=0.0).to(ACC) + offset)
        s += dy * x
    tl.store(C + row * num_segments + seg, tl.sum(s, axis=0))


@bind_launches
@triton.jit(do_not_specialize=word_args("offset"))
def _rms_bwd_cols_kernel(DY, X, W, Rstd, C, DRES, DX, DW, M, N,
                         stride_dy, stride_x, stride_dres, stride_dx, offset_high, offset_low, row_tiles, num_segments,
                         HAS_W: tl.constexpr, HAS_DRES: tl.constexpr, ROUND_XHAT: tl.constexpr,
                         SEGMENTS: tl.constexpr, ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Wide rows, step 2: program cb walks every row tile of its BLOCK_N columns in order,
    # writes dx, and keeps dgamma for its columns in registers until it stores the finished
    # sum: no partial rows, no third launch, the same bits on every run.
    cb = tl.program_id(0)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC) + unpack_float64(offset_high, offset_low, ACC)
    acc_dw = tl.zeros([BLOCK_N], dtype=ACC)
    for i in tl.range(0, row_tiles, num_stages=NUM_STAGES):
        rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0).to(ACC)
        # the row-sums kernel's segments, as a tile (a loop here would stop the pipelining)
        segs = tl.arange(0, SEGMENTS)
        c = tl.sum(tl.load(C + rows64[:, None] * num_segments + segs[None, :],
                           mask=rmask[:, None] & (segs < num_segments)[None, :], other=0.0), axis=1) / N
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        dx = rstd[:, None] * g - (rstd * rstd * rstd * c)[:, None] * x
        if HAS_DRES:
            dx += tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(ACC)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        xhat = x * rstd[:, None]
        if ROUND_XHAT:
            xhat = xhat.to(X.dtype.element_ty).to(ACC)
        acc_dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW + cols, acc_dw.to(DW.dtype.element_ty), mask=cmask)


def rms_norm_grad(dy, x, rstd, gamma, dx_out=None, offset=0.0, round_xhat=False, dres=None, grad_dtype=None):
    """``grad_dtype``: the dtype dgamma is returned in (the accumulator dtype when None), rounded
    into by the kernel that writes it: no conversion pass after it."""
    m, n = x.shape
    acc = stat_dtype(x.dtype)
    out_dtype = grad_dtype or acc
    device = x.device
    if m == 0 or n == 0:
        dx = dx_out if dx_out is not None else torch.empty((m, n), dtype=x.dtype, device=device)
        if dres is not None:
            dx.copy_(dres)  # an empty row's norm gradient is empty; h's own gradient remains
        return dx, torch.zeros(n, dtype=out_dtype, device=device)
    dy_rows, x_rows = as_rows(dy), as_rows(x)
    rstd = vector(rstd)
    w = vector(gamma) if gamma is not None else x_rows
    offset_bits = float64_bits(offset)
    dres_rows = as_rows(dres) if dres is not None else x_rows
    dx_buf, copy_back = dx_target(dx_out, x)
    flag_pairs = (("HAS_W", gamma is not None), ("HAS_DRES", dres is not None), ("ROUND_XHAT", bool(round_xhat)))
    streams = 3 if dres is not None else 2
    strides = (row_stride(dy_rows), row_stride(x_rows), row_stride(dres_rows), row_stride(dx_buf))
    if norm_config.is_fused(n, device):
        launch, cfg, kw = fused_launch(_rms_bwd_fused_kernel, m, n, x.dtype, device, "bwd", streams,
                                       flag_pairs)
        partial = torch.empty((cfg.grid, n), dtype=acc, device=device)
        launch(dy_rows, x_rows, w, rstd, dres_rows, dx_buf, partial, m, n, *strides, partial.stride(0), *offset_bits,
               cfg.tiles_per_program, cfg.grid, **kw)
        dgamma = sum_partial_rows(partial, out_dtype)
    else:
        flags = dict(flag_pairs, ACC=tl_acc(x.dtype))
        shape = dict(elem_bytes=x.element_size(), streams=streams)
        cfg = norm_config.split_config(m, n, device, whole_columns=True, **shape)
        segs = cfg.row_segments
        c = torch.empty((m, segs), dtype=acc, device=device)
        dgamma = torch.empty(n, dtype=out_dtype, device=device)
        _rms_bwd_row_sums_kernel[(m, segs)](
            dy_rows, x_rows, w, c, n, strides[0], strides[1], *offset_bits, cfg.segment_blocks, segs,
            HAS_W=flags["HAS_W"], ACC=flags["ACC"], BLOCK_N=cfg.row_block_n, NUM_STAGES=cfg.num_stages,
            **cfg.row_launch())
        _rms_bwd_cols_kernel[(cfg.col_blocks,)](
            dy_rows, x_rows, w, rstd, c, dres_rows, dx_buf, dgamma, m, n, *strides, *offset_bits, cfg.row_tiles,
            segs, SEGMENTS=norm_config.next_pow2(segs), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            NUM_STAGES=cfg.num_stages, **cfg.launch(), **flags)
    dx = dx_out.copy_(dx_buf) if copy_back else dx_buf
    return dx, dgamma
