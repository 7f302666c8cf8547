"""CANN's "double benchmark" (双标杆) precision standard for floating-point operator outputs.

A result is judged not against an absolute tolerance but against a *benchmark*: the same
computation done by a third-party implementation in the same (low) precision, e.g. PyTorch
running the operator's formula in float16 on a GPU. Both are compared with a high-precision
*golden* (float64 here), and the result passes when its errors are not much larger than the
benchmark's. Users porting kernels to Ascend NPUs (or from them) can apply it to their own
outputs::

    from gradops.precision import compare
    verdict = compare(npu_out, gpu_out, golden_fp64)   # any devices; computed in float64
    assert verdict.passed, verdict

What is implemented (docs/precision.md has the same with the sources and the choices made):

* Elements are split by the golden's magnitude. **Small values**, ``|golden| < small_value``,
  are judged by absolute error: the *error count* is the number of small-value elements with
  ``|actual - golden| > small_error``. The others (**normal values**) are judged by relative
  error ``|actual - golden| / |golden|`` (the denominator is at least ``small_value``, never 0).
* Per output: ``max_rel`` (MARE) and ``mean_rel`` (MERE) over the normal values, ``rmse``
  over all finite elements, ``small_err`` (the error count) over the small values.
* Ratios ours/benchmark must satisfy ``max_rel <= 10``, ``mean_rel <= 2``, ``rmse <= 2``,
  ``small_err <= 2`` (CANN's level L0, the level of msprobe's benchmark comparison).
* A benchmark metric of exactly zero: the ratio is 1 when ours is zero too, infinite (fail)
  otherwise; an error count of zero is floored at one element (see docs/precision.md).
* Non-finite values: elements where the golden, ours or the benchmark is inf/NaN are left out
  of the metrics; ours must then agree with the golden or with the benchmark there
  (``nonfinite`` counts the elements where it agrees with neither: it must be 0).

Thresholds per output dtype (CANN's commercial standard, as its ops-precision-standard
tooling states them; sources in docs/precision.md): float16 small_value 2^-11, small_error
2^-16; bfloat16 2^-8, 2^-16; float32 2^-14, 2^-30 (also used for float64 outputs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

__all__ = ["Thresholds", "THRESHOLDS", "LIMITS", "ErrorStats", "Comparison", "error_stats", "ratio",
           "compare", "stress_normal"]


@dataclass(frozen=True)
class Thresholds:
    """Small-value domain of one dtype: ``|golden| < small_value`` is a small value, and a small
    value is in error when ``|actual - golden| > small_error``."""
    small_value: float
    small_error: float


THRESHOLDS: Dict[torch.dtype, Thresholds] = {
    torch.float16: Thresholds(2.0 ** -11, 2.0 ** -16),
    torch.bfloat16: Thresholds(2.0 ** -8, 2.0 ** -16),
    torch.float32: Thresholds(2.0 ** -14, 2.0 ** -30),
    torch.float64: Thresholds(2.0 ** -14, 2.0 ** -30),
}

# Largest allowed ratio ours / benchmark of each metric (CANN level L0).
LIMITS: Dict[str, float] = {"max_rel": 10.0, "mean_rel": 2.0, "rmse": 2.0, "small_err": 2.0}

# An error count of zero in the benchmark is taken as one element: a count ratio needs a unit,
# and one element is the smallest count that can be observed (docs/precision.md).
COUNT_FLOOR = 1


@dataclass(frozen=True)
class ErrorStats:
    """Errors of one tensor against the golden (see the module docstring)."""
    max_rel: float
    mean_rel: float
    rmse: float
    small_err: int
    n_normal: int
    n_small: int
    n_excluded: int  # elements left out because one of golden/ours/benchmark is not finite

    def metric(self, name: str) -> float:
        return float(getattr(self, name))


def _thresholds(dtype: torch.dtype, thresholds: Optional[Thresholds]) -> Thresholds:
    if thresholds is not None:
        return thresholds
    try:
        return THRESHOLDS[dtype]
    except KeyError:
        raise ValueError(f"no precision thresholds for dtype {dtype}; pass thresholds=") from None


def error_stats(actual: torch.Tensor, golden: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
                thresholds: Optional[Thresholds] = None,
                mask: Optional[torch.Tensor] = None) -> ErrorStats:
    """MARE, MERE, RMSE and the small-value error count of ``actual`` against ``golden``.

    ``dtype`` selects the thresholds (default: actual's dtype). ``mask`` (bool, golden's shape)
    restricts the statistics to the elements where it is True; by default the elements where
    both tensors are finite.
    """
    if actual.shape != golden.shape:
        raise ValueError(f"actual has shape {tuple(actual.shape)}, golden {tuple(golden.shape)}")
    th = _thresholds(dtype or actual.dtype, thresholds)
    a = actual.detach().to(torch.float64).flatten()
    g = golden.detach().to(device=a.device, dtype=torch.float64).flatten()
    keep = torch.isfinite(a) & torch.isfinite(g)
    if mask is not None:
        keep &= mask.to(device=a.device).flatten()
    a, g = a[keep], g[keep]
    excluded = int(keep.numel() - keep.sum().item())
    err = (a - g).abs()
    mag = g.abs()
    small = mag < th.small_value
    normal = ~small
    rel = err[normal] / mag[normal]  # |golden| >= small_value > 0 here
    n = err.numel()
    return ErrorStats(
        max_rel=rel.max().item() if rel.numel() else 0.0,
        mean_rel=rel.mean().item() if rel.numel() else 0.0,
        rmse=math.sqrt((err * err).mean().item()) if n else 0.0,
        small_err=int((err[small] > th.small_error).sum().item()),
        n_normal=int(normal.sum().item()),
        n_small=int(small.sum().item()),
        n_excluded=excluded,
    )


def ratio(ours: float, bench: float, *, count: bool = False) -> float:
    """``ours / bench``; a zero benchmark gives 1 if ours is zero too, else inf (an error count
    of zero is floored at :data:`COUNT_FLOOR` instead)."""
    if count:
        return ours / max(bench, COUNT_FLOOR)
    if bench > 0:
        return ours / bench
    return 1.0 if ours == 0 else math.inf


def _same(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x == y) | (torch.isnan(x) & torch.isnan(y))


@dataclass
class Comparison:
    """The verdict of :func:`compare` for one output."""
    ours: ErrorStats
    bench: ErrorStats
    ratios: Dict[str, float]
    nonfinite: int
    limits: Dict[str, float] = field(default_factory=lambda: dict(LIMITS))
    what: str = ""

    @property
    def failures(self) -> List[str]:
        out = [f"{k} ratio {v:.3g} > {self.limits[k]:g}" for k, v in self.ratios.items()
               if not v <= self.limits[k]]
        if self.nonfinite:
            out.append(f"{self.nonfinite} non-finite elements matching neither golden nor benchmark")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def worst(self) -> float:
        """The largest ratio as a fraction of its limit (> 1 fails)."""
        return max(v / self.limits[k] for k, v in self.ratios.items())

    def __str__(self) -> str:
        def fmt(s: ErrorStats) -> str:
            return (f"MARE {s.max_rel:.3e}  MERE {s.mean_rel:.3e}  RMSE {s.rmse:.3e}  "
                    f"small errors {s.small_err}/{s.n_small}")
        head = f"{self.what}: " if self.what else ""
        verdict = "pass" if self.passed else "FAIL (" + "; ".join(self.failures) + ")"
        ratios = "  ".join(f"{k} {v:.3g}" for k, v in self.ratios.items())
        return (f"{head}{verdict}\n  ratios  {ratios}\n  ours    {fmt(self.ours)}\n"
                f"  bench   {fmt(self.bench)}  ({self.ours.n_normal} normal, "
                f"{self.ours.n_excluded} non-finite left out)")


def compare(actual: torch.Tensor, benchmark: torch.Tensor, golden: torch.Tensor, *,
            dtype: Optional[torch.dtype] = None, thresholds: Optional[Thresholds] = None,
            limits: Optional[Dict[str, float]] = None, what: str = "") -> Comparison:
    """Judge ``actual`` by CANN's double benchmark: its errors against ``golden`` (float64),
    relative to those of ``benchmark`` (the same computation by a third party in the same
    dtype). ``dtype`` selects the thresholds (default: actual's dtype); ``limits`` overrides
    :data:`LIMITS` (e.g. CANN's stricter levels L1 ``{max_rel: 5, mean_rel: 1.5, rmse: 1.5,
    small_err: 2}``)."""
    if not (actual.shape == benchmark.shape == golden.shape):
        raise ValueError(f"shapes differ: actual {tuple(actual.shape)}, benchmark "
                         f"{tuple(benchmark.shape)}, golden {tuple(golden.shape)}")
    dtype = dtype or actual.dtype
    a = actual.detach().to(torch.float64).flatten()
    b = benchmark.detach().to(device=a.device, dtype=torch.float64).flatten()
    g = golden.detach().to(device=a.device, dtype=torch.float64).flatten()
    finite = torch.isfinite(a) & torch.isfinite(b) & torch.isfinite(g)
    # ours non-finite or golden non-finite: ours must match the golden or the benchmark there
    suspect = ~(torch.isfinite(a) & torch.isfinite(g))
    nonfinite = int((suspect & ~_same(a, g) & ~_same(a, b)).sum().item())
    ours = error_stats(a, g, dtype=dtype, thresholds=thresholds, mask=finite)
    bench = error_stats(b, g, dtype=dtype, thresholds=thresholds, mask=finite)
    ratios = {k: ratio(ours.metric(k), bench.metric(k), count=(k == "small_err"))
              for k in ("max_rel", "mean_rel", "rmse", "small_err")}
    lim = dict(LIMITS if limits is None else limits)
    return Comparison(ours, bench, ratios, nonfinite, lim, what)


def stress_normal(shape, *, generator: Optional[torch.Generator] = None,
                  dtype: torch.dtype = torch.float64, device="cpu") -> torch.Tensor:
    """CANN's stress distribution for one tensor: normal with mean drawn from U(-100, 100) and
    standard deviation from U(1, 25), scaled by 1/100."""
    # drawn on the CPU (a CPU generator, and the same values whatever the default device)
    u = torch.rand(2, generator=generator, dtype=torch.float64, device="cpu")
    mean, std = -100.0 + 200.0 * u[0].item(), 1.0 + 24.0 * u[1].item()
    x = torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu") * std + mean
    return (x / 100.0).to(dtype).to(device)
