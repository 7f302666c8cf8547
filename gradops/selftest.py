"""``gradops selftest``: every operator on every backend this machine can run, a few shapes
and dtypes each, against the independent float64 oracles of :mod:`gradops.oracles`."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import api, oracles
from ._backend import FAMILIES, available_backends
from .oracles import TOLERANCE, rel_error

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
}


def run(device: str = "cpu", backends: Optional[List[str]] = None, dtypes=DTYPES) -> List[Result]:
    results = []
    for family in FAMILIES:
        usable = available_backends(family, torch.device(device))
        for backend in usable if backends is None else [b for b in backends if b in usable]:
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
                    results.append(res)
                    yield res


def format_row(r: Result) -> str:
    verdict = "PASS" if r.ok else "FAIL"
    err = f"{r.max_error:.2e}" if r.error is None else r.error[:60]
    return (f"{r.op:<24} {r.backend:<10} {r.dtype:<9} {r.shape:<32} {err:>10} "
            f"{'<=' if r.ok else '> '} {r.tolerance:.0e}  {verdict}  {r.seconds * 1e3:8.1f} ms")


HEADER = (f"{'operator':<24} {'backend':<10} {'dtype':<9} {'shape':<32} {'max error':>10}    "
          f"{'tol':<5}  verdict {'time':>11}")
