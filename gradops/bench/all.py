"""``gradops bench all``: validate a GPU machine in one command.

Runs the norm, NSA, Floyd, model and FloydNet-step benchmarks in turn at their GPU shapes
(bfloat16, and float32 where a goal or a second code path asks for it), against every peer that
imports here, within one time budget, and writes one folder: each part's JSON and PNG, and
``summary.json`` / ``summary.txt`` (per family, the worst and median ratio of each peer's time
to ours, and each goal of docs/benchmarks.md: met, missed, incomplete, not measured or not
evaluated). Exits 1 when one of our measurements failed, a part crashed, or the budget left
cases unmeasured.

On a CPU it runs the CPU comparison instead (``CPU_PLAN``: our CPU path against ATen,
autograd and torch.compile at the CPU shapes of the norms and NSA, and the cost of a call),
and with ``--quick`` the wiring check (``CPU_QUICK_PLAN``: tiny shapes, our kernels through
the Triton interpreter).

The plan is data (``GPU_PLAN``, ``CPU_PLAN`` and the two quick plans below): each part is a family's own
command line, so ``gradops bench FAMILY ARGS`` reproduces any part alone. Each part has a
share of the budget; part i stops starting measurements once the shares of parts 1..i are
spent (time a part leaves over passes on; an overrun is taken from the parts after it).
docs/gpu.md gives the budget arithmetic. ``--dry-run`` prints the plan and runs nothing.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from . import harness

FAMILIES = ("norm", "nsa", "floyd", "overhead", "model", "floydnet")
NORM_OPS = ("rms_bwd", "ln_bwd", "rms_fwd", "ln_fwd")


@dataclass(frozen=True)
class Part:
    name: str  # file stem in the results folder
    family: str  # gradops.bench.<family>
    argv: Tuple[str, ...]  # that benchmark's own flags
    share: float  # seconds of the default budget
    what: str


def _shapes(*shapes: str) -> Tuple[str, ...]:
    return tuple(a for s in shapes for a in ("--shape", s))


# The validation on a GPU, in the order of issue 33: the norms and NSA (host, eager and kernel
# time), Floyd forward + backward against FloydNet eager and compiled, a whole model step, a step
# of FloydNet's blocks (issue 44), then the rest of the sweep. Each share is seconds: the plan
# runs whole in GPU_BUDGET (an estimate, docs/gpu.md), and a shorter --budget-seconds cuts it
# from the end, as much as fits, each part cut recorded as skipped (gpu_validate.sh's one-call
# `all` gives the sweep what its tests left).
GPU_MAX_SECONDS = 1.0  # per measurement: warm-up and timed repetitions are each bounded by it
FLOYD_FWDBWD = ("--dtype", "bfloat16", "--direction", "fwdbwd")
GPU_PLAN = (
    Part("norm", "norm", ("--ops", *NORM_OPS, "--dtype", "bfloat16", "--widths", "1024", "16384", "65536",
                          "--peers", "autograd", "aten", "liger", "--check"), 30,
         "bfloat16 at 32768 x 1024, 8192 x 16384 and 2048 x 65536 (M = min(32768, 128M/N)), kernel (CUDA-graph "
         "replay), eager and host time, outputs checked against the reference"),
    Part("norm-small", "norm", ("--ops", *NORM_OPS, "ln_call", "rms_call", "--dtype", "bfloat16", "--widths",
                                "1024", "4096", "--numel", str(2**20), "--peers", "autograd", "aten", "liger"), 15,
         "launch-bound shapes, M*N = 1M, and the cost of an nn.functional call (fwd+bwd) on tiny tensors"),
    Part("overhead", "overhead", ("--dtype", "bfloat16", "--reps", "7"), 10,
         "host time per call of each entry point at 8x64 against torch's call and a bare autograd.Function"),
    Part("norm-compile", "norm", ("--ops", "rms_bwd", "ln_bwd", "--dtype", "bfloat16", "--widths", "4096",
                                  "--peers", "compile"), 15,
         "torch.compile at 32K x 4096 (one compilation per case)"),
    Part("nsa", "nsa", ("--tokens", "65536", "--heads", "16", "64", "--dims", "128", "--blocks", "32x16",
                        "--dtype", "bfloat16", "--peers", "reference", "naive"), 15,
         "T = 64K packed, bfloat16, 16 and 64 heads"),
    Part("floyd", "floyd", (*_shapes("1,8,512,512,512,128", "1,8,512,512,512,64", "1,8,256,256,256,128",
                                     "1,8,256,256,256,64"), *FLOYD_FWDBWD, "--impl", "gradops", "floydnet",
                            "compiled"), 50,
         "forward + backward, L = 512 and 256, D = 128 and 64, bfloat16, against FloydNet eager and torch.compile "
         "of its pivotal_attention: time, peak memory and error against float64"),
    Part("floyd-strategies", "floyd", (*_shapes("1,8,512,512,512,128", "1,8,512,512,512,64"), *FLOYD_FWDBWD,
                                       "--impl", "gradops", "gradops-hybrid", "gradops-chunked", "gradops-fused",
                                       "--no-accuracy"), 25,
         "forward + backward at L = 512, D = 128 and 64: each strategy forced (the rule's inputs)"),
    Part("model", "model", ("--compile",), 100,
         "a training step of a Llama (RMSNorm) and a GPT-2 (LayerNorm), unpatched and patched, eager then "
         "torch.compile, then Liger's"),
    Part("floydnet", "floydnet", ("--dtype", "bfloat16"), 60,
         "a training step (forward + backward) of 8 FloydNet blocks, TSP (width 384, 6 heads, L = 20..200) and graph "
         "count (768, 12 heads, L = 32, 64), bf16 autocast: FloydNet eager and torch.compile(dynamic=True) against "
         "gradops-patched, time, host time, launches and peak memory (the compiled ones after every eager one)"),
    # the rest of the sweep
    Part("norm-fp32", "norm", ("--ops", *NORM_OPS, "--dtype", "float32", "--widths", "1024", "4096", "16384",
                               "65536", "--peers", "autograd", "aten", "liger", "--check"), 20,
         "float32 width sweep"),
    Part("norm-wide", "norm", ("--ops", *NORM_OPS, "--dtype", "bfloat16", "--widths", "4096", "262144",
                               "--peers", "autograd", "aten", "liger", "--check"), 15,
         "bfloat16 at 32768 x 4096 and 512 x 262144"),
    Part("norm-add", "norm", ("--ops", "add_rms_bwd", "add_rms_fwd", "--dtype", "bfloat16", "--widths", "4096",
                              "16384", "--peers", "autograd", "liger", "--check"), 10,
         "the residual add fused into RMSNorm (Llama's casting) against a separate add and norm, and Liger's"),
    Part("nsa-more", "nsa", ("--tokens", "65536", "--heads", "4", "16", "--dims", "128", "--blocks", "64x32",
                             "--dtype", "bfloat16", "--peers", "reference", "naive"), 15,
         "4 heads, and blocks of 64 with stride 32"),
    Part("nsa-fp32", "nsa", ("--tokens", "65536", "--heads", "16", "--dims", "128", "192", "--blocks", "32x16",
                             "--dtype", "float32", "--peers", "reference", "naive"), 20, "float32, D = 128 and 192"),
    Part("nsa-compile", "nsa", ("--tokens", "65536", "--heads", "16", "--dims", "128", "--blocks", "32x16",
                                "--dtype", "bfloat16", "--peers", "compile"), 35,
         "torch.compile of the reference (one compilation per case)"),
    Part("floyd-directions", "floyd", (*_shapes("1,8,512,512,512,128", "1,8,512,512,512,32"), "--dtype", "bfloat16",
                                       "--direction", "fwd", "--direction", "bwd", "--impl", "gradops", "einsum",
                                       "floydnet", "--no-accuracy"), 20,
         "forward and backward alone at L = 512, D = 128 and 32, against FloydNet and its einsum formulation"),
    Part("floyd-large", "floyd", (*_shapes("1,4,1024,1024,1024,128"), "--dtype", "bfloat16",
                                  "--direction", "fwd", "--direction", "bwd",
                                  "--impl", "gradops", "einsum", "floydnet"), 20,
         "N = M = K = 1024, D = 128 (the einsum peers may run out of memory: a result)"),
)
GPU_BUDGET = sum(p.share for p in GPU_PLAN)

# A smoke run on a GPU: a minute or two.
GPU_QUICK_BUDGET = 120.0
GPU_QUICK_PLAN = (
    Part("norm", "norm", ("--quick", "--dtype", "bfloat16", "float32", "--widths", "1024", "8192",
                          "--numel", str(2**22), "--check"), 40, "two widths"),
    Part("nsa", "nsa", ("--quick", "--dtype", "bfloat16", "float32"), 30, "T = 4096"),
    Part("floyd", "floyd", (*_shapes("1,2,128,128,128,64"), "--quick", "--dtype", "bfloat16",
                            "--impl", "gradops", "reference", "einsum", "floydnet"), 50, "N = M = K = 128"),
)

# On a CPU: tiny shapes, our kernels through the Triton interpreter (float32 only for Floyd:
# the interpreter's bfloat16 tl.dot is wrong, triton issue 11584). Checks the wiring, not speed.
CPU_QUICK_BUDGET = 150.0
CPU_QUICK_PLAN = (
    Part("norm", "norm", ("--quick", "--interpret", "--dtype", "float32", "bfloat16", "--widths", "256", "1024",
                          "--numel", "8192", "--peers", "autograd", "aten", "--check"), 60, "tiny norms"),
    Part("nsa", "nsa", ("--quick", "--interpret", "--dtype", "float32", "bfloat16"), 40, "T = 192"),
    Part("floyd", "floyd", (*_shapes("1,2,16,16,16,16", "1,1,32,32,32,32"), "--quick", "--interpret",
                            "--dtype", "float32", "--impl", "gradops", "einsum", "floydnet", "reference"), 50,
         "two tiny shapes: the rule picks the fused strategy, then the hybrid one"),
)


# The CPU comparison (docs/benchmarks.md, "On a CPU"): our CPU path (the reference backend)
# against ATen, autograd and torch.compile at the CPU shapes; timings, not a wiring check.
# Calls take 0.05-1 s on a 2-core machine and every torch.compile case compiles anew.
CPU_BUDGET = 920.0
CPU_PLAN = (
    Part("norm", "norm", ("--ops", *NORM_OPS, "--dtype", "float32", "bfloat16", "--widths", "4096", "16384",
                          "--numel", str(32 * 2**20), "--peers", "autograd", "aten", "compile"), 640,
         "our CPU path at 8192 x 4096 and 2048 x 16384, float32 and bfloat16, against ATen, autograd and "
         "torch.compile"),
    Part("norm-call", "norm", ("--ops", "ln_call", "rms_call", "--dtype", "float32", "bfloat16",
                               "--peers", "autograd"), 20,
         "the cost of a call: nn.functional fwd+bwd on tiny tensors against torch.nn.functional"),
    Part("overhead", "overhead", ("--dtype", "float32", "--reps", "7"), 20,
         "gradops' Python around its Triton launches (stubbed) against a bare autograd.Function and torch's call"),
    Part("nsa", "nsa", ("--tokens", "16384", "--heads", "8", "--dims", "128", "--blocks", "32x16",
                        "--dtype", "float32", "bfloat16", "--peers", "autograd", "naive", "compile"), 240,
         "our CPU path at T = 16K, N = 8, D = 128, against autograd of the same formula, the naive one "
         "and torch.compile"),
)


def plan_for(device: str, quick: bool) -> Tuple[Tuple[Part, ...], float]:
    if device != "cuda":
        return (CPU_QUICK_PLAN, CPU_QUICK_BUDGET) if quick else (CPU_PLAN, CPU_BUDGET)
    return (GPU_QUICK_PLAN, GPU_QUICK_BUDGET) if quick else (GPU_PLAN, GPU_BUDGET)


def part_dtypes(part: Part) -> Tuple[str, ...]:
    """The dtypes a part's command line names (canonical names)."""
    argv, found = list(part.argv), []
    if "--dtype" in argv:
        for a in argv[argv.index("--dtype") + 1:]:
            if a.startswith("--"):
                break
            found.append(harness.dtype_name(a))
    return tuple(found)


def restrict_dtypes(part: Part, dtypes: Optional[Sequence[str]]) -> Optional[Part]:
    """``part`` with its dtypes cut down to ``dtypes`` (bench all's --dtype: only these), or
    None when it keeps none. A part that names no dtype takes ``dtypes`` as its own."""
    if not dtypes:
        return part
    own = part_dtypes(part)
    keep = [d for d in own if d in dtypes] if own else list(dtypes)
    if not keep:
        return None
    argv = list(part.argv)
    if own:
        i = argv.index("--dtype")
        argv[i + 1:i + 1 + len(own)] = keep
    else:
        argv += ["--dtype", *keep]
    return Part(part.name, part.family, tuple(argv), part.share, part.what)


def part_deadlines(parts: Sequence[Part], budget: float) -> List[float]:
    """Seconds from the start after which each part starts no measurement: the shares added up,
    stretched in proportion when the budget is larger than their sum, and cut at the budget when
    it is smaller (the plan is in order of priority: what does not fit is the end of it)."""
    stretch = max(1.0, budget / sum(p.share for p in parts))
    deadlines, total = [], 0.0
    for part in parts:
        total += part.share * stretch
        deadlines.append(min(total, budget))
    return deadlines


def part_args(part: Part, args, folder: Optional[str]):
    """The part's own parsed and resolved arguments, with bench all's overrides."""
    module = importlib.import_module(f"gradops.bench.{part.family}")
    argv = list(part.argv) + ["--device", args.device, "--tag", part.name]
    if folder:
        argv += ["--out", folder]
    if args.no_plot:
        argv += ["--no-plot"]
    for flag, value in (("--reps", args.reps), ("--warmup", args.warmup), ("--max-seconds", args.max_seconds)):
        if value is not None:
            argv += [flag, str(value)]
    if args.max_seconds is None and args.device == "cuda" and not args.quick:
        argv += ["--max-seconds", str(GPU_MAX_SECONDS)]
    return module, module.prepare(module.parse_args(argv), need_device=not args.dry_run)


# ---------------------------------------------------------------------------------------
# The summary


def _family_summary(family: str, runs: List[harness.Run], module) -> dict:
    peers: Dict[str, dict] = {}
    for run in runs:
        for row in run.ratios():
            if row["impl"] == harness.OURS:
                continue
            p = peers.setdefault(row["impl"], {"ratios": [], "errors": 0})
            if row["speedup_of_ours"] is not None:
                p["ratios"].append(row["speedup_of_ours"])
            elif row["error"]:
                p["errors"] += 1
    table = {}
    for name, p in peers.items():
        r = p["ratios"]
        table[name] = {"cases": len(r), "worst": min(r) if r else None,
                       "median": statistics.median(r) if r else None, "errors": p["errors"]}
    ours = [r for run in runs for r in run.records if r.impl == harness.OURS]
    return {
        "peers": table,
        "ours_measured": sum(1 for r in ours if r.times_ms),
        "ours_failed": [{"op": r.op, "case": r.case, "error": r.error} for run in runs for r in run.failures()],
        "skipped": sum(len(run.skipped()) for run in runs),
        "goals": [g.evaluate(runs) for g in module.GOALS],
    }


def _fmt(v: Optional[float], f: str = "%.3gx") -> str:
    return "-" if v is None else f % v


def summary_text(summary: dict) -> str:
    meta = summary["meta"]
    lines = [f"gradops bench all on {meta.get('device_name')} ({meta.get('device')}): "
             f"{summary['elapsed_seconds']:.0f} s of a {summary['budget_seconds']:.0f} s budget"]
    if summary.get("note"):
        lines.append(f"note: {summary['note']}")
    lines += ["ratio = a peer's median time / ours (> 1: gradops is faster); worst = the case least "
              "favourable to gradops", "",
              f"{'family':<7} {'peer':<26} {'cases':>5} {'worst':>8} {'median':>8} {'peer errors':>12}"]
    for family, fam in summary["families"].items():
        if not fam["peers"]:
            lines.append(f"{family:<7} {'(no peer measured against ours)':<26}")
        for peer, p in fam["peers"].items():
            lines.append(f"{family:<7} {peer:<26} {p['cases']:>5} {_fmt(p['worst']):>8} {_fmt(p['median']):>8} "
                         f"{p['errors']:>12}")
    lines += ["", "goals (docs/benchmarks.md)"]
    for family, fam in summary["families"].items():
        for g in fam["goals"]:
            missing = f", {g['unevaluated']} more gave no value" if g.get("unevaluated") else ""
            worst = "" if g["worst"] is None else f" (worst {g['worst']:.3g} over {g['cases']} cases{missing})"
            lines.append(f"{family:<7} {g['status']:<10} {g['goal']}{worst}" if g["status"] in harness.EVALUATED
                         else f"{family:<7} {'-':<10} {g['goal']}: {g['status']}")
    lines.append("")
    for family, peers in summary["peers_not_usable"].items():
        for peer, why in peers.items():
            lines.append(f"peer not usable here: {peer} ({family}): {why}")
    for family, fam in summary["families"].items():
        for f in fam["ours_failed"]:
            lines.append(f"FAILED {family}: gradops on {f['op']} {f['case']}: {f['error']}")
        if fam["skipped"]:
            lines.append(f"SKIPPED {family}: {fam['skipped']} measurements (the time budget was spent)")
    for name, error in summary["crashed_parts"].items():
        lines.append(f"FAILED part {name}: {error}")
    lines.append(f"result: {'ok' if summary['ok'] else 'FAILED'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench all", description=__doc__.split("\n\n")[0])
    harness.add_common_args(
        p, family=False, dtype_help="only the parts' cases in these dtypes (a part left with none is left out)",
        quick_help="small shapes: a smoke run (on a CPU: tiny shapes, our kernels through the Triton interpreter)",
        out_help=(f"results folder (default: {harness.RESULTS_DIR}/<device>-<date>/ for a full run on a GPU, "
                  f"else {harness.scratch_dir()}/<device>-<date>/). The folder written is printed"),
        budget_help=(f"whole run's time budget (default {GPU_BUDGET:.0f} on a GPU, {GPU_QUICK_BUDGET:.0f} "
                     f"with --quick; on a CPU {CPU_BUDGET:.0f}, {CPU_QUICK_BUDGET:.0f} with --quick)"))
    p.add_argument("--only", nargs="+", default=None, metavar="PART", help="only these parts (by name)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its budget; run nothing")
    return p.parse_args(argv)


def _default_folder(meta: dict, committed: bool = True) -> str:
    """<device>-<date>/ under benchmarks/results/ (a full GPU run) or the scratch folder."""
    stem = f"{harness.device_slug(meta)}-{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}"
    folder = os.path.join(harness.RESULTS_DIR if committed else harness.scratch_dir(), stem)
    if os.path.exists(folder):
        folder += f"-{_dt.datetime.now(_dt.timezone.utc):%H%M%S}"
    return folder


def print_plan(parts: Sequence[Part], budget: float, args) -> None:
    deadlines = part_deadlines(parts, budget)
    print(f"gradops bench all --dry-run: {len(parts)} parts on {args.device}, budget {budget:.0f} s")
    print(f"{'part':<16} {'cases':>5} {'x impls':>7} {'<= meas.':>8} {'warmup+reps':>11} {'max s':>5} "
          f"{'until s':>7}  implementations")
    total, before = 0, 0.0
    for part, deadline in zip(parts, deadlines):
        module, pargs = part_args(part, args, None)
        per_case = len(pargs.direction or module.DIRECTIONS) if part.family == "floyd" else 1
        if part.family == "model" and pargs.compile:
            per_case = 2  # eager and compiled
        cases, impls = len(module.cases(pargs)) * per_case, module.impl_names(pargs)
        # a floydnet case (eager or compiled) holds ours and the FloydNet variant of its kind
        measured = cases * (2 if part.family == "floydnet" else len(impls))
        total += measured
        until = f"{deadline:>7.0f}" if deadline > before else f"{'cut':>7}"
        before = deadline
        print(f"{part.name:<16} {cases:>5} {len(impls):>7} {measured:>8} "
              f"{f'{pargs.warmup}+{pargs.reps}':>11} {pargs.max_seconds:>5g} {until}  "
              f"{', '.join(impls)}")
        print(f"{'':<16} {part.what}: gradops bench {part.family} {' '.join(part.argv)}")
    print(f"at most {total} measurements (a peer that does not apply to an op is not measured)")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    import torch

    from ..selftest import use_interpreter_on_cpu

    args.device = args.device or harness.default_device()
    kernels_skipped = None
    parts, budget = plan_for(args.device, args.quick)
    if args.only:
        unknown = set(args.only) - {p.name for p in parts}
        if unknown:
            raise SystemExit(f"gradops bench all: no part named {', '.join(sorted(unknown))} "
                             f"(parts: {', '.join(p.name for p in parts)})")
        parts = tuple(p for p in parts if p.name in args.only)
    if args.dtypes:
        kept = [restrict_dtypes(p, args.dtypes) for p in parts]
        left = [p.name for p, k in zip(parts, kept) if k is None]
        parts = tuple(k for k in kept if k is not None)
        if not parts:
            raise SystemExit(f"gradops bench all: no part of the plan runs in {' '.join(args.dtypes)}")
        if left:
            print(f"gradops bench all: --dtype {' '.join(args.dtypes)} leaves out {', '.join(left)}", flush=True)
    budget = args.budget_seconds if args.budget_seconds is not None else budget
    if args.dry_run:
        print_plan(parts, budget, args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gradops bench all: --device cuda, but no CUDA device is visible")
    if args.device != "cuda" and any("--interpret" in p.argv for p in parts):
        use_interpreter_on_cpu("cpu")  # before anything imports triton
        kernels_skipped = harness.cpu_kernels_skipped()
        ours = ("our Triton kernels through the Triton interpreter" if kernels_skipped is None else
                f"ours is the reference backend (our Triton kernels are skipped: {kernels_skipped})")
        print(f"gradops bench all on a CPU: tiny shapes, {ours}.", flush=True)
        print(f"note: {harness.CPU_NOTE}", flush=True)
    elif args.device != "cuda":
        print("gradops bench all on a CPU: the CPU comparison, our CPU path (the reference backend) against "
              "ATen, autograd and torch.compile at the CPU shapes (--quick: the wiring check through the "
              "Triton interpreter instead).", flush=True)
        print(f"note: {harness.CPU_NOTE}", flush=True)
    meta = harness.device_info(args.device)
    folder = args.out or _default_folder(meta, committed=args.device == "cuda" and not args.quick)
    start = time.monotonic()
    deadlines = part_deadlines(parts, budget)
    runs: Dict[str, List[harness.Run]] = {f: [] for f in FAMILIES}
    modules = {f: importlib.import_module(f"gradops.bench.{f}") for f in FAMILIES}
    files: List[str] = []
    crashed: Dict[str, str] = {}
    part_seconds: Dict[str, float] = {}
    interrupted = None
    for part, deadline in zip(parts, deadlines):
        if interrupted:
            crashed[part.name] = f"not run: {interrupted}"
            continue
        t0 = time.monotonic()
        print(f"\n=== {part.name}: {part.what} (until {deadline:.0f} s of {budget:.0f} s)", flush=True)
        try:
            module, pargs = part_args(part, args, folder)
            pargs.deadline = start + deadline
            run = module.run(pargs)
            runs[part.family].append(run)
            files += harness.finish(run, pargs, part.name, module.PLOT, module.GOALS)
        except (Exception, SystemExit) as e:  # a part that crashes is a failure to report, not to hide
            crashed[part.name] = f"{type(e).__name__}: {e}"[:300]
            print(f"part {part.name} failed: {crashed[part.name]}", file=sys.stderr)
        except KeyboardInterrupt:  # SIGINT: a caller's time limit (gpu_validate.sh); the summary still gets written
            interrupted = f"interrupted (SIGINT) during part {part.name}"
            crashed[part.name] = interrupted
            print(f"part {part.name}: {interrupted}", file=sys.stderr)
        part_seconds[part.name] = round(time.monotonic() - t0, 1)
        if args.device == "cuda":
            torch.cuda.empty_cache()

    families = {f: _family_summary(f, runs[f], modules[f]) for f in FAMILIES if runs[f]}
    failed = any(fam["ours_failed"] or fam["skipped"] for fam in families.values())
    measured = sum(fam["ours_measured"] for fam in families.values())
    summary = {
        "meta": meta,
        "note": harness.CPU_NOTE if args.device != "cuda" else None,
        "kernels_skipped_on_cpu": kernels_skipped,
        "command": "gradops bench all " + " ".join(sys.argv[1:] if argv is None else argv),
        "budget_seconds": budget,
        "elapsed_seconds": round(time.monotonic() - start, 1),
        "part_seconds": part_seconds,
        "plan": [{"name": p.name, "family": p.family, "argv": list(p.argv), "share_seconds": p.share,
                  "until_seconds": d}
                 for p, d in zip(parts, deadlines)],
        "peers_not_usable": {f: {k: v for k, v in modules[f].optional_peers(args.device).items() if v}
                             for f in FAMILIES if any(p.family == f for p in parts)},
        "families": families,
        "crashed_parts": crashed,
        "files": [os.path.basename(f) for f in files],
        "ok": not failed and not crashed and measured > 0,
    }
    text = summary_text(summary)
    print("\n" + text)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    with open(os.path.join(folder, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(f"wrote {folder}/ (summary.json, summary.txt and {len(files)} files)"
          + ("" if args.out or (args.device == "cuda" and not args.quick) else
             " (a CPU or --quick run: not results to commit; --out DIR writes elsewhere)"))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
