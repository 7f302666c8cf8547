"""What each Floyd attention strategy moves, computes and launches at any shape: the roofline the
strategy rule ranks them by (floyd_strategy.strategy; docs/kernels-floyd.md, "Roofline").

For every launch a call makes, :func:`launches` gives the bytes it loads and stores, **distinct**
(each byte once per launch: its least traffic between memory and the chip, the HBM traffic of
the score-sized tensors) and **issued** (every load and store each time it is issued: what it
asks of L2), and the FLOP its dots execute at the tile shapes used (tensor cores for 16-bit
inputs, FMA for float32 and float64). These are not estimates: they follow the launchers and
kernels line by line, and tests/test_floyd_roofline.py checks the bytes against the ones the
interpreter counts (``gradops.bench.traffic``), launch by launch, at shapes with tails, masks
and chunks; at shapes the interpreter cannot reach (L = 512 is 10^9 scores) they are what the
count would be.

:func:`roofline` turns them into a time on a device (:data:`H100`): the largest of the HBM
bytes over HBM bandwidth, the issued bytes over L2 bandwidth, the FLOP over the units' rates,
and the launches times the host's cost of one. A roofline bounds a time from below, it does not
predict one; where a GPU has measured two strategies, the measurement decides
(floyd_config.MEASURED).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from . import floyd_config as config

Shape = Tuple[int, int, int, int, int, int]  # B, H, N, M, K, D


@dataclass(frozen=True)
class Launch:
    """One launch: its kernel, bytes loaded and stored (distinct, issued), and the FLOP its dots
    execute on tensor cores (``mma``) and on FMA units (``fma``), padded tiles included."""

    kernel: str
    distinct_load: int
    distinct_store: int
    issued_load: int
    issued_store: int
    mma: float = 0.0
    fma: float = 0.0

    @property
    def distinct(self) -> int:
        return self.distinct_load + self.distinct_store

    @property
    def issued(self) -> int:
        return self.issued_load + self.issued_store


@dataclass(frozen=True)
class Device:
    """The rates a roofline divides by. ``hbm``, ``l2``: bytes/s; ``mma``: dense 16-bit
    tensor-core FLOP/s of the instructions the tiles use; ``fma``: float32 FMA FLOP/s;
    ``launch``: host seconds per kernel launch; ``memory``: total bytes."""

    name: str
    hbm: float
    l2: float
    mma: float
    fma: float
    launch: float
    memory: int  # total bytes: the memory strategies' chunk budget derives from it


# Host seconds a kernel launch costs, as the rule weighs it: the bare autograd.Function floors of
# the H200 run of 2026-11-28 (benchmarks/results/nvidia-h200-2026-11-28/overhead.json: the least
# a call with gradops' kernels costs the host, its allocations and autograd included), each
# floor's median time over its launches, the median of the six floors: 104.6 (F.rms_norm, 3
# launches), 137.6 (F.layer_norm, 3), 145.2 (nn.RMSNorm, 3), 204.0 (nn.LayerNorm, 3), 59.9
# (gradops.rms_norm, 1) and 109.8 us (gradops.layer_norm, 1): 123.7 us. (The same run's Floyd
# hybrid at L = 256, 28 launches in 7.06 ms against a roofline of 2.03, took about 250 us a
# launch: host-bound.) tests/test_floyd_roofline.py recomputes it from the committed JSON.
LAUNCH_SECONDS = 123.7e-6
# What a launch would cost with the bound launcher (gradops.kernels._launch: a compiled
# kernel launched without JITFunction.run's binder and cache lookup): LAUNCH_SECONDS less the
# binder's share of a JIT launch. That share is 69 % (the H200 run's profile.txt, cProfile of
# 600 launches: JITFunction.run 0.059 s cumulative, the compiled launcher within it 0.018 s) of
# the 23.2 us a bare JIT launch took on the H100 machine of 2026-11-25
# (shared/gpu/h100-2026-11-25, launch-and-gemm.txt): 16.0 us saved, 107.7 us left. An estimate
# until a GPU run times the bound launcher (docs/gpu.md).
BOUND_LAUNCH_SECONDS = LAUNCH_SECONDS - (1 - 0.018 / 0.059) * 23.2e-6

# H100 SXM (80 GB HBM3): 3.35 TB/s HBM and 989 TFLOP/s dense 16-bit on wgmma, 67 TFLOP/s float32
# (NVIDIA's specification); about 5.5 TB/s from L2 (microbenchmarks, e.g. Chips and Cheese's);
# LAUNCH_SECONDS of host time a launch. The fused kernels' batched dots lower to mma.sync, whose
# rate is lower than wgmma's: the tensor-core term is not what binds them (their L2 traffic
# is), so one rate serves.
H100 = Device("H100 SXM", hbm=3.35e12, l2=5.5e12, mma=989e12, fma=67e12, launch=LAUNCH_SECONDS,
              memory=81559 << 20)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad(x: int, to: int) -> int:
    return _cdiv(x, to) * to


@dataclass(frozen=True)
class Estimate:
    """A strategy's forward + backward at one shape: its bytes, FLOP and launches, and the
    roofline time on ``device`` with the term that bounds it."""

    strategy: str
    hbm_bytes: int
    l2_bytes: int
    mma: float
    fma: float
    launches: int
    seconds: float
    bound: str


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------
class _Chunk:
    """Bytes of the tensors of one chunk (``g`` slices, ``cn`` rows of n, ``cm`` rows of m, every
    pivot) of a problem with ``k`` pivots, head dim ``d``, inputs of ``e`` bytes, statistics of
    ``acc`` bytes, and ``batches`` distinct batch entries b among its slices (the mask's)."""

    def __init__(self, g, cn, cm, k, d, e, acc, batches, masked):
        self.scores = g * cn * cm * k
        self.q = g * cn * cm * d * e  # Q, dY, Y, dQ
        self.n_side = g * cn * k * d * e  # K1, V1, dK1, dV1
        self.m_side = g * k * cm * d * e  # K2, V2, dK2, dV2
        self.stat = g * cn * cm * acc  # one statistic (or Dr)
        self.part = g * cn * cm * d * 4  # a float32 partial Y or dQ
        self.mask = batches * cn * k if masked else 0  # the chunk's mask rows, bytes


def _chunks(plan, b, h, n, m, k, d, e, acc, masked):
    """(chunk sizes, first/last along n, first/last along m) of each chunk ``plan`` walks."""
    for g0, g1, n0, n1, m0, m1 in plan.chunks(b * h, n, m):
        batches = len({x // h for x in range(g0, g1)})
        yield (g1 - g0, n1 - n0, m1 - m0, _Chunk(g1 - g0, n1 - n0, m1 - m0, k, d, e, acc, batches, masked),
               (n0 == 0, n1 == n), (m0 == 0, m1 == m))


def _reduction(elements: int, e: int, ends: Tuple[bool, bool]) -> Tuple[int, int]:
    """(float32 accumulator bytes loaded, bytes stored) of a chunk's part of a sum that may
    span chunks (``elements`` results; the launchers' ``_reduction``): straight into the output
    when the chunk holds the whole sum; else the first chunk stores float32, the middle ones
    load and store it, the last loads it and stores the output."""
    first, last = ends
    return (0 if first else 4 * elements), (e * elements if last else 4 * elements)


def _gemm(products, e: int) -> Launch:
    """A :func:`floyd_gemm.gemm` launch of ``products``: (batch entries, R, C, T, (a key, a
    bytes), (b key, b bytes), accumulator bytes loaded, bytes stored). Operands with one key
    are one tensor (distinct once per launch); every program loads its rows of a and columns
    of b at each step, with the blocks ``gemm_config`` gives its product's shape."""
    distinct: Dict[str, int] = {}
    issued = store = acc_bytes = 0
    flop = 0.0
    for batch, r, c, t, (a_key, a_bytes), (b_key, b_bytes), acc, out in products:
        cfg = config.gemm_config(r, c, t, e)
        br, bc, bt = cfg["BLOCK_R"], cfg["BLOCK_C"], cfg["BLOCK_T"]
        distinct[a_key] = a_bytes
        distinct[b_key] = b_bytes
        acc_bytes += acc
        issued += a_bytes * _cdiv(c, bc) + b_bytes * _cdiv(r, br) + acc
        store += out
        flop += 2.0 * batch * _pad(r, br) * _pad(c, bc) * _pad(t, bt)
    tensor_cores = e == 2
    return Launch("_gemm_kernel", sum(distinct.values()) + acc_bytes, store, issued, store,
                  mma=flop if tensor_cores else 0.0, fma=0.0 if tensor_cores else flop)


def _dots(flop: float, e: int) -> Dict[str, float]:
    return dict(mma=flop, fma=0.0) if e == 2 else dict(mma=0.0, fma=flop)


# ---------------------------------------------------------------------------------------------
# The hybrid strategy (floyd_hybrid.py)
# ---------------------------------------------------------------------------------------------
def _hybrid(b, h, n, m, k, d, dtype, masked, budget) -> Dict[str, List[Launch]]:
    e = dtype.itemsize
    hb = config.half_bits(dtype) // 8
    cfg = config.hybrid_config(d, dtype)
    bm, bk, bd = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["BLOCK_D"]
    plan = config.strategy_plan("hybrid", b * h, n, m, k, d, dtype, budget)
    fwd, bwd = [], []
    for g, cn, cm, z, n_ends, m_ends in _chunks(plan, b, h, n, m, k, d, e, 4, masked):
        half, probs = z.scores * hb, z.scores * e
        programs = g * cn * _cdiv(cm, bm)
        pivots = programs * k * d * e  # one sweep's K1 (or V1) tiles, every program
        masks = programs * k if masked else 0  # one sweep's mask loads
        dot = 2.0 * programs * _cdiv(k, bk) * bm * bd * bk  # one dot per step, every program

        fwd.append(_gemm([(g * cm, cn, k, d, ("q", z.q), ("k2", z.m_side), 0, half)], e))
        fwd.append(Launch("_rows_forward", z.q + 2 * z.n_side + half + z.mask, probs + 2 * z.stat + z.part,
                          z.q + 3 * pivots + 2 * half + 2 * masks, probs + 2 * z.stat + z.part,
                          **_dots(3 * dot, e)))
        fwd.append(_gemm([(g * cm, cn, d, k, ("p", probs), ("v2", z.m_side), z.part, z.q)], e))

        bwd.append(_gemm([(g * cm, cn, k, d, ("q", z.q), ("k2", z.m_side), 0, half),
                          (g * cm, cn, k, d, ("dy", z.q), ("v2", z.m_side), 0, half)], e))
        bwd.append(Launch("_rows_backward", 2 * z.q + 2 * z.n_side + 2 * z.stat + 2 * half + z.mask,
                          2 * probs + z.part,
                          2 * z.q + 2 * z.stat + 4 * pivots + 4 * half + 2 * masks, 2 * probs + z.part,
                          **_dots(5 * dot, e)))
        acc2, out2 = _reduction(z.m_side // e, e, n_ends)
        bwd.append(_gemm([(g * cm, cn, d, k, ("ds", probs), ("k2", z.m_side), z.part, z.q),
                          (g * cm, k, d, cn, ("ds", probs), ("q", z.q), acc2, out2),
                          (g * cm, k, d, cn, ("p", probs), ("dy", z.q), acc2, out2)], e))
        acc1, out1 = _reduction(z.n_side // e, e, m_ends)
        bwd.append(_gemm([(g * cn, k, d, cm, ("ds", probs), ("q", z.q), acc1, out1),
                          (g * cn, k, d, cm, ("p", probs), ("dy", z.q), acc1, out1)], e))
    return {"forward": fwd, "backward": bwd}


# ---------------------------------------------------------------------------------------------
# The chunked strategy (floyd_chunked.py)
# ---------------------------------------------------------------------------------------------
def _chunked(b, h, n, m, k, d, dtype, masked, budget) -> Dict[str, List[Launch]]:
    e = dtype.itemsize
    passes = 1 if config.row_config(k)["ONE_TILE"] else 2
    plan = config.strategy_plan("chunked", b * h, n, m, k, d, dtype, budget)
    fwd, bwd = [], []
    for g, cn, cm, z, n_ends, m_ends in _chunks(plan, b, h, n, m, k, d, e, 4, masked):
        s, probs = z.scores * 4, z.scores * e
        rows = g * cn * cm
        masks = rows * k if masked else 0  # one pass's mask loads: a row's K bytes each

        def scores(x, x_key, y1, y1_key, y2, y2_key):
            """S (or dP) of the chunk: the n-side GEMM, then the m-side one onto it."""
            return [_gemm([(g * cn, cm, k, d, (x_key, x), (y1_key, y1), 0, s)], e),
                    _gemm([(g * cm, cn, k, d, (x_key, x), (y2_key, y2), s, s)], e)]

        fwd += scores(z.q, "q", z.n_side, "k1", z.m_side, "k2")
        fwd.append(Launch("_softmax_rows", s + z.mask, probs + 2 * z.stat, passes * (s + masks), probs + 2 * z.stat))
        fwd.append(_gemm([(g * cn, cm, d, k, ("p", probs), ("v1", z.n_side), 0, z.part)], e))
        fwd.append(_gemm([(g * cm, cn, d, k, ("p", probs), ("v2", z.m_side), z.part, z.q)], e))

        bwd += scores(z.q, "q", z.n_side, "k1", z.m_side, "k2")
        bwd += scores(z.q, "dy", z.n_side, "v1", z.m_side, "v2")
        bwd.append(Launch("_grad_rows", 2 * s + 2 * z.stat + z.mask, 2 * probs,
                          passes * (2 * s + masks) + 2 * z.stat, 2 * probs))
        bwd.append(_gemm([(g * cn, cm, d, k, ("ds", probs), ("k1", z.n_side), 0, z.part)], e))
        bwd.append(_gemm([(g * cm, cn, d, k, ("ds", probs), ("k2", z.m_side), z.part, z.q)], e))
        acc1, out1 = _reduction(z.n_side // e, e, m_ends)
        for x, y in (("ds", "q"), ("p", "dy")):
            bwd.append(_gemm([(g * cn, k, d, cm, (x, probs), (y, z.q), acc1, out1)], e))
        acc2, out2 = _reduction(z.m_side // e, e, n_ends)
        for x, y in (("ds", "q"), ("p", "dy")):
            bwd.append(_gemm([(g * cm, k, d, cn, (x, probs), (y, z.q), acc2, out2)], e))
    return {"forward": fwd, "backward": bwd}


# ---------------------------------------------------------------------------------------------
# The fused strategy (floyd_attention.py): no score leaves the chip; operands re-read from L2
# ---------------------------------------------------------------------------------------------
def _batched_dot(batch: int, rows: int, cols: int, inner: int) -> float:
    """FLOP of a batched tl.dot at the MMA's shape (rows padded to 16, the others to 8 and 16)."""
    return 2.0 * batch * _pad(rows, 16) * _pad(cols, 8) * _pad(inner, 16)


def _fused(b, h, n, m, k, d, dtype, masked, budget) -> Dict[str, List[Launch]]:
    e = dtype.itemsize
    acc = 8 if dtype == torch.float64 else 4
    bh = b * h
    q, stat = bh * n * m * d * e, bh * n * m * acc
    k1, k2 = bh * n * k * d * e, bh * k * m * d * e
    mask = b * n * k if masked else 0  # distinct: the mask of every batch entry, once
    f = config.floyd_config("fwd", d, e)
    tn, tm = _cdiv(n, f.block_n), _cdiv(m, f.block_m)
    issued_mask = bh * tm * n * k if masked else 0  # [BN, BK] per program and step
    # forward: per step two score dots (batched over n and over m) and two output dots
    steps = bh * tn * tm * _cdiv(k, f.block_k)
    bn, bm_, bk_, bd = f.block_n, f.block_m, f.block_k, f.block_d
    fwd_flop = steps * (_batched_dot(bn, bm_, bk_, bd) + _batched_dot(bm_, bn, bk_, bd)  # S
                        + _batched_dot(bn, bm_, bd, bk_) + _batched_dot(bm_, bn, bd, bk_))  # P V1, P V2
    forward = [Launch("_fwd_kernel", q + 2 * k1 + 2 * k2 + mask, q + 2 * stat,
                      q + 2 * tm * k1 + 2 * tn * k2 + issued_mask, q + 2 * stat, **_flop(fwd_flop, e))]

    c = config.floyd_config("bwd_dq", d, e)
    tn, tm = _cdiv(n, c.block_n), _cdiv(m, c.block_m)
    bn, bm_, bk_, bd = c.block_n, c.block_m, c.block_k, c.block_d
    steps = bh * tn * tm * _cdiv(k, bk_)
    pair = _batched_dot(bn, bm_, bk_, bd) + _batched_dot(bm_, bn, bk_, bd)  # S or dP
    dq_flop = steps * (4 * pair + _batched_dot(bn, bm_, bd, bk_) + _batched_dot(bm_, bn, bd, bk_))
    issued_mask = 2 * bh * tm * n * k if masked else 0
    backward = [Launch("_bwd_dq_kernel", 2 * q + 2 * stat + 2 * k1 + 2 * k2 + mask, stat + q,
                       2 * q + 2 * stat + 2 * (2 * tm * k1 + 2 * tn * k2) + issued_mask, stat + q,
                       **_flop(dq_flop, e))]
    for name, own, other, own_len, loop_len in (("bwd_dk1", k1, k2, n, m), ("bwd_dk2", k2, k1, m, n)):
        meta = config.floyd_config(name, d, e)
        if name == "bwd_dk2":
            block_own, block_loop = meta.block_m, meta.block_n
        else:
            block_own, block_loop = meta.block_n, meta.block_m
        tj, tk = _cdiv(own_len, block_own), _cdiv(k, meta.block_k)
        steps = bh * tj * tk * _cdiv(loop_len, block_loop)
        bj, bl, bk_, bd = block_own, block_loop, meta.block_k, meta.block_d
        pair = _batched_dot(bj, bl, bk_, bd) + _batched_dot(bl, bj, bk_, bd)
        flop = steps * (2 * pair + 2 * _batched_dot(bj, bk_, bd, bl))
        # the mask: the program's own [BJ, BK] tile once (dK1/dV1), or a [BL, BK] tile a step
        issued_mask = (bh * n * k if name == "bwd_dk1" else bh * tj * n * k) if masked else 0
        backward.append(Launch("_bwd_dkv_kernel", 2 * q + 3 * stat + 2 * own + 2 * other + mask, 2 * own,
                               2 * own + tk * (2 * q + 3 * stat) + 2 * tj * other + issued_mask, 2 * own,
                               **_flop(flop, e)))
    return {"forward": forward, "backward": backward}


def _flop(flop: float, e: int) -> Dict[str, float]:
    return dict(mma=flop, fma=0.0) if e == 2 else dict(mma=0.0, fma=flop)


STRATEGIES = {"fused": _fused, "chunked": _chunked, "hybrid": _hybrid}


def launches(strategy: str, shape: Shape, dtype: torch.dtype, masked: bool = False, memory: int = H100.memory,
             override: bool = True) -> Dict[str, List[Launch]]:
    """Every launch of a forward and of a backward of ``strategy`` at ``shape`` (B, H, N, M, K,
    D) for inputs of ``dtype``, masked or not: {"forward": [...], "backward": [...]}. The
    memory strategies walk the chunks their launchers plan on a device of ``memory`` bytes,
    with ``floyd_config.CHUNK_BUDGET_BYTES`` in place of its budget when set and ``override``."""
    small = config.small_grid(*shape[2:5])

    def budget(problem: int) -> int:
        return (config.chunk_budget if override else config.device_budget)(memory, problem, small)

    return STRATEGIES[strategy](*shape, dtype, masked, budget)


def roofline(strategy: str, shape: Shape, dtype: torch.dtype, masked: bool = False, device: Device = H100,
             override: bool = True) -> Estimate:
    """The forward + backward of ``strategy`` at ``shape`` on ``device``: bytes, FLOP, launches
    and the roofline time, the largest of its four terms (named in ``bound``)."""
    every = [launch for direction in launches(strategy, shape, dtype, masked, device.memory, override).values()
             for launch in direction]
    hbm = sum(launch.distinct for launch in every)
    l2 = sum(launch.issued for launch in every)
    mma = sum(launch.mma for launch in every)
    fma = sum(launch.fma for launch in every)
    terms = {"HBM": hbm / device.hbm, "L2": l2 / device.l2, "FLOP": mma / device.mma + fma / device.fma,
             "launches": len(every) * device.launch}
    bound = max(terms, key=terms.get)
    return Estimate(strategy, hbm, l2, mma, fma, len(every), terms[bound], bound)
