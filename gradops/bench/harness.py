"""The benchmark harness every operator's benchmark uses.

A benchmark builds a list of *cases* (operator, shape, dtype) and, for each case, a set of
*implementations* measured side by side in the same process on the same inputs: ours and
each peer. ``measure`` times one callable (CUDA events with the L2 flushed between
repetitions on a GPU, ``time.perf_counter`` on a CPU) and returns the raw timings; ``Run``
collects records, computes the ratio of every peer to ours, and writes a table, a JSON file
(device, versions, date, raw timings) and optionally a PNG plot.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch

OURS = "gradops"
RESULTS_DIR = os.path.join("benchmarks", "results")  # committed GPU results (benchmarks/README.md)


def device_info(device: str) -> dict:
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": device,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if device.startswith("cuda"):
        info["device_name"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        try:
            import subprocess

            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            info["driver"] = None
        props = torch.cuda.get_device_properties(0)
        info["sm_count"] = props.multi_processor_count
    else:
        info["device_name"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


_L2_FLUSH: Dict[str, torch.Tensor] = {}


def _flush_l2(device: torch.device):
    buf = _L2_FLUSH.get(str(device))
    if buf is None:
        buf = _L2_FLUSH[str(device)] = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    buf.zero_()


def measure(fn: Callable[[], object], device: str, *, warmup: int = 3, reps: int = 20,
            flush_l2: bool = True, max_seconds: float = 10.0) -> List[float]:
    """Raw times of ``fn()`` in milliseconds, one per repetition, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    if device.startswith("cuda"):
        dev = torch.device(device)
        torch.cuda.synchronize()
        start_all = time.perf_counter()
        for _ in range(reps):
            if flush_l2:
                _flush_l2(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if time.perf_counter() - start_all > max_seconds and len(times) >= 3:
                break
    else:
        start_all = time.perf_counter()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if time.perf_counter() - start_all > max_seconds and len(times) >= 3:
                break
    return times


def peak_memory(fn: Callable[[], object], device: str) -> Optional[int]:
    """Peak bytes allocated by ``fn()`` beyond what was allocated before (CUDA only)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@dataclass
class Record:
    op: str
    case: dict
    impl: str
    times_ms: List[float]
    bytes: Optional[float] = None  # bytes moved (PERFORMANCE.md conventions)
    flops: Optional[float] = None
    peak_bytes: Optional[int] = None
    error: Optional[str] = None  # why this implementation could not run this case
    extra: dict = field(default_factory=dict)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan

    @property
    def gbps(self) -> Optional[float]:
        return None if self.bytes is None or not self.times_ms else self.bytes / (self.median_ms * 1e-3) / 1e9

    @property
    def tflops(self) -> Optional[float]:
        return None if self.flops is None or not self.times_ms else self.flops / (self.median_ms * 1e-3) / 1e12


def progress(items: Iterable, desc: str):
    """tqdm when installed (to stderr), else a plain counter."""
    items = list(items)
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        def gen():
            for i, item in enumerate(items):
                print(f"[{desc}] {i + 1}/{len(items)}", file=sys.stderr, flush=True)
                yield item
        return gen()


class Run:
    """Records of one benchmark run, with ratios to ours, a table, JSON and a plot."""

    def __init__(self, name: str, device: str):
        self.name = name
        self.device = device
        self.meta = device_info(device)
        self.records: List[Record] = []

    def add(self, record: Record) -> Record:
        self.records.append(record)
        return record

    def time(self, op: str, case: dict, impl: str, fn: Callable[[], object], *,
             bytes: Optional[float] = None, flops: Optional[float] = None,
             memory: bool = False, **measure_kw) -> Record:
        """Measure ``fn`` and add the record; an exception (e.g. out of memory) is recorded."""
        try:
            times = measure(fn, self.device, **measure_kw)
            peak = peak_memory(fn, self.device) if memory else None
            rec = Record(op, case, impl, times, bytes, flops, peak)
        except Exception as e:  # a peer that cannot run a case is a result, not a crash
            rec = Record(op, case, impl, [], bytes, flops, None, error=f"{type(e).__name__}: {e}"[:300])
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
        return self.add(rec)

    def ratios(self) -> List[dict]:
        """For every record of a peer: its median time over ours (> 1 means we are faster)."""
        ours = {(r.op, json.dumps(r.case, sort_keys=True)): r for r in self.records if r.impl == OURS}
        rows = []
        for r in self.records:
            o = ours.get((r.op, json.dumps(r.case, sort_keys=True)))
            ratio = None
            if o is not None and r is not o and r.times_ms and o.times_ms:
                ratio = r.median_ms / o.median_ms
            rows.append({"op": r.op, "case": r.case, "impl": r.impl, "median_ms": r.median_ms,
                         "gbps": r.gbps, "tflops": r.tflops, "peak_bytes": r.peak_bytes,
                         "speedup_of_ours": ratio, "error": r.error})
        return rows

    def table(self) -> str:
        lines = [f"{'op':<22} {'case':<44} {'impl':<22} {'ms':>10} {'GB/s':>8} {'TFLOP/s':>8} "
                 f"{'peak MiB':>9} {'ours x':>7}"]
        for row in self.ratios():
            case = ",".join(f"{k}={v}" for k, v in row["case"].items())
            if row["error"]:
                lines.append(f"{row['op']:<22} {case:<44} {row['impl']:<22} {'-- ' + row['error'][:60]}")
                continue
            fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
            peak = row["peak_bytes"] / 2**20 if row["peak_bytes"] is not None else None
            lines.append(
                f"{row['op']:<22} {case:<44} {row['impl']:<22} {row['median_ms']:>10.4f} "
                f"{fmt(row['gbps'], '%8.1f'):>8} {fmt(row['tflops'], '%8.2f'):>8} "
                f"{fmt(peak, '%9.1f'):>9} {fmt(row['speedup_of_ours'], '%6.2fx'):>7}")
        return "\n".join(lines)

    def result_stem(self, family: str) -> str:
        """``<family>-<device name>-<UTC time>``: the file name stem of this run's results."""
        device = str(self.meta.get("device_name") or self.device)
        device = device.replace(" ", "_").replace("/", "_")
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        return f"{family}-{device}-{stamp}"

    def exit_status(self) -> int:
        """1 (after naming each on stderr) when one of our own measurements failed, else 0."""
        failed = [r for r in self.records if r.impl == OURS and r.error]
        for r in failed:
            print(f"gradops failed on {r.op} {r.case}: {r.error}", file=sys.stderr)
        return 1 if failed else 0

    def write_json(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        data = {"benchmark": self.name, "meta": self.meta,
                "records": [asdict(r) | {"median_ms": r.median_ms, "gbps": r.gbps, "tflops": r.tflops}
                            for r in self.records],
                "ratios": self.ratios()}
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)
        return path

    def plot(self, path: str, x_key: str, metric: str = "gbps", group_keys=("op", "dtype"),
             panels: bool = False) -> Optional[str]:
        """PNG of ``metric`` against ``case[x_key]``, one line per (group, impl); None without
        matplotlib. ``panels=True`` draws one panel per group (lines per impl) instead of
        putting every group on one axis."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        series: Dict[tuple, list] = {}
        for r in self.records:
            y = getattr(r, metric)
            if y is None or x_key not in r.case:
                continue
            group = " ".join(str(r.case.get(k, getattr(r, k, ""))) for k in group_keys)
            series.setdefault((group, r.impl), []).append((r.case[x_key], y))
        if not series:
            return None
        groups = sorted({g for g, _ in series}) if panels else [None]
        cols = min(2, len(groups))
        rows = -(-len(groups) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(9 if cols == 1 else 13, 5 if rows == 1 else 3.6 * rows),
                                 squeeze=False)
        for ax, group in zip(axes.flat, groups):
            for (g, impl), pts in sorted(series.items()):
                if group is not None and g != group:
                    continue
                pts.sort()
                label = impl if group is not None else f"{g} {impl}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(x_key)
            ax.set_ylabel({"gbps": "GB/s", "tflops": "TFLOP/s"}.get(metric, metric))
            ax.set_title(group if group is not None else f"{self.name} on {self.meta.get('device_name')}",
                         fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(True, alpha=0.3)
        for ax in list(axes.flat)[len(groups):]:
            ax.set_visible(False)
        if panels:
            fig.suptitle(f"{self.name} on {self.meta.get('device_name')}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
