"""Benchmark of NSA compression (``gradops bench nsa``): forward and backward, ours (the
Triton kernels through the public API on a GPU, our CPU path on a CPU) against the reference
path, autograd of the reference's forward formula, ``torch.compile`` of the reference, and a
naive ``unfold`` implementation with autograd, at NSA's training shapes.

The autograd peers time the backward alone: their graph is built once, outside the timing,
as ours is fed with the forward's inputs. Bandwidth is reported against the traffic floor of
docs/benchmarks.md: the backward reads x and dOut once and writes dx once,
``(2*T + C)*N*D*e`` bytes (+ the weight and dweight); the forward reads x once and writes
out, ``(T + C)*N*D*e``.

On a CPU without ``--quick`` ours is our CPU path (the reference backend), compared at a
CPU-sized shape (T = 16K, N = 8, D = 128, block 32, stride 16; float32 and bfloat16) with
autograd on the same formula, the naive formula under autograd and torch.compile.
``--quick`` on a CPU runs tiny shapes with our kernels through the Triton interpreter
(implied there): a wiring check, whose times say nothing about GPU speed.
"""
from __future__ import annotations

import argparse
import random
import sys
from typing import Callable, Dict, List, Optional

from . import harness
from .harness import DTYPES, OURS, Goal, Run, progress

FAMILY = "nsa"
DEFAULT_TOKENS = (32768, 65536, 131072)
DEFAULT_HEADS = (4, 16, 64)
DEFAULT_DIMS = (128, 192)
DEFAULT_BLOCKS = ("32x16", "64x32")  # block_size x stride
# The CPU comparison: a call of our CPU path takes tens of milliseconds, the peers' up to a second.
CPU_TOKENS = (16384,)
CPU_HEADS = (8,)
CPU_DIMS = (128,)
CPU_BLOCKS = ("32x16",)
OPS = ("nsa_compress_grad", "nsa_compress")
PEERS = ("reference", "autograd", "compile", "naive")
PEER_NAMES = {"reference": "reference", "autograd": "autograd(reference)", "compile": "torch.compile(reference)",
              "naive": "naive unfold"}
PLOT = dict(x_key="T", metric="gbps", group_keys=("op", "N", "D", "dtype"))
# docs/benchmarks.md: relative to the device's HBM peak, so evaluated on any GPU in the peak table
GOALS = (Goal("NSA compress bwd >= 80 % of peak HBM bandwidth", ("nsa_compress_grad",), "hbm_fraction", 0.8,
              gpu=None),
         # docs/benchmarks.md, "On a CPU": the CPU path at least as fast as autograd on the same formula
         # (the forward against the naive formula's: the reference's forward formula is ours there)
         Goal("CPU: NSA compress bwd at least as fast as autograd on the same formula, fwd as the naive unfold formula", OPS,
              "speedup:autograd(reference)|naive unfold (autograd)|naive unfold", 1.0, gpu=None, device="cpu"))


def sequence_lengths(total: int, mean: int, seed: int = 0) -> List[int]:
    """Packed variable lengths summing to ``total``: uniform in [mean/2, 3*mean/2], so that
    sequences end in tails that fill no block, as in real packed batches."""
    rng = random.Random(seed)
    lengths, left = [], total
    while left > 0:
        n = min(left, rng.randint(max(1, mean // 2), max(1, 3 * mean // 2)))
        lengths.append(n)
        left -= n
    return lengths


def cumulative(lengths: List[int]) -> List[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def count_blocks(cu: List[int], block_size: int, stride: int) -> int:
    return sum((b - a - block_size) // stride + 1 for a, b in zip(cu[:-1], cu[1:]) if b - a >= block_size)


# ---------------------------------------------------------------------------------------
# The naive peer: what one writes first in PyTorch, one unfold per sequence, autograd


def naive_forward(x, weight, block_size: int, stride: int, cu: List[int]):
    import torch

    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        if b - a >= block_size:
            windows = x[a:b].unfold(0, block_size, stride)  # [n_b, N, D, l], a view
            outs.append(torch.einsum("cndj,jn->cnd", windows.float(), weight.float()).to(x.dtype))
    if not outs:
        return x.new_zeros((0,) + tuple(x.shape[1:]))
    return torch.cat(outs)


def autograd_backward(forward: Callable, dout, x, weight) -> Callable[[], object]:
    """The backward alone of ``forward(x, weight)`` under autograd: the graph is built once
    here, and each call runs autograd's backward through it."""
    import torch

    xl = x.detach().requires_grad_()
    wl = weight.detach().requires_grad_()
    out = forward(xl, wl)
    return lambda: torch.autograd.grad(out, (xl, wl), dout, retain_graph=True)


# ---------------------------------------------------------------------------------------


def build_impls(op: str, x, weight, dout, block_size: int, stride: int, cu: List[int],
                peers: List[str], device: str, backend: str = "triton") -> Dict[str, Callable[[], object]]:
    import gradops
    from gradops.reference import nsa_compress as reference

    ends = cu[1:]
    num_blocks = count_blocks(cu, block_size, stride)
    impls: Dict[str, Callable[[], object]] = {}
    if op == "nsa_compress":
        impls[OURS] = lambda: gradops.nsa_compress(x, weight, block_size, stride, ends, backend=backend)
        if "reference" in peers:
            impls["reference"] = lambda: gradops.nsa_compress(x, weight, block_size, stride, ends,
                                                             backend="reference")
        if "compile" in peers:
            import torch

            compiled = torch.compile(reference.nsa_compress, dynamic=False)
            impls["torch.compile(reference)"] = lambda: compiled(x, weight, block_size, stride, cu, num_blocks)
        if "naive" in peers:
            impls["naive unfold"] = lambda: naive_forward(x, weight, block_size, stride, cu)
    else:
        impls[OURS] = lambda: gradops.nsa_compress_grad(dout, x, weight, block_size, stride, ends,
                                                        backend=backend)
        if "reference" in peers:
            impls["reference"] = lambda: gradops.nsa_compress_grad(dout, x, weight, block_size, stride, ends,
                                                                  backend="reference")
        if "autograd" in peers:
            impls["autograd(reference)"] = autograd_backward(
                lambda a, w: reference.nsa_compress(a, w, block_size, stride, cu, num_blocks), dout, x, weight)
        if "compile" in peers:
            import torch

            compiled = torch.compile(reference.nsa_compress_grad, dynamic=False)
            impls["torch.compile(reference)"] = lambda: compiled(dout, x, weight, block_size, stride, cu,
                                                                 num_blocks)
        if "naive" in peers:
            impls["naive unfold (autograd)"] = autograd_backward(
                lambda a, w: naive_forward(a, w, block_size, stride, cu), dout, x, weight)
    return impls


def traffic_bytes(op: str, tokens: int, blocks: int, heads: int, head_dim: int, block_size: int,
                  elem: int) -> float:
    rows = 2 * tokens + blocks if op == "nsa_compress_grad" else tokens + blocks
    weights = 2 * block_size * heads if op == "nsa_compress_grad" else block_size * heads
    return float(rows * heads * head_dim * elem + weights * elem)


def optional_peers(device: str) -> Dict[str, Optional[str]]:
    return {}  # every peer here is PyTorch


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench nsa", description=__doc__.split("\n\n")[0])
    harness.add_common_args(p, dtypes=("bfloat16", "float16", "float32"), dtype_help="default: bfloat16")
    p.add_argument("--tokens", type=int, nargs="+",
                   help=f"T values (default {DEFAULT_TOKENS} on a GPU, {CPU_TOKENS} on a CPU)")
    p.add_argument("--heads", type=int, nargs="+", help=f"N values (default {DEFAULT_HEADS}, {CPU_HEADS} on a CPU)")
    p.add_argument("--dims", type=int, nargs="+", help=f"D values (default {DEFAULT_DIMS}, {CPU_DIMS} on a CPU)")
    p.add_argument("--blocks", nargs="+", help=f"block_size x stride pairs (default {' '.join(DEFAULT_BLOCKS)}; "
                                                f"{' '.join(CPU_BLOCKS)} on a CPU)")
    p.add_argument("--seqlen", type=int, default=8192, help="mean packed sequence length (default 8192)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--peers", nargs="+", default=None, choices=PEERS,
                   help="default: all; --quick leaves out torch.compile, and on a CPU without --interpret "
                        "the reference is ours")
    return p.parse_args(argv)


def prepare(args, need_device: bool = True):
    args.device = args.device or harness.default_device()
    cpu = args.device == "cpu"
    if args.quick and cpu:
        args.interpret = True  # --quick on a CPU runs our kernels, through the interpreter
    if args.peers is None:
        args.peers = [q for q in PEERS if not (args.quick and q == "compile")
                      and not (cpu and not args.interpret and q == "reference")]
    # the CPU comparison: calls of tens of milliseconds to a second, fewer repetitions
    reps, warmup, max_seconds = (7, 2, 4.0) if cpu else (30, 3, 10.0)
    return harness.prepare(args, reps=reps, warmup=warmup, max_seconds=max_seconds, quick_reps=3,
                           quick_max_seconds=3.0, need_device=need_device, gpu_dtypes=("bfloat16",),
                           cpu_dtypes=("bfloat16",) if args.quick else ("float32", "bfloat16"))


def cases(args) -> List[tuple]:
    """(T, N, D, block_size, stride, dtype, op) for every case this run measures."""
    gpu = args.device == "cuda"
    if args.quick:
        tokens = args.tokens or ([4096] if gpu else [192])
        heads = args.heads or ([4] if gpu else [2])
        dims = args.dims or ([128] if gpu else [16])
        blocks = args.blocks or ["32x16"]
    else:
        tokens = args.tokens or list(DEFAULT_TOKENS if gpu else CPU_TOKENS)
        heads = args.heads or list(DEFAULT_HEADS if gpu else CPU_HEADS)
        dims = args.dims or list(DEFAULT_DIMS if gpu else CPU_DIMS)
        blocks = args.blocks or list(DEFAULT_BLOCKS if gpu else CPU_BLOCKS)
    pairs = [tuple(int(v) for v in spec.lower().split("x")) for spec in blocks]
    return [(t, n, d, l, s, dt, op) for dt in args.dtypes for t in tokens for n in heads
            for d in dims for (l, s) in pairs for op in args.ops]


def impl_names(args) -> List[str]:
    return [OURS] + [PEER_NAMES[p] for p in args.peers]


def run(args) -> Run:
    """Measure every case of ``args`` (parsed by :func:`parse_args`, resolved by ``prepare``)."""
    import torch

    device = args.device
    backend = harness.ours_backend(args)
    seqlen = min(args.seqlen, 1024 if device == "cuda" else 100) if args.quick else args.seqlen
    bench = Run("nsa_compress", device, args.deadline)
    bench.meta["backend_ours"] = backend
    peak = harness.hbm_peak_gbps(str(bench.meta.get("device_name") or ""))
    for t, n, d, l, s, dt, op in progress(cases(args), "nsa"):
        case = {"T": t, "N": n, "D": d, "block": l, "stride": s, "dtype": dt}
        if bench.out_of_time():
            bench.skip([op], case)
            continue
        dtype = DTYPES[dt]
        torch.manual_seed(0)
        cu = cumulative(sequence_lengths(t, seqlen))
        c = count_blocks(cu, l, s)
        case["seqs"] = len(cu) - 1
        x = torch.randn(t, n, d, device=device, dtype=dtype)
        weight = torch.randn(l, n, device=device, dtype=dtype)
        dout = torch.randn(c, n, d, device=device, dtype=dtype)
        nbytes = traffic_bytes(op, t, c, n, d, l, dtype.itemsize)
        impls = build_impls(op, x, weight, dout, l, s, cu, args.peers, device, backend)
        for name, fn in impls.items():
            rec = bench.time(op, case, name, fn, bytes=nbytes, costs=True, warmup=args.warmup, reps=args.reps,
                             max_seconds=args.max_seconds)
            if peak is not None and rec.gbps is not None:
                rec.extra["fraction_of_hbm_peak"] = rec.gbps / peak
        del x, weight, dout
        if device == "cuda":
            torch.cuda.empty_cache()
    if peak is not None:
        print(f"\nours against the {peak:.0f} GB/s HBM peak of {bench.meta.get('device_name')}:")
        for r in bench.records:
            if r.impl == OURS and r.gbps is not None:
                case = ",".join(f"{k}={v}" for k, v in r.case.items())
                print(f"  {r.op:<18} {case:<60} {r.gbps:8.1f} GB/s  {100 * r.gbps / peak:5.1f} %")
    return bench


def main(argv=None) -> int:
    args = prepare(parse_args(sys.argv[1:] if argv is None else list(argv)))
    harness.announce(args, FAMILY)
    bench = run(args)
    harness.finish(bench, args, FAMILY, PLOT, GOALS)
    return bench.exit_status()


if __name__ == "__main__":
    sys.exit(main())
