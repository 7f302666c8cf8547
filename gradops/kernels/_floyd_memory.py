"""What the two Floyd strategies that go through memory (``floyd_hybrid.py``, ``floyd_chunked.py``)
share around their kernels: the flat [B*H, ...] views, a chunk's slices of them, and a
backward's outputs: its five gradients, its statistics as the row kernels read them, and the
products that sum dK1/dV1 over m and dK2/dV2 over n, through float32 accumulators where a sum
spans chunks."""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from ._floyd_common import _ACC
from .floyd_gemm import Product, by_m


def forward_outputs(q: torch.Tensor):
    """A forward's outputs for inputs like ``q`` [B, H, N, M, D]: Y in q's dtype and the two
    float32 statistics [B, H, N, M]."""
    b, h, n, m, d = q.shape
    out = torch.empty((b, h, n, m, d), dtype=q.dtype, device=q.device)
    return out, *(torch.empty((b, h, n, m), dtype=torch.float32, device=q.device) for _ in range(2))


def flat(t: torch.Tensor) -> torch.Tensor:
    """[B, H, ...] -> [B*H, ...] (a view when the strides allow, else a copy; explicit sizes,
    as torch refuses -1 for a tensor of no elements, e.g. D = 0)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


class Chunk(NamedTuple):
    """One chunk of a plan's walk: the slices (``gs``), rows of n (``ns``) and rows of m (``ms``)
    of the flat views it covers, their sizes, and whether it opens and closes the sums over n
    (dK2/dV2) and over m (dK1/dV1)."""

    gs: slice
    ns: slice
    ms: slice
    g: int
    cn: int
    cm: int
    first_n: bool
    last_n: bool
    first_m: bool
    last_m: bool


def chunks(plan, bh: int, n: int, m: int):
    """The plan's chunks, in its walk (slices, then n, then m), as :class:`Chunk`."""
    for g0, g1, n0, n1, m0, m1 in plan.chunks(bh, n, m):
        yield Chunk(slice(g0, g1), slice(n0, n1), slice(m0, m1), g1 - g0, n1 - n0, m1 - m0,
                    n0 == 0, n1 == n, m0 == 0, m1 == m)


def reduction(a, b, out, accumulator, first: bool, last: bool) -> Product:
    """``out (+)= a @ b`` for a sum that may span chunks: straight into ``out`` when this chunk
    holds the whole sum; else through the float32 ``accumulator`` (the first chunk stores,
    middle ones accumulate, the last adds and stores the rounded result into ``out``)."""
    if first and last:
        return Product(a, b, out)
    return Product(a, b, out if last else accumulator, acc=None if first else accumulator)


class Backward:
    """A backward's outputs: the five gradients (``grads``, [B, H, ...], q's dtype, dK2/dV2
    ``kv2_dtype``'s; ``dq``, ``dk1``, ... flat), the statistics flat and contiguous (the row kernels read both at one offset, and
    each may come in its own layout: compact, a view of CANN's [B,H,N,M,8], transposed), and
    the float32 accumulators of the sums that span ``plan``'s chunks (dK1/dV1 over the
    m-chunks of one n range, dK2/dV2 over the n ranges of one group of slices), only where
    some do."""

    def __init__(self, q, k, softmax_max, softmax_sum, plan, kv2_dtype):
        b, h, n, m, d = q.shape
        dev, dtype = q.device, q.dtype
        self.softmax_max, self.softmax_sum = (flat(t.to(_ACC[dtype])).contiguous() for t in (softmax_max, softmax_sum))
        self.grads = [torch.empty(shape, dtype=grad_dtype, device=dev)
                      for shape, grad_dtype in [((b, h, n, m, d), dtype)] + [((b, h, n, k, d), dtype)] * 2
                      + [((b, h, k, m, d), kv2_dtype)] * 2]
        self.dq, self.dk1, self.dv1, self.dk2, self.dv2 = (flat(t) for t in self.grads)

        def accumulators(shape, needed):
            return [torch.empty(shape, dtype=torch.float32, device=dev) for _ in range(2)] if needed else [None, None]

        self._acc1 = accumulators((plan.groups, plan.block_n, k, d), plan.block_m < m)
        self._acc2 = accumulators((plan.groups, k, m, d), plan.block_n < n)

    def n_side(self, c: Chunk, ds, p, q_c, dy_c) -> List[Product]:
        """dK1 = dS^T Q and dV1 = P^T dY of chunk ``c``, batched over (slice, n), summed over m:
        ``[G, cn, K, cm] @ [G, cn, cm, D]``."""
        return [reduction(x.transpose(2, 3), y, out[c.gs, c.ns], acc if acc is None else acc[:c.g, :c.cn],
                          c.first_m, c.last_m)
                for x, y, out, acc in ((ds, q_c, self.dk1, self._acc1[0]), (p, dy_c, self.dv1, self._acc1[1]))]

    def m_side(self, c: Chunk, ds, p, q_c, dy_c) -> List[Product]:
        """dK2 = dS^T Q and dV2 = P^T dY of chunk ``c``, batched over (slice, m), summed over n:
        ``[G, cm, K, cn] @ [G, cm, cn, D]``."""
        return [reduction(x.permute(0, 2, 3, 1), by_m(y), out[c.gs, :, c.ms].transpose(1, 2),
                          acc if acc is None else acc[:c.g, :, c.ms].transpose(1, 2), c.first_n, c.last_n)
                for x, y, out, acc in ((ds, q_c, self.dk2, self._acc2[0]), (p, dy_c, self.dv2, self._acc2[1]))]
