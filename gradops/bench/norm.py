"""``gradops bench norm``: LayerNorm and RMSNorm, forward and backward, against PyTorch.

For every (operator, dtype, width) case the implementations run side by side in this
process on the same inputs:

* ``gradops``: the public API (``gradops.rms_norm_grad`` etc.) with ``backend="triton"`` on
  a GPU and ``backend="reference"`` on a CPU (our CPU path against PyTorch's);
* ``torch autograd``: the backward of ``F.layer_norm`` / ``F.rms_norm`` through autograd
  (backward only: the graph is built once, outside the timing);
* ``aten bwd``: the ATen backward alone (``native_layer_norm_backward``;
  ``_fused_rms_norm_backward`` where this build has it, else the eager formula, named
  ``eager formula``);
* ``torch.compile``: the same backward formula compiled by Inductor;
* ``liger``: Liger-Kernel's Triton kernels, when ``liger_kernel`` imports (GPU only).

Bytes follow ../shared/spec/PERFORMANCE.md: backward ``3*M*N*e + 2*N*w_e``, forward
``2*M*N*e``. Writes a table (stdout), a JSON file and a PNG (GB/s against width).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import harness
from .harness import OURS, RESULTS_DIR, Run

OPS = ("rms_bwd", "ln_bwd", "rms_fwd", "ln_fwd")
PEERS = ("autograd", "aten", "compile", "liger")
GPU_WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
GPU_ROWS = 32768
GPU_MAX_NUMEL = 128 * 2**20  # M*N capped at 128M elements (issue 4's sweep)
QUICK_WIDTHS = (256, 1024, 4096)
QUICK_NUMEL = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
EPS_LN, EPS_RMS = 1e-5, 1e-6


def bytes_moved(op: str, m: int, n: int, dtype: torch.dtype, wdtype: torch.dtype) -> float:
    e = torch.empty((), dtype=dtype).element_size()
    we = torch.empty((), dtype=wdtype).element_size()
    if op.endswith("_bwd"):
        return 3.0 * m * n * e + 2.0 * n * we
    return 2.0 * m * n * e


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm

        return liger_layer_norm, liger_rms_norm
    except Exception:
        return None


def _rms_backward_formula(dy, x, rstd, w):
    # The eager math of RMSNorm's backward (what torch.compile fuses), float32 accumulation.
    xf, dyf = x.float(), dy.float()
    r = rstd.float().unsqueeze(1)
    g = dyf * w.float()
    c = (g * xf).mean(dim=1, keepdim=True)
    dx = r * g - r.pow(3) * xf * c
    return dx.to(x.dtype), (dyf * xf * r).sum(dim=0)


def _ln_backward_formula(dy, x, mean, rstd, w):
    xf, dyf = x.float(), dy.float()
    xhat = (xf - mean.float().unsqueeze(1)) * rstd.float().unsqueeze(1)
    g = dyf * w.float()
    dx = rstd.float().unsqueeze(1) * (g - g.mean(dim=1, keepdim=True) - xhat * (g * xhat).mean(dim=1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(dim=0), dyf.sum(dim=0)


def _autograd_backward(forward: Callable, inputs: List[torch.Tensor], dy: torch.Tensor) -> Callable:
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = forward(*leaves)
    return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)


def _compiled(fn: Callable) -> Optional[Callable]:
    """``fn`` compiled for static shapes. Every case is a new shape of the same function, and
    past Dynamo's recompile limit (8 by default) it would silently run eager code under the
    name torch.compile: the limits are raised for the sweep."""
    try:
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 1024))
        if hasattr(dynamo_config, "accumulated_recompile_limit"):
            dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
        return torch.compile(fn, dynamic=False)
    except Exception:
        return None


def implementations(op: str, x, dy, w, b, backend: str, peers, device: str) -> Dict[str, Callable]:
    """name -> zero-argument callable, ours first; a peer that cannot be built is left out
    (one that fails while running is recorded as an error by the harness)."""
    import gradops

    m, n = x.shape
    impls: Dict[str, Callable] = {}
    liger = _liger() if ("liger" in peers and device.startswith("cuda")) else None
    if op == "rms_fwd":
        impls[OURS] = lambda: gradops.rms_norm(x, w, EPS_RMS, backend=backend)
        if "autograd" in peers or "aten" in peers:
            impls["torch eager"] = lambda: F.rms_norm(x, (n,), w, EPS_RMS)
        if "compile" in peers:
            fn = _compiled(lambda a, g: F.rms_norm(a, (n,), g, EPS_RMS))
            if fn:
                impls["torch.compile"] = lambda: fn(x, w)
        if liger:
            impls["liger"] = lambda: liger[1](x, w, EPS_RMS)
    elif op == "ln_fwd":
        impls[OURS] = lambda: gradops.layer_norm(x, (n,), w, b, EPS_LN, backend=backend)
        if "autograd" in peers or "aten" in peers:
            impls["torch eager"] = lambda: F.layer_norm(x, (n,), w, b, EPS_LN)
        if "compile" in peers:
            fn = _compiled(lambda a, g, c: F.layer_norm(a, (n,), g, c, EPS_LN))
            if fn:
                impls["torch.compile"] = lambda: fn(x, w, b)
        if liger:
            impls["liger"] = lambda: liger[0](x, w, b, EPS_LN)
    elif op == "rms_bwd":
        _, rstd = gradops.rms_norm(x, w, EPS_RMS, backend="reference")
        rstd_rows = rstd.reshape(m)
        impls[OURS] = lambda: gradops.rms_norm_grad(dy, x, rstd, w, backend=backend)
        if "autograd" in peers:
            impls["torch autograd"] = _autograd_backward(lambda a, g: F.rms_norm(a, (n,), g, EPS_RMS), [x, w], dy)
        if "aten" in peers:
            fused = getattr(torch.ops.aten, "_fused_rms_norm_backward", None)
            aten_ok = False
            if fused is not None:
                try:
                    fused(dy[:1], x[:1], [n], rstd[:1], w, [True, True])
                    aten_ok = True
                except Exception:  # e.g. no CPU kernel in this build
                    pass
            if aten_ok:
                impls["aten bwd"] = lambda: fused(dy, x, [n], rstd, w, [True, True])
            else:
                impls["eager formula"] = lambda: _rms_backward_formula(dy, x, rstd_rows, w)
        if "compile" in peers:
            fn = _compiled(_rms_backward_formula)
            if fn:
                impls["torch.compile"] = lambda: fn(dy, x, rstd_rows, w)
        if liger:
            # a copy of dy: Liger's backward may write dx into its grad_output
            impls["liger"] = _autograd_backward(lambda a, g: liger[1](a, g, EPS_RMS), [x, w], dy.clone())
    elif op == "ln_bwd":
        # our statistics are float32 (ATen's CPU kernel keeps them in the input dtype)
        _, mean, rstd = gradops.layer_norm(x, (n,), w, b, EPS_LN, backend="reference")
        mean_rows, rstd_rows = mean.reshape(m), rstd.reshape(m)
        _, mean_aten, rstd_aten = torch.ops.aten.native_layer_norm(x, [n], w, b, EPS_LN)
        impls[OURS] = lambda: gradops.layer_norm_backward(dy, x, (n,), mean, rstd, w, b, backend=backend)
        if "autograd" in peers:
            impls["torch autograd"] = _autograd_backward(lambda a, g, c: F.layer_norm(a, (n,), g, c, EPS_LN),
                                                         [x, w, b], dy)
        if "aten" in peers:
            impls["aten bwd"] = lambda: torch.ops.aten.native_layer_norm_backward(
                dy, x, [n], mean_aten, rstd_aten, w, b, [True, True, True])
        if "compile" in peers:
            fn = _compiled(_ln_backward_formula)
            if fn:
                impls["torch.compile"] = lambda: fn(dy, x, mean_rows, rstd_rows, w)
        if liger:
            impls["liger"] = _autograd_backward(lambda a, g, c: liger[0](a, g, c, EPS_LN), [x, w, b], dy.clone())
    else:
        raise ValueError(op)
    return impls


def check_against_reference(ours: Callable, reference: Callable, dtype: torch.dtype) -> float:
    """Largest relative error of our outputs against the reference backend's on this case (a
    sanity check at benchmark sizes; the tests are the real check). Raises when it exceeds
    the input dtype's tolerance; the caller records that as the case's error."""
    from ..oracles import TOLERANCE, rel_error

    worst = 0.0
    for got, want in zip(ours(), reference()):
        if got is None or want is None:
            continue
        worst = max(worst, rel_error(got, want))
    if not worst <= TOLERANCE[dtype]:
        raise AssertionError(f"gradops differs from the reference: relative error {worst:.3e}")
    return worst


def _cases(args, device: str):
    gpu = device.startswith("cuda")
    widths = args.widths or (QUICK_WIDTHS if args.quick else (GPU_WIDTHS if gpu else QUICK_WIDTHS))
    max_numel = args.numel or (QUICK_NUMEL if (args.quick or not gpu) else GPU_MAX_NUMEL)
    rows_cap = args.rows or (GPU_ROWS if gpu else 2**20)
    dtypes = args.dtypes or (["bf16", "fp32"] if gpu else ["fp32", "bf16"])
    cases = []
    for op in args.ops:
        for dt in dtypes:
            for n in widths:
                m = max(1, min(rows_cap, max_numel // n))
                cases.append((op, dt, m, n))
    return cases


def run(args) -> Run:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.backend or ("triton" if device.startswith("cuda") else "reference")
    peers = set(args.peers)
    result = Run("norm", device)
    result.meta["backend_ours"] = backend
    result.meta["peers"] = sorted(peers)
    result.meta["liger"] = _liger() is not None
    measure_kw = dict(reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds)
    for op, dt, m, n in harness.progress(_cases(args, device), "bench norm"):
        dtype = DTYPES[dt]
        wdtype = dtype
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn((m, n), generator=gen).to(device=device, dtype=dtype)
        dy = torch.randn((m, n), generator=gen).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=wdtype)
        b = (0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=wdtype)
        case = {"dtype": dt, "M": m, "N": n}
        nbytes = bytes_moved(op, m, n, dtype, wdtype)
        try:
            impls = implementations(op, x, dy, w, b, backend, peers, device)
        except Exception as e:  # our own side failing is a result too
            result.add(harness.Record(op, case, OURS, [], nbytes, error=f"{type(e).__name__}: {e}"[:300]))
            continue
        for name, fn in impls.items():
            rec = result.time(op, case, name, fn, bytes=nbytes, **measure_kw)
            if args.check and name == OURS and not rec.error:
                try:
                    rec.extra["rel_error_vs_reference"] = check_against_reference(
                        fn, implementations(op, x, dy, w, b, "reference", set(), device)[OURS], dtype)
                except Exception as e:
                    rec.error = f"{type(e).__name__}: {e}"[:300]
        del x, dy, w, b, impls
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return result


_LONG_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _short_dtype(name: str) -> str:
    return _LONG_NAMES.get(name, name)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench norm", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    # --dtype as in `gradops bench nsa|floyd`; the full torch names are accepted too
    p.add_argument("--dtype", "--dtypes", dest="dtypes", nargs="+", type=_short_dtype, choices=tuple(DTYPES),
                   default=None, help="default: bf16 fp32 on a GPU, fp32 bf16 on a CPU")
    p.add_argument("--widths", nargs="+", type=int, default=None,
                   help=f"row widths N (default on a GPU: {' '.join(map(str, GPU_WIDTHS))})")
    p.add_argument("--rows", type=int, default=None, help=f"rows M at most (default {GPU_ROWS} on a GPU)")
    p.add_argument("--numel", type=int, default=None,
                   help="M*N at most (default 128M on a GPU, 1M on a CPU or with --quick)")
    p.add_argument("--peers", nargs="*", choices=PEERS, default=None,
                   help="peers to time (default: all; --quick leaves out torch.compile)")
    p.add_argument("--backend", choices=("triton", "reference"), default=None,
                   help="our backend (default: triton on a GPU, reference on a CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="small CPU-sized sweep, under a minute")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None, help="time budget per measurement")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=RESULTS_DIR, help="folder for JSON and PNG")
    p.add_argument("--tag", default=None, help="file name stem (default: norm-<device>-<date>)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--check", action="store_true",
                   help="also compare our outputs with the reference backend's on every case")
    p.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)  # handled by gradops.cli
    args = p.parse_args(argv)
    if args.peers is None:
        args.peers = [q for q in PEERS if not (args.quick and q == "compile")]
    if args.reps is None:
        args.reps = 5 if args.quick else 30
    if args.warmup is None:
        args.warmup = 1 if args.quick else 5
    if args.max_seconds is None:
        args.max_seconds = 0.5 if args.quick else 5.0
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    print(result.table())
    stem = args.tag or result.result_stem("norm")
    path = result.write_json(os.path.join(args.out, stem + ".json"))
    print(f"wrote {path}")
    if not args.no_plot:
        png = result.plot(os.path.join(args.out, stem + ".png"), x_key="N", group_keys=("op", "dtype"), panels=True)
        print(f"wrote {png}" if png else "no plot (matplotlib is not installed)")
    return result.exit_status()


if __name__ == "__main__":
    sys.exit(main())
