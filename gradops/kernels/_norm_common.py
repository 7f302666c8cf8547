"""Pieces shared by the LayerNorm and RMSNorm kernels: row views, accumulator dtypes, and
the deterministic reduction of float partial rows."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..ops._checks import stat_dtype
from . import norm_config
from ._launch import bind_launches
from ._traceable import traced, tracing_launches


def tl_acc(dtype: torch.dtype):
    """Triton accumulator dtype for inputs of ``dtype`` (float64 stays float64)."""
    return tl.float64 if stat_dtype(dtype) == torch.float64 else tl.float32


def fused_launch(kernel, m: int, n: int, dtype: torch.dtype, device: torch.device, kind: str, streams: int,
                 flags: tuple):
    """What a whole-row launch of ``kernel`` takes besides its tensors, strides and scalars,
    decided once per call signature (a training step repeats its signatures): the kernel
    bound to its grid, its configuration (the loop arguments ``tiles_per_program`` and
    ``grid``, the partial rows of a backward) and the keyword arguments (``flags`` as (name,
    value) pairs, ACC, tile sizes, launch options). In a traced triton_op body
    (``_traceable``), the launch torch records instead, and ``m`` may be a symbol
    (``norm_config.SYMBOLIC_ROWS``)."""
    launch, cfg, kw = _fused_launch(kernel, norm_config.config_rows(m), n, dtype, device, kind, streams, flags)
    if not isinstance(m, int):
        if not tracing_launches():  # (a plain launch's grid is a number)
            raise RuntimeError("gradops: a symbolic row count reaches a norm kernel only in a traced triton_op body")
        cfg = cfg.for_rows(m)
    if tracing_launches():
        launch, options = traced(kernel, (cfg.grid,), cfg.launch())
        kw = {k: v for k, v in kw.items() if k not in cfg.launch()} | options
    return launch, cfg, kw


@functools.lru_cache(maxsize=4096)
def _fused_launch(kernel, m: int, n: int, dtype: torch.dtype, device: torch.device, kind: str, streams: int,
                  flags: tuple):
    cfg = norm_config.fused_config(m, n, device, kind=kind, elem_bytes=dtype.itemsize, streams=streams)
    kw = dict(flags, ACC=tl_acc(dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
              **cfg.launch())
    return kernel[(cfg.grid,)], cfg, kw


def clear_caches() -> None:
    """Forget every launch and configuration decided so far (they are cached per signature):
    for tests that change ``norm_config``'s constants. (Here, not in norm_config: this module
    imports norm_config and owns the launch cache, so neither imports the other back.)"""
    for cached in (norm_config.fused_config, norm_config.split_config, norm_config.reduce_config, _fused_launch):
        cached.cache_clear()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is contiguous (any row stride is passed to the
    kernel), else a contiguous copy: the kernels vectorise along a row."""
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def row_stride(t: torch.Tensor) -> int:
    # A single row's stride is never used to move, but must be a valid int.
    return t.stride(0) if t.shape[0] > 1 else max(t.shape[1], 1)


def vector(t: torch.Tensor) -> torch.Tensor:
    """A 1-D per-row or per-column vector (mean, rstd, weight) as a unit-stride tensor."""
    return t if t.stride(0) == 1 or t.numel() <= 1 else t.contiguous()


def dx_target(dx_out, like: torch.Tensor):
    """Where a kernel writes dx: ``dx_out`` when the kernel can write it directly (last dim
    contiguous), else a fresh buffer that is copied into ``dx_out`` afterwards."""
    if dx_out is not None and (dx_out.shape[-1] <= 1 or dx_out.stride(-1) == 1):
        return dx_out, False
    return torch.empty(like.shape, dtype=like.dtype, device=like.device), dx_out is not None


@triton.jit
def load_input(X, R, x_offs, r_offs, mask, HAS_RES: tl.constexpr, ACC: tl.constexpr):
    """What a norm normalises, in x's dtype: x, or (HAS_RES) h = x + residual rounded to x's
    dtype as torch's add rounds it, so that the norm sees exactly the h it returns."""
    x = tl.load(X + x_offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + r_offs, mask=mask, other=0.0)
        x = (x.to(ACC) + r.to(ACC)).to(X.dtype.element_ty)
    return x


@triton.jit
def div_rn(a, b, ACC: tl.constexpr):
    """``a / b`` rounded to nearest, for the divisions an exact result rests on (LayerNorm's
    width-1 dx, a constant row's statistics): on a GPU a float32 ``/`` is the approximate
    div.full.f32 (up to 2 ulp), float64's is IEEE. Row scalars only: it costs more instructions."""
    if ACC == tl.float32:
        return tl.math.div_rn(a, b + tl.zeros_like(a))
    else:
        return a / b


@bind_launches
@triton.jit
def _sum_rows_kernel(P, OUT_A, OUT_B, R, N, N_A, stride_p,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per column block sums R partial rows in a fixed order (row blocks in
    # sequence, then one tree reduction): no atomics, so every run gives the same bits.
    # Columns [0, N_A) go to OUT_A, the rest to OUT_B: two results (dweight and dbias) from
    # one launch, in separate tensors.
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=P.dtype.element_ty)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & cmask[None, :]
        acc += tl.load(P + rows.to(tl.int64)[:, None] * stride_p + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    in_a = cols < N_A
    tl.store(OUT_A + cols, total.to(OUT_A.dtype.element_ty), mask=cmask & in_a)
    tl.store(OUT_B + (cols - N_A), total.to(OUT_B.dtype.element_ty), mask=cmask & (cols >= N_A))


def sum_partial_rows(partial: torch.Tensor, out_dtype: torch.dtype, parts: int = 1):
    """Column sums of a contiguous ``[R, parts * n]`` partial buffer.

    ``parts=1``: one fresh ``[n]`` tensor. ``parts=2``: a tuple of two fresh ``[n]`` tensors
    (never views of one buffer: the nn layer's custom ops may not return aliases)."""
    r, width = partial.shape
    n = width // parts
    if parts == 1 and r == 1 and partial.dtype == out_dtype:
        return partial[0]  # one program wrote the whole sum: no second launch (small calls)
    outs = [torch.empty(n, dtype=out_dtype, device=partial.device) for _ in range(parts)]
    if n == 0:
        pass
    elif r == 0:
        for out in outs:
            out.zero_()
    else:
        cfg = norm_config.reduce_config(r, width, partial.device)
        _sum_rows_kernel[(cfg.grid,)](partial, outs[0], outs[-1], r, width, n, partial.stride(0),
                                      BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, **cfg.launch())
    return outs[0] if parts == 1 else tuple(outs)
