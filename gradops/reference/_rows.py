"""Row blocks of the reference backend's CPU path (docs/backends.md, "The CPU path").

The norms go over their rows in blocks whose float32 buffers stay in the cores' L2 from one
op to the next and are reused from block to block: one pass over memory per input and
output, where whole-tensor ops would stream every intermediate through memory (and pay the
page faults of fresh buffers of the tensor's size, about 5x a write into a reused one here).
"""
from __future__ import annotations

from typing import Optional

import torch

# Elements of a block per thread: above ATen's grain size (32768 elements, under which an op
# runs on one thread), so every thread gets work; each thread's share of a float32 buffer is
# 512 KiB, so the three or four buffers a block uses stay in a few MiB of L2. Measured on 2
# cores with 4 MiB of L2 each, at (8192, 4096) and (2048, 16384): 2^17 was the best of
# 2^15..2^18 for every norm, forward and backward (2^15 was up to 1.7x slower, 2^18 within 10 %).
ELEMENTS_PER_THREAD = 1 << 17

# A fixed block size in elements instead (the tests set a small one to force several blocks)
BLOCK_ELEMENTS: Optional[int] = None


def row_block(x: torch.Tensor) -> int:
    """Rows per block of ``x [M, N]``: all of them off the CPU (CUDA, meta), or when they fit."""
    m, n = x.shape
    if m * n <= (BLOCK_ELEMENTS or ELEMENTS_PER_THREAD) or not x.is_cpu:  # (a small call asks nothing more)
        return max(m, 1)
    limit = BLOCK_ELEMENTS or ELEMENTS_PER_THREAD * torch.get_num_threads()
    return max(m, 1) if m * n <= limit else max(1, limit // n)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call when ``t`` has that dtype already (a small call
    notices each call it makes)."""
    return t if t.dtype == dtype else t.to(dtype)
