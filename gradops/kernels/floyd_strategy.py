"""Which strategy runs a Floyd attention call: the rule (docs/kernels-floyd.md, "Strategies").

The strategies (``floyd_config``: what each can take) are ranked by their roofline
(``floyd_roofline``: the bytes, FLOP and launches of a forward + backward, counted) on the
reference device, an H100 whose host pays ``floyd_roofline.LAUNCH_SECONDS`` a launch. A small
grid (``floyd_config.small_grid``: N, M, K <= 128, FloydNet's shapes) goes to a strategy that
launches each of its kernels once, where one can take it on the call's device: at those sizes a
call's launches cost the host more than its kernels cost the GPU, and chunking would multiply
them. The bound launcher (``_launch``) changes no pick: a host-side switch must not change the
numbers a call computes (the picks at its estimated cost, ``BOUND_LAUNCH_SECONDS``, are reported
in docs/kernels-floyd.md).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from . import floyd_config as config
from . import floyd_roofline as roofline


def strategy(b: int, h: int, n: int, m: int, k: int, d: int, element_size: int, memory: int = roofline.H100.memory
             ) -> str:
    """"fused", "hybrid" or "chunked" for a call of this shape and element size (bytes per
    input element) on a device of ``memory`` bytes (its chunks' budget): the one with the
    shortest roofline among those that can take it, only those that launch each kernel once
    on a small grid where there is one, or the one forced (``floyd_config.STRATEGY``) wherever
    it can take the call (past the widest head of the fused kernels or the hybrid row kernels:
    chunked, which takes any).
    Float64 (element size 8) is always "fused": the other strategies' GEMMs and row kernels
    are for the 16-bit and float32 inputs tensor cores serve. Every strategy is
    deterministic, so torch's determinism setting does not enter; a forward and its backward
    get the same answer."""
    if element_size == 8:
        return "fused"
    forced = config.forced_strategy()
    if forced == "hybrid" and config.padded_head_dim(d) > config.HYBRID_MAX_HEAD_DIM:
        return "chunked"  # the hybrid row kernels hold a whole head: past their widest, chunked
    if forced == "fused" and d > config.FUSED_MAX_HEAD_DIM[element_size]:
        return "chunked"  # past the fused kernels' widest no tile fits shared memory
    if forced is not None:
        return forced
    return _fastest(b, h, n, m, k, d, element_size, memory, config.half_bits(torch.bfloat16))


def launches_once(name: str, shape, dtype: torch.dtype, memory: int) -> bool:
    """Whether strategy ``name`` launches each of its kernels once at ``shape`` (B, H, N, M, K,
    D) on a device of ``memory`` bytes: in one chunk (the fused kernels have none)."""
    if name == "fused":
        return True
    b, h, n, m, k, d = shape
    small = config.small_grid(n, m, k)
    plan = config.strategy_plan(name, b * h, n, m, k, d, dtype,
                                lambda problem: config.device_budget(memory, problem, small))
    return plan.count(b * h, n, m) == 1


@functools.lru_cache(maxsize=4096)
def _fastest(b, h, n, m, k, d, element_size, memory, bits, launch=roofline.LAUNCH_SECONDS) -> str:
    """The strategy :func:`strategy` picks (``bits``: HALF_BITS, part of the key; ``launch``:
    the host cost of a launch weighed, for the report of docs/kernels-floyd.md)."""
    dtype = torch.bfloat16 if element_size == 2 else torch.float32
    shape = (b, h, n, m, k, d)
    candidates = config.runnable(d, element_size)
    if config.small_grid(n, m, k):
        candidates = tuple(c for c in candidates if launches_once(c, shape, dtype, memory)) or candidates
    device = replace(roofline.H100, launch=launch, memory=memory)
    times = [roofline.roofline(name, shape, dtype, device=device, override=False).seconds for name in candidates]
    return candidates[times.index(min(times))]
