"""``gradops bench norm``: LayerNorm and RMSNorm, forward and backward, against PyTorch.

For every (operator, dtype, width) case the implementations run side by side in this
process on the same inputs:

* ``gradops``: the public API (``gradops.rms_norm_grad`` etc.) with ``backend="triton"`` on
  a GPU and ``backend="reference"`` on a CPU (our CPU path against PyTorch's);
* ``torch autograd``: the backward of ``F.layer_norm`` / ``F.rms_norm`` through autograd
  (backward only: the graph is built once, outside the timing); for the forwards,
  ``torch eager`` (``F.layer_norm`` / ``F.rms_norm``);
* ``aten bwd``: the ATen backward alone (``native_layer_norm_backward``;
  ``_fused_rms_norm_backward`` where this build has a kernel for the device, else the eager
  formula, named ``eager formula``); for the forwards, ``aten fwd``
  (``native_layer_norm``, ``_fused_rms_norm``);
* ``torch.compile``: the same formula compiled by Inductor;
* ``liger``: Liger-Kernel's Triton kernels, when ``liger_kernel`` imports (GPU only).

``ln_call`` / ``rms_call`` time the cost of a call on tiny tensors (``CALL_SHAPES``):
forward and backward through autograd of ``gradops.nn.functional.layer_norm`` /
``rms_norm`` (our default backend) against the same through ``torch.nn.functional``.

On a CPU without ``--quick`` the defaults are the CPU comparison (docs/benchmarks.md): our
CPU path at M x N = 8192 x 4096 and 2048 x 16384, float32 and bfloat16, forwards,
backwards and the call cost, against ATen, autograd and torch.compile.

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
NORM_OPS = ("rms_bwd", "ln_bwd", "rms_fwd", "ln_fwd", "add_rms_bwd", "add_rms_fwd")
CALL_OPS = ("ln_call", "rms_call")  # forward + backward through nn.functional: the cost of a call
OPS = NORM_OPS + CALL_OPS
PEERS = ("autograd", "aten", "compile", "liger")
GPU_WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
GPU_ROWS = 32768
GPU_MAX_NUMEL = 128 * 2**20  # M*N capped at 128M elements (issue 4's sweep)
QUICK_WIDTHS = (256, 1024, 4096)
QUICK_NUMEL = 2**20
# The CPU comparison (issue 12): M x N = 8192 x 4096 and 2048 x 16384, i.e. M*N = 32M at both widths.
CPU_WIDTHS = (4096, 16384)
CPU_NUMEL = 32 * 2**20
CPU_SHAPES = tuple((CPU_NUMEL // n, n) for n in CPU_WIDTHS)
CPU_OPS = ("rms_bwd", "ln_bwd", "rms_fwd", "ln_fwd") + CALL_OPS
CALL_SHAPES = ((8, 64), (64, 256))
CALL_REPS_SCALE = 20  # the call cases take 20x --reps and --warmup
# the peers our CPU path must not be slower than: ATen and autograd, eager (not torch.compile)
EAGER_PEERS = ("torch autograd", "aten bwd", "eager formula", "torch eager", "aten fwd")
CALL_PEER = "torch.nn.functional"
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
    Goal("small shapes (M*N <= 1M) within 1.3x of the fastest peer", NORM_OPS, "speedup:fastest", 1 / 1.3,
         lambda c: _MN(c) <= 2**20, gpu=None),
    # issue 24: the call as a user makes it, not only its kernels
    Goal("eager time within 1.2x of the CUDA-graph replay of the same call at M*N >= 32M", NORM_OPS,
         "extra:kernel_over_eager", 1 / 1.2, lambda c: _MN(c) >= 32 * 2**20, gpu=None),
    Goal("eager at least ATen's speed at 8192x16384 and 2048x65536", NORM_OPS, "speedup:aten fwd|aten bwd", 1.0,
         lambda c: (c["M"], c["N"]) in ((8192, 16384), (2048, 65536)), gpu=None),
    # on any device: the cost of a call is Python and dispatch, not the kernels
    Goal("nn.functional fwd+bwd on tiny tensors within 1.3x of torch.nn.functional", CALL_OPS,
         f"speedup:{CALL_PEER}", 1 / 1.3, gpu=None, device="any"),
) + tuple(
    # docs/benchmarks.md, "On a CPU": our CPU path is never slower than ATen / autograd eager
    Goal(f"CPU: {what} never slower than ATen/autograd eager at 8192x4096 and 2048x16384", (op,),
         "speedup:" + "|".join(EAGER_PEERS), 1.0, lambda c: (c["M"], c["N"]) in CPU_SHAPES, gpu=None, device="cpu")
    for op, what in (("rms_bwd", "RMSNorm bwd"), ("ln_bwd", "LayerNorm bwd"), ("rms_fwd", "RMSNorm fwd"),
                     ("ln_fwd", "LayerNorm fwd"))
)


def bytes_moved(op: str, m: int, n: int, dtype: torch.dtype, wdtype: torch.dtype) -> Optional[float]:
    if op in CALL_OPS:
        return None  # bound by the cost of the call, not by memory: no GB/s
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
    """The backward alone, through autograd, of a peer's ``forward`` run once here. A forward
    that raises gives a callable that raises the same: timed, it is recorded as that peer's
    error, never as ours (Liger's forward at N = 262144 took gradops' case with it)."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    try:
        out = forward(*leaves)
    except Exception as e:
        error = e

        def failed():
            raise error
        return failed
    return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)


def _forward_backward(forward: Callable, inputs: List[torch.Tensor], dy: torch.Tensor) -> Callable:
    """A training step's use of a norm: the forward call, then autograd's backward through it
    (a new graph every call, as in training)."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    return lambda: torch.autograd.grad(forward(*leaves), leaves, dy)


def _call_implementations(op: str, x, dy, w, b, backend: str, peers) -> Dict[str, Callable]:
    from ..nn import functional as GF

    n = x.shape[-1]
    # the backend named as a user may name it: the call checks it as it checks the default
    kw = {"backend": backend}
    impls: Dict[str, Callable] = {}
    if op == "ln_call":
        impls[OURS] = _forward_backward(lambda a, g, c: GF.layer_norm(a, (n,), g, c, EPS_LN, **kw), [x, w, b], dy)
        if "autograd" in peers:
            impls[CALL_PEER] = _forward_backward(lambda a, g, c: F.layer_norm(a, (n,), g, c, EPS_LN), [x, w, b], dy)
    else:
        impls[OURS] = _forward_backward(lambda a, g: GF.rms_norm(a, (n,), g, EPS_RMS, **kw), [x, w], dy)
        if "autograd" in peers:
            impls[CALL_PEER] = _forward_backward(lambda a, g: F.rms_norm(a, (n,), g, EPS_RMS), [x, w], dy)
    return impls


def _aten_rms_forward(x, w, n: int) -> Optional[Callable]:
    fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
    if fused is None:
        return None
    try:
        fused(x[:1], [n], w, EPS_RMS)
    except Exception:  # no kernel for this device in this build
        return None
    return lambda: fused(x, [n], w, EPS_RMS)


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
    if op in CALL_OPS:
        return _call_implementations(op, x, dy, w, b, backend, peers)
    if op == "rms_fwd":
        impls[OURS] = lambda: gradops.rms_norm(x, w, EPS_RMS, backend=backend)
        if "autograd" in peers or "aten" in peers:
            impls["torch eager"] = lambda: F.rms_norm(x, (n,), w, EPS_RMS)
        aten = _aten_rms_forward(x, w, n) if "aten" in peers else None
        if aten:
            impls["aten fwd"] = aten
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
        if "aten" in peers:
            impls["aten fwd"] = lambda: torch.ops.aten.native_layer_norm(x, [n], w, b, EPS_LN)
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


def parse_shape(text: str) -> tuple:
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected MxN, e.g. 8x64") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: M and N must be >= 1")
    return m, n


def cases(args) -> List[tuple]:
    """(op, dtype, M, N) for every case this run measures."""
    gpu = args.device.startswith("cuda")
    full_cpu = not gpu and not args.quick
    widths = args.widths or (QUICK_WIDTHS if args.quick else (GPU_WIDTHS if gpu else CPU_WIDTHS))
    max_numel = args.numel or (QUICK_NUMEL if args.quick else (GPU_MAX_NUMEL if gpu else CPU_NUMEL))
    rows_cap = args.rows or (GPU_ROWS if gpu else 2**20)
    shapes = [(max(1, min(rows_cap, max_numel // n)), n) for n in widths]
    call_shapes = args.call_shapes or list(CALL_SHAPES)
    ops = args.ops or (CPU_OPS if full_cpu else OPS)
    return [(op, dt, m, n) for op in ops for dt in args.dtypes
            for m, n in (call_shapes if op in CALL_OPS else shapes)]


def impl_names(args) -> List[str]:
    """The implementations a case is measured with (at most; a peer may not apply to every op)."""
    ops = {op for op, _, _, _ in cases(args)}
    names = [OURS]
    if ops - set(CALL_OPS):
        names += [{"autograd": "torch autograd", "aten": "aten bwd", "compile": "torch.compile",
                   "liger": "liger"}[p] for p in args.peers]
    if "autograd" in args.peers and ops & set(CALL_OPS):
        names.append(CALL_PEER)
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
        # a call on tiny tensors takes a fraction of a millisecond, and its time is noisy: many more
        # repetitions (still bounded by --max-seconds), timed on the host (see harness.measure)
        kw = dict(measure_kw, reps=CALL_REPS_SCALE * args.reps, warmup=CALL_REPS_SCALE * args.warmup,
                  wall_clock=True) if op in CALL_OPS else measure_kw
        for name, fn in impls.items():
            rec = result.time(op, case, name, fn, bytes=nbytes, costs=True, **kw)
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
    p.add_argument("--ops", nargs="+", choices=OPS, default=None,
                   help=f"default: all; on a CPU without --quick {' '.join(CPU_OPS)}")
    p.add_argument("--widths", nargs="+", type=int, default=None,
                   help=f"row widths N (default on a GPU: {' '.join(map(str, GPU_WIDTHS))}; on a CPU: "
                        f"{' '.join(map(str, CPU_WIDTHS))}; with --quick: {' '.join(map(str, QUICK_WIDTHS))})")
    p.add_argument("--rows", type=int, default=None, help=f"rows M at most (default {GPU_ROWS} on a GPU)")
    p.add_argument("--numel", type=int, default=None,
                   help="M*N at most (default 128M on a GPU, 32M on a CPU, 1M with --quick)")
    p.add_argument("--call-shapes", nargs="+", type=parse_shape, default=None, metavar="MxN",
                   help=f"shapes of {' and '.join(CALL_OPS)} (default: "
                        f"{' '.join(f'{m}x{n}' for m, n in CALL_SHAPES)})")
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
    args.device = args.device or harness.default_device()
    # a CPU call at the CPU shapes takes 0.1-1 s: fewer repetitions, each measurement within seconds
    reps, warmup, max_seconds = (30, 5, 5.0) if args.device == "cuda" else (7, 2, 4.0)
    return harness.prepare(args, reps=reps, warmup=warmup, max_seconds=max_seconds, quick_reps=5,
                           need_device=need_device, gpu_dtypes=("bfloat16", "float32"),
                           cpu_dtypes=("float32", "bfloat16"))


def main(argv=None) -> int:
    args = prepare(parse_args(sys.argv[1:] if argv is None else list(argv)))
    if args.threads:
        torch.set_num_threads(args.threads)
    harness.announce(args, FAMILY)
    result = run(args)
    harness.finish(result, args, FAMILY, PLOT, GOALS)
    return result.exit_status()


if __name__ == "__main__":
    sys.exit(main())
