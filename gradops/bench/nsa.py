"""Benchmark of NSA compression (``gradops bench nsa``): forward and backward, ours (the
Triton kernels through the public API) against the reference path, ``torch.compile`` of the
reference, and a naive ``unfold`` implementation with autograd, at NSA's training shapes.

Bandwidth is reported against the traffic floor of PERFORMANCE.md: the backward reads x
and dOut once and writes dx once, ``(2*T + C)*N*D*e`` bytes (+ the weight and dweight);
the forward reads x once and writes out, ``(T + C)*N*D*e``.

On CPU only ``--quick`` makes sense (tiny shapes; our kernels run through the Triton
interpreter, so their CPU times say nothing about GPU speed).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Callable, Dict, List, Optional

from .harness import OURS, RESULTS_DIR, Run, progress

# HBM bandwidth of the GPUs PERFORMANCE.md sets goals on, GB/s (nominal, not a copy).
HBM_PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0}

DEFAULT_TOKENS = (32768, 65536, 131072)
DEFAULT_HEADS = (4, 16, 64)
DEFAULT_DIMS = (128, 192)
DEFAULT_BLOCKS = ("32x16", "64x32")  # block_size x stride


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


def naive_grad(dout, x, weight, block_size: int, stride: int, cu: List[int]):
    import torch

    xl = x.detach().requires_grad_()
    wl = weight.detach().requires_grad_()
    out = naive_forward(xl, wl, block_size, stride, cu)
    return torch.autograd.grad(out, (xl, wl), dout)


# ---------------------------------------------------------------------------------------


def _peak_gbps(run: Run) -> Optional[float]:
    name = str(run.meta.get("device_name") or "")
    for key, gbps in HBM_PEAK_GBPS.items():
        if key in name:
            return gbps
    return None


def build_impls(op: str, x, weight, dout, block_size: int, stride: int, cu: List[int],
                peers: List[str], device: str) -> Dict[str, Callable[[], object]]:
    import gradops
    from gradops.reference import nsa_compress as reference

    ends = cu[1:]
    num_blocks = count_blocks(cu, block_size, stride)
    impls: Dict[str, Callable[[], object]] = {}
    if op == "nsa_compress":
        impls[OURS] = lambda: gradops.nsa_compress(x, weight, block_size, stride, ends, backend="triton")
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
                                                        backend="triton")
        if "reference" in peers:
            impls["reference"] = lambda: gradops.nsa_compress_grad(dout, x, weight, block_size, stride, ends,
                                                                  backend="reference")
        if "compile" in peers:
            import torch

            compiled = torch.compile(reference.nsa_compress_grad, dynamic=False)
            impls["torch.compile(reference)"] = lambda: compiled(dout, x, weight, block_size, stride, cu,
                                                                 num_blocks)
        if "naive" in peers:
            impls["naive unfold (autograd)"] = lambda: naive_grad(dout, x, weight, block_size, stride, cu)
    return impls


def traffic_bytes(op: str, tokens: int, blocks: int, heads: int, head_dim: int, block_size: int,
                  elem: int) -> float:
    rows = 2 * tokens + blocks if op == "nsa_compress_grad" else tokens + blocks
    weights = 2 * block_size * heads if op == "nsa_compress_grad" else block_size * heads
    return float(rows * heads * head_dim * elem + weights * elem)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench nsa", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, few repetitions: a smoke run (under a minute on CPU)")
    p.add_argument("--interpret", action="store_true",
                   help="on CPU, run our kernels through the Triton interpreter (implied by --quick)")
    p.add_argument("--tokens", type=int, nargs="+", help=f"T values (default {DEFAULT_TOKENS})")
    p.add_argument("--heads", type=int, nargs="+", help=f"N values (default {DEFAULT_HEADS})")
    p.add_argument("--dims", type=int, nargs="+", help=f"D values (default {DEFAULT_DIMS})")
    p.add_argument("--blocks", nargs="+", help=f"block_size x stride pairs (default {' '.join(DEFAULT_BLOCKS)})")
    p.add_argument("--seqlen", type=int, default=8192, help="mean packed sequence length (default 8192)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--ops", nargs="+", default=["nsa_compress_grad", "nsa_compress"],
                   choices=["nsa_compress_grad", "nsa_compress"])
    p.add_argument("--peers", nargs="+", default=["reference", "compile", "naive"],
                   choices=["reference", "compile", "naive"])
    p.add_argument("--reps", type=int, help="timed repetitions per implementation (default 30, quick 3)")
    p.add_argument("--json", help="write the results JSON here (default on CUDA: "
                                  "benchmarks/results/nsa-<gpu>-<date>.json; on CPU: none)")
    p.add_argument("--plot", help="write a PNG of GB/s against T here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and (args.quick or args.interpret) and "triton" not in sys.modules:
        # Triton reads this when first imported; nothing has imported it yet.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gradops bench nsa: --device cuda but no GPU is visible", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    if args.quick:
        tokens = args.tokens or ([4096] if device == "cuda" else [192])
        heads = args.heads or ([4] if device == "cuda" else [2])
        dims = args.dims or ([128] if device == "cuda" else [16])
        blocks = args.blocks or ["32x16"]
        seqlen = min(args.seqlen, 100 if device == "cpu" else 1024)
        reps, warmup = args.reps or 3, 1
    else:
        if device == "cpu":
            print("gradops bench nsa: the full shapes are meant for a GPU; on CPU use --quick",
                  file=sys.stderr)
        tokens = args.tokens or list(DEFAULT_TOKENS)
        heads = args.heads or list(DEFAULT_HEADS)
        dims = args.dims or list(DEFAULT_DIMS)
        blocks = args.blocks or list(DEFAULT_BLOCKS)
        seqlen = args.seqlen
        reps, warmup = args.reps or 30, 3
    pairs = []
    for spec in blocks:
        l, s = (int(v) for v in spec.lower().split("x"))
        pairs.append((l, s))

    run = Run("nsa_compress", device)
    peak = _peak_gbps(run)
    elem = torch.empty((), dtype=dtype).element_size()
    cases = [(t, n, d, l, s, op) for t in tokens for n in heads for d in dims for (l, s) in pairs
             for op in args.ops]
    for t, n, d, l, s, op in progress(cases, "nsa"):
        torch.manual_seed(0)
        cu = cumulative(sequence_lengths(t, seqlen))
        c = count_blocks(cu, l, s)
        x = torch.randn(t, n, d, device=device, dtype=dtype)
        weight = torch.randn(l, n, device=device, dtype=dtype)
        dout = torch.randn(c, n, d, device=device, dtype=dtype)
        case = {"T": t, "N": n, "D": d, "block": l, "stride": s, "seqs": len(cu) - 1,
                "dtype": args.dtype}
        nbytes = traffic_bytes(op, t, c, n, d, l, elem)
        impls = build_impls(op, x, weight, dout, l, s, cu, args.peers, device)
        for name, fn in impls.items():
            rec = run.time(op, case, name, fn, bytes=nbytes, warmup=warmup, reps=reps,
                           max_seconds=3.0 if args.quick else 10.0)
            if peak is not None and rec.gbps is not None:
                rec.extra["fraction_of_hbm_peak"] = rec.gbps / peak
            if device == "cpu" and name == OURS:
                rec.extra["note"] = "Triton interpreter: says nothing about GPU speed"
        del x, weight, dout
        if device == "cuda":
            torch.cuda.empty_cache()

    print(run.table())
    if peak is not None:
        print(f"\nours against the {peak:.0f} GB/s HBM peak of {run.meta.get('device_name')}:")
        for r in run.records:
            if r.impl == OURS and r.gbps is not None:
                case = ",".join(f"{k}={v}" for k, v in r.case.items())
                print(f"  {r.op:<18} {case:<60} {r.gbps:8.1f} GB/s  {100 * r.gbps / peak:5.1f} %")
    path = args.json
    if path is None and device == "cuda" and not args.quick:
        path = os.path.join(RESULTS_DIR, run.result_stem("nsa") + ".json")
    if path:
        print(f"\nresults: {run.write_json(path)}")
    if args.plot:
        written = run.plot(args.plot, "T", "gbps", group_keys=("op", "N", "D"))
        print(f"plot: {written}" if written else "plot: matplotlib is not installed")
    return run.exit_status()


if __name__ == "__main__":
    sys.exit(main())
