"""``gradops bench floydnet``: a training step of FloydNet's pivotal-attention blocks, as FloydNet
ships them and patched by gradops, eager and compiled (issue 44).

The model is a stack of ``floydnet.PivotalAttentionBlock`` built as FloydNet's example model
builds them (``activation_fn="silu"``, ``norm_fn="affine"``, the FFN on) and run as that
model's loop runs them: from a padding ``pair_mask [B, L, L]`` (1 for a pair of real nodes)
the boolean ``attn_mask = ~pair_mask[:, None, :, None, :]``, then per block
``x = block(x, attn_mask)`` and ``x = x * pair_mask[..., None]``. The last ``max(1, L // 10)``
nodes of every grid are padding. A step is the forward under ``torch.autocast`` (bfloat16 by
default, FloydNet's trainer's; ``--dtype float32``: no autocast) from an input ``x [B, L, L,
width]`` that requires grad (as FloydNet's embeddings do), a scalar loss (the mean square of the
output, outside autocast) and ``torch.autograd.grad`` of it with respect to the input and every
parameter (fresh gradients each step: nothing accumulates, so every step is the same).

Tasks (the paper's configurations, ``--tasks``): ``tsp``, width 384, 6 heads (D = 64), grids of
L = 20, 50, 100, 200 nodes (``--tsp-lengths``; FloydNet trains on 20-100 and tests on 101-200);
``count`` (graph count), width 768, 12 heads, L = 32, 64 (``--count-lengths``). Both with
``--blocks`` blocks (default 8; FloydNet's TSP model has 96, the count one 12: a step's cost is
per block) and batch ``--batch`` (default 1). Each block's weights are drawn at random (FloydNet
initialises c_mix, c_proj and the FFN's output to zero, which would leave the attention without
gradient), once per task: every variant runs a copy of the same weights on the same inputs.

Variants, side by side in one process, each case holding two of them:

* ``floydnet``: the stack as FloydNet ships it, eager;
* ``gradops``: a copy after ``gradops.patch(model)``, eager. Its records say how many blocks the
  patch adopted (``extra.blocks_patched``, from the patch report: 0 means the patch left
  FloydNet's attention in place and the row measures FloydNet again);
* with ``compiled=True`` in the case (on a GPU; ``--no-compile`` leaves them out): ``floydnet
  compiled``, ``torch.compile(stack, dynamic=True)``, and ``gradops``, the patched copy under
  the same ``torch.compile``: compiled once per task (the first step, outside the timing), for
  every L.

Every record holds, per step: ``extra.launches`` (kernels launched, as
:func:`gradops.bench.overhead.kernels_launched` counts them: each Triton launch and each ATen
op that launches a kernel; ``launches_triton``, ``launches_aten`` and ``launch_names`` split
them), ``extra.first_loss`` (the first step's loss: the variants of a case must agree, within
4x the dtype's tolerance) and for ours ``extra.blocks_patched``.

On a GPU the times are real: ``times_ms`` (CUDA events around each step), ``peak_bytes``,
``extra.kernel_ms`` (the step replayed as a CUDA graph: the GPU's share), ``extra.host_ms`` (20
steps queued back to back: the host's share), ``extra.gpu_ops`` (the device operations the
profiler's CUDA activity recorded in one step, a check on the launch count), and on ours
``extra.peak_over_floydnet`` (our peak memory over the FloydNet variant's of the same case).

On a CPU nothing is a GPU time. The launches are counted at the case's own shape, with every
Triton launch stubbed (recorded, not run: :func:`gradops.bench.overhead.stubbed_launches`;
ours takes its Triton path there, as on a GPU) while the ATen ops run on the CPU: one step per
variant. The time recorded (``times_ms``, and ``extra.host_ms``) is the **host time** of a step
at a stand-in shape, ``extra.host_shape``: the same blocks at L = 8 with D = 2 (width = 2 x
heads), where the CPU's arithmetic is negligible and what remains is the Python, dispatch,
autograd and allocation a step costs, Triton launches stubbed and one intra-op thread, the two
variants of a case taking turns (``extra.host_launches``: that step's launch count). FloydNet's
eager step launches the same ops at every shape but for a copy or two that ATen's stride rules
add, so its stand-in is its step's host work; ours at the stand-in runs the fused strategy,
which at L >= 100 gives way to the hybrid one with more launches per block (compare
``host_launches`` with ``launches``). Under CPU autocast softmax stays in bfloat16, where CUDA's autocast runs it in
float32 with casts around it: FloydNet's CPU count is a few launches per block below its GPU
count. The compiled variants are not run on a CPU: Inductor there generates C++ loops, whose
count says nothing about a GPU's launches, and compiling the stack for the CPU takes minutes on
a small machine. The first-loss check runs ours on the reference backend there (our Triton
kernels through the interpreter with ``--interpret``), at the stand-in shape.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import harness
from .harness import DTYPES, OURS, Goal, Record, Run
from .overhead import kernels_launched, stubbed_launches

FAMILY = "floydnet"
OP = "floydnet_step"
PEER = "floydnet"  # FloydNet eager
COMPILED_PEER = "floydnet compiled"  # torch.compile(FloydNet's stack, dynamic=True)
PLOT = dict(x_key="L", metric="median_ms", group_keys=("task", "compiled"))


@dataclass(frozen=True)
class Task:
    name: str
    width: int
    heads: int
    lengths: Tuple[int, ...]


# The paper's configurations (FloydNet's example models), and the tiny ones of --quick
TASKS = {"tsp": Task("tsp", 384, 6, (20, 50, 100, 200)), "count": Task("count", 768, 12, (32, 64))}
QUICK_TASKS = {"tsp": Task("tsp", 16, 2, (12,)), "count": Task("count", 32, 4, (8,))}
BLOCKS, QUICK_BLOCKS = 8, 2
NORM_FN, ACTIVATION = "affine", "silu"
# The CPU's stand-in for host time: the case's blocks and heads at this L and head dim
HOST_L, HOST_HEAD_DIM = 8, 2


def padded(length: int) -> int:
    """Padding nodes at the end of a grid of ``length`` nodes: about a tenth, at least one."""
    return max(1, length // 10)


def _compiled(case: dict) -> bool:
    return bool(case["compiled"])


GOALS = (
    Goal("FloydNet step: gradops-patched eager >= 1.5x FloydNet eager (issue 44)", (OP,), f"speedup:{PEER}", 1.5,
         lambda c: not _compiled(c), gpu=None),
    Goal("FloydNet step: gradops-patched compiled >= 1.0x torch.compile(FloydNet) (issue 44)", (OP,),
         f"speedup:{COMPILED_PEER}", 1.0, _compiled, gpu=None),
    Goal("FloydNet step: peak memory <= 0.5x FloydNet's, eager and compiled (issue 44)", (OP,),
         "extra:peak_over_floydnet", None, gpu=None, maximum=0.5),
)


# ---------------------------------------------------------------------------------------
# The model and its step

class FloydStack(torch.nn.Module):
    """FloydNet's blocks run as its example model runs them (the module docstring)."""

    def __init__(self, blocks: Sequence[torch.nn.Module]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, pair_mask: torch.Tensor) -> torch.Tensor:
        attn_mask = ~(pair_mask[:, None, :, None, :].bool())  # True: the pivot is padding
        keep = pair_mask.unsqueeze(-1)
        for block in self.blocks:
            x = block(x, attn_mask) * keep
        return x


def build_stack(width: int, heads: int, blocks: int, seed: int = 0) -> FloydStack:
    """``blocks`` FloydNet blocks with random weights (float32, on the CPU), the same for the
    same arguments whatever ran before (FloydNet's initialisation draws from the global RNG)."""
    from floydnet import PivotalAttentionBlock

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        stack = FloydStack([PivotalAttentionBlock(embed_dim=width, num_heads=heads, activation_fn=ACTIVATION,
                                                  norm_fn=NORM_FN, enable_ffn=True, dropout=0.0)
                            for _ in range(blocks)])
        with torch.no_grad():
            for block in stack.blocks:  # FloydNet's zeros: the attention would get no gradient
                for linear in (block.c_mix, block.c_proj, block.ffn[2]):
                    linear.weight.normal_(0.0, 0.02)
    return stack.train()


def make_inputs(batch: int, length: int, width: int, device: str, seed: int = 1):
    """``(x [B, L, L, width], pair_mask [B, L, L])``: x requires grad; the mask is 1 for a pair of
    real nodes, 0 where either node is padding (float32, as FloydNet's)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, length, width, generator=gen).to(device).requires_grad_()
    mask = torch.ones(batch, length, length)
    real = length - padded(length)
    mask[:, real:] = 0
    mask[:, :, real:] = 0
    return x, mask.to(device)


def training_step(model: torch.nn.Module, x: torch.Tensor, pair_mask: torch.Tensor,
                  autocast: Optional[torch.dtype]) -> Callable[[], torch.Tensor]:
    """A zero-argument step: forward (under autocast to ``autocast``; None: none), the mean
    square of the output, gradients of the input and every parameter; returns the loss."""
    leaves = [x, *model.parameters()]
    device_type = x.device.type

    def step() -> torch.Tensor:
        with torch.autocast(device_type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = model(x, pair_mask)
        loss = y.float().square().mean()
        torch.autograd.grad(loss, leaves)
        return loss.detach()

    return step


def autocast_dtype(name: str) -> Optional[torch.dtype]:
    return None if name == "float32" else DTYPES[name]


def blocks_patched(report) -> int:
    """Blocks whose attention the patch report says it replaced (FloydNet's or gradops' class
    named as pivotal attention; the norms it may also replace are not counted)."""
    return sum(1 for r in report.replaced if "pivotal" in f"{r.original} {r.replacement}".lower())


def launch_fields(names: List[str]) -> dict:
    triton = sum(1 for n in names if not n.startswith("aten::"))
    counts = collections.Counter(names)
    return {"launches": len(names), "launches_triton": triton, "launches_aten": len(names) - triton,
            "launch_names": dict(counts.most_common())}


def gpu_ops(fn: Callable[[], object]) -> int:
    """Device operations (kernels, memsets, copies) the profiler's CUDA activity records in one
    call of ``fn``: what the GPU ran, a check on the launch count read from the op tree."""
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads set to one for the block: a step whose arithmetic is negligible
    (the CPU's host-time stand-in) gains nothing from them, and on a loaded machine their
    barriers wait for cores other processes hold (milliseconds per op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def host_times(steps: Dict[str, Callable[[], object]], args) -> Dict[str, List[float]]:
    """ms per step of each of ``steps`` (a CPU's host time), one value per round: the steps take
    turns within each round, the first one rotating, so a slow spell of a shared machine falls
    on all of them alike. ``args.warmup`` untimed rounds, then ``args.reps`` rounds, stopped
    after ``args.max_seconds`` once three are done."""
    names = list(steps)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for _ in range(max(1, args.warmup)):
        for name in names:
            steps[name]()
    start = time.perf_counter()
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
        if rep >= 2 and time.perf_counter() - start > args.max_seconds:
            break
    return times


# ---------------------------------------------------------------------------------------
# The run

def _tasks(args) -> List[Task]:
    table = QUICK_TASKS if args.quick else TASKS
    lengths = {"tsp": args.tsp_lengths, "count": args.count_lengths}
    return [Task(t.name, t.width, t.heads, tuple(lengths[name] or t.lengths))
            for name, t in table.items() if name in args.tasks]


def _blocks(args) -> int:
    return args.blocks or (QUICK_BLOCKS if args.quick else BLOCKS)


def cases(args) -> List[Tuple[str, int, str, bool]]:
    """(task, L, dtype, compiled) of every case, in the order measured: eager, then compiled."""
    phases = (False, True) if args.compile else (False,)
    return [(t.name, length, dt, compiled) for compiled in phases for t in _tasks(args)
            for dt in args.dtypes for length in t.lengths]


def impl_names(args) -> List[str]:
    return [OURS, PEER] + ([COMPILED_PEER] if args.compile else [])


COMPILE_ON_CPU = ("not run on a CPU: Inductor generates C++ loops there, whose count says nothing about a GPU's "
                  "launches, and compiling the stack takes minutes")


def optional_peers(device: str) -> Dict[str, Optional[str]]:
    try:
        import floydnet  # noqa: F401
    except Exception as e:
        why = f"floydnet is not importable ({type(e).__name__}: {e})"[:200]
        return {PEER: why, COMPILED_PEER: why}
    return {PEER: None, COMPILED_PEER: None if device == "cuda" else COMPILE_ON_CPU}


def run(args) -> Run:
    import gradops

    why = optional_peers(args.device)[PEER]
    if why is not None:
        raise SystemExit(f"gradops bench floydnet: {why}")
    from importlib.metadata import version

    device = args.device
    on_gpu = device == "cuda"
    blocks = _blocks(args)
    result = Run(FAMILY, device, args.deadline)
    result.meta.update(
        floydnet=version("floydnet"), blocks=blocks, batch=args.batch, norm_fn=NORM_FN, activation=ACTIVATION,
        tasks={t.name: {"width": t.width, "heads": t.heads, "lengths": list(t.lengths)} for t in _tasks(args)},
        padding="the last max(1, L // 10) nodes of every grid",
        launches="gradops.bench.overhead.kernels_launched: Triton launches and ATen ops that launch a kernel",
        compiled="torch.compile(stack, dynamic=True), once per task" if args.compile else
        (COMPILE_ON_CPU if not on_gpu else "left out (--no-compile)"))
    if on_gpu:
        result.meta["backend_ours"] = "triton"
    else:
        result.meta["backend_ours"] = "triton, launches stubbed (Python only)"
        result.meta["first_loss_backend_ours"] = args.check_backend
        result.meta["cpu_rows"] = (f"launches at the case's shape (Triton launches stubbed, ATen ops run); times: "
                                   f"host time of a step at L = {HOST_L}, D = {HOST_HEAD_DIM}, the same blocks")
    measure_kw = dict(reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds, flush_l2=False)
    reports: Dict[str, dict] = {}

    def case_of(task: Task, length: int, dt: str, compiled: bool) -> dict:
        return {"task": task.name, "L": length, "width": task.width, "heads": task.heads, "blocks": blocks,
                "dtype": dt, "compiled": compiled}

    def patched(base: torch.nn.Module, key: str) -> torch.nn.Module:
        model = copy.deepcopy(base)
        report = gradops.patch(model)
        reports[key] = {"blocks_patched": blocks_patched(report), "patched_modules": len(report.replaced),
                        "left": [f"{r.name}: {r.reason}" for r in report.left]}
        return model

    def gpu_record(case, impl, model, x, mask, autocast, extra) -> Record:
        step = training_step(model, x, mask, autocast)
        try:
            first = float(step())  # a compiled model compiles here, outside the timing
        except Exception as e:  # a failing variant is a result, not a crash
            torch.cuda.empty_cache()
            return result.add(Record(OP, case, impl, [], error=f"{type(e).__name__}: {e}"[:300]))
        rec = result.time(OP, case, impl, step, memory=True, costs=True, **measure_kw)
        if not rec.error:
            rec.extra.update(extra, first_loss=first)
            for key, count in (("launches", lambda: launch_fields(kernels_launched(step))),
                               ("gpu_ops", lambda: {"gpu_ops": gpu_ops(step)})):
                try:
                    rec.extra.update(count())
                except Exception as e:  # the time stands; the record says why the count is missing
                    rec.extra[f"{key}_error"] = f"{type(e).__name__}: {e}"[:200]
        torch.cuda.empty_cache()
        return rec

    def cpu_records(case, task, length, autocast, variants, host, extras) -> Dict[str, Record]:
        """Per variant: launches at the case's shape, first loss at the stand-in shape; then the
        host time of the stand-in's steps, the variants taking turns (:func:`host_times`)."""
        steps, recs = {}, {}
        host_x, host_mask = make_inputs(args.batch, HOST_L, task.heads * HOST_HEAD_DIM, device)
        for impl, model in variants.items():
            x, mask = make_inputs(args.batch, length, task.width, device)
            step = training_step(host[impl], host_x, host_mask, autocast)
            try:
                with gradops.use_backend(args.check_backend):
                    first = float(step())
                with gradops.use_backend("triton"):
                    launches = kernels_launched(training_step(model, x, mask, autocast))
                    host_launches = kernels_launched(step)
            except Exception as e:  # a failing variant is a result, not a crash
                recs[impl] = result.add(Record(OP, case, impl, [], error=f"{type(e).__name__}: {e}"[:300]))
                continue
            steps[impl] = step
            recs[impl] = Record(OP, case, impl, [], extra=dict(
                extras[impl], first_loss=first, **launch_fields(launches), host_launches=len(host_launches),
                host_shape={"L": HOST_L, "width": task.heads * HOST_HEAD_DIM, "heads": task.heads}))
        with gradops.use_backend("triton"), stubbed_launches(), one_thread():
            times = host_times(steps, args)
        for impl, step in steps.items():
            recs[impl].times_ms = times[impl]
            recs[impl].extra["host_ms"] = statistics.median(times[impl]) if times[impl] else None
            result.add(recs[impl])
        return recs

    def skip(case, impls):
        for impl in impls:
            result.skip([OP], case, impl)

    for compiled in ((False, True) if args.compile else (False,)):
        for task in harness.progress(_tasks(args), f"bench floydnet{' compiled' if compiled else ''}"):
            peer = COMPILED_PEER if compiled else PEER
            base = build_stack(task.width, task.heads, blocks).to(device)
            if compiled:
                import torch._dynamo

                torch._dynamo.reset()  # each task's pair compiles afresh, far from the recompile limit
                variants = {OURS: torch.compile(patched(base, task.name), dynamic=True),
                            peer: torch.compile(copy.deepcopy(base), dynamic=True)}
            else:
                variants = {OURS: patched(base, task.name), peer: copy.deepcopy(base)}
            host = {}
            if not on_gpu:  # the stand-in: the same blocks at width 2 x heads
                host_base = build_stack(task.heads * HOST_HEAD_DIM, task.heads, blocks).to(device)
                host = {OURS: patched(host_base, "host"), peer: host_base}
            for dt in args.dtypes:
                autocast = autocast_dtype(dt)
                for length in task.lengths:
                    case = case_of(task, length, dt, compiled)
                    if result.out_of_time():
                        skip(case, (OURS, peer))
                        continue
                    extras = {OURS: dict(reports[task.name]), peer: {}}
                    if on_gpu:
                        recs = {}
                        for impl, model in variants.items():
                            x, mask = make_inputs(args.batch, length, task.width, device)
                            recs[impl] = gpu_record(case, impl, model, x, mask, autocast, extras[impl])
                    else:
                        recs = cpu_records(case, task, length, autocast, variants, host, extras)
                    ours, theirs = recs[OURS], recs[peer]
                    if ours.peak_bytes and theirs.peak_bytes:
                        ours.extra["peak_over_floydnet"] = ours.peak_bytes / theirs.peak_bytes
            del variants, base, host
    result.meta["loss_disagreements"] = check_losses(result)
    return result


def check_losses(result: Run) -> List[str]:
    """Cases whose variants disagree on the first loss by more than 4x the dtype's tolerance."""
    from ..oracles import TOLERANCE

    by_case: Dict[str, Dict[str, float]] = {}
    for r in result.records:
        if "first_loss" in r.extra:
            key = ",".join(f"{k}={v}" for k, v in r.case.items())
            by_case.setdefault(key, {})[r.impl] = (r.extra["first_loss"], DTYPES[r.case["dtype"]])
    problems = []
    for key, losses in by_case.items():
        if OURS not in losses:
            continue
        got, dtype = losses.pop(OURS)
        for impl, (want, _) in losses.items():
            if not abs(got - want) <= 4 * TOLERANCE[dtype] * abs(want):
                problems.append(f"{key}: {OURS} first loss {got:.6g} != {impl} {want:.6g}")
    return problems


def launch_lines(result: Run) -> List[str]:
    """Per case and variant: launches per step (Triton + ATen), host ms, peak memory, blocks
    patched; on a CPU the host time is the stand-in's and its launch count is shown beside."""
    on_gpu = result.device == "cuda"
    host = "host ms" if on_gpu else f"host ms (L={HOST_L}, D={HOST_HEAD_DIM})"
    lines = ["launches per step (kernels_launched: Triton launches + ATen ops that launch a kernel)",
             f"{'task':<6} {'L':>4} {'dtype':<9} {'compiled':<8} {'impl':<18} {'launches':>8} {'triton':>6} "
             f"{'aten':>6} {'gpu ops' if on_gpu else 'at host':>8} {host:>22} {'peak MiB':>9} {'patched':>8}"]
    for r in result.records:
        if r.error:
            continue
        e, c = r.extra, r.case
        check = e.get("gpu_ops", "-") if on_gpu else e.get("host_launches", "-")
        peak = f"{r.peak_bytes / 2**20:.1f}" if r.peak_bytes is not None else "-"
        done = f"{e['blocks_patched']}/{c['blocks']}" if "blocks_patched" in e else ""
        host_ms = f"{e['host_ms']:.3f}" if e.get("host_ms") is not None else "-"
        counts = [e.get(k, "-") for k in ("launches", "launches_triton", "launches_aten")]
        lines.append(f"{c['task']:<6} {c['L']:>4} {c['dtype']:<9} {str(c['compiled']):<8} {r.impl:<18} "
                     f"{counts[0]!s:>8} {counts[1]!s:>6} {counts[2]!s:>6} {check!s:>8} "
                     f"{host_ms:>22} {peak:>9} {done:>8}")
    unpatched = {r.case["task"] for r in result.records if r.extra.get("blocks_patched") == 0}
    for task in sorted(unpatched):
        lines.append(f"note: gradops.patch adopted no PivotalAttentionBlock of {task}: its gradops rows run "
                     f"FloydNet's own attention")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench floydnet", description=__doc__.split("\n\n")[0])
    harness.add_common_args(p, dtypes=("bfloat16", "float16", "float32"),
                            dtype_help="the autocast dtype (float32: no autocast); default bfloat16, FloydNet's",
                            quick_help="tiny widths, one L per task, 2 blocks: a smoke run (seconds on a CPU)")
    p.add_argument("--tasks", nargs="+", choices=tuple(TASKS), default=list(TASKS),
                   help="tsp: width 384, 6 heads; count: width 768, 12 heads (default both)")
    p.add_argument("--tsp-lengths", nargs="+", type=int, default=None, metavar="L",
                   help=f"grid sizes of tsp (default {' '.join(map(str, TASKS['tsp'].lengths))})")
    p.add_argument("--count-lengths", nargs="+", type=int, default=None, metavar="L",
                   help=f"grid sizes of count (default {' '.join(map(str, TASKS['count'].lengths))})")
    p.add_argument("--blocks", type=int, default=None, help=f"blocks in the stack (default {BLOCKS})")
    p.add_argument("--batch", type=int, default=1, help="graphs per step (default 1, FloydNet's TSP)")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out the torch.compile variants (on a CPU they are never run)")
    args = p.parse_args(argv)
    for name in ("tsp_lengths", "count_lengths"):
        if any(length < 2 for length in getattr(args, name) or ()):
            p.error(f"--{name.replace('_', '-')}: every L must be at least 2 (a node and a padding one)")
    if args.blocks is not None and args.blocks < 1 or args.batch < 1:
        p.error("--blocks and --batch must be at least 1")
    return args


def prepare(args, need_device: bool = True):
    args.device = args.device or harness.default_device()
    # On a CPU ours takes its Triton path with every launch stubbed, so Triton must import: the
    # interpreter rule is applied (nothing is interpreted). --interpret asks for the first-loss
    # check of ours through the interpreter instead of the reference backend.
    interpret = bool(args.interpret)
    args.interpret = args.device != "cuda"
    harness.prepare(args, reps=20, warmup=3, max_seconds=10.0, quick_reps=3, quick_warmup=1, quick_max_seconds=1.0,
                    need_device=need_device, gpu_dtypes=("bfloat16",), cpu_dtypes=("bfloat16",))
    args.interpret = False  # (for the CPU caveat: no timing is interpreted)
    args.check_backend = "triton" if args.device == "cuda" or interpret else "reference"
    args.compile = args.device == "cuda" and not args.no_compile
    return args


def main(argv=None) -> int:
    args = prepare(parse_args(sys.argv[1:] if argv is None else list(argv)))
    harness.announce(args, FAMILY)
    if args.device != "cuda":
        print(f"note: on a CPU the launches are counted at each case's shape with Triton launches stubbed; the "
              f"times are host time of a step at L = {HOST_L}, D = {HOST_HEAD_DIM} (the same blocks), not GPU "
              f"times; the compiled variants are {COMPILE_ON_CPU}", flush=True)
    result = run(args)
    harness.finish(result, args, FAMILY, PLOT, GOALS)
    print()
    print("\n".join(launch_lines(result)))
    problems = result.meta["loss_disagreements"]
    for p in problems:
        print(f"gradops bench floydnet: {p}", file=sys.stderr)
    return max(result.exit_status(), 1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
