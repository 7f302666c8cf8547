"""``gradops bench floyd3``: 3-Floyd attention, gradops' ``pivotal_attention3`` against FloydNet's.

Both take FloydNet's signature (``q_ijk, k_pjk, k_ipk, k_ijp, v_pjk, v_ipk, v_ijp``, default
scale 1/sqrt(3 D)) and are called the same way, side by side in one process on the same inputs:

- ``gradops``: ``gradops.pivotal_attention3`` (its fused path: gradops' ``floyd3_attention``
  operator) with our backend as the default (``gradops.use_backend``): the Triton kernels on a
  GPU; on a CPU the reference backend (plain PyTorch, bounded memory; with ``--interpret``, our
  kernels through the Triton interpreter, a wiring check whose times mean nothing);
- ``floydnet``: ``floydnet.pivotal_attention3`` (PyPI ``floydnet``), eager: it materialises the
  [B,H,L,L,L,L] scores (L^4);
- compiled cases (``compiled=True``; on a GPU, ``--no-compile`` leaves them out; on a CPU only
  with ``--compile``): ``gradops`` is ``torch.compile(gradops.pivotal_attention3)`` and the peer
  ``floydnet compiled`` is ``torch.compile(floydnet.pivotal_attention3)``; static shapes, Dynamo
  reset before each case (compiled anew per case, on the first call, outside the timing).

Directions (``--direction``, default both): ``fwd``, the forward under ``torch.no_grad()`` (as
BREC evaluates), and ``fwdbwd``, the forward and ``torch.autograd.grad`` of every input, as a
training step runs them. FLOP: 12*B*H*L^4*D forward (three score and three value products),
36*B*H*L^4*D forward + backward (the backward: dP, dQ, the three dK and the three dV).

Cases: BREC-like sizes, B = 1 (``--batch``), I = J = K = P = L in 16, 32, 48, 64 (``--lengths``),
D = 32 (``--head-dim``), 4 and 8 heads (``--heads``); on a GPU bfloat16 and float16, on a CPU
float32. ``--quick``: L = 8 and 16 (a CPU run in well under a minute).

Every record of a case holds, where measured: ``times_ms``; on a GPU ``peak_bytes`` (the peak
the call allocated beyond what was allocated before it) and ``extra.peak_over_scores`` (that
peak over one [B,H,L,L,L,L] tensor of the dtype: FloydNet's score tensor), and on ours
``extra.peak_over_floydnet`` (ours over the FloydNet variant's of the same case);
``extra.rel_errors`` (max |x - ref| / max |ref| against float64 on the same rounded inputs:
Y for ``fwd``; Y and the seven gradients for ``fwdbwd``; the oracle of
``gradops.bench.floyd3_accuracy``, FloydNet's formula in float64 under autograd),
``extra.max_rel_error``, and on ours ``extra.error_over_floydnet`` (ours' largest over
FloydNet's largest) and ``extra.tensor_error_over_floydnet`` (the largest per-tensor ratio).
``--no-accuracy`` skips the errors.

Other modes: ``--accuracy`` runs ``gradops.bench.floyd3_accuracy`` (the error goal, per seed);
``--memory`` measures on the CPU, in fresh processes, the peak resident memory a forward +
backward holds beyond its inputs, outputs and gradients (:func:`memory_main`); ``--traffic``
hands over to ``gradops.bench.traffic.floyd3_main`` (the bytes our kernels move).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import harness
from .harness import DTYPES, OURS, Goal, Record, Run, progress

FAMILY = "floyd3"
PEER = "floydnet"
COMPILED_PEER = "floydnet compiled"
DIRECTIONS = ("fwd", "fwdbwd")
OPS = tuple(f"floyd3_{d}" for d in DIRECTIONS)
LENGTHS = (16, 32, 48, 64)
QUICK_LENGTHS = (8, 16)
HEADS = (4, 8)
HEAD_DIM = 32
PLOT = dict(x_key="L", metric="median_ms", group_keys=("op", "H", "dtype", "compiled"))
OUT_OF_MEMORY = ("out of memory", "OutOfMemoryError")
MEMORY_LENGTHS = (32, 48, 64, 96)
MEMORY_HEADS, MEMORY_HEAD_DIM = 1, 4
SIXTEEN_BIT = ("float16", "bfloat16")


def _eager(c: dict) -> bool:
    return not c["compiled"]


def _brec(c: dict) -> bool:
    return 16 <= c["L"] <= 64


# PERFORMANCE.md: "3-Floyd | >= 2x FloydNet's pivotal_attention3 at BREC-like sizes (L 16-64, D 32) at
# <= 0.25x its memory; never an L^4 tensor"; and the error goal of floyd3_accuracy, read off each case.
GOALS = (
    Goal("3-Floyd >= 2x FloydNet's pivotal_attention3 eager at BREC-like sizes (L 16-64), fwd and fwd+bwd", OPS,
         f"speedup:{PEER}", 2.0, lambda c: _eager(c) and _brec(c), gpu=None, excuse=OUT_OF_MEMORY),
    Goal("3-Floyd peak memory <= 0.25x FloydNet's at BREC-like sizes (L 16-64; eager and compiled, each against "
         "FloydNet's of its kind)", OPS, "extra:peak_over_floydnet", None, _brec, gpu=None, maximum=0.25),
    Goal("3-Floyd fwd+bwd max relative error vs float64 <= 0.5x FloydNet eager's, 16-bit", ("floyd3_fwdbwd",),
         "extra:error_over_floydnet", None, lambda c: _eager(c) and c["dtype"] in SIXTEEN_BIT, gpu=None,
         maximum=0.5),
)


def fwd_flops(b: int, h: int, length: int, d: int) -> float:
    return 12.0 * b * h * length ** 4 * d


def fwdbwd_flops(b: int, h: int, length: int, d: int) -> float:
    return 36.0 * b * h * length ** 4 * d


FLOPS = {"fwd": fwd_flops, "fwdbwd": fwdbwd_flops}


# ---------------------------------------------------------------------------------------------
# The implementations
# ---------------------------------------------------------------------------------------------
def floydnet_order(inputs):
    """gradops' operator order (q, k1, v1, k2, v2, k3, v3) -> FloydNet's (q, k_pjk, k_ipk, k_ijp,
    v_pjk, v_ipk, v_ijp)."""
    q, k1, v1, k2, v2, k3, v3 = inputs
    return q, k1, k2, k3, v1, v2, v3


def pivotal(impl: str, backend: str, compiled: bool) -> Callable:
    """``fn(q, k_pjk, k_ipk, k_ijp, v_pjk, v_ipk, v_ijp) -> y`` of ``impl`` (FloydNet's signature,
    default scale): ours with ``backend`` as gradops' default around the call, FloydNet's as it
    ships; ``compiled``: under ``torch.compile`` (static shapes)."""
    if impl == OURS:
        import gradops

        target = gradops.pivotal_attention3
    else:
        from floydnet.functional import pivotal_attention3 as target
    fn = torch.compile(target, dynamic=False) if compiled else target
    if impl != OURS:
        return fn

    def ours(*tensors):
        import gradops

        with gradops.use_backend(backend):
            return fn(*tensors)

    return ours


def makers(fn: Callable, inputs, dy) -> Dict[str, Callable[[], object]]:
    """direction -> the callable timed: ``fwd`` under no_grad; ``fwdbwd`` the forward and the
    gradients of the seven inputs (gradops' order)."""
    leaves = [t.detach().requires_grad_() for t in inputs]

    def fwd():
        with torch.no_grad():
            return fn(*floydnet_order(inputs))

    def fwdbwd():
        y = fn(*floydnet_order(leaves))
        return (y.detach(), *torch.autograd.grad(y, leaves, dy))

    return {"fwd": fwd, "fwdbwd": fwdbwd}


def make_inputs(b: int, h: int, length: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """``(q, k1, v1, k2, v2, k3, v3), dy`` (gradops' order), normal in float32 from a generator on
    ``device`` seeded with ``seed``, rounded to ``dtype``: every implementation gets these."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (b, h, length, length, length, d)
    tensors = [torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype) for _ in range(8)]
    return tuple(tensors[:7]), tensors[7]


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def optional_peers(device: str) -> Dict[str, Optional[str]]:
    """Peers: name -> None when usable here, else why not."""
    try:
        from floydnet.functional import pivotal_attention3  # noqa: F401
    except Exception as e:
        why = f"floydnet is not importable ({type(e).__name__}: {e})"[:200]
        return {PEER: why, COMPILED_PEER: why}
    return {PEER: None, COMPILED_PEER: None}


def _lengths(args) -> Tuple[int, ...]:
    return tuple(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS))


def _heads(args) -> Tuple[int, ...]:
    return tuple(args.heads or HEADS)


def cases(args) -> List[Tuple[int, int, str, bool]]:
    """(L, H, dtype, compiled) of every case, in the order measured: every eager case, then the
    compiled ones."""
    phases = (False, True) if args.compile else (False,)
    return [(length, h, dt, compiled) for compiled in phases for dt in args.dtypes for h in _heads(args)
            for length in _lengths(args)]


def impl_names(args) -> List[str]:
    return [OURS, PEER] + ([COMPILED_PEER] if args.compile else [])


def our_backend(args) -> str:
    """Ours: the Triton kernels on a GPU (or through the interpreter on a CPU with --interpret)
    where gradops has them for 3-Floyd, else the reference backend (saying why)."""
    from .._backend import has_triton_kernels

    backend = harness.ours_backend(args)
    if backend == "triton" and not has_triton_kernels("floyd3_attention"):
        print("gradops bench floyd3: there are no Triton kernels for floyd3_attention here; ours is the reference "
              "backend", file=sys.stderr)
        return "reference"
    return backend


def case_of(args, length: int, h: int, dt: str, compiled: bool) -> dict:
    return {"B": args.batch, "H": h, "L": length, "D": args.head_dim, "dtype": dt, "compiled": compiled}


def run(args) -> Run:
    """Measure every case of ``args`` (parsed by :func:`parse_args`, resolved by :func:`prepare`)."""
    why = optional_peers(args.device)[PEER]
    if why is not None:
        raise SystemExit(f"gradops bench floyd3: {why}")
    from importlib.metadata import version

    device = args.device
    directions = list(dict.fromkeys(args.direction or DIRECTIONS))
    backend = our_backend(args)
    result = Run(FAMILY, device, args.deadline)
    result.meta.update(floydnet=version("floydnet"), backend_ours=backend, directions=directions,
                       lengths=list(_lengths(args)), heads=list(_heads(args)), head_dim=args.head_dim,
                       batch=args.batch, scale="FloydNet's default, 1/sqrt(3 D), for both",
                       compiled="torch.compile(fn, dynamic=False), anew per case" if args.compile else
                       ("left out (--no-compile)" if device == "cuda" else "not run on a CPU without --compile"))
    for length, h, dt, compiled in progress(cases(args), FAMILY):
        case = case_of(args, length, h, dt, compiled)
        peer = COMPILED_PEER if compiled else PEER
        if result.out_of_time():
            for impl in (OURS, peer):
                result.skip([f"floyd3_{d}" for d in directions], case, impl=impl)
            continue
        dtype = DTYPES[dt]
        inputs, dy = make_inputs(args.batch, h, length, args.head_dim, dtype, device)
        fns = {}
        if compiled:
            import torch._dynamo

            torch._dynamo.reset()  # a fresh static compile per case (no recompile limit reached)
        for impl, name in ((OURS, OURS), (PEER, peer)):
            try:
                fns[name] = makers(pivotal(impl, backend, compiled), inputs, dy)
            except Exception as e:
                fns[name] = {d: _raiser(e) for d in directions}
        scores = args.batch * h * length ** 4 * dtype.itemsize
        for name, fn_of in fns.items():
            for direction in directions:
                rec = result.time(f"floyd3_{direction}", case, name, fn_of[direction],
                                  flops=FLOPS[direction](args.batch, h, length, args.head_dim),
                                  memory=device == "cuda", reps=args.reps, warmup=args.warmup,
                                  max_seconds=args.max_seconds, flush_l2=False)
                if rec.peak_bytes is not None:
                    rec.extra["peak_over_scores"] = rec.peak_bytes / scores
                _free(device)
        for direction in directions:
            rows = {r.impl: r for r in result.records if r.case == case and r.op == f"floyd3_{direction}"}
            ours, theirs = rows.get(OURS), rows.get(peer)
            if ours is not None and theirs is not None and ours.peak_bytes and theirs.peak_bytes:
                ours.extra["peak_over_floydnet"] = ours.peak_bytes / theirs.peak_bytes
        if args.accuracy and not result.out_of_time():
            try:
                record_accuracy(result, case, fns, inputs, dy, directions, peer)
            except Exception as e:  # e.g. the float64 oracle out of memory: said on ours
                for r in result.records:
                    if r.case == case and r.impl == OURS:
                        r.extra["max_rel_error_error"] = f"{type(e).__name__}: {e}"[:200]
        del fns, inputs, dy
        _free(device)
    return result


def record_accuracy(result: Run, case: dict, fns: Dict[str, Dict[str, Callable]], inputs, dy,
                    directions: Sequence[str], peer: str) -> None:
    """The error against float64 of each implementation's ``fwd`` (Y) and ``fwdbwd`` (Y and the
    seven gradients) on its records of ``case`` (the module docstring)."""
    from .floyd3_accuracy import TENSORS, default_scale, oracle
    from .floyd_accuracy import relative_errors

    shape = tuple(inputs[0].shape[:2]) + (case["L"],) * 4 + (case["D"],)
    reference = oracle(inputs, dy, None, default_scale(shape))
    for direction in directions:
        op = f"floyd3_{direction}"
        records = {r.impl: r for r in result.records if r.case == case and r.op == op and not r.error}
        for name, rec in records.items():
            try:
                got = fns[name][direction]()
            except Exception as e:
                rec.extra["max_rel_error_error"] = f"{type(e).__name__}: {e}"[:200]
                continue
            got = [got] if isinstance(got, torch.Tensor) else list(got)
            rel = relative_errors(got, reference[:len(got)])
            rec.extra["rel_errors"] = dict(zip(TENSORS, rel))
            rec.extra["max_rel_error"] = max(rel)
            del got
        ours, theirs = records.get(OURS), records.get(peer)
        if ours is None or theirs is None or "rel_errors" not in ours.extra or "rel_errors" not in theirs.extra:
            continue
        if theirs.extra["max_rel_error"]:
            ours.extra["error_over_floydnet"] = ours.extra["max_rel_error"] / theirs.extra["max_rel_error"]
        ratios = [ours.extra["rel_errors"][t] / e for t, e in theirs.extra["rel_errors"].items() if e]
        if ratios:
            ours.extra["tensor_error_over_floydnet"] = max(ratios)
    del reference


def _raiser(error: Exception):
    def fn():
        raise error
    return fn


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def summary_lines(result: Run) -> List[str]:
    """Per case and direction: ours' time, peak and error beside the peer's, and the ratios."""
    lines = [f"{'op':<14} {'L':>3} {'H':>2} {'dtype':<9} {'compiled':<8} {'ours ms':>9} {'peer ms':>9} {'x':>6} "
             f"{'ours MiB':>9} {'peer MiB':>9} {'mem x':>6} {'ours err':>9} {'peer err':>9} {'err x':>6}"]
    by_case: Dict[tuple, Dict[str, Record]] = {}
    for r in result.records:
        by_case.setdefault((r.op, json.dumps(r.case, sort_keys=True)), {})[r.impl] = r

    def cell(v, fmt):
        return "-" if v is None else fmt % v

    for (op, _), group in by_case.items():
        ours = group.get(OURS)
        peer = next((r for name, r in group.items() if name != OURS), None)
        if ours is None or peer is None:
            continue
        c = ours.case
        ok = [r for r in (ours, peer) if not r.error]
        ms = {id(r): r.median_ms for r in ok}
        mib = {id(r): r.peak_bytes / 2**20 for r in ok if r.peak_bytes is not None}
        err = {id(r): r.extra.get("max_rel_error") for r in ok}
        speed = ms[id(peer)] / ms[id(ours)] if id(ours) in ms and id(peer) in ms else None
        lines.append(
            f"{op:<14} {c['L']:>3} {c['H']:>2} {c['dtype']:<9} {str(c['compiled']):<8} "
            f"{cell(ms.get(id(ours)), '%9.3f'):>9} {cell(ms.get(id(peer)), '%9.3f'):>9} {cell(speed, '%5.2fx'):>6} "
            f"{cell(mib.get(id(ours)), '%9.1f'):>9} {cell(mib.get(id(peer)), '%9.1f'):>9} "
            f"{cell(ours.extra.get('peak_over_floydnet'), '%6.3f'):>6} {cell(err.get(id(ours)), '%9.2e'):>9} "
            f"{cell(err.get(id(peer)), '%9.2e'):>9} {cell(ours.extra.get('error_over_floydnet'), '%6.3f'):>6}")
    lines.append("x: the peer's time over ours (> 1: gradops is faster); mem x and err x: ours over the peer's "
                 "(< 1: gradops holds less, errs less); err: max over Y (and the gradients, fwdbwd) of "
                 "max |x - ref| / max |ref| against float64")
    return lines


# ---------------------------------------------------------------------------------------------
# --memory: peak resident memory on the CPU, each measurement in a fresh process
# ---------------------------------------------------------------------------------------------
_MEMORY_CHILD = r"""
import json, sys
import torch
from gradops.bench.floyd3 import memory_child
print(json.dumps(memory_child(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]), sys.argv[7])))
"""
MMAP_THRESHOLD = "65536"  # glibc: allocations above 64 KiB mapped, returned to the system when freed


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Linux: the peak resident set size (VmHWM) reset to what is resident now (clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmHWM")


def peak_can_be_reset() -> bool:
    try:
        _reset_peak()
        return True
    except (OSError, RuntimeError):
        return False


def memory_child(impl: str, direction: str, b: int, h: int, length: int, d: int, dtype: str) -> dict:
    """In a fresh process: the growth of the peak resident set over one ``direction`` call of
    ``impl`` (ours on the reference backend) at B x H x L^3 x D, the inputs (and dY) made and
    every library's one-time set-up done (a tiny call of the same) before the peak is reset;
    with the bytes of what the call returns (Y, and the seven gradients for fwdbwd)."""
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    fn = pivotal(impl, "reference", False)
    tiny, tiny_dy = make_inputs(1, 1, 2, d, dt, "cpu")
    makers(fn, tiny, tiny_dy)[direction]()
    inputs, dy = make_inputs(b, h, length, d, dt, "cpu")
    call = makers(fn, inputs, dy)[direction]
    before = _reset_peak()
    result = call()
    after = _status_bytes("VmHWM")
    result = [result] if isinstance(result, torch.Tensor) else list(result)
    return {"impl": impl, "direction": direction, "B": b, "H": h, "L": length, "D": d, "dtype": dtype,
            "grew": after - before, "returned": sum(t.numel() * t.element_size() for t in result),
            "inputs": sum(t.numel() * t.element_size() for t in (*inputs, dy)), "threads": torch.get_num_threads()}


def measure_memory(impl: str, direction: str, b: int, h: int, length: int, d: int, dtype: str = "float32",
                   timeout: float = 900.0) -> dict:
    """:func:`memory_child` in a fresh interpreter with ``MALLOC_MMAP_THRESHOLD_`` = 64 KiB (so that
    freed tensors leave the resident set and the peak is the call's own), and ``held``: the growth
    less what the call returned (bytes held beyond the inputs, the outputs and the gradients);
    or ``{"error"}``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD,
               PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-c", _MEMORY_CHILD, impl, direction, str(b), str(h), str(length), str(d), dtype]
    case = {"impl": impl, "direction": direction, "B": b, "H": h, "L": length, "D": d, "dtype": dtype}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired:
        return case | {"error": f"no result within {timeout:.0f} s"}
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ""
        killed = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
        return case | {"error": f"exit {proc.returncode}{killed}" + (f": {tail}" if tail else ""), "seconds": seconds}
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return found | {"held": found["grew"] - found["returned"], "seconds": seconds}


def memory_lines(rows: Sequence[dict]) -> List[str]:
    """The memory table: per L and direction, ours' and FloydNet's bytes held, the ratio, and one
    [B,H,L^4] float tensor (the score tensor FloydNet builds) for scale."""
    mib = 2 ** 20
    by = {(r["direction"], r["L"], r["impl"]): r for r in rows}
    lines = [f"{'direction':<9} {'L':>4} {'gradops MiB':>12} {'FloydNet MiB':>13} {'ours / FloydNet':>16} "
             f"{'one L^4 tensor MiB':>19}"]
    for direction, length in dict.fromkeys((r["direction"], r["L"]) for r in rows):
        ours, theirs = by.get((direction, length, OURS)), by.get((direction, length, PEER))
        some = ours or theirs

        def cell(r):
            if r is None:
                return "-"
            return "error" if "error" in r else f"{r['held'] / mib:.1f}"

        ratio = (f"{ours['held'] / theirs['held']:.4f}" if ours and theirs and "held" in ours and "held" in theirs
                 and theirs["held"] > 0 else "-")
        l4 = some["B"] * some["H"] * length ** 4 * DTYPES[some["dtype"]].itemsize / mib
        lines.append(f"{direction:<9} {length:>4} {cell(ours):>12} {cell(theirs):>13} {ratio:>16} {l4:>19.1f}")
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']} {r['direction']} L={r['L']}: {r['error']}")
    return lines


def memory_main(args) -> int:
    """``gradops bench floyd3 --memory``: for each --memory-lengths L (default 32 48 64 96) and
    direction (default fwdbwd, then fwd), ours (the reference backend) and FloydNet's, each in a
    fresh process (:func:`measure_memory`) at B = --batch, H = --heads (default 1), D =
    --head-dim (default 4), --dtype (default float32); the table, and the rows as JSON where the
    bench's results go. Exit status 1 when a measurement failed, 2 when it cannot run here."""
    from .floyd_accuracy import write_json

    if (args.device or "cpu") != "cpu":
        print("gradops bench floyd3 --memory: measures resident memory on the CPU (on a GPU the bench's records hold "
              "peak_bytes)", file=sys.stderr)
        return 2
    args.device = "cpu"
    if not sys.platform.startswith("linux") or not peak_can_be_reset():
        print("gradops bench floyd3 --memory: needs Linux's /proc/self/clear_refs and VmHWM", file=sys.stderr)
        return 2
    if optional_peers("cpu")[PEER] is not None:
        print(f"gradops bench floyd3 --memory: {optional_peers('cpu')[PEER]}", file=sys.stderr)
        return 2
    lengths = args.memory_lengths or list(MEMORY_LENGTHS)
    heads = (args.heads or [MEMORY_HEADS])[0]
    d = args.head_dim if args.head_dim_given else MEMORY_HEAD_DIM
    dtype = (args.dtypes or ["float32"])[0]
    directions = list(dict.fromkeys(args.direction or ("fwdbwd", "fwd")))
    print(f"gradops bench floyd3 --memory: peak resident memory held beyond inputs, outputs and gradients, each "
          f"call in a fresh process (MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}); B={args.batch}, H={heads}, D={d}, "
          f"{dtype}; ours on the reference backend", flush=True)
    rows = []
    for direction in directions:
        for length in lengths:
            for impl in (OURS, PEER):
                rows.append(measure_memory(impl, direction, args.batch, heads, length, d, dtype))
                r = rows[-1]
                what = r["error"] if "error" in r else f"held {r['held'] / 2**20:.1f} MiB"
                print(f"  {impl:<8} {direction:<6} L={length}: {what} ({r.get('seconds', 0):.1f} s)", flush=True)
    print("\n".join(memory_lines(rows)))
    write_json(args, "floyd3-memory", {"benchmark": "gradops bench floyd3 --memory", "meta": harness.device_info("cpu"),
                                       "malloc_mmap_threshold": MMAP_THRESHOLD, "rows": rows})
    return int(any("error" in r for r in rows))


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def parse_args(argv):
    from .floyd3_accuracy import DEFAULT_SHAPE, parse_shape

    p = argparse.ArgumentParser(prog="gradops bench floyd3", description=__doc__.split("\n\n")[0])
    harness.add_common_args(p, dtypes=("bfloat16", "float16", "float32", "float64"),
                            dtype_help="default: bfloat16 float16 on a GPU, float32 on a CPU (--accuracy: float16)",
                            quick_help="L = 8 and 16, few repetitions: a smoke run (seconds on a CPU)")
    p.add_argument("--lengths", nargs="+", type=_positive, metavar="L",
                   help=f"I = J = K = P = L (default {' '.join(map(str, LENGTHS))}; --quick "
                        f"{' '.join(map(str, QUICK_LENGTHS))})")
    p.add_argument("--heads", nargs="+", type=_positive, metavar="H",
                   help=f"heads (default {' '.join(map(str, HEADS))}; --memory: {MEMORY_HEADS})")
    p.add_argument("--head-dim", type=_positive, default=None, metavar="D",
                   help=f"D (default {HEAD_DIM}; --memory: {MEMORY_HEAD_DIM})")
    p.add_argument("--batch", type=_positive, default=1, help="B (default 1)")
    p.add_argument("--direction", action="append", choices=DIRECTIONS,
                   help="fwd (under no_grad) or fwdbwd (forward then every input's gradient); repeatable; default both")
    p.add_argument("--threads", type=_positive, default=None,
                   help="on a CPU, torch's intra-op threads for the run (default: 1 with --quick, whose tiny calls "
                        "gain nothing from threads and, on a loaded machine, lose milliseconds per op at their "
                        "barriers; else torch's default)")
    p.add_argument("--no-compile", action="store_true", help="on a GPU, leave out the torch.compile cases")
    p.add_argument("--compile", dest="compile_cpu", action="store_true",
                   help="on a CPU, add the torch.compile cases (compiling takes a while)")
    p.add_argument("--no-accuracy", dest="accuracy", action="store_false",
                   help="skip the error against float64 of every record (default: measured)")
    p.add_argument("--accuracy", dest="accuracy_run", action="store_true",
                   help="ours' error per tensor against FloydNet's, per seed (gradops.bench.floyd3_accuracy; default "
                        f"--shape {','.join(map(str, DEFAULT_SHAPE))}, --dtype float16); exit 1 where a tensor's ratio "
                        "exceeds 0.5")
    p.add_argument("--shape", action="append", type=parse_shape, metavar="B,H,I,J,K,P,D",
                   help="with --accuracy: a shape (repeatable)")
    p.add_argument("--seeds", type=int, default=5, help="with --accuracy: seeds 0 .. SEEDS-1 (default 5)")
    p.add_argument("--backend", choices=("reference", "triton"),
                   help="with --accuracy: ours' backend (default: triton where its kernels exist, through the "
                        "interpreter on a CPU, else reference)")
    p.add_argument("--mask", action="store_true", help="with --accuracy: a boolean mask removing ~10%% of the pivots")
    p.add_argument("--inf", type=float, default=None,
                   help="with --accuracy: FloydNet's masked magnitude (default 1e4 in float16, else 1e9)")
    p.add_argument("--memory", action="store_true",
                   help="peak resident memory beyond inputs, outputs and gradients, ours (reference) against "
                        "FloydNet, each call in a fresh process, on the CPU (default B=1, H=1, D=4, float32)")
    p.add_argument("--memory-lengths", nargs="+", type=_positive, metavar="L",
                   help=f"with --memory: the lengths (default {' '.join(map(str, MEMORY_LENGTHS))})")
    p.add_argument("--traffic", action="store_true",
                   help="the bytes our kernels move, through the Triton interpreter: the rest of the command line "
                        "goes to gradops.bench.traffic.floyd3_main (its options: --shape B,H,I,J,K,P,D or B,H,L,D, "
                        "--dtype, --mask, --quick, --scale, --json PATH)")
    args = p.parse_args(argv)
    args.head_dim_given = args.head_dim is not None
    if args.head_dim is None:
        args.head_dim = HEAD_DIM
    return args


def prepare(args, need_device: bool = True):
    args.device = args.device or harness.default_device()
    quick_cpu = args.device != "cuda" and not args.quick
    harness.prepare(args, reps=5 if quick_cpu else 20, warmup=1 if quick_cpu else 3,
                    max_seconds=4.0 if quick_cpu else 2.0, quick_reps=3, quick_warmup=1, quick_max_seconds=0.5,
                    need_device=need_device, gpu_dtypes=("bfloat16", "float16"), cpu_dtypes=("float32",))
    args.compile = (args.device == "cuda" and not args.no_compile) or (args.device != "cuda" and args.compile_cpu)
    if args.threads is None and args.device != "cuda" and args.quick:
        args.threads = 1
    return args


@contextlib.contextmanager
def cpu_threads(args):
    """torch's intra-op threads set to ``args.threads`` for the block on a CPU run (restored after)."""
    before = torch.get_num_threads()
    if args.device != "cuda" and args.threads:
        torch.set_num_threads(args.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def traffic_main(argv: Sequence[str]) -> int:
    """``--traffic``: ``gradops.bench.traffic.floyd3_main(argv)``, which parses ``argv`` itself (its
    options: --shape B,H,I,J,K,P,D or B,H,L,D, --dtype, --mask, --quick, --scale, --json)."""
    from . import traffic

    floyd3_main = getattr(traffic, "floyd3_main", None)
    if floyd3_main is None:
        print("gradops bench floyd3 --traffic: gradops.bench.traffic has no floyd3_main yet (the 3-Floyd traffic "
              "count is not written): nothing to run", file=sys.stderr)
        return 2
    return floyd3_main(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--traffic" in argv:  # its own options (traffic.floyd3_main parses them): before ours
        return traffic_main(argv)
    args = parse_args(argv)
    if args.accuracy_run:  # on a CPU through the interpreter, which it switches on itself
        from . import floyd3_accuracy

        return floyd3_accuracy.main(args)
    if args.memory:
        return memory_main(args)
    args = prepare(args)
    harness.announce(args, FAMILY)
    with cpu_threads(args):
        result = run(args)
        if args.device != "cuda":
            result.meta["cpu_threads"] = torch.get_num_threads()
    harness.finish(result, args, FAMILY, PLOT, GOALS)
    print()
    print("\n".join(summary_lines(result)))
    return result.exit_status()


if __name__ == "__main__":
    sys.exit(main())
