"""The benchmark harness every operator's benchmark uses.

A benchmark builds a list of *cases* (operator, shape, dtype) and, for each case, a set of
*implementations* measured side by side in the same process on the same inputs: ours and
each peer. ``measure`` times one callable (CUDA events with the L2 flushed between
repetitions on a GPU, ``time.perf_counter`` on a CPU) and returns the raw timings; ``Run``
collects records, computes the ratio of every peer to ours, and writes a table, a JSON file
(device, versions, date, raw timings) and optionally a PNG plot.

It also decides, once for every benchmark: the flags they share (:func:`add_common_args`,
:func:`prepare`), where results go (:func:`output_dir`), the time budget (``Run.deadline``)
and how a performance goal of docs/benchmarks.md is read off the records (:class:`Goal`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

OURS = "gradops"
RESULTS_DIR = os.path.join("benchmarks", "results")  # committed GPU results (benchmarks/README.md)
CPU_NOTE = ("CPU timings (the Triton interpreter's included) are not GPU numbers: they say nothing "
            "about the kernels' speed on a GPU")

# Nominal HBM bandwidth of the GPUs the goals are set on (docs/benchmarks.md), GB/s (not a copy's).
HBM_PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0}

# The one set of dtype names every `gradops bench` command (and `gradops selftest`) takes:
# torch's names are canonical (they are what the JSON records hold); the short names are
# aliases, accepted everywhere and turned into the torch names as they are parsed.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}


def dtype_name(name: str) -> str:
    """The canonical (torch) name of a dtype given by its torch name, ``torch.<name>`` or its
    short alias (fp32, fp16, bf16, fp64); anything else is returned as given, for argparse's
    ``choices`` to reject."""
    name = str(name).strip().lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    return DTYPE_ALIASES.get(name, name)


def dtype_choices(names: Sequence[str]) -> str:
    """'float32 (fp32), bfloat16 (bf16)': the names a --dtype takes, for help texts."""
    short = {v: k for k, v in DTYPE_ALIASES.items()}
    return ", ".join(f"{n} ({short[n]})" if n in short else n for n in names)


def hbm_peak_gbps(device_name: str) -> Optional[float]:
    for key, gbps in HBM_PEAK_GBPS.items():
        if key in device_name:
            return gbps
    return None


# ---------------------------------------------------------------------------------------
# The flags every `gradops bench FAMILY` takes, and what they resolve to

def add_common_args(p: argparse.ArgumentParser, dtypes: Sequence[str] = tuple(DTYPES), dtype_help: str = "", *,
                    family: bool = True, quick_help: str = "", out_help: str = "", budget_help: str = ""):
    """The options of every `gradops bench` command, in one place: --device, --dtype, --quick,
    --out, --no-plot, --reps, --warmup, --max-seconds, --budget-seconds; and, for a single
    family (``family=True``; not `bench all`, which sets them per part), --interpret and
    --tag. ``dtypes``: the canonical names this command accepts (each also by its alias)."""
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument("--dtype", "--dtypes", dest="dtypes", nargs="+", action="extend", type=dtype_name,
                   choices=tuple(dtypes), metavar="DTYPE", default=None,
                   help="one or more of " + dtype_choices(dtypes) + " (repeatable; the short names are aliases)"
                   + (f"; {dtype_help}" if dtype_help else ""))
    p.add_argument("--quick", action="store_true",
                   help=quick_help or "tiny shapes and few repetitions: a smoke run (a minute or less on a CPU)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=out_help or (f"folder for the JSON (and PNG); default: {RESULTS_DIR}/ for a full run on a "
                                     f"GPU, else {scratch_dir()}/. The path written is printed"))
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls before them")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time bound of one measurement's warm-up and of its timed repetitions (each)")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help=budget_help or "stop starting measurements after this long; the rest are recorded as skipped")
    if family:
        p.add_argument("--interpret", action="store_true",
                       help="on a CPU, run our Triton kernels through the Triton interpreter (correctness only: "
                            "interpreter timings mean nothing)")
        p.add_argument("--tag", default=None, help="file name stem (default: FAMILY-<device>-<UTC time>)")


def scratch_dir() -> str:
    """Where the results of a CPU run or of a --quick smoke run go without --out: not results
    to commit (benchmarks/results/ holds GPU results only), but written all the same."""
    return os.path.join(tempfile.gettempdir(), "gradops-bench")


def cpu_caveat(args) -> Optional[str]:
    """The line every benchmark prints when it times on a CPU (None on a GPU)."""
    if args.device == "cuda":
        return None
    how = ", our Triton kernels through the Triton interpreter" if getattr(args, "interpret", False) else ""
    return f"note: timed on a CPU{how}. {CPU_NOTE}"


def announce(args, family: str) -> None:
    """The first line of a benchmark: what runs where, with the CPU caveat on a CPU."""
    dtypes = " ".join(args.dtypes) if getattr(args, "dtypes", None) else "its default dtypes"
    print(f"gradops bench {family} on {args.device}{' --quick' if args.quick else ''}: {dtypes}", flush=True)
    caveat = cpu_caveat(args)
    if caveat:
        print(caveat, flush=True)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare(args, *, reps: int, warmup: int, max_seconds: float, quick_reps: int = 3, quick_warmup: int = 1,
            quick_max_seconds: float = 0.5, need_device: bool = True, gpu_dtypes: Sequence[str] = ("bfloat16",),
            cpu_dtypes: Sequence[str] = ("float32",)):
    """Resolve the shared flags in place: the device, the dtypes (``gpu_dtypes`` or
    ``cpu_dtypes`` unless --dtype names them), the repetition defaults and the deadline.
    With --interpret on a CPU, the Triton interpreter rule of gradops.selftest is applied here,
    before anything imports triton (only then: a process that also runs CUDA kernels, such as
    the test suite on a GPU, must not have it switched on behind its back). ``need_device``:
    False for a dry run, which neither needs the device nor touches the interpreter."""
    from ..selftest import use_interpreter_on_cpu

    if args.device is None:
        args.device = default_device()
    if need_device:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("gradops bench: --device cuda, but no CUDA device is visible")
        if args.interpret:
            use_interpreter_on_cpu(args.device)
    if not args.dtypes:
        args.dtypes = list(gpu_dtypes if args.device == "cuda" else cpu_dtypes)
    if args.reps is None:
        args.reps = quick_reps if args.quick else reps
    if args.warmup is None:
        args.warmup = quick_warmup if args.quick else warmup
    if args.max_seconds is None:
        args.max_seconds = quick_max_seconds if args.quick else max_seconds
    if getattr(args, "deadline", None) is None:
        args.deadline = time.monotonic() + args.budget_seconds if args.budget_seconds is not None else None
    return args


def cpu_kernels_skipped() -> Optional[str]:
    """Why our Triton kernels cannot run on this CPU, by the rule `gradops selftest` follows
    (None when they can, through the interpreter)."""
    from ..selftest import backends_here

    return next((a.skipped for a in backends_here("cpu") if a.backend == "triton" and a.skipped), None)


def ours_backend(args) -> str:
    """Our backend: the Triton kernels on a GPU, and on a CPU with --interpret when they can
    run there (else, saying why, the reference: our CPU path, as without --interpret)."""
    if args.device == "cuda":
        return "triton"
    if not args.interpret:
        return "reference"
    why = cpu_kernels_skipped()
    if why is not None:
        print(f"gradops bench: our Triton kernels are skipped on this CPU ({why}); ours is the reference backend",
              file=sys.stderr)
        return "reference"
    return "triton"


def output_dir(args) -> Tuple[str, str]:
    """The one rule of where results go: (folder, why there). --out wins; a full run on a GPU
    goes to benchmarks/results/; a CPU run or a --quick smoke run goes to :func:`scratch_dir`
    (written all the same, and the path printed, but not a result to commit)."""
    if args.out:
        return args.out, ""
    if args.device == "cuda" and not args.quick:
        return RESULTS_DIR, ""
    what = "a CPU run" if args.device != "cuda" else "a --quick smoke run"
    return scratch_dir(), f"{what}: not a result to commit; --out DIR writes elsewhere"


def device_slug(meta: dict) -> str:
    """'nvidia-h100-80gb-hbm3', 'cpu-x86_64': a device name fit for a folder name."""
    name = str(meta.get("device_name") or meta.get("device") or "device")
    if not str(meta.get("device", "")).startswith("cuda"):
        name = "cpu-" + name
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


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
            flush_l2: bool = True, max_seconds: float = 10.0, wall_clock: bool = False) -> List[float]:
    """Raw times of ``fn()`` in milliseconds, one per repetition, after ``warmup`` calls.

    ``wall_clock``: on a GPU too, time each call on the host, from an idle device to its
    work done (synchronised on both sides, no L2 flush): the cost of a call, which CUDA
    events would hide behind work already queued.

    Bounded: the warm-up stops after ``max_seconds`` (at least one call, which holds any
    compilation), and so do the repetitions (at least three). One measurement therefore
    takes at most about: first call + max_seconds + one call (warm-up), then
    max(max_seconds + one call, three calls)."""
    start_warm = time.perf_counter()
    for i in range(max(1, warmup)):
        if i and time.perf_counter() - start_warm > max_seconds:
            break
        fn()
    times = []
    if device.startswith("cuda") and wall_clock:
        torch.cuda.synchronize()
        start_all = time.perf_counter()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            if time.perf_counter() - start_all > max_seconds and len(times) >= 3:
                break
    elif device.startswith("cuda"):
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


def graph_times(fn: Callable[[], object], device: str, *, reps: int = 20, flush_l2: bool = True,
                max_seconds: float = 10.0) -> List[float]:
    """Kernel time of ``fn()`` in ms per repetition: ``fn`` captured once in a CUDA graph and
    replayed, so no host work sits between its kernels (what the GPU spends on the call; a
    call whose eager time is well above it is host-bound). Raises where ``fn`` cannot be
    captured (a host synchronisation inside it, for one)."""
    dev = torch.device(device)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    # The capture registers the device's default RNG with the graph, and a capture that fails
    # leaves that RNG state in capture mode in torch 2.11: every random op after it raises
    # "Offset increment outside graph capture" (the GPU run of 2026-11-28 lost its NSA parts
    # and a GPT-2 step so). So the graph captures with a copy of the state, and the run's own
    # state is put back whatever the capture did.
    rng = torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
    own_state = rng.graphsafe_get_state()
    rng.graphsafe_set_state(rng.clone_state())
    # Warm-up and capture on a side stream (capture cannot run on the default stream). The
    # stream context is the outer one, so that a capture that fails (an autograd peer whose
    # forward ran on the default stream launches its backward there: not capturable) still
    # leaves the default stream current for the rest of the run.
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
            side.synchronize()
            graph.capture_begin()
            try:
                fn()
            finally:
                graph.capture_end()
    finally:
        rng.graphsafe_set_state(own_state)
    torch.cuda.current_stream(dev).wait_stream(side)
    return measure(graph.replay, device, warmup=1, reps=reps, flush_l2=flush_l2, max_seconds=max_seconds)


HOST_CALLS = 20  # calls queued back to back to time the host's share of one


def host_ms(fn: Callable[[], object], device: str, calls: int = HOST_CALLS) -> float:
    """The host's time per call of ``fn`` in ms: ``calls`` calls queued back to back without
    waiting for the GPU (far fewer than fill CUDA's launch queue), timed on the host."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    return elapsed * 1e3 / calls


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
    bytes: Optional[float] = None  # bytes moved (docs/benchmarks.md conventions)
    flops: Optional[float] = None
    peak_bytes: Optional[int] = None
    error: Optional[str] = None  # why this implementation could not run this case
    extra: dict = field(default_factory=dict)
    skipped: bool = False  # not run: the time budget was spent (error says so)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan

    @property
    def kernel_ms(self) -> float:
        """The GPU's time for the call (CUDA-graph replay, ``extra["kernel_ms"]``) where it was
        measured, else the call's own time: the rates below divide by it, so a host-bound
        call's launch gaps are never reported as a kernel's speed."""
        return self.extra.get("kernel_ms") or self.median_ms

    @property
    def gbps(self) -> Optional[float]:
        return None if self.bytes is None or not self.times_ms else self.bytes / (self.kernel_ms * 1e-3) / 1e9

    @property
    def tflops(self) -> Optional[float]:
        return None if self.flops is None or not self.times_ms else self.flops / (self.kernel_ms * 1e-3) / 1e12


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

    def __init__(self, name: str, device: str, deadline: Optional[float] = None):
        self.name = name
        self.device = device
        self.meta = device_info(device)
        if not device.startswith("cuda"):
            self.meta["note"] = CPU_NOTE
        self.records: List[Record] = []
        self.deadline = deadline  # time.monotonic() after which no measurement starts
        self.goals: List[dict] = []  # this run's goals, evaluated by finish()

    def add(self, record: Record) -> Record:
        self.records.append(record)
        return record

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def skip(self, ops: Iterable[str], case: dict, impl: str = OURS):
        """Record that ``case`` was not run because the time budget was spent."""
        for op in ops:
            self.add(Record(op, case, impl, [], error="skipped: the time budget was spent", skipped=True))

    def time(self, op: str, case: dict, impl: str, fn: Callable[[], object], *,
             bytes: Optional[float] = None, flops: Optional[float] = None,
             memory: bool = False, costs: bool = False, **measure_kw) -> Record:
        """Measure ``fn`` and add the record; an exception (e.g. out of memory) is recorded.
        ``costs`` (on a GPU): also its kernel and host time (:meth:`_split_costs`)."""
        if self.out_of_time():
            return self.add(Record(op, case, impl, [], bytes, flops, error="skipped: the time budget was spent",
                                   skipped=True))
        try:
            times = measure(fn, self.device, **measure_kw)
            peak = peak_memory(fn, self.device) if memory else None
            rec = Record(op, case, impl, times, bytes, flops, peak)
        except Exception as e:  # a peer that cannot run a case is a result, not a crash
            rec = Record(op, case, impl, [], bytes, flops, None, error=f"{type(e).__name__}: {e}"[:300])
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if costs and not rec.error and self.device.startswith("cuda"):
            self._split_costs(rec, fn, measure_kw)
        return self.add(rec)

    def _split_costs(self, rec: Record, fn: Callable[[], object], measure_kw: dict) -> None:
        """The call's time as the GPU spends it and as the host does, beside the eager time
        (``times_ms``, CUDA events around each call): ``extra`` gains ``eager_ms``,
        ``kernel_ms`` (CUDA-graph replay) and ``host_ms`` (per call, queued back to back), and
        ``host_bound`` when the eager time exceeds the kernel time by more than 20 %. A call
        that cannot be captured keeps its eager time as its rate's basis and says why."""
        rec.extra["eager_ms"] = rec.median_ms
        kw = {k: measure_kw[k] for k in ("reps", "flush_l2", "max_seconds") if k in measure_kw}
        try:
            rec.extra["kernel_ms"] = statistics.median(graph_times(fn, self.device, **kw))
        except Exception as e:
            rec.extra["kernel_ms_error"] = f"{type(e).__name__}: {e}"[:200]
            torch.cuda.synchronize(self.device)
        try:
            rec.extra["host_ms"] = host_ms(fn, self.device)
        except Exception as e:
            rec.extra["host_ms_error"] = f"{type(e).__name__}: {e}"[:200]
        rec.extra["rate_basis"] = "kernel" if rec.extra.get("kernel_ms") else "eager"
        if rec.extra.get("kernel_ms"):
            rec.extra["kernel_over_eager"] = rec.extra["kernel_ms"] / rec.median_ms
            rec.extra["host_bound"] = rec.median_ms > 1.2 * rec.extra["kernel_ms"]

    def ratios(self) -> List[dict]:
        """For every record of a peer: its median time over ours (> 1 means we are faster), as
        the call takes it (eager), and where both were captured, its kernel time over ours."""
        ours = {(r.op, json.dumps(r.case, sort_keys=True)): r for r in self.records if r.impl == OURS}
        rows = []
        for r in self.records:
            o = ours.get((r.op, json.dumps(r.case, sort_keys=True)))
            ratio = kernel_ratio = None
            if o is not None and r is not o and r.times_ms and o.times_ms:
                ratio = r.median_ms / o.median_ms
                if r.extra.get("kernel_ms") and o.extra.get("kernel_ms"):
                    kernel_ratio = r.extra["kernel_ms"] / o.extra["kernel_ms"]
            rows.append({"op": r.op, "case": r.case, "impl": r.impl, "median_ms": r.median_ms,
                         "kernel_ms": r.extra.get("kernel_ms"), "host_ms": r.extra.get("host_ms"),
                         "gbps": r.gbps, "tflops": r.tflops, "peak_bytes": r.peak_bytes,
                         "speedup_of_ours": ratio, "kernel_speedup_of_ours": kernel_ratio,
                         "error": r.error, "extra": r.extra})
        return rows

    def table(self) -> str:
        # ms: the call as a user makes it; kernel ms: its CUDA-graph replay; host ms: the host's
        # time per call (both on a GPU where measured); GB/s and TFLOP/s divide by kernel ms
        # (by ms where a GPU call could not be captured, marked *)
        lines = [f"{'op':<22} {'case':<44} {'impl':<22} {'ms':>10} {'kernel ms':>10} {'host ms':>9} {'GB/s':>8} "
                 f"{'TFLOP/s':>8} {'peak MiB':>9} {'ours x':>7}"]
        for row in self.ratios():
            case = ",".join(f"{k}={v}" for k, v in row["case"].items())
            if row["error"]:
                lines.append(f"{row['op']:<22} {case:<44} {row['impl']:<22} {'-- ' + row['error'][:90]}")
                continue
            fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
            peak = row["peak_bytes"] / 2**20 if row["peak_bytes"] is not None else None
            # a rate from the eager time where the kernel time could not be captured: marked
            eager_rate = "*" if row["extra"].get("rate_basis") == "eager" else ""
            lines.append(
                f"{row['op']:<22} {case:<44} {row['impl']:<22} {row['median_ms']:>10.4f} "
                f"{fmt(row['kernel_ms'], '%10.4f'):>10} {fmt(row['host_ms'], '%9.4f'):>9} "
                f"{fmt(row['gbps'], '%7.1f') + eager_rate:>8} {fmt(row['tflops'], '%8.2f'):>8} "
                f"{fmt(peak, '%9.1f'):>9} {fmt(row['speedup_of_ours'], '%6.2fx'):>7}")
        return "\n".join(lines)

    def side_by_side(self) -> str:
        """The same records pivoted: one line per (op, case), ours first, then every peer's
        median and, in brackets, its time over ours (> 1: gradops is faster)."""
        per_op: Dict[str, Dict[str, Dict[str, dict]]] = {}
        for row in self.ratios():
            key = ",".join(f"{k}={v}" for k, v in row["case"].items())
            per_op.setdefault(row["op"], {}).setdefault(key, {})[row["impl"]] = row
        lines = ["side by side: median ms, (a peer's time / ours: > 1, gradops is faster)"]
        for op, per_case in per_op.items():
            impls = [OURS] + list(dict.fromkeys(i for group in per_case.values() for i in group if i != OURS))
            width = max(len(k) for k in per_case)
            lines.append(f"{op:<14} {'':<{width}}" + "".join(f" {i[:26]:>26}" for i in impls))
            for key, group in per_case.items():
                cells = []
                for impl in impls:
                    r = group.get(impl)
                    if r is None:
                        cell = "-"
                    elif r["error"]:
                        cell = "skipped" if r["error"].startswith("skipped") else "error"
                    else:
                        cell = f"{r['median_ms']:.4g}"
                        if r["speedup_of_ours"] is not None:
                            cell += f" ({r['speedup_of_ours']:.2f}x)"
                    cells.append(f" {cell:>26}")
                lines.append(f"{'':<14} {key:<{width}}" + "".join(cells))
        return "\n".join(lines)

    def result_stem(self, family: str) -> str:
        """``<family>-<device name>-<UTC time>``: the file name stem of this run's results."""
        device = str(self.meta.get("device_name") or self.device)
        device = device.replace(" ", "_").replace("/", "_")
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        return f"{family}-{device}-{stamp}"

    def failures(self) -> List[Record]:
        """Our own measurements that failed (not those skipped for time)."""
        return [r for r in self.records if r.impl == OURS and r.error and not r.skipped]

    def skipped(self) -> List[Record]:
        return [r for r in self.records if r.skipped]

    def exit_status(self) -> int:
        """1 (after naming each on stderr) when one of our own measurements failed, or when
        the time budget left cases unmeasured; else 0."""
        for r in self.failures():
            print(f"gradops failed on {r.op} {r.case}: {r.error}", file=sys.stderr)
        skipped = self.skipped()
        if skipped:
            print(f"{len(skipped)} measurements skipped: the time budget was spent", file=sys.stderr)
        return 1 if self.failures() or skipped else 0

    def write_json(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        data = {"benchmark": self.name, "meta": self.meta,
                "records": [asdict(r) | {"median_ms": r.median_ms, "gbps": r.gbps, "tflops": r.tflops}
                            for r in self.records],
                "ratios": self.ratios(), "goals": self.goals}
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


# The statuses of a goal read against a run's numbers (the others say why it was not)
EVALUATED = ("met", "missed", "incomplete")


def goal_lines(results: Sequence[dict]) -> List[str]:
    """The goals a run could be read against (met, missed or incomplete), one line each, and a count of
    the rest (set for another device, or no case of this run under them)."""
    lines = []
    for g in results:
        if g["status"] in EVALUATED:
            case = g.get("worst_case") or {}
            where = ",".join(f"{k}={v}" for k, v in case.items())
            missing = f", {g['unevaluated']} more gave no value" if g.get("unevaluated") else ""
            bar = f"<= {g['maximum']:.3g}" if g.get("maximum") is not None else f">= {g['minimum']:.3g}"
            lines.append(f"goal {g['status']:<6} {g['goal']} (worst {g['worst']:.3g} over {g['cases']} cases{missing}, "
                         f"at {where}; {g['metric']} {bar})")
    rest = len(results) - len(lines)
    if rest:
        lines.append(f"{rest} other goals not evaluated on this run (set for another device, or no case of the "
                     "run falls under them): see the JSON's goals")
    return lines


def finish(run: Run, args, family: str, plot: dict, goals: Sequence["Goal"] = ()) -> List[str]:
    """Print the table, the records side by side and the ``goals`` this run can be read
    against; write the JSON (always, the goals' evaluation included) and the PNG where
    :func:`output_dir` says, print each path written and, on a CPU, the caveat; return the
    paths written."""
    print(run.table())
    print()
    print(run.side_by_side())
    run.goals = [g.evaluate([run]) for g in goals]
    lines = goal_lines(run.goals)
    if lines:
        print()
        print("\n".join(lines))
    caveat = cpu_caveat(args)
    if caveat:
        print(caveat)
    out, why = output_dir(args)
    run.meta["options"] = {k: getattr(args, k, None) for k in ("device", "dtypes", "quick", "interpret", "reps",
                                                                "warmup", "max_seconds", "budget_seconds")}
    stem = args.tag or run.result_stem(family)
    written = [run.write_json(os.path.join(out, stem + ".json"))]
    print(f"wrote {written[0]}" + (f" ({why})" if why else ""))
    if not args.no_plot:
        png = run.plot(os.path.join(out, stem + ".png"), **plot)
        print(f"wrote {png}" if png else "no plot (matplotlib is not installed, or nothing to plot)")
        if png:
            written.append(png)
    return written


# ---------------------------------------------------------------------------------------
# Goals: the bar of docs/benchmarks.md, read off a run's records

@dataclass(frozen=True)
class Goal:
    """One goal of docs/benchmarks.md, checked on our records of ``ops`` whose case ``applies``.

    ``metric``: "gbps", "tflops", "hbm_fraction" (GB/s over the GPU's nominal HBM peak),
    "speedup:<peer>" (the peer's median time over ours), "speedup:<peer>|<peer>|..." (the
    worst of those peers that ran in a case), "speedup:fastest" (the fastest peer's time
    over ours) or "extra:<key>" (the value our record holds under ``extra[key]``). Met when
    the worst value over those cases is >= ``minimum`` (or, for a goal with a ``maximum``
    instead, the largest is <= ``maximum``) and every case gave its value (ours and every
    peer read that ran in it measured); "incomplete" when the values there are met but a
    case, or a peer in one, failed or was skipped.
    ``excuse``: for the speedup metrics, texts (case-insensitive) of a peer's error that take
    that peer out of a case instead of leaving the goal incomplete (e.g. "out of memory", for
    a goal that holds wherever the peer fits in memory); a case where every peer the goal
    reads failed so is not counted at all (the result's ``excused`` counts them).
    ``device``: where the goal holds: "cuda" (a GPU goal, never evaluated on a CPU run),
    "cpu" (a goal for our CPU path, evaluated on CPU runs only) or "any" (both).
    ``gpu``: the GPU an absolute goal is set for (evaluated on it alone); None for goals that
    are relative to a peer or to the device's peak, evaluated on any GPU."""
    text: str
    ops: Tuple[str, ...]
    metric: str
    minimum: Optional[float]  # None for a goal with a maximum instead
    applies: Callable[[dict], bool] = lambda case: True
    gpu: Optional[str] = "H100"
    device: str = "cuda"
    maximum: Optional[float] = None  # the bar of a "<=" goal (then minimum is None)
    excuse: Tuple[str, ...] = ()

    def __post_init__(self):
        if (self.minimum is None) == (self.maximum is None):
            raise ValueError(f"goal {self.text!r}: give a minimum or a maximum, not both or neither")

    def _excused(self, row: dict) -> bool:
        error = (row["error"] or "").lower()
        return bool(error) and any(text.lower() in error for text in self.excuse)

    def applies_to(self, meta: dict) -> Optional[str]:
        """None when this goal is evaluated on a run with ``meta``, else why not."""
        on_gpu = str(meta.get("device", "")).startswith("cuda")
        name = str(meta.get("device_name") or "")
        if self.device == "cuda" and not on_gpu:
            return "not evaluated (a GPU goal; this is a CPU run)"
        if self.device == "cpu" and on_gpu:
            return "not evaluated (a CPU goal; this is a GPU run)"
        if not on_gpu and meta.get("backend_ours") == "triton":
            return "not evaluated (ours ran through the Triton interpreter: not a timing)"
        if on_gpu and self.gpu is not None and self.gpu not in name:
            return f"not evaluated (set for the {self.gpu}; this is {name})"
        return None

    def evaluate(self, runs: Sequence[Run]) -> dict:
        out = {"goal": self.text, "metric": self.metric, "minimum": self.minimum, "device": self.device,
               "cases": 0, "worst": None}
        if self.maximum is not None:
            out["maximum"] = self.maximum
        meta = runs[0].meta if runs else {}
        name = str(meta.get("device_name") or "")
        why = self.applies_to(meta)
        if why is not None:
            return out | {"status": why}
        peak = hbm_peak_gbps(name)
        if self.metric == "hbm_fraction" and peak is None:
            return out | {"status": f"not evaluated (no HBM peak known for {name})"}
        values = []
        unevaluated = 0  # cases the goal covers that gave no value (ours or every named peer failed or was skipped)
        excused = 0  # cases left out: every peer the goal reads failed with an error it excuses
        for run in runs:
            rows = run.ratios()
            by_case: Dict[tuple, List[dict]] = {}
            for row in rows:
                by_case.setdefault((row["op"], json.dumps(row["case"], sort_keys=True)), []).append(row)
            for (op, _), group in by_case.items():
                if op not in self.ops or not self.applies(group[0]["case"]):
                    continue
                ours = next((r for r in group if r["impl"] == OURS), None)
                if ours is None or ours["error"]:
                    unevaluated += 1
                    continue
                compared = [r for r in group if r["impl"] != OURS]  # the peers the goal reads
                if self.metric.startswith("speedup:") and self.metric != "speedup:fastest":
                    named = self.metric[len("speedup:"):].split("|")
                    compared = [r for r in compared if r["impl"] in named]
                if self.metric.startswith("speedup:") and self.excuse:
                    fits = [r for r in compared if not self._excused(r)]
                    if compared and not fits:
                        excused += 1
                        continue
                    compared = fits
                peers = [r for r in compared if r["speedup_of_ours"] is not None]
                if self.metric == "gbps":
                    v = ours["gbps"]
                elif self.metric == "tflops":
                    v = ours["tflops"]
                elif self.metric == "hbm_fraction":
                    v = ours["gbps"] / peak if ours["gbps"] is not None else None
                elif self.metric == "speedup:fastest":
                    v = min((r["speedup_of_ours"] for r in peers), default=None)
                elif self.metric.startswith("speedup:"):
                    v = min((r["speedup_of_ours"] for r in peers), default=None)
                elif self.metric.startswith("extra:"):
                    v = (ours.get("extra") or {}).get(self.metric[len("extra:"):])
                else:
                    raise ValueError(self.metric)
                if v is not None:
                    values.append((v, op, ours["case"]))
                # no value, or a peer the goal reads that ran in this case but failed or was skipped
                if v is None or (self.metric.startswith("speedup:") and len(peers) < len(compared)):
                    unevaluated += 1
        out["unevaluated"] = unevaluated
        if self.excuse:
            out["excused"] = excused
        if not values:
            return out | {"status": "not measured"}
        if self.maximum is not None:
            worst, op, case = max(values, key=lambda t: t[0])
            missed = worst > self.maximum
        else:
            worst, op, case = min(values, key=lambda t: t[0])
            missed = worst < self.minimum
        # "incomplete": met where measured, but not shown for every case the goal covers
        status = "missed" if missed else "incomplete" if unevaluated else "met"
        return out | {"cases": len(values), "worst": worst, "worst_case": {"op": op, **case}, "status": status}
