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

``add_rms_fwd`` / ``add_rms_bwd`` time the pre-norm residual add fused into RMSNorm (Llama's
casting): ours through the ops layer (``residual`` / ``dresidual``), against torch's
separate add and norm (eager, autograd, compiled) and Liger's ``liger_fused_add_rms_norm``.

On a CPU ours is the reference backend (our CPU path), or with ``--interpret`` the Triton
kernels through the interpreter. Bytes follow docs/benchmarks.md: backward
``3*M*N*e + 2*N*w_e``, forward ``2*M*N*e``; with the residual add, backward
``4*M*N*e + 2*N*w_e`` (dy, h and h's gradient in, dx out), forward ``4*M*N*e`` (x and the
residual in, h and y out). Writes a table (stdout), a JSON file and a PNG
(GB/s against width).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import harness
from .harness import DTYPES, OURS, Goal, Run

FAMILY = "norm"
OPS = ("rms_bwd", "ln_bwd", "rms_fwd", "ln_fwd", "add_rms_bwd", "add_rms_fwd")
PEERS = ("autograd", "aten", "compile", "liger")
GPU_WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
GPU_ROWS = 32768
GPU_MAX_NUMEL = 128 * 2**20  # M*N capped at 128M elements (issue 4's sweep)
QUICK_WIDTHS = (256, 1024, 4096)
QUICK_NUMEL = 2**20
EPS_LN, EPS_RMS = 1e-5, 1e-6
PLOT = dict(x_key="N", metric="gbps", group_keys=("op", "dtype"), panels=True)

_MN = lambda c: c["M"] * c["N"]  # noqa: E731
# The goals for the norms (docs/benchmarks.md; H100 unless gpu=None: relative goals hold anywhere).
GOALS = (
    Goal("RMSNorm bwd >= 2.9 TB/s bf16 at M*N >= 32M, N in 1K..64K", ("rms_bwd",), "gbps", 2900.0,
         lambda c: c["dtype"] == "bfloat16" and _MN(c) >= 32 * 2**20 and 1024 <= c["N"] <= 65536),
    Goal("RMSNorm bwd >= 2 TB/s bf16 for N in 64K..256K", ("rms_bwd",), "gbps", 2000.0,
         lambda c: c["dtype"] == "bfloat16" and 65536 < c["N"] <= 262144),
    Goal("RMSNorm bwd >= 2x torch.compile at 32K x 4096", ("rms_bwd",), "speedup:torch.compile", 2.0,
         lambda c: c["M"] == 32768 and c["N"] == 4096, gpu=None),
    Goal("LayerNorm bwd >= 2.8 TB/s bf16 and fp32 at M*N >= 16M, N in 1K..64K", ("ln_bwd",), "gbps", 2800.0,
         lambda c: c["dtype"] in ("bfloat16", "float32") and _MN(c) >= 16 * 2**20 and 1024 <= c["N"] <= 65536),
    Goal("LayerNorm bwd >= 2x ATen at M*N >= 16M, N in 1K..64K", ("ln_bwd",), "speedup:aten bwd", 2.0,
         lambda c: _MN(c) >= 16 * 2**20 and 1024 <= c["N"] <= 65536, gpu=None),
    Goal("norm forwards >= 3.0 TB/s at M*N >= 16M", ("rms_fwd", "ln_fwd"), "gbps", 3000.0,
         lambda c: _MN(c) >= 16 * 2**20),
    Goal("small shapes (M*N <= 1M) within 1.3x of the fastest peer", OPS, "speedup:fastest", 1 / 1.3,
         lambda c: _MN(c) <= 2**20, gpu=None),
)


def bytes_moved(op: str, m: int, n: int, dtype: torch.dtype, wdtype: torch.dtype) -> float:
    e = torch.empty((), dtype=dtype).element_size()
    we = torch.empty((), dtype=wdtype).element_size()
    streams = 4.0 if op.startswith("add_") else (3.0 if op.endswith("_bwd") else 2.0)
    return streams * m * n * e + (2.0 * n * we if op.endswith("_bwd") else 0.0)


def _liger():
    try:
        from liger_kernel.transformers.functional import (
            liger_fused_add_rms_norm,
            liger_layer_norm,
            liger_rms_norm,
        )

        return liger_layer_norm, liger_rms_norm, liger_fused_add_rms_norm
    except Exception:
        return None


def optional_peers(device: str) -> Dict[str, Optional[str]]:
    """Peers that need a package or a device: name -> None when usable here, else why not."""
    try:
        from liger_kernel.transformers.functional import liger_layer_norm  # noqa: F401
        why = None if device == "cuda" else "GPU only"
    except Exception as e:
        why = f"not importable ({type(e).__name__}: {e})"[:200]
    return {"liger": why}


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


def _add_rms_formula(x, r, w):
    # what an unfused pre-norm block does: the add, then the norm (Llama's rounding)
    h = x + r
    hf = h.float()
    xhat = (hf * torch.rsqrt(hf.square().mean(dim=1, keepdim=True) + EPS_RMS)).to(x.dtype)
    return w * xhat, h


def _add_rms_backward_formula(dy, h, rstd, w, dh):
    # the unfused backward with Llama's rounding: the norm's dx plus h's own gradient, and
    # dgamma against the x-hat rounded to h's dtype
    dx, _ = _rms_backward_formula(dy, h, rstd, w)
    xhat = (h.float() * rstd.float().unsqueeze(1)).to(h.dtype).float()
    return dx + dh, (dy.float() * xhat).sum(dim=0)


def _add_rms_implementations(op: str, x, dy, w, backend: str, peers, liger) -> Dict[str, Callable]:
    from ..ops.rms_norm import prepare_rms_norm, prepare_rms_norm_grad

    r, dh = dy.flip(0), x.flip(0)  # a residual and h's own gradient, as large as x
    impls: Dict[str, Callable] = {}
    if op == "add_rms_fwd":
        impls[OURS] = lambda: prepare_rms_norm(x, w, EPS_RMS, casting_mode="llama", residual=r,
                                               backend=backend).run()
        if "autograd" in peers or "aten" in peers:
            impls["torch eager"] = lambda: _add_rms_formula(x, r, w)
        if "compile" in peers:
            fn = _compiled(_add_rms_formula)
            if fn:
                impls["torch.compile"] = lambda: fn(x, r, w)
        if liger:
            impls["liger"] = lambda: liger[2](x, r, w, EPS_RMS, casting_mode="llama", in_place=False)
        return impls
    _, rstd, h = prepare_rms_norm(x, w, EPS_RMS, casting_mode="llama", residual=r, backend="reference").run()
    impls[OURS] = lambda: prepare_rms_norm_grad(dy, h, rstd, w, casting_mode="llama", dresidual=dh,
                                                backend=backend).run()

    def autograd_of(forward):
        leaves = [t.detach().requires_grad_(True) for t in (x, r, w)]
        outs = forward(*leaves)
        return lambda: torch.autograd.grad(outs, leaves, (dy, dh), retain_graph=True)

    if "autograd" in peers:
        impls["torch autograd"] = autograd_of(_add_rms_formula)
    if "compile" in peers:
        fn = _compiled(_add_rms_backward_formula)
        if fn:
            rstd_rows = rstd.reshape(-1)
            impls["torch.compile"] = lambda: fn(dy, h, rstd_rows, w, dh)
    if liger:
        impls["liger"] = autograd_of(lambda a, c, g: liger[2](a, c, g, EPS_RMS, casting_mode="llama",
                                                                in_place=False))
    return impls


def implementations(op: str, x, dy, w, b, backend: str, peers, device: str) -> Dict[str, Callable]:
    """name -> zero-argument callable, ours first; a peer that cannot be built is left out
    (one that fails while running is recorded as an error by the harness)."""
    import gradops

    m, n = x.shape
    impls: Dict[str, Callable] = {}
    liger = _liger() if ("liger" in peers and device.startswith("cuda")) else None
    if op.startswith("add_"):
        return _add_rms_implementations(op, x, dy, w, backend, peers, liger)
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


def cases(args) -> List[tuple]:
    """(op, dtype, M, N) for every case this run measures."""
    gpu = args.device.startswith("cuda")
    widths = args.widths or (QUICK_WIDTHS if args.quick else (GPU_WIDTHS if gpu else QUICK_WIDTHS))
    max_numel = args.numel or (QUICK_NUMEL if (args.quick or not gpu) else GPU_MAX_NUMEL)
    rows_cap = args.rows or (GPU_ROWS if gpu else 2**20)
    cases = []
    for op in args.ops:
        for dt in args.dtypes:
            for n in widths:
                m = max(1, min(rows_cap, max_numel // n))
                cases.append((op, dt, m, n))
    return cases


def impl_names(args) -> List[str]:
    """The implementations a case is measured with (at most; a peer may not apply to every op)."""
    names = [OURS] + [{"autograd": "torch autograd", "aten": "aten bwd", "compile": "torch.compile",
                       "liger": "liger"}[p] for p in args.peers]
    if optional_peers(args.device)["liger"] is not None and "liger" in names:
        names.remove("liger")
    return names


def run(args) -> Run:
    """Measure every case of ``args`` (parsed by :func:`parse_args`, resolved by ``prepare``)."""
    device = args.device
    backend = args.backend or harness.ours_backend(args)
    peers = set(args.peers)
    result = Run(FAMILY, device, args.deadline)
    result.meta["backend_ours"] = backend
    result.meta["peers"] = sorted(peers)
    result.meta["liger"] = _liger() is not None
    measure_kw = dict(reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds)
    for op, dt, m, n in harness.progress(cases(args), "bench norm"):
        case = {"dtype": dt, "M": m, "N": n}
        if result.out_of_time():
            result.skip([op], case)
            continue
        dtype = DTYPES[dt]
        wdtype = dtype
        # drawn on the device: on a GPU, a CPU generator would spend seconds per 128M-element case
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((m, n), generator=gen, device=device).to(dtype)
        dy = torch.randn((m, n), generator=gen, device=device).to(dtype)
        w = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(wdtype)
        b = (0.1 * torch.randn(n, generator=gen, device=device)).to(wdtype)
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


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench norm", description=__doc__.split("\n\n")[0])
    harness.add_common_args(p, dtype_help="default: bfloat16 float32 on a GPU, float32 bfloat16 on a CPU")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--widths", nargs="+", type=int, default=None,
                   help=f"row widths N (default on a GPU: {' '.join(map(str, GPU_WIDTHS))})")
    p.add_argument("--rows", type=int, default=None, help=f"rows M at most (default {GPU_ROWS} on a GPU)")
    p.add_argument("--numel", type=int, default=None,
                   help="M*N at most (default 128M on a GPU, 1M on a CPU or with --quick)")
    p.add_argument("--peers", nargs="*", choices=PEERS, default=None,
                   help="peers to time (default: all; --quick leaves out torch.compile)")
    p.add_argument("--backend", choices=("triton", "reference"), default=None,
                   help="our backend (default: triton on a GPU or with --interpret, reference on a CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--check", action="store_true",
                   help="also compare our outputs with the reference backend's on every case")
    args = p.parse_args(argv)
    if args.peers is None:
        args.peers = [q for q in PEERS if not (args.quick and q == "compile")]
    return args


def prepare(args, need_device: bool = True):
    return harness.prepare(args, reps=30, warmup=5, max_seconds=5.0, quick_reps=5, need_device=need_device,
                           gpu_dtypes=("bfloat16", "float32"), cpu_dtypes=("float32", "bfloat16"))


def main(argv=None) -> int:
    args = prepare(parse_args(sys.argv[1:] if argv is None else list(argv)))
    if args.threads:
        torch.set_num_threads(args.threads)
    harness.announce(args, FAMILY)
    result = run(args)
    harness.finish(result, args, FAMILY, PLOT)
    return result.exit_status()


if __name__ == "__main__":
    sys.exit(main())
