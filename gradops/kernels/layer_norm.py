"""LayerNorm in Triton: the fused forward, the one-pass backward with deterministic
dweight/dbias partial sums, and the AscendC LayerNormGrad / LayerNormGradBeta semantics.

Same functions and canonical arguments as ``gradops.reference.layer_norm`` (see
docs/backends.md); the reference is the specification of every result. How the kernels
are organised (persistent grid, partial rows, wide rows) is in docs/kernels-norm.md; every
launch parameter comes from ``norm_config``.

Conventions shared by all kernels below: rows are addressed as ``row * stride + col``
with the row index widened to int64 first (so a tensor may pass 2**31 elements); masked
lanes load 0 and are forced back to 0 after any shift, so they never leak into a sum;
ACC is the accumulator dtype (float32, float64 for float64 inputs); eps comes as the bits of its
float64 (``_scalar_args``), so float64 rows use it unrounded; every launch takes its options
from ``norm_config.launch_options``: the backwards run without floating-point contraction
(``norm_config.fp_fusion``), since their exact results (dx = 0 at width 1) rest on every
product being rounded as written.

The fused residual add (``residual``/``dres``, see the reference) is a flag of the same
kernels: HAS_RES reads the residual and writes h = x + residual beside y, HAS_DRES reads the
gradient that reaches h from elsewhere and adds it to dx, each in the one pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops._checks import stat_dtype
from . import norm_config
from ._launch import bind_launches
from ._norm_common import (
    as_rows,
    div_rn,
    dx_target,
    fused_launch,
    load_input,
    row_stride,
    sum_partial_rows,
    tl_acc,
    vector,
)
from ._scalar_args import float64_bits, unpack_float64, word_args
from ._traceable import launcher


# --------------------------------------------------------------------------- forward
@bind_launches
@triton.jit(do_not_specialize=word_args("eps"))
def _ln_fwd_fused_kernel(X, R, H, Y, W, B, Mean, Rstd, M, N, stride_x, stride_r, stride_h, stride_y, eps_high, eps_low,
                         tiles_per_program, num_programs,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr, ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Persistent over tiles of BLOCK_M whole rows (p, p + P, ...): x is read once, y written
    # once; weight and bias are loaded once per program, and the pipelined loop has the next
    # tiles' x in flight while this one is reduced.
    pid = tl.program_id(0)
    eps = unpack_float64(eps_high, eps_low, ACC)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC)
    if HAS_B:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(ACC)
    for i in tl.range(0, tiles_per_program, num_stages=NUM_STAGES):
        rows = (pid + i * num_programs) * BLOCK_M + tl.arange(0, BLOCK_M)  # past M: all masked
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x = load_input(X, R, rows64[:, None] * stride_x + cols[None, :],
                       rows64[:, None] * stride_r + cols[None, :], mask, HAS_RES, ACC)
        if HAS_RES:
            tl.store(H + rows64[:, None] * stride_h + cols[None, :], x, mask=mask)
        x = x.to(ACC)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        # corrected two-pass: adding the mean deviation removes the first sum's rounding, so a
        # constant row gets its value back exactly and centres to exact zeros (variance 0)
        mean = mean + tl.sum(xc, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / N  # two-pass (in registers): no cancellation
        rstd = 1.0 / tl.sqrt(var + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * w[None, :]
        if HAS_B:
            y = y + b[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Mean + rows, mean.to(Mean.dtype.element_ty), mask=rmask)
        tl.store(Rstd + rows, rstd.to(Rstd.dtype.element_ty), mask=rmask)


@bind_launches
@triton.jit(do_not_specialize=word_args("eps"))
def _ln_fwd_wide_kernel(X, R, H, Y, W, B, Mean, Rstd, N, stride_x, stride_r, stride_h, stride_y, eps_high, eps_low,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr, ACC: tl.constexpr,
                        BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # One row per program, too wide for registers. Pass 1 merges exact per-block sums of
    # squared deviations (Chan et al.'s pairwise update, as accurate as two-pass; a constant
    # row merges blocks of one exact mean and zero deviations: variance 0) and writes h;
    # pass 2 re-reads the row, which the program has just touched (L2), and writes y (h is
    # recomputed from x and the residual: reading it back would need a barrier).
    # The mean itself is not taken from the running merge, whose N / BLOCK_N rounded
    # updates each cost an ulp of the mean: it is the first block's mean (the shift) plus
    # the sum of every element's deviation from it, which are exact differences of the size
    # of the spread, not of the mean, so a large offset costs no more than one rounding.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    count = tl.zeros([1], dtype=ACC)
    mean = tl.zeros([1], dtype=ACC)
    m2 = tl.zeros([1], dtype=ACC)
    shift = tl.zeros([1], dtype=ACC)
    dev = tl.zeros([BLOCK_N], dtype=ACC)
    for c0 in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        cols = c0 + offs
        cmask = cols < N
        x = load_input(X, R, row * stride_x + cols, row * stride_r + cols, cmask, HAS_RES, ACC)
        if HAS_RES:
            tl.store(H + row * stride_h + cols, x, mask=cmask)
        x = x.to(ACC)
        n_b = tl.minimum(N - c0, BLOCK_N).to(ACC)
        mean_b = tl.sum(x, axis=0) / n_b
        d = tl.where(cmask, x - mean_b, 0.0)
        mean_b = mean_b + tl.sum(d, axis=0) / n_b  # corrected, as the fused kernel's mean
        d = tl.where(cmask, x - mean_b, 0.0)
        m2_b = tl.sum(d * d, axis=0)
        shift = tl.where(c0 == 0, mean_b, shift)
        dev += tl.where(cmask, x - shift, 0.0)
        total = count + n_b
        delta = mean_b - mean
        # exact divisions: the first block's n_b / total must be exactly 1, so that a constant
        # row's running mean is its value and every later delta exactly 0
        mean = mean + delta * div_rn(n_b, total, ACC)
        # (the first block has no cross term: its delta, the block's mean, squared overflows
        # past sqrt of the dtype's max (1.8e19 in float32), and inf * 0 would be NaN)
        m2 = m2 + m2_b + tl.where(count > 0, delta * delta * div_rn(count * n_b, total, ACC), 0.0)
        count = total
    mean = shift + tl.sum(dev, axis=0) / N
    var = m2 / N
    rstd = 1.0 / tl.sqrt(var + unpack_float64(eps_high, eps_low, ACC))
    y_row = Y + row * stride_y
    for c0 in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        cols = c0 + offs
        cmask = cols < N
        x = load_input(X, R, row * stride_x + cols, row * stride_r + cols, cmask, HAS_RES, ACC).to(ACC)
        y = (x - mean) * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=0.0).to(ACC)
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(ACC)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=cmask)
    one = tl.arange(0, 1)
    tl.store(Mean + row + one, mean.to(Mean.dtype.element_ty))
    tl.store(Rstd + row + one, rstd.to(Rstd.dtype.element_ty))


def layer_norm(x, weight, bias, eps, residual=None, h_out=None):
    m, n = x.shape
    acc = stat_dtype(x.dtype)
    x = as_rows(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(m, dtype=acc, device=x.device)
    rstd = torch.empty(m, dtype=acc, device=x.device)
    if m == 0 or n == 0:
        # Statistics of an empty row follow torch.native_layer_norm (and the reference): mean 0,
        # variance 0/0, so rstd nan.
        if m and not n:
            mean.zero_()
            rstd.fill_(float("nan"))
        return y, mean, rstd
    w = vector(weight) if weight is not None else x
    b = vector(bias) if bias is not None else x
    has_res = residual is not None
    r = as_rows(residual) if has_res else x
    h = h_out if has_res else x  # the ops layer passes a fresh contiguous h_out
    strides = (row_stride(x), row_stride(r), row_stride(h), row_stride(y))
    flags = (("HAS_W", weight is not None), ("HAS_B", bias is not None), ("HAS_RES", has_res))
    if norm_config.is_fused(n, x.device, "fwd"):
        launch, cfg, kw = fused_launch(_ln_fwd_fused_kernel, m, n, x.dtype, x.device, "fwd", 1 + has_res, flags)
        launch(x, r, h, y, w, b, mean, rstd, m, n, *strides, *float64_bits(eps), cfg.tiles_per_program, cfg.grid, **kw)
    else:
        common = dict(flags, ACC=tl_acc(x.dtype))
        shape = dict(elem_bytes=x.element_size(), streams=2 if has_res else 1)
        cfg = norm_config.split_config(norm_config.config_rows(m), n, x.device, kind="fwd", **shape)
        launch, options = launcher(_ln_fwd_wide_kernel, (m,), cfg.row_launch())
        launch(
            x, r, h, y, w, b, mean, rstd, n, *strides, *float64_bits(eps),
            BLOCK_N=cfg.row_block_n, NUM_STAGES=cfg.num_stages, **options, **common)
    return y, mean, rstd


# -------------------------------------------------------------------------- backward
@bind_launches
@triton.jit
def _ln_bwd_fused_kernel(DY, X, W, Mean, Rstd, DRES, DX, DW_P, DB_P,
                         M, N, stride_dy, stride_x, stride_dres, stride_dx, stride_p, tiles_per_program,
                         num_programs, HAS_W: tl.constexpr, HAS_DRES: tl.constexpr, WANT_DX: tl.constexpr,
                         WANT_DW: tl.constexpr,
                         WANT_DB: tl.constexpr, ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Persistent: program p takes row tiles p, p + P, p + 2P, ... Each element of x and dy
    # is read once; dx is written once; dw/db accumulate in registers across all the
    # program's tiles and leave as one float partial row per program (DW_P[p, :]).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC)
    acc_dw = tl.zeros([BLOCK_N], dtype=ACC)
    acc_db = tl.zeros([BLOCK_N], dtype=ACC)
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
        mean = tl.load(Mean + rows, mask=rmask, other=0.0).to(ACC)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0).to(ACC)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if WANT_DX:
            if HAS_W:
                g = dy * w[None, :]
            else:
                g = dy
            # exact division: at width 1, c2 must be g itself for g - c2 to cancel to 0
            c1 = div_rn(tl.sum(xhat * g, axis=1), N, ACC)
            c2 = div_rn(tl.sum(g, axis=1), N, ACC)
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            if HAS_DRES:
                dx += tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask,
                              other=0.0).to(ACC)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if WANT_DW:
            acc_dw += tl.sum(dy * xhat, axis=0)
        if WANT_DB:
            acc_db += tl.sum(dy, axis=0)
    if WANT_DW:
        tl.store(DW_P + pid.to(tl.int64) * stride_p + cols, acc_dw, mask=cmask)
    if WANT_DB:
        tl.store(DB_P + pid.to(tl.int64) * stride_p + cols, acc_db, mask=cmask)


@bind_launches
@triton.jit
def _ln_bwd_row_sums_kernel(DY, X, W, Mean, Rstd, C1, C2, N, stride_dy, stride_x, segment_blocks, num_segments,
                            HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                            NUM_STAGES: tl.constexpr):
    # Wide rows, step 1: program (row, segment) stores the sums dx needs, of xhat*g and of g,
    # over its segment of segment_blocks column blocks in C1/C2[row, segment].
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)
    mean = tl.load(Mean + row).to(ACC)
    rstd = tl.load(Rstd + row).to(ACC)
    s1 = tl.zeros([BLOCK_N], dtype=ACC)
    s2 = tl.zeros([BLOCK_N], dtype=ACC)
    for j in tl.range(0, segment_blocks, num_stages=NUM_STAGES):
        cols = (seg * segment_blocks + j) * BLOCK_N + offs
        cmask = cols < N
        dy = tl.load(DY + row * stride_dy + cols, mask=cmask, other=0.0).to(ACC)
        x = tl.load(X + row * stride_x + cols, mask=cmask, other=0.0).to(ACC)
        xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
        if HAS_W:
            g = dy * tl.load(W + cols, mask=cmask, other=0.0).to(ACC)
        else:
            g = dy
        s1 += xhat * g
        s2 += g
    tl.store(C1 + row * num_segments + seg, tl.sum(s1, axis=0))
    tl.store(C2 + row * num_segments + seg, tl.sum(s2, axis=0))


@bind_launches
@triton.jit
def _ln_bwd_cols_kernel(DY, X, W, Mean, Rstd, C1, C2, DRES, DX, DW, DB,
                        M, N, stride_dy, stride_x, stride_dres, stride_dx, row_tiles, num_segments,
                        HAS_W: tl.constexpr, HAS_DRES: tl.constexpr, WANT_DX: tl.constexpr,
                        WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, SEGMENTS: tl.constexpr, ACC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Wide rows, step 2: program cb walks every row tile of its BLOCK_N columns in order.
    # With the row reductions known it writes dx, and keeps dw/db for its columns in
    # registers until it stores the finished sums (in DW/DB's dtype): no partial rows, no
    # third launch, the same bits on every run.
    cb = tl.program_id(0)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC)
    acc_dw = tl.zeros([BLOCK_N], dtype=ACC)
    acc_db = tl.zeros([BLOCK_N], dtype=ACC)
    for i in tl.range(0, row_tiles, num_stages=NUM_STAGES):
        rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
        mean = tl.load(Mean + rows, mask=rmask, other=0.0).to(ACC)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0).to(ACC)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if WANT_DX:
            # the row-sums kernel's segments, as a tile (a loop here would stop the pipelining)
            segs = tl.arange(0, SEGMENTS)
            c_offs = rows64[:, None] * num_segments + segs[None, :]
            c_mask = rmask[:, None] & (segs < num_segments)[None, :]
            c1 = div_rn(tl.sum(tl.load(C1 + c_offs, mask=c_mask, other=0.0), axis=1), N, ACC)
            c2 = div_rn(tl.sum(tl.load(C2 + c_offs, mask=c_mask, other=0.0), axis=1), N, ACC)
            if HAS_W:
                g = dy * w[None, :]
            else:
                g = dy
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            if HAS_DRES:
                dx += tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask,
                              other=0.0).to(ACC)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if WANT_DW:
            acc_dw += tl.sum(dy * xhat, axis=0)
        if WANT_DB:
            acc_db += tl.sum(dy, axis=0)
    if WANT_DW:
        tl.store(DW + cols, acc_dw.to(DW.dtype.element_ty), mask=cmask)
    if WANT_DB:
        tl.store(DB + cols, acc_db.to(DB.dtype.element_ty), mask=cmask)


def layer_norm_backward(dy, x, mean, rstd, weight, output_mask, dx_out=None, dres=None, grad_dtype=None):
    """``grad_dtype``: the dtype dw and db are returned in (the accumulator dtype when None,
    as the reference returns them); the reduction kernel rounds into it as it writes, so a
    caller that wants the weight's dtype needs no conversion pass of its own."""
    want_dx, want_dw, want_db = (bool(v) for v in output_mask)
    m, n = x.shape
    acc = stat_dtype(x.dtype)
    out_dtype = grad_dtype or acc
    device = x.device
    dx = dw = db = None
    if m == 0 or n == 0:
        if want_dx:
            dx = dx_out if dx_out is not None else torch.empty((m, n), dtype=x.dtype, device=device)
            if dres is not None:
                dx.copy_(dres)  # an empty row's norm gradient is empty; h's own gradient remains
        if want_dw:
            dw = torch.zeros(n, dtype=out_dtype, device=device)
        if want_db:
            db = torch.zeros(n, dtype=out_dtype, device=device)
        return dx, dw, db
    if not (want_dx or want_dw or want_db):
        return None, None, None

    dy_rows, x_rows = as_rows(dy), as_rows(x)
    mean, rstd = vector(mean), vector(rstd)
    w = vector(weight) if weight is not None else x_rows
    dx_buf, copy_back = dx_target(dx_out, x) if want_dx else (x_rows, False)
    has_dres = dres is not None and want_dx
    dres_rows = as_rows(dres) if has_dres else x_rows
    flag_pairs = (("HAS_W", weight is not None), ("HAS_DRES", has_dres), ("WANT_DX", want_dx), ("WANT_DW", want_dw),
                  ("WANT_DB", want_db))
    strides = (row_stride(dy_rows), row_stride(x_rows), row_stride(dres_rows), row_stride(dx_buf))
    streams = 3 if has_dres else 2

    if norm_config.is_fused(n, device):
        launch, cfg, kw = fused_launch(_ln_bwd_fused_kernel, m, n, x.dtype, device, "bwd", streams,
                                       flag_pairs)
        # dw and db partials side by side in one buffer, summed by one reduction launch.
        n_partials = int(want_dw) + int(want_db)
        partial = torch.empty((cfg.grid, n_partials * n) if n_partials else (1, 1), dtype=acc, device=device)
        db_p = partial[:, n:] if want_dw else partial
        launch(dy_rows, x_rows, w, mean, rstd, dres_rows, dx_buf, partial, db_p, m, n, *strides, partial.stride(0),
               cfg.tiles_per_program, cfg.grid, **kw)
        if n_partials == 2:
            dw, db = sum_partial_rows(partial, out_dtype, parts=2)
        elif n_partials:
            sums = sum_partial_rows(partial, out_dtype)
            dw, db = (sums, None) if want_dw else (None, sums)
    else:
        flags = dict(flag_pairs, ACC=tl_acc(x.dtype))
        cfg = norm_config.split_config(m, n, device, whole_columns=True, elem_bytes=x.element_size(),
                                       streams=streams)
        segs = cfg.row_segments
        c1 = c2 = mean[:, None]  # unused unless dx is wanted
        if want_dx:
            c1 = torch.empty((m, segs), dtype=acc, device=device)
            c2 = torch.empty((m, segs), dtype=acc, device=device)
            _ln_bwd_row_sums_kernel[(m, segs)](
                dy_rows, x_rows, w, mean, rstd, c1, c2, n, strides[0], strides[1], cfg.segment_blocks, segs,
                HAS_W=weight is not None, ACC=flags["ACC"], BLOCK_N=cfg.row_block_n, NUM_STAGES=cfg.num_stages,
                **cfg.row_launch())
        dw = torch.empty(n, dtype=out_dtype, device=device) if want_dw else None
        db = torch.empty(n, dtype=out_dtype, device=device) if want_db else None
        _ln_bwd_cols_kernel[(cfg.col_blocks,)](
            dy_rows, x_rows, w, mean, rstd, c1, c2, dres_rows, dx_buf, dw if want_dw else x_rows,
            db if want_db else x_rows, m, n, *strides, cfg.row_tiles, segs, SEGMENTS=norm_config.next_pow2(segs),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, **cfg.launch(), **flags)
    if want_dx:
        dx = dx_out.copy_(dx_buf) if copy_back else dx_buf
    return dx, dw, db


# ------------------------------------------------------- AscendC LayerNormGrad(Beta)
@triton.jit
def _ascendc_row_factors(var, s_x1x2, s_x1, s_x2, eps, H, ACC: tl.constexpr):
    # CANN's formula, literally (OPERATORS.md section 2), given the three row sums
    # sum(x1*x2), sum(x1), sum(x2); pd_mean keeps the analytically-zero term.
    r = 1.0 / tl.sqrt(var + eps)
    r3 = r * r * r
    pd_var = -0.5 * r3 * s_x1x2
    # 1/H and 2/H in the accumulator dtype (a Python-float constant would be float32), by an
    # IEEE division: at H = 1 (x = mean) pd_x = x1*r + pd_mean/H cancels to exactly 0 only if
    # 1/H is exactly 1.
    inv_h = div_rn(tl.zeros_like(var) + 1.0, H, ACC)
    pd_mean = -r * s_x1 + pd_var * inv_h * (-2.0 * s_x2)
    return r, pd_var, pd_mean, inv_h


@bind_launches
@triton.jit(do_not_specialize=word_args("eps"))
def _ln_grad_fused_kernel(DY, X, Var, Mean, Gamma, PDX, RES, M, H,
                          stride_dy, stride_x, stride_pdx, stride_res, eps_high, eps_low,
                          REUSE: tl.constexpr, ACC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    dy_ptr = DY + rows64[:, None] * stride_dy + cols[None, :]
    x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
    dy = tl.load(dy_ptr, mask=mask, other=0.0).to(ACC)
    x = tl.load(x_ptr, mask=mask, other=0.0).to(ACC)
    gamma = tl.load(Gamma + cols, mask=cmask, other=0.0).to(ACC)
    var = tl.load(Var + rows, mask=rmask, other=1.0).to(ACC)
    mean = tl.load(Mean + rows, mask=rmask, other=0.0).to(ACC)
    x2 = tl.where(mask, x - mean[:, None], 0.0)
    x1 = dy * gamma[None, :]
    r, pd_var, pd_mean, inv_h = _ascendc_row_factors(var, tl.sum(x1 * x2, axis=1), tl.sum(x1, axis=1),
                                              tl.sum(x2, axis=1), unpack_float64(eps_high, eps_low, ACC), H, ACC)
    pd_x = x1 * r[:, None] + (pd_var * (2.0 * inv_h))[:, None] * x2 + (pd_mean * inv_h)[:, None]
    tl.store(PDX + rows64[:, None] * stride_pdx + cols[None, :], pd_x.to(PDX.dtype.element_ty), mask=mask)
    tl.store(RES + rows64[:, None] * stride_res + cols[None, :], (x2 * r[:, None]).to(RES.dtype.element_ty),
             mask=mask)
    if REUSE:  # CANN leaves dy*gamma in inputDy and x-mean in inputX
        tl.store(dy_ptr, x1.to(DY.dtype.element_ty), mask=mask)
        tl.store(x_ptr, x2.to(X.dtype.element_ty), mask=mask)


@bind_launches
@triton.jit
def _ln_grad_row_sums_kernel(DY, X, Mean, Gamma, S, H, stride_dy, stride_x,
                             ACC: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Wide rows: S[row] = (sum(x1*x2), sum(x1), sum(x2)).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mean = tl.load(Mean + row).to(ACC)
    s12 = tl.zeros([BLOCK_N], dtype=ACC)
    s1 = tl.zeros([BLOCK_N], dtype=ACC)
    s2 = tl.zeros([BLOCK_N], dtype=ACC)
    for c0 in tl.range(0, H, BLOCK_N, num_stages=NUM_STAGES):
        cols = c0 + offs
        cmask = cols < H
        dy = tl.load(DY + row * stride_dy + cols, mask=cmask, other=0.0).to(ACC)
        x = tl.load(X + row * stride_x + cols, mask=cmask, other=0.0).to(ACC)
        x1 = dy * tl.load(Gamma + cols, mask=cmask, other=0.0).to(ACC)
        x2 = tl.where(cmask, x - mean, 0.0)
        s12 += x1 * x2
        s1 += x1
        s2 += x2
    tl.store(S + row * 3, tl.sum(s12, axis=0))
    tl.store(S + row * 3 + 1, tl.sum(s1, axis=0))
    tl.store(S + row * 3 + 2, tl.sum(s2, axis=0))


@bind_launches
@triton.jit(do_not_specialize=word_args("eps"))
def _ln_grad_cols_kernel(DY, X, Var, Mean, Gamma, S, PDX, RES, M, H,
                         stride_dy, stride_x, stride_pdx, stride_res, eps_high, eps_low,
                         REUSE: tl.constexpr, ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Wide rows: elementwise once the row sums are known, one tile per program. Row tiles
    # on grid axis 0 (up to 2**31 - 1; axis 1 stops at 65535), column blocks on axis 1.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    dy_ptr = DY + rows64[:, None] * stride_dy + cols[None, :]
    x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
    dy = tl.load(dy_ptr, mask=mask, other=0.0).to(ACC)
    x = tl.load(x_ptr, mask=mask, other=0.0).to(ACC)
    gamma = tl.load(Gamma + cols, mask=cmask, other=0.0).to(ACC)
    var = tl.load(Var + rows, mask=rmask, other=1.0).to(ACC)
    mean = tl.load(Mean + rows, mask=rmask, other=0.0).to(ACC)
    s12 = tl.load(S + rows64 * 3, mask=rmask, other=0.0)
    s1 = tl.load(S + rows64 * 3 + 1, mask=rmask, other=0.0)
    s2 = tl.load(S + rows64 * 3 + 2, mask=rmask, other=0.0)
    x2 = x - mean[:, None]
    x1 = dy * gamma[None, :]
    r, pd_var, pd_mean, inv_h = _ascendc_row_factors(var, s12, s1, s2, unpack_float64(eps_high, eps_low, ACC), H, ACC)
    pd_x = x1 * r[:, None] + (pd_var * (2.0 * inv_h))[:, None] * x2 + (pd_mean * inv_h)[:, None]
    tl.store(PDX + rows64[:, None] * stride_pdx + cols[None, :], pd_x.to(PDX.dtype.element_ty), mask=mask)
    tl.store(RES + rows64[:, None] * stride_res + cols[None, :], (x2 * r[:, None]).to(RES.dtype.element_ty),
             mask=mask)
    if REUSE:
        tl.store(dy_ptr, x1.to(DY.dtype.element_ty), mask=mask)
        tl.store(x_ptr, x2.to(X.dtype.element_ty), mask=mask)


def _writable_rows(t: torch.Tensor):
    """Rows the kernel may overwrite in place (reuse_source), plus whether the result must
    be copied back because ``t`` itself could not be used."""
    rows = as_rows(t)
    return rows, rows is not t


def layer_norm_grad(dy, x, variance, mean, gamma, eps, reuse_source):
    r, h = x.shape
    device = x.device
    pd_x = torch.empty((r, h), dtype=x.dtype, device=device)
    res = torch.empty((r, h), dtype=x.dtype, device=device)
    if r == 0 or h == 0:
        return pd_x, res
    dy_rows, dy_copied = _writable_rows(dy)
    x_rows, x_copied = _writable_rows(x)
    variance, mean, gamma = vector(variance), vector(mean), vector(gamma)
    reuse = bool(reuse_source)
    acc = tl_acc(x.dtype)
    if norm_config.is_fused(h, device):
        cfg = norm_config.fused_config(r, h, device, persistent=False)
        _ln_grad_fused_kernel[(cfg.grid,)](
            dy_rows, x_rows, variance, mean, gamma, pd_x, res, r, h,
            row_stride(dy_rows), row_stride(x_rows), row_stride(pd_x), row_stride(res), *float64_bits(eps),
            REUSE=reuse, ACC=acc, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **cfg.launch())
    else:
        cfg = norm_config.split_config(r, h, device)
        sums = torch.empty((r, 3), dtype=stat_dtype(x.dtype), device=device)
        _ln_grad_row_sums_kernel[(r,)](
            dy_rows, x_rows, mean, gamma, sums, h, row_stride(dy_rows), row_stride(x_rows),
            ACC=acc, BLOCK_N=cfg.row_block_n, NUM_STAGES=cfg.num_stages, **cfg.row_launch())
        _ln_grad_cols_kernel[(cfg.row_tiles, cfg.col_blocks)](
            dy_rows, x_rows, variance, mean, gamma, sums, pd_x, res, r, h,
            row_stride(dy_rows), row_stride(x_rows), row_stride(pd_x), row_stride(res), *float64_bits(eps),
            REUSE=reuse, ACC=acc, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **cfg.launch())
    if reuse:
        if dy_copied:
            dy.copy_(dy_rows)
        if x_copied:
            x.copy_(x_rows)
    return pd_x, res


@bind_launches
@triton.jit
def _ln_grad_beta_kernel(RES, DY, PG_P, PB_P, M, N, stride_res, stride_dy, stride_p,
                         tiles_per_group, num_row_groups,
                         REUSE: tl.constexpr, ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Column sums only: program (column block, row group) accumulates its columns over its
    # row tiles in registers and writes one partial row.
    cb = tl.program_id(0)
    rg = tl.program_id(1)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc_g = tl.zeros([BLOCK_N], dtype=ACC)
    acc_b = tl.zeros([BLOCK_N], dtype=ACC)
    for i in tl.range(0, tiles_per_group, num_stages=NUM_STAGES):
        rows = (rg + i * num_row_groups) * BLOCK_M + tl.arange(0, BLOCK_M)  # past M: all masked
        mask = (rows < M)[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        res_ptr = RES + rows64[:, None] * stride_res + cols[None, :]
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        prod = dy * tl.load(res_ptr, mask=mask, other=0.0).to(ACC)
        acc_g += tl.sum(prod, axis=0)
        acc_b += tl.sum(dy, axis=0)
        if REUSE:  # CANN leaves dy*resForGamma in resForGamma
            tl.store(res_ptr, prod.to(RES.dtype.element_ty), mask=mask)
    tl.store(PG_P + rg.to(tl.int64) * stride_p + cols, acc_g, mask=cmask)
    tl.store(PB_P + rg.to(tl.int64) * stride_p + cols, acc_b, mask=cmask)


def layer_norm_grad_beta(res_for_gamma, dy, reuse_source):
    r, h = dy.shape
    device = dy.device
    acc = stat_dtype(dy.dtype)
    if r == 0 or h == 0:
        return torch.zeros(h, dtype=dy.dtype, device=device), torch.zeros(h, dtype=dy.dtype, device=device)
    res_rows, res_copied = _writable_rows(res_for_gamma)
    dy_rows = as_rows(dy)
    cfg = norm_config.split_config(r, h, device, elem_bytes=dy.element_size())
    partial = torch.empty((cfg.row_groups, 2 * h), dtype=acc, device=device)
    _ln_grad_beta_kernel[(cfg.col_blocks, cfg.row_groups)](
        res_rows, dy_rows, partial, partial[:, h:], r, h, row_stride(res_rows), row_stride(dy_rows),
        partial.stride(0), cfg.tiles_per_group, cfg.row_groups,
        REUSE=bool(reuse_source), ACC=tl_acc(dy.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        NUM_STAGES=cfg.num_stages, **cfg.launch())
    if reuse_source and res_copied:
        res_for_gamma.copy_(res_rows)
    return sum_partial_rows(partial, dy.dtype, parts=2)
