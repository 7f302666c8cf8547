"""``gradops selftest``: every operator on every backend this machine can run, a few shapes
and dtypes each, against the independent float64 oracles of :mod:`gradops.oracles`.

It also holds the one rule of what runs where, which ``gradops info``, ``gradops selftest``
and ``gradops bench`` all follow: :func:`use_interpreter_on_cpu` (when the Triton
interpreter is on) and :func:`backends_here` (which backends run on a device, and why the
others are skipped).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from . import api, oracles
from ._backend import FAMILIES, available_backends, has_triton_kernels, triton_interpreter_on
from .oracles import TOLERANCE, rel_error

TRITON_INSTALL_HINT = "pip install 'gradops[triton]' / pip install triton"
INTERPRETER_HINT = "it runs on CPU only with TRITON_INTERPRET=1 set before triton is imported"

# ---------------------------------------------------------------------------------------
# What runs here: the rule every `gradops` command follows

_interpreter_set_by_gradops = False


def use_interpreter_on_cpu(device: str) -> None:
    """The rule: a `gradops` command that works on the CPU runs the Triton kernels through
    the Triton interpreter, so it sets TRITON_INTERPRET=1 before anything imports triton
    (Triton reads it once, at import). A TRITON_INTERPRET the user set is left alone
    (TRITON_INTERPRET=0 keeps the kernels off the CPU); on a GPU nothing is set and the
    kernels are compiled. `gradops info` applies the rule for the CPU too, so that it lists
    what `gradops selftest --device cpu` runs."""
    global _interpreter_set_by_gradops
    if device == "cpu" and "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        _interpreter_set_by_gradops = True


@dataclass(frozen=True)
class Availability:
    family: str
    backend: str
    skipped: Optional[str] = None  # why this backend cannot run this family here; None: it runs
    how: str = ""  # how it runs: "compiled" or "Triton interpreter" for triton


def _triton_how(device: str) -> str:
    if device == "cpu":
        return "Triton interpreter"
    # on a GPU the interpreter is on only when the user set TRITON_INTERPRET
    return "Triton interpreter" if triton_interpreter_on() and not _interpreter_set_by_gradops else "compiled"


def _triton_skip_reason(family: str, device: str) -> str:
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "triton":
            return f"triton is not installed ({TRITON_INSTALL_HINT})"
        return f"triton does not import ({e})"
    except Exception as e:  # a broken install is worth naming
        return f"triton does not import ({type(e).__name__}: {e})"
    if not has_triton_kernels(family):
        return f"there are no Triton kernels for {family} yet"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is visible"
    if device == "cpu" and not triton_interpreter_on():
        value = os.environ.get("TRITON_INTERPRET")
        why = (f"TRITON_INTERPRET={value} is set" if value is not None
               else "triton was imported before gradops could switch it on")
        return f"the Triton interpreter is off ({why}; {INTERPRETER_HINT})"
    return "gradops' backend choice does not offer it here"


def backends_here(device: str, selected: Optional[List[str]] = None) -> List[Availability]:
    """Every (family, backend) on ``device``: runs, or skipped with the reason. Call
    :func:`use_interpreter_on_cpu` first (the commands do). ``selected``: the backends asked
    for (None: all); the others are skipped as not selected."""
    dev = torch.device(device)
    plan = []
    for family in FAMILIES:
        usable = available_backends(family, dev)
        for backend in ("reference", "triton"):
            if selected is not None and backend not in selected:
                plan.append(Availability(family, backend, "not selected (--backend)"))
            elif backend in usable:
                plan.append(Availability(family, backend, how=_triton_how(device) if backend == "triton" else ""))
            else:
                plan.append(Availability(family, backend, _triton_skip_reason(family, device)))
    return plan


def _skips(plan: List[Availability]) -> List[Tuple[str, str, List[str]]]:
    """(backend, reason, families) for each distinct skip, in order."""
    out: Dict[Tuple[str, str], List[str]] = {}
    for a in plan:
        if a.skipped is not None:
            out.setdefault((a.backend, a.skipped), []).append(a.family)
    return [(b, r, fams) for (b, r), fams in out.items()]


def describe_backends(plan: List[Availability], device: str) -> List[str]:
    """The lines `gradops info` and `gradops selftest` print for a device."""
    lines = []
    for family in FAMILIES:
        runs = [a.backend + (f" ({a.how})" if a.how else "") for a in plan
                if a.family == family and a.skipped is None]
        lines.append(f"  {family:<16} backends: {', '.join(runs) or 'none'}")
    for backend, reason, families in _skips(plan):
        which = "" if len(families) == len(FAMILIES) else f" for {', '.join(families)}"
        lines.append(f"  {backend}: skipped on {device}{which}: {reason}")
    return lines


def skipped_summary(plan: List[Availability], device: str) -> str:
    """One clause for the summary line: what was skipped and why ('' when nothing was)."""
    parts = []
    for backend, reason, families in _skips(plan):
        which = "" if len(families) == len(FAMILIES) else f" for {', '.join(families)}"
        parts.append(f"{backend} on {device}{which}: {reason}")
    return "skipped: " + "; ".join(parts) if parts else ""


DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Result:
    op: str
    backend: str
    dtype: str
    shape: str
    max_error: float
    tolerance: float
    seconds: float
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.max_error <= self.tolerance


def _rand(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype).to(device)


# Each check builds inputs for (dtype, device), runs the library on `backend` and returns the
# (name, actual, expected) pairs to compare.
Check = Callable[[torch.dtype, str, str], List[Tuple[str, torch.Tensor, torch.Tensor]]]


def _layer_norm(shape, n_norm):
    def check(dtype, device, backend):
        ns = shape[len(shape) - n_norm:]
        x, dy = _rand(shape, dtype, device), _rand(shape, dtype, device)
        w, b = _rand(ns, dtype, device), _rand(ns, dtype, device)
        y, mean, rstd = api.layer_norm(x, ns, w, b, backend=backend)
        dx, dw, db = api.layer_norm_backward(dy, x, ns, mean, rstd, w, b, backend=backend)
        ey, _, erstd = oracles.layer_norm(x, ns, w, b)
        edx, edw, edb = oracles.layer_norm_backward(dy, x, ns, w)
        return [("y", y, ey), ("rstd", rstd, erstd), ("dx", dx, edx), ("dw", dw, edw), ("db", db, edb)]
    return check


def _layer_norm_grad(shape):
    def check(dtype, device, backend):
        x, dy = _rand(shape, dtype, device), _rand(shape, dtype, device)
        gamma = _rand(shape[-1:], dtype, device)
        xd = x.double()
        mean, var = xd.mean(-1), xd.var(-1, unbiased=False)
        # the AscendC kernel's epsilon has type T
        eps = float(torch.tensor(1e-5, dtype=dtype))
        pd_x, res = api.layer_norm_grad(dy, x, var.to(dtype), mean.to(dtype), gamma, eps, backend=backend)
        pd_gamma, pd_beta = api.layer_norm_grad_beta(res, dy, backend=backend)
        # with the true statistics, LayerNormGrad's pd_x is LayerNorm's dx
        edx, _ = oracles.layer_norm_autograd(dy, x, 1, gamma, eps=eps)
        exhat = (xd - mean[..., None]) / torch.sqrt(var[..., None] + eps)
        rows_dy, rows_res = dy.reshape(-1, shape[-1]).double(), res.reshape(-1, shape[-1]).double()
        return [("pd_x", pd_x, edx), ("res_for_gamma", res, exhat),
                ("pd_gamma", pd_gamma, (rows_dy * rows_res).sum(0)), ("pd_beta", pd_beta, rows_dy.sum(0))]
    return check


def _rms_norm(shape):
    def check(dtype, device, backend):
        x, dy = _rand(shape, dtype, device), _rand(shape, dtype, device)
        gamma = _rand(shape[-1:], dtype, device)
        y, rstd = api.rms_norm(x, gamma, backend=backend)
        dx, dgamma = api.rms_norm_grad(dy, x, rstd, gamma, backend=backend)
        ey, erstd = oracles.rms_norm(x, gamma)
        edx, edgamma = oracles.rms_norm_backward(dy, x, gamma)
        return [("y", y, ey), ("rstd", rstd, erstd), ("dx", dx, edx), ("dgamma", dgamma, edgamma)]
    return check


def _nsa(lengths, heads, dim, block, stride):
    def check(dtype, device, backend):
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        x = _rand((ends[-1], heads, dim), dtype, device)
        w = _rand((block, heads), dtype, device, scale=0.5)
        out = api.nsa_compress(x, w, block, stride, ends, backend=backend)
        dout = _rand(tuple(out.shape), dtype, device)
        dx, dw = api.nsa_compress_grad(dout, x, w, block, stride, ends, backend=backend)
        eout = oracles.nsa_compress(x, w, block, stride, ends)
        edx, edw = oracles.nsa_compress_backward(dout, x, w, block, stride, ends)
        return [("out", out, eout), ("dx", dx, edx), ("dweight", dw, edw)]
    return check


def _floyd(b, h, n, m, k, d, masked):
    def check(dtype, device, backend):
        q = _rand((b, h, n, m, d), dtype, device)
        k1, v1 = _rand((b, h, n, k, d), dtype, device), _rand((b, h, n, k, d), dtype, device)
        k2, v2 = _rand((b, h, k, m, d), dtype, device), _rand((b, h, k, m, d), dtype, device)
        mask = None
        if masked:
            mask = torch.rand((b, 1, n, 1, k), generator=torch.Generator().manual_seed(1)) < 0.3
            mask[:, :, 0] = True  # one fully masked row: uniform softmax
            mask = mask.to(device)
        scale = d ** -0.5
        out, smax, ssum = api.floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=backend)
        dy = _rand(tuple(out.shape), dtype, device)
        grads = api.floyd_attention_grad(dy, q, k1, v1, k2, v2, out, smax, ssum, mask, scale, backend=backend)
        eout, emax, esum = oracles.floyd_attention(q, k1, v1, k2, v2, mask, scale)
        egrads = oracles.floyd_attention_backward(dy, q, k1, v1, k2, v2, mask, scale)
        pairs = [("out", out, eout), ("softmax_max", smax, emax), ("softmax_sum", ssum, esum)]
        return pairs + list(zip(("dq", "dk1", "dv1", "dk2", "dv2"), grads, egrads))
    return check


def _floyd3(b, h, i, j, k, p, d, masked):
    def check(dtype, device, backend):
        q = _rand((b, h, i, j, k, d), dtype, device)
        k1, v1 = _rand((b, h, p, j, k, d), dtype, device), _rand((b, h, p, j, k, d), dtype, device)
        k2, v2 = _rand((b, h, i, p, k, d), dtype, device), _rand((b, h, i, p, k, d), dtype, device)
        k3, v3 = _rand((b, h, i, j, p, d), dtype, device), _rand((b, h, i, j, p, d), dtype, device)
        mask = None
        if masked:
            mask = torch.rand((b, 1, i, 1, k, p), generator=torch.Generator().manual_seed(1)) < 0.3
            mask[:, :, 0, :, 0] = True  # fully masked rows: uniform softmax
            mask = mask.to(device)
        scale = (3 * d) ** -0.5
        out, smax, ssum = api.floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale, backend=backend)
        dy = _rand(tuple(out.shape), dtype, device)
        grads = api.floyd3_attention_grad(dy, q, k1, v1, k2, v2, k3, v3, out, smax, ssum, mask, scale,
                                          backend=backend)
        eout, emax, esum = oracles.floyd3_attention(q, k1, v1, k2, v2, k3, v3, mask, scale)
        egrads = oracles.floyd3_attention_backward(dy, q, k1, v1, k2, v2, k3, v3, mask, scale)
        pairs = [("out", out, eout), ("softmax_max", smax, emax), ("softmax_sum", ssum, esum)]
        return pairs + list(zip(("dq", "dk1", "dv1", "dk2", "dv2", "dk3", "dv3"), grads, egrads))
    return check


CASES: Dict[str, List[Tuple[str, str, Check]]] = {
    "layer_norm": [
        ("layer_norm fwd+bwd", "(4, 64)", _layer_norm((4, 64), 1)),
        ("layer_norm fwd+bwd", "(3, 5, 2, 33)", _layer_norm((3, 5, 2, 33), 2)),
        ("layer_norm_grad(+beta)", "(2, 3, 40)", _layer_norm_grad((2, 3, 40))),
    ],
    "rms_norm": [
        ("rms_norm fwd+bwd", "(4, 64)", _rms_norm((4, 64))),
        ("rms_norm fwd+bwd", "(3, 7, 129)", _rms_norm((3, 7, 129))),
    ],
    "nsa_compress": [
        ("nsa_compress fwd+bwd", "S=(0,5,16,37) N=3 D=16 l=8 s=4", _nsa([0, 5, 16, 37], 3, 16, 8, 4)),
        ("nsa_compress fwd+bwd", "S=(29,40) N=2 D=24 l=6 s=4", _nsa([29, 40], 2, 24, 6, 4)),
    ],
    "floyd_attention": [
        ("floyd_attention fwd+bwd", "B=1 H=2 N=5 M=7 K=9 D=8 mask", _floyd(1, 2, 5, 7, 9, 8, True)),
        ("floyd_attention fwd+bwd", "B=2 H=1 N=4 M=3 K=6 D=16", _floyd(2, 1, 4, 3, 6, 16, False)),
    ],
    "floyd3_attention": [
        ("floyd3_attention fwd+bwd", "B=1 H=2 I=3 J=4 K=5 P=6 D=8 mask", _floyd3(1, 2, 3, 4, 5, 6, 8, True)),
        ("floyd3_attention fwd+bwd", "B=2 H=1 I=5 J=3 K=4 P=7 D=16", _floyd3(2, 1, 5, 3, 4, 7, 16, False)),
    ],
}


def run(device: str = "cpu", backends: Optional[List[str]] = None, dtypes=DTYPES,
        plan: Optional[List[Availability]] = None) -> Iterator[Result]:
    """Yield a Result for every case of every (family, backend) that ``plan`` (default:
    :func:`backends_here`) says runs here."""
    plan = backends_here(device, backends) if plan is None else plan
    for family in FAMILIES:
        for backend in [a.backend for a in plan if a.family == family and a.skipped is None]:
            for op, shape, check in CASES[family]:
                for dtype in dtypes:
                    torch.manual_seed(0)
                    t0 = time.perf_counter()
                    try:
                        pairs = check(dtype, device, backend)
                        err = max(rel_error(a, e) for _, a, e in pairs)
                        res = Result(op, backend, str(dtype).replace("torch.", ""), shape, err,
                                     TOLERANCE[dtype], time.perf_counter() - t0)
                    except Exception as e:  # a crash is a failure to report, not to hide
                        res = Result(op, backend, str(dtype).replace("torch.", ""), shape, float("nan"),
                                     TOLERANCE[dtype], time.perf_counter() - t0, f"{type(e).__name__}: {e}")
                    yield res


def format_row(r: Result) -> str:
    verdict = "PASS" if r.ok else "FAIL"
    err = f"{r.max_error:.2e}" if r.error is None else r.error[:60]
    return (f"{r.op:<24} {r.backend:<10} {r.dtype:<9} {r.shape:<32} {err:>10} "
            f"{'<=' if r.ok else '> '} {r.tolerance:.0e}  {verdict}  {r.seconds * 1e3:8.1f} ms")


HEADER = (f"{'operator':<24} {'backend':<10} {'dtype':<9} {'shape':<32} {'max error':>10}    "
          f"{'tol':<5}  verdict {'time':>11}")
