"""Benchmark of Floyd (pivotal) attention, forward and backward: ``gradops bench floyd``.

Implementations measured side by side, same process, same inputs:

- ``gradops``: our operators, ``gradops.floyd_attention`` and ``gradops.floyd_attention_grad``
  (backend="triton"; on CPU only with ``--interpret``, and then only to see that it runs:
  interpreter timings mean nothing), with the strategy ``floyd_strategy.strategy`` chooses for
  the case: what a user gets. Each of its records names that choice (``extra.strategy``);
- ``gradops-fused``, ``gradops-hybrid`` and ``gradops-chunked``: the same calls with
  ``floyd_config.STRATEGY`` forcing one strategy, set around every timed call (and the forward a backward is fed
  from) and restored after it, so nothing leaks into the other implementations. Float64
  always runs fused (``extra.strategy`` says what ran);
- ``reference``: the chunked PyTorch reference (backend="reference"), bounded memory;
- ``einsum``: FloydNet's formulation (two einsums for the scores, softmax, two einsums for
  the output) under autograd: it materialises the [B,H,N,M,K] scores, so it runs out of
  memory where the others do not (recorded as an error, not a crash);
- ``floydnet``: FloydNet's own ``pivotal_attention`` (PyPI ``floydnet``) under autograd, when
  it imports: the einsum users have;
- ``compiled``: ``torch.compile`` (static shapes, compiled anew for each case) of FloydNet's
  ``pivotal_attention`` when it imports, else of the einsum formulation (CUDA only; the
  run's ``meta.compiled`` says which).

Directions (``--direction``, default all three): ``fwd``, the forward (8*B*H*N*M*K*D FLOP);
``bwd``, the backward alone (20*B*H*N*M*K*D): for ours the standalone grad operator fed with
its forward's outputs, for the autograd peers ``autograd.grad`` on a retained graph;
``fwdbwd``, a forward then its backward, as a training step runs them (28*B*H*N*M*K*D): ours
calls the two operators, the peers build the graph and differentiate it. On a GPU every
record holds the peak memory its call allocated beyond what was allocated before
(``peak_bytes``), and each of ours ``extra.memory_bound_ratio``: (inputs + that peak) /
(inputs + outputs + ``floyd_config.CHUNK_BUDGET_BYTES``), the issue's memory bound (<= 1.1),
with the bytes of :func:`io_bytes`.

Defaults: on CUDA bf16 and the grid of issue 11: H = 8, N = M = K in 128, 256, 512, 1024, D
in 128, 64, 32 (measured in that order: the D = 128 goals first), with B = 4, 4, 2, 1 for
those N: B in 1..4 shrinking as the cube grows (B*H*N*M*K*D from 2^31 at N = 128, D = 32 to
2^40 at N = 1024, D = 128: 0.02 to 9 TFLOP forward, 0.06 to 31 forward+backward; at
N = 1024 B = 1 is the floor); 3 warm-up calls and 20 repetitions, each of the two bounded by
2 s, and a 600 s budget for that grid (``--budget-seconds`` changes it; measurements past it
are recorded as skipped and the exit status is 1); a JSON file under benchmarks/results/.
In each case ours come first and the reference, slowest at large N, last. ``--quick`` runs a few tiny fp32 shapes on the CPU in well
under a minute (the reference against einsum; ``--interpret`` adds ours, all three, through
the Triton interpreter). ``--compile-check`` compiles the kernels for an H100 without a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import harness
from .floyd_accuracy import _floydnet, floyd_einsum, floydnet_pivotal
from .harness import DTYPES, OURS, Goal, Record, Run, progress
from .traffic import forced_strategy, rule_strategy

FAMILY = "floyd"
FUSED, HYBRID, CHUNKED = f"{OURS}-fused", f"{OURS}-hybrid", f"{OURS}-chunked"
FORCED = {FUSED: "fused", HYBRID: "hybrid", CHUNKED: "chunked"}  # ours with floyd_config.STRATEGY forced
OUR_IMPLS = (OURS, FUSED, HYBRID, CHUNKED)
# measured in this order in each case: the reference, slowest at large N, last
IMPLS = (OURS, FUSED, HYBRID, CHUNKED, "einsum", "floydnet", "compiled", "reference")
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
OPS = tuple(f"floyd_{d}" for d in DIRECTIONS)
Shape = Tuple[int, int, int, int, int, int]  # B, H, N, M, K, D
PLOT = dict(x_key="N", metric="tflops", group_keys=("op", "D", "dtype"))
GRID_H = 8
GRID_B = {128: 4, 256: 4, 512: 2, 1024: 1}  # B per N = M = K of the default CUDA grid
GRID_D = (128, 64, 32)  # D = 128 first: the goals' headline cases are measured first
GRID_BUDGET_SECONDS = 600.0  # the default budget of a run of the default CUDA grid
MEMORY_BOUND = 1.1
# A peer's error that says it did not fit in memory (torch's OutOfMemoryError, or a compiler
# wrapping it): the speedup goal holds "wherever that fits in memory"
OUT_OF_MEMORY = ("out of memory", "OutOfMemoryError")


def _bf16(c: dict) -> bool:
    return c["dtype"] == "bfloat16"


def _bf16_d128(c: dict) -> bool:
    return c["dtype"] == "bfloat16" and c["D"] == 128


# The goals for Floyd attention (docs/benchmarks.md; H100), read off the records of ``gradops``
# (the rule's choice). The spec's, then issue 11's intermediate bars and its relative goals.
# The memory goal O(inputs) is also measured on a CPU by tests/test_floyd_memory.py.
GOALS = (
    Goal("Floyd bwd >= 300 TFLOP/s bf16 at D = 128", ("floyd_bwd",), "tflops", 300.0, _bf16_d128),
    Goal("Floyd fwd >= 450 TFLOP/s bf16 at D = 128", ("floyd_fwd",), "tflops", 450.0, _bf16_d128),
    Goal("Floyd bwd >= 150 TFLOP/s bf16 at D = 32/64", ("floyd_bwd",), "tflops", 150.0,
         lambda c: c["dtype"] == "bfloat16" and c["D"] in (32, 64)),
    Goal("Floyd fwd >= 300 TFLOP/s bf16 at D = 128 (issue 11, intermediate)", ("floyd_fwd",), "tflops", 300.0,
         _bf16_d128),
    Goal("Floyd bwd >= 200 TFLOP/s bf16 at D = 128 (issue 11, intermediate)", ("floyd_bwd",), "tflops", 200.0,
         _bf16_d128),
    Goal("Floyd >= 2x FloydNet's einsum wherever it fits in memory, bf16 (issue 11)", OPS, "speedup:einsum", 2.0,
         _bf16, gpu=None, excuse=OUT_OF_MEMORY),
    Goal(f"Floyd peak memory <= {MEMORY_BOUND}x inputs + outputs + the chunk budget (issue 11)", OPS,
         "extra:memory_bound_ratio", None, gpu=None, maximum=MEMORY_BOUND),
    # issue 25: forward + backward against FloydNet, eager and compiled, in time, memory and error
    Goal("Floyd fwd+bwd >= 2x FloydNet eager, bf16 (issue 25)", ("floyd_fwdbwd",), "speedup:floydnet", 2.0, _bf16,
         gpu=None, excuse=OUT_OF_MEMORY),
    Goal("Floyd fwd+bwd >= 0.8x torch.compile(FloydNet), bf16 (issue 25)", ("floyd_fwdbwd",), "speedup:compiled", 0.8,
         _bf16, gpu=None, excuse=OUT_OF_MEMORY),
    Goal("Floyd fwd+bwd >= 1.0x torch.compile(FloydNet), bf16 (issue 32)", ("floyd_fwdbwd",), "speedup:compiled",
         1.0, _bf16, gpu=None, excuse=OUT_OF_MEMORY),
    Goal("Floyd fwd+bwd peak memory <= 0.5x torch.compile(FloydNet)'s, bf16 (issue 25)", ("floyd_fwdbwd",),
         "extra:peak_over_compiled", None, _bf16, gpu=None, maximum=0.5),
    Goal("Floyd max relative error vs float64 <= 0.5x FloydNet eager's, bf16 (issue 25)", ("floyd_fwdbwd",),
         "extra:error_over_floydnet", None, _bf16, gpu=None, maximum=0.5),
)


def fwd_flops(shape: Shape) -> float:
    b, h, n, m, k, d = shape
    return 8.0 * b * h * n * m * k * d


def bwd_flops(shape: Shape) -> float:
    b, h, n, m, k, d = shape
    return 20.0 * b * h * n * m * k * d


def fwdbwd_flops(shape: Shape) -> float:
    return fwd_flops(shape) + bwd_flops(shape)


FLOPS = {"fwd": fwd_flops, "bwd": bwd_flops, "fwdbwd": fwdbwd_flops}


def default_shapes(quick: bool, device: str) -> List[Shape]:
    if quick or not device.startswith("cuda"):
        return [(1, 2, 16, 16, 16, 16), (1, 2, 32, 32, 32, 32), (2, 4, 48, 48, 48, 32)]
    return [(GRID_B[s], GRID_H, s, s, s, d) for d in GRID_D for s in sorted(GRID_B)]


def parse_shape(text: str) -> Shape:
    parts = [int(p) for p in text.replace("x", ",").split(",")]
    if len(parts) != 6 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B,H,N,M,K,D (all >= 1)")
    return tuple(parts)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Bytes in and out, and the memory bound
# ---------------------------------------------------------------------------------------------
def io_bytes(op: str, shape: Shape, element_size: int, masked: bool = False) -> Tuple[int, int]:
    """(inputs, outputs) of one call of ``op``, in bytes. ``floyd_fwd`` reads q, k1, v1, k2,
    v2 (and the [B,1,N,1,K] bool mask) and writes out and the two statistics (float32;
    float64 for float64 inputs); ``floyd_bwd`` reads dy, q, k1, v1, k2, v2, out, the
    statistics (and the mask) and writes the five gradients; ``floyd_fwdbwd`` reads the
    forward's inputs and dy and writes out, the statistics and the gradients."""
    b, h, n, m, k, d = shape
    e = element_size
    qy = b * h * n * m * d * e  # q, out, dy, dq
    kv = 2 * b * h * n * k * d * e + 2 * b * h * k * m * d * e  # k1, v1, k2, v2 (and their gradients)
    stats = 2 * b * h * n * m * (8 if e == 8 else 4)
    mask = b * n * k if masked else 0
    if op == "floyd_fwd":
        return qy + kv + mask, qy + stats
    if op == "floyd_bwd":
        return 3 * qy + kv + stats + mask, qy + kv
    if op == "floyd_fwdbwd":
        return 2 * qy + kv + mask, 2 * qy + stats + kv
    raise ValueError(f"unknown Floyd op {op!r}")


def chunk_budget(device: str, shape: Shape, element_size: int, strategy: Optional[str] = None) -> int:
    """The workspace per chunk of a memory strategy (the hybrid one's for "hybrid", else the
    chunked one's) for ``shape`` on ``device`` (``floyd_config.chunk_budget``)."""
    from ..kernels import floyd_config

    b, h, n, m, k, d = shape
    if strategy == "hybrid":
        pair = floyd_config.hybrid_pair_bytes(k, d, torch.float32 if element_size == 4 else torch.bfloat16)
    else:
        pair = floyd_config.pair_bytes(k, d, element_size)
    return floyd_config.chunk_budget(floyd_config.total_memory(torch.device(device)), b * h * n * m * pair,
                                     floyd_config.small_grid(n, m, k))


def memory_bound(op: str, shape: Shape, element_size: int, masked: bool = False,
                 budget: Optional[int] = None, strategy: Optional[str] = None) -> Tuple[int, int]:
    """(inputs, the bound): inputs + outputs + ``budget`` (default: the workspace of
    ``strategy``'s chunks on this machine's GPU, else its CPU, :func:`chunk_budget`)."""
    if budget is None:
        budget = chunk_budget("cuda" if torch.cuda.is_available() else "cpu", shape, element_size, strategy)
    inputs, outputs = io_bytes(op, shape, element_size, masked)
    return inputs, inputs + outputs + budget


def memory_bound_ratio(op: str, shape: Shape, element_size: int, peak_bytes: int, masked: bool = False,
                       budget: Optional[int] = None) -> float:
    """(inputs + ``peak_bytes``) / (inputs + outputs + budget): ``peak_bytes`` is what the call
    allocated beyond what was allocated before it (the harness's ``peak_bytes``; the inputs
    were allocated before), so the numerator is the call's own peak footprint."""
    inputs, bound = memory_bound(op, shape, element_size, masked, budget)
    return (inputs + peak_bytes) / bound


def annotate(rec: Record, shape: Shape, element_size: int, masked: bool, strategy: Optional[str] = None,
             budget: Optional[int] = None) -> Record:
    """Add to one of our records the strategy that ran (when known) and, where its peak
    memory was measured, ``memory_bound_ratio`` and the bound in bytes."""
    if strategy is not None:
        rec.extra["strategy"] = strategy
    if rec.peak_bytes is not None:
        inputs, bound = memory_bound(rec.op, shape, element_size, masked, budget, strategy)
        rec.extra["memory_bound_bytes"] = bound
        rec.extra["memory_bound_ratio"] = (inputs + rec.peak_bytes) / bound
    return rec


# ---------------------------------------------------------------------------------------------
# FloydNet's formulation (floyd_einsum: everything materialised, differentiated by autograd) and
# FloydNet's own function (floydnet_pivotal), which floyd_accuracy defines as its oracle and peer
# ---------------------------------------------------------------------------------------------
def optional_peers(device: str) -> Dict[str, Optional[str]]:
    """Peers that need a package or a device: name -> None when usable here, else why not."""
    try:
        from floydnet.functional import pivotal_attention  # noqa: F401
        floydnet = None
    except Exception as e:
        floydnet = f"not importable ({type(e).__name__}: {e})"[:200]
    return {"floydnet": floydnet, "compiled": None if device == "cuda" else "CUDA only (compile time dwarfs a CPU run)"}


def compiled_target() -> Tuple[Callable, str]:
    """What ``compiled`` compiles, and its name for the run's meta: FloydNet's
    ``pivotal_attention`` when it imports, else the einsum formulation."""
    pivotal = _floydnet()
    if pivotal is None:
        return floyd_einsum, "gradops.bench.floyd_accuracy.floyd_einsum (floydnet is not importable)"

    def floydnet_fn(q, k1, v1, k2, v2, mask, scale):
        return pivotal(q, k1, k2, v1, v2, attn_mask=mask, scale=scale)

    return floydnet_fn, "floydnet.functional.pivotal_attention"


def make_inputs(shape: Shape, dtype: torch.dtype, device: str, masked: bool):
    b, h, n, m, k, d = shape
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = rnd(b, h, n, m, d)
    k1, v1, k2, v2 = rnd(b, h, n, k, d), rnd(b, h, n, k, d), rnd(b, h, k, m, d), rnd(b, h, k, m, d)
    dy = rnd(b, h, n, m, d)
    mask = None
    if masked:
        mask = torch.rand(b, 1, n, 1, k, generator=gen, device=device) < 0.1
    return (q, k1, v1, k2, v2), dy, mask


# ---------------------------------------------------------------------------------------------
# The implementations: for a case, direction -> make() -> the callable timed
# ---------------------------------------------------------------------------------------------
# make() of "bwd" runs the forward the backward is fed from (its state lives only while the
# backward is measured); those of "fwd" and "fwdbwd" hold nothing.
Makers = Dict[str, Callable[[], Callable[[], object]]]


def _gradops_fns(backend: str, inputs, dy, mask, scale) -> Makers:
    import gradops

    def fwd():
        return gradops.floyd_attention(*inputs, mask, scale, backend=backend)

    def fwdbwd():
        out, mx, sm = fwd()
        return gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, scale, backend=backend)

    def make_bwd():
        out, mx, sm = fwd()

        def bwd():
            return gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, scale, backend=backend)
        return bwd

    return {"fwd": lambda: fwd, "bwd": make_bwd, "fwdbwd": lambda: fwdbwd}


def _autograd_fns(fn: Callable, inputs, dy, mask, scale) -> Makers:
    leaves = [t.detach().requires_grad_() for t in inputs]

    def fwd():
        return fn(*leaves, mask, scale)

    def fwdbwd():
        return torch.autograd.grad(fwd(), leaves, dy)

    def make_bwd():
        y = fwd()

        def bwd():
            return torch.autograd.grad(y, leaves, dy, retain_graph=True)
        return bwd

    return {"fwd": lambda: fwd, "bwd": make_bwd, "fwdbwd": lambda: fwdbwd}


def _under(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    def call():
        with forced_strategy(name):
            return fn()
    return call


def _forcing(name: str, makers: Makers) -> Makers:
    """The same makers with ``name`` forced while each runs (the backward's forward) and
    around every call of the callable it returns: forced inside the timed function."""
    return {direction: (lambda make=make: _under(name, _under(name, make)()))
            for direction, make in makers.items()}


def implementations(names: Sequence[str], device: str, ours: str = "triton") -> Dict[str, Callable]:
    """name -> builder(inputs, dy, mask, scale) -> {direction: make}; ``make()`` returns the
    callable timed. ``compiled`` compiles anew for each case it is built for (static shapes,
    Dynamo's caches reset), on its first call."""
    builders: Dict[str, Callable] = {}
    for name in names:
        if name == OURS:
            builders[name] = lambda *a: _gradops_fns(ours, *a)
        elif name in FORCED:
            builders[name] = lambda *a, _s=FORCED[name]: _forcing(_s, _gradops_fns(ours, *a))
        elif name == "reference":
            builders[name] = lambda *a: _gradops_fns("reference", *a)
        elif name == "einsum":
            builders[name] = lambda *a: _autograd_fns(floyd_einsum, *a)
        elif name == "floydnet":
            builders[name] = lambda *a: _autograd_fns(floydnet_pivotal, *a)
        elif name == "compiled":
            target, _ = compiled_target()

            def build_compiled(*a, _target=target):
                import torch._dynamo

                torch._dynamo.reset()  # a fresh static compile per case (no recompile limit reached)
                return _autograd_fns(torch.compile(_target, dynamic=False), *a)
            builders[name] = build_compiled
    return builders


def default_impls(device: str, interpret: bool) -> List[str]:
    """Ours (on a CPU only through the interpreter) and every peer usable here."""
    unusable = {name for name, why in optional_peers(device).items() if why is not None}
    names = [i for i in IMPLS if i not in unusable]
    return names if device == "cuda" or interpret else [i for i in names if i not in OUR_IMPLS]


def default_grid(args) -> bool:
    """Whether ``args`` run the default CUDA grid (no --shape, no --quick)."""
    return args.device == "cuda" and not args.quick and not args.shape


def cases(args) -> List[tuple]:
    """(shape, dtype) for every case this run measures."""
    return [(shape, dt) for dt in args.dtypes for shape in (args.shape or default_shapes(args.quick, args.device))]


def _unusable(args) -> Dict[str, str]:
    why = {name: reason for name, reason in optional_peers(args.device).items() if reason}
    if args.device != "cuda" and not args.interpret:
        for name in OUR_IMPLS:
            why[name] = "the Triton kernels need CUDA, or --interpret on a CPU"
    return why


def impl_names(args) -> List[str]:
    """The implementations measured: those asked for (default: all) that can run here."""
    unusable = _unusable(args)
    return [i for i in (args.impl or default_impls(args.device, args.interpret)) if i not in unusable]


def run(args) -> Run:
    """Measure every case of ``args`` (parsed by :func:`parse_args`, resolved by ``prepare``)."""
    device = args.device
    impls = impl_names(args)
    for name, why in _unusable(args).items():
        if name in (args.impl or ()):
            print(f"gradops bench floyd: leaving out {name}: {why}", file=sys.stderr)
    directions = list(dict.fromkeys(args.direction or DIRECTIONS))
    bench = Run(FAMILY, device, args.deadline)
    backend = harness.ours_backend(args) if any(i in OUR_IMPLS for i in impls) else None
    if backend is not None and backend != "triton":  # no strategy to force in the reference
        left = [i for i in impls if i in FORCED]
        if left:
            print(f"gradops bench floyd: leaving out {', '.join(left)}: ours runs on the {backend} backend here",
                  file=sys.stderr)
        impls = [i for i in impls if i not in FORCED]
    bench.meta["backend_ours"] = backend
    bench.meta["directions"] = directions
    if backend == "triton":
        from ..kernels import floyd_config

        # an override in force when the run started (then ``gradops`` is not the rule's choice)
        bench.meta["strategy_override"] = floyd_config.forced_strategy()
    if "compiled" in impls:
        bench.meta["compiled"] = compiled_target()[1]
    builders = implementations(impls, device, backend or "triton")
    for shape, dt in progress(cases(args), "floyd"):
        b, h, n, m, k, d = shape
        case = {"B": b, "H": h, "N": n, "M": m, "K": k, "D": d, "dtype": dt, "mask": args.mask}
        if bench.out_of_time():
            bench.skip([f"floyd_{direction}" for direction in directions], case)
            continue
        element_size = torch.empty((), dtype=DTYPES[dt]).element_size()
        inputs, dy, mask = make_inputs(shape, DTYPES[dt], device, args.mask)
        sc = d ** -0.5 if args.scale is None else args.scale
        for name, build in builders.items():
            strategy = None
            if name in OUR_IMPLS and backend == "triton":
                strategy = rule_strategy(shape, element_size, FORCED.get(name))
            try:
                makers = build(inputs, dy, mask, sc)
            except Exception as e:
                makers = {direction: _raiser(e) for direction in directions}
            for direction in directions:
                op = f"floyd_{direction}"
                if bench.out_of_time():  # making the backward runs a forward (and may compile)
                    bench.skip([op], case, impl=name)
                    continue
                try:
                    fn = makers[direction]()
                except Exception as e:  # e.g. out of memory in the forward a backward needs: a result
                    fn = _raiser(e)
                rec = bench.time(op, case, name, fn, flops=FLOPS[direction](shape), memory=device == "cuda",
                                 reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds, flush_l2=False)
                if name in OUR_IMPLS:
                    annotate(rec, shape, element_size, args.mask, strategy)
                del fn
                _free(device)
            del makers
            _free(device)
        if device == "cuda":
            record_peak_over_compiled(bench, case)
            if args.accuracy and not bench.out_of_time():
                try:
                    record_accuracy(bench, case, builders, inputs, dy, mask, sc)
                except Exception as e:  # e.g. the float64 reference out of memory: say so on ours
                    for r in bench.records:
                        if r.case == case and r.op == "floyd_fwdbwd" and r.impl in OUR_IMPLS:
                            r.extra["max_rel_error_error"] = f"{type(e).__name__}: {e}"[:200]
                _free(device)
            if args.compile_time:
                for r in bench.records:
                    if r.case == case and r.op == "floyd_fwdbwd" and r.impl in OUR_IMPLS and not r.error \
                            and not bench.out_of_time():
                        r.extra["compile"] = compile_seconds(shape, dt, device, FORCED.get(r.impl))
    return bench


def strategy_lines(bench: Run) -> List[str]:
    """One line per strategy our rule chose in this run, with the cases it chose it for."""
    chosen: Dict[str, Dict[str, None]] = {}
    for r in bench.records:
        if r.impl == OURS and "strategy" in r.extra:
            c = r.case
            where = f"{c['B']}x{c['H']}x{c['N']}x{c['M']}x{c['K']}x{c['D']} {c['dtype']}"
            chosen.setdefault(r.extra["strategy"], {})[where] = None
    return [f"gradops ran {s} (floyd_strategy's rule) at B x H x N x M x K x D: {', '.join(where)}"
            for s, where in chosen.items()]


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile check: no GPU needed
# ---------------------------------------------------------------------------------------------
# Stride arguments the JIT turns into the constant 1 for contiguous tensors.
_UNIT_STRIDES = ("sq_d", "sk1_d", "sv1_d", "sk2_d", "sv2_d", "so_d", "sdy_d", "sdq_d", "sg_d", "smk_k",
                 "sst_m", "smax_m", "ssum_m", "sok_d", "sov_d", "sxk_d", "sxv_d")
# _bwd_dkv_kernel sees the [B,H,N,M] statistics and Dr as [own, loop]: m, their unit stride,
# is the looped axis of the dK1/dV1 launch and the own axis of the dK2/dV2 launch.
_UNIT_STRIDES_DKV = {"bwd_dk1": ("smax_loop", "ssum_loop", "sdr_loop"),
                     "bwd_dk2": ("smax_own", "ssum_own", "sdr_own")}
# The chunked strategy's row kernels: an integer argument the JIT specialises but does not
# see as a multiple of 16 at the shapes of the benchmark (H = 8); those it does not
# specialise (floyd_chunked.NOT_SPECIALISED) get no hint either.
_ROW_NOT_DIVISIBLE = ("H",)
# Pivots of the row-kernel compile check without --shape: the BLOCK_R x BLOCK_K tiles 16x128,
# 4x512, 1x2048 (one tile per row) and 1x2048 walked twice (K = 4096)
ROW_CHECK_K = (128, 512, 2048, 4096)


def _ptr_types(dtype: torch.dtype) -> Tuple[str, str]:
    """(pointer type of the inputs, of the float accumulators) in a signature."""
    ptr = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}[dtype]
    return ptr, "*fp64" if dtype == torch.float64 else "*fp32"


def _compile_sm(kernel, sig: dict, consts: dict, attrs: dict, arch: int, num_warps: int, num_stages: int,
                row: dict, fp_fusion: bool = True) -> dict:
    """Compile ``kernel`` for ``sm_<arch>`` and add to ``row`` its shared memory (bytes), the
    registers a thread uses, its local-memory spill instructions and MMA count, read from the
    SASS, and its float32 FMAs (``fma_f32``, from the PTX); or ``error`` (e.g. out of shared
    memory: the finding this check exists for)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    try:
        compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages,
                                               enable_fp_fusion=fp_fusion))
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
        row.update(shared=compiled.metadata.shared, registers=max(regs) + 1 if regs else None,
                   spill_loads=sass.count("LDL"), spill_stores=sass.count("STL"),
                   mma=sass.count("HMMA") + sass.count("DMMA") + sass.count("HGMMA"), wgmma=sass.count("HGMMA"),
                   layout_conversions=compiled.asm["ttgir"].count("convert_layout"),
                   fma_f32=len(re.findall(r"\bfma\.[a-z.]*f32\b", compiled.asm["ptx"])),
                   **loop_memory_ops(compiled.asm["ttgir"]))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[-1][:200] if str(e) else ''}"
    return row


def loop_memory_ops(ttgir: str) -> dict:
    """Inside the loops (``scf.for``) of a kernel's TTGIR: ``loop_loads``, the loads that wait
    for their data where they stand (``tt.load``: no software pipelining, the latency of each
    exposed at every step), ``loop_async_copies``, the loads the pipeliner issued ahead
    (``async_copy_global_to_local``), and ``loop_barriers``, CTA-wide barriers the source asked
    for (``tl.debug_barrier``, which keeps the pipeliner off the loop that holds one)."""
    counts = dict(loop_loads=0, loop_async_copies=0, loop_barriers=0)
    depth, loops = 0, []  # brace depth; the depth each open loop started at
    for line in ttgir.splitlines():
        if "scf.for " in line:
            loops.append(depth)
        if loops:
            counts["loop_loads"] += " tt.load " in line
            counts["loop_async_copies"] += "async_copy_global_to_local" in line
            counts["loop_barriers"] += "ttg.barrier" in line or "gpu.barrier" in line
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1]:
            loops.pop()
    return counts


def compile_check(dtype: torch.dtype, head_dim: int, arch: int = 90) -> List[dict]:
    """Compile the four fused kernels for ``sm_<arch>`` without a GPU (Triton's bundled
    ptxas), specialised as the JIT would for contiguous tensors whose sizes are multiples of
    16, and report shared memory (bytes), the registers a thread uses and its local-memory
    spill instructions, read from the SASS. Needs TRITON_INTERPRET unset when triton was
    imported. The chunked strategy's row kernels: :func:`compile_check_rows`."""
    import triton.language as tl

    from ..kernels import floyd_attention as fa
    from ..kernels._floyd_common import SCALE_ARGS
    from ..kernels.floyd_config import floyd_config

    ptr, acc = _ptr_types(dtype)
    rows = []
    for name, kernel in (("fwd", fa._fwd_kernel), ("bwd_dq", fa._bwd_dq_kernel),
                         ("bwd_dk1", fa._bwd_dkv_kernel), ("bwd_dk2", fa._bwd_dkv_kernel)):
        cfg = floyd_config(name, head_dim, torch.empty((), dtype=dtype).element_size())
        consts = dict(HAS_MASK=True, PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32",
                      ACC=tl.float64 if dtype == torch.float64 else tl.float32, IDX=tl.int32, UPCAST=False)
        if kernel is fa._bwd_dkv_kernel:
            consts.update({k: v for k, v in fa._dkv_meta(name, cfg).items() if k not in ("num_warps", "num_stages")})
        else:
            consts.update(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d,
                          GROUP=cfg.group)
        sig, attrs = {}, {}
        for idx, arg in enumerate(kernel.arg_names):
            if kernel.params[idx].is_constexpr:
                continue
            if arg in _UNIT_STRIDES or arg in _UNIT_STRIDES_DKV.get(name, ()):
                sig[arg], consts[arg] = "constexpr", 1
                continue
            if arg in SCALE_ARGS:  # the float64's bits (do_not_specialize: no attributes)
                sig[arg] = "i32"
                continue
            if arg.endswith("_ptr"):
                # the mask: the bool tensor itself (floyd_attention._Fused), as the JIT types it
                sig[arg] = "*i1" if arg == "mask_ptr" else acc if arg in ("max_ptr", "sum_ptr", "dr_ptr") else ptr
            else:
                sig[arg] = "i32"
            attrs[(idx,)] = [["tt.divisibility", 16]]
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "D": head_dim,
               "tile": f"{cfg.block_n}x{cfg.block_m}x{cfg.block_k}x{cfg.block_d}", "warps": cfg.num_warps}
        rows.append(_compile_sm(kernel, sig, consts, attrs, arch, cfg.num_warps, cfg.num_stages, row))
    return rows


def _row_signature(kernel, consts: dict, unit: Sequence[str], pointer: Callable[[str], str],
                   not_specialised: Sequence[str]) -> Tuple[dict, dict]:
    """(signature, attributes) of a row kernel as the JIT specialises it: ``unit`` arguments
    the constant 1 (added to ``consts``), the scale's float64 bits two i32, pointers typed by
    ``pointer(name)``, other integers i32 with a divisibility hint but those the kernel does
    not specialise (``not_specialised``) and H (a multiple of 16 only by chance)."""
    from ..kernels._floyd_common import SCALE_ARGS

    sig, attrs = {}, {}
    for idx, arg in enumerate(kernel.arg_names):
        if kernel.params[idx].is_constexpr:
            continue
        if arg in unit:
            sig[arg], consts[arg] = "constexpr", 1
            continue
        if arg in SCALE_ARGS:
            sig[arg] = "i32"
            continue
        if arg.endswith(("_ptr", "_hi", "_lo")):
            sig[arg] = pointer(arg)
        else:
            sig[arg] = "i32"
            if arg in _ROW_NOT_DIVISIBLE or arg in not_specialised:
                continue
        attrs[(idx,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_check_rows(dtype: torch.dtype, k: int = 1024, arch: int = 90, masked: bool = True) -> List[dict]:
    """Compile the chunked strategy's row kernels (``_softmax_rows``, forward; ``_grad_rows``,
    backward) for ``sm_<arch>`` with the blocks and launch options ``floyd_config.row_config(k)``
    gives, specialised as the JIT would for a contiguous mask (``masked``; without one the
    mask's arguments are dead code) and statistics, K = 1 as a constant, and sizes it
    specialises multiples of 16 (but H and the chunk's first slice); report as
    :func:`compile_check`. 16-bit and float32 inputs (float64 always runs fused). The rows'
    ``D`` is None (the row kernels do not see the head dim) and ``K`` the pivots."""
    from ..kernels import floyd_chunked as fc
    from ..kernels.floyd_config import row_config

    if dtype == torch.float64:
        raise ValueError("the chunked strategy's row kernels take 16-bit and float32 inputs")
    ptr, _ = _ptr_types(dtype)
    cfg = row_config(k)
    rows = []
    for name, kernel in (("rows_softmax", fc._softmax_rows), ("rows_grad", fc._grad_rows)):
        consts = dict(HAS_MASK=masked, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], ONE_TILE=cfg["ONE_TILE"])
        # the mask's k and the statistics' m: unit strides; K = 1: the JIT's constant 1; the
        # float32 scores, dP and statistics, P and dS in the input dtype
        sig, attrs = _row_signature(kernel, consts, ("smk_k", "sst_m") + (("K",) if k == 1 else ()),
                                    lambda arg: "*u8" if arg == "mask_ptr" else ptr if arg in ("p_ptr", "ds_ptr")
                                    else "*fp32", fc.NOT_SPECIALISED[kernel.__name__])
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "D": None, "K": k, "masked": masked,
               "tile": f"{cfg['BLOCK_R']}x{cfg['BLOCK_K']}", "warps": cfg["num_warps"]}
        rows.append(_compile_sm(kernel, sig, consts, attrs, arch, cfg["num_warps"], 1, row,
                                fp_fusion=cfg["enable_fp_fusion"]))
    return rows


# The GEMM (floyd_gemm.py) as the launches of the chunked and hybrid strategies use it, at the
# shapes of the default grid (N = M = K = 512, D = 128): name -> (its half_bits, and per product:
# rows, cols, contraction, the strides that are 1 (specialised by the JIT), ACCUMULATE, the
# result's kind: "in" (the input dtype), "f32" or "half" (an int16 top plane); optionally a 7th,
# "split": a float32 (a 16-bit b beside it, floyd_gemm's SPLIT: 3-Floyd's P and dS)).
GEMM_CHECK = {
    "gemm_scores": (0, [(512, 512, 128, ("sat", "sbt", "soc"), False, "f32")]),  # chunked S = Q K1^T
    "gemm_scores_acc": (0, [(512, 512, 128, ("sat", "sbt", "scc", "soc"), True, "f32")]),  # S += Q K2^T
    "gemm_pv_acc": (0, [(512, 128, 512, ("sat", "sbc", "scc", "soc"), True, "in")]),  # Y = Yp + P V2
    "gemm_reduce_acc": (0, [(512, 128, 512, ("sar", "sbc", "scc", "soc"), True, "in")]),  # dK1 = acc + dS^T Q
    # hybrid: S2 and dP2 in 24 bits, one launch; dQ2 + dQ1, dK2, dV2 in one launch
    "gemm_halves": (24, [(512, 512, 128, ("sat", "sbt", "soc"), False, "half")] * 2),
    "gemm_m_side": (0, [(512, 128, 512, ("sat", "sbc", "scc", "soc"), True, "in"),
                        (512, 128, 512, ("sar", "sbc", "soc"), False, "in"),
                        (512, 128, 512, ("sar", "sbc", "soc"), False, "in")]),
}


def compile_check_gemm(dtype: torch.dtype, arch: int = 90, table: Optional[dict] = None) -> List[dict]:
    """Compile the GEMM (``floyd_gemm._gemm_kernel``) for ``sm_<arch>`` as each kind of launch
    runs it (``table``, :data:`GEMM_CHECK` by default), each product with
    ``floyd_config.gemm_config``'s blocks; report as :func:`compile_check` (``D`` and ``tile`` are
    the first product's contraction and blocks, ``K`` None). float32 inputs keep their halves in
    float32: a "half" result is float32 there, and a "split" a is a plain float32 product."""
    from ..kernels import floyd_gemm
    from ..kernels.floyd_config import gemm_config

    if dtype == torch.float64:
        raise ValueError("the GEMM takes 16-bit and float32 inputs")
    ptr, _ = _ptr_types(dtype)
    kernel = floyd_gemm._gemm_kernel
    rows = []
    for name, (half_bits, products) in (GEMM_CHECK if table is None else table).items():
        if dtype == torch.float32:  # float32 halves are stored as they are
            half_bits = 0
        split = dtype != torch.float32 and len(products[0]) > 6 and products[0][6] == "split"
        t = products[0][2]
        slots = products + [products[0]] * (3 - len(products))
        configs = [gemm_config(*slot[:3], dtype.itemsize, split) for slot in slots]
        cfg = configs[0]
        consts = dict(PRODUCTS=len(products), HALF_BITS=half_bits, SPLIT=split, **dot_constexprs_for(dtype),
                      **{f"{key}{i}": c[key] for i, c in enumerate(configs) for key in ("BLOCK_R", "BLOCK_C", "BLOCK_T")},
                      **{f"ACCUMULATE{i}": i < len(products) and products[i][4] for i in range(3)})
        warps = max(c["num_warps"] for c in configs[:len(products)])
        sig, attrs = {}, {}
        for idx, arg in enumerate(kernel.arg_names):
            if kernel.params[idx].is_constexpr:
                continue
            base, _, slot = arg.rpartition("_") if arg[-2:-1] == "_" else (arg[:-1], None, arg[-1:])
            if arg == "B1":
                sig[arg] = "i32"
                attrs[(idx,)] = [["tt.divisibility", 16]]
                continue
            unit, kind = slots[int(slot)][3], slots[int(slot)][5]
            if base in unit:
                sig[arg], consts[arg] = "constexpr", 1
                continue
            if base == "a" and split:
                sig[arg] = "*fp32"
            elif base in ("a", "b"):
                sig[arg] = ptr
            elif base == "acc":
                sig[arg] = "*fp32"
            elif base in ("out", "lo"):
                if base == "lo":
                    sig[arg] = "*u8"
                elif kind == "half":
                    sig[arg] = "*i16" if half_bits else "*fp32"
                else:
                    sig[arg] = "*fp32" if kind == "f32" else ptr
            else:
                sig[arg] = "i32"
            attrs[(idx,)] = [["tt.divisibility", 16]]
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "D": t, "K": None,
               "tile": f"{cfg['BLOCK_R']}x{cfg['BLOCK_C']}x{cfg['BLOCK_T']}", "warps": warps,
               "products": len(products)}
        rows.append(_compile_sm(kernel, sig, consts, attrs, arch, warps, cfg["num_stages"], row))
    return rows


# The hybrid strategy's row kernels (floyd_hybrid.py): the arguments that are unit strides for
# contiguous inputs and statistics (specialised to the constant 1 by the JIT)
_HYBRID_UNIT = ("sq3", "sdy3", "sk3", "sv3", "smk_k", "sst2")


def compile_check_hybrid(dtype: torch.dtype, head_dim: int, arch: int = 90, masked: bool = True) -> List[dict]:
    """Compile the hybrid strategy's row kernels (``_rows_forward``, ``_rows_backward``) for
    ``sm_<arch>`` with ``floyd_config.hybrid_config``'s tiles and launch options, specialised
    as the JIT would for contiguous inputs, halves and statistics (unit strides constant,
    other sizes and strides multiples of 16 but those it does not specialise,
    ``floyd_hybrid.NOT_SPECIALISED``, and H), with a mask when ``masked`` (contiguous along
    the pivots: read as words, ``floyd_hybrid.mask_words``); report as :func:`compile_check`.
    16-bit and float32 inputs (float64 always runs fused)."""
    from ..kernels import floyd_hybrid as fh
    from ..kernels.floyd_config import half_bits, hybrid_config

    if dtype == torch.float64:
        raise ValueError("the hybrid strategy takes 16-bit and float32 inputs")
    ptr, _ = _ptr_types(dtype)
    cfg = hybrid_config(head_dim, dtype)
    bits = half_bits(dtype)
    top = "*fp32" if bits == 32 else "*i16"
    rows = []
    for name, kernel in (("hybrid_fwd", fh._rows_forward), ("hybrid_bwd", fh._rows_backward)):
        consts = dict(HAS_MASK=masked, MASK_WORDS=masked, HALF_BITS=bits, P_SPREAD=fh.p_spread(dtype),
                      **{key: cfg[key] for key in ("BLOCK_M", "BLOCK_K", "BLOCK_D", "STAGES")},
                      **dot_constexprs_for(dtype))

        def pointer(arg):
            if arg.endswith("_hi"):
                return top
            if arg.endswith("_lo") or arg == "mask_ptr":
                return "*u8"
            return "*fp32" if arg in ("max_ptr", "sum_ptr", "y1_ptr", "dq1_ptr") else ptr

        sig, attrs = _row_signature(kernel, consts, _HYBRID_UNIT, pointer, fh.NOT_SPECIALISED)
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "D": head_dim, "masked": masked,
               "tile": f"{cfg['BLOCK_M']}x{cfg['BLOCK_K']}x{cfg['BLOCK_D']}", "warps": cfg["num_warps"]}
        rows.append(_compile_sm(kernel, sig, consts, attrs, arch, cfg["num_warps"], cfg["num_stages"], row,
                                fp_fusion=cfg["enable_fp_fusion"]))
    return rows


def dot_constexprs_for(dtype: torch.dtype) -> dict:
    """The Floyd kernels' dot constexprs as a GPU launch gets them (no interpreter widening)."""
    from ..kernels._floyd_common import dot_constexprs

    return dot_constexprs(dtype, torch.device("cuda"))


# ---------------------------------------------------------------------------------------------
# Accuracy against float64, memory against torch.compile, compile time
# ---------------------------------------------------------------------------------------------
def _forward_and_grads(makers: Makers) -> List[torch.Tensor]:
    """Y and the five gradients of one forward and one forward + backward by ``makers`` (the
    first forward's graph is let go before the second runs)."""
    y = makers["fwd"]()()
    y = (y[0] if isinstance(y, tuple) else y).detach()
    return [y, *makers["fwdbwd"]()()]


# The implementations whose error the benchmark measures: ours (the rule's choice) and
# FloydNet eager, the pair the issue-25 goal compares.
ACCURACY_IMPLS = (OURS, "floydnet")


def _reference_slices(inputs, dy, mask, scale):
    """Y and the five gradients of each (b, h) slice in float64 by the reference backend (the
    golden; a slice at a time, so that the float64 copies stay small): yields (b, h, [6])."""
    import gradops

    b_, h_ = inputs[0].shape[:2]
    for b in range(b_):
        for h in range(h_):
            wide = [t[b:b + 1, h:h + 1].double() for t in inputs]
            m = None if mask is None else mask[b:b + 1]
            g = dy[b:b + 1, h:h + 1].double()
            out, mx, sm = gradops.floyd_attention(*wide, m, scale, backend="reference")
            yield b, h, [out, *gradops.floyd_attention_grad(g, *wide, out, mx, sm, m, scale, backend="reference")]


def record_accuracy(bench: Run, case: dict, builders: Dict[str, Callable], inputs, dy, mask, scale) -> None:
    """The largest relative error against float64 of ours and FloydNet eager on their
    ``floyd_fwdbwd`` records (``extra.max_rel_error``, and ``extra.rel_errors`` per tensor:
    Y, dQ, dK1, dV1, dK2, dV2, max |x - ref| / max |ref| over the whole tensor), and ours over
    FloydNet's (``extra.error_over_floydnet``). The reference is the reference backend in
    float64, one (b, h) slice at a time."""
    records = {r.impl: r for r in bench.records if r.op == "floyd_fwdbwd" and r.case == case and not r.error}
    names = [name for name in ACCURACY_IMPLS if name in records and name in builders]
    if not names:
        return
    results = {}
    for name in names:
        try:
            results[name] = _forward_and_grads(builders[name](inputs, dy, mask, scale))
        except Exception as e:  # a peer that cannot run it again: no error recorded
            records[name].extra["max_rel_error_error"] = f"{type(e).__name__}: {e}"[:200]
    worst = {name: [0.0] * 6 for name in results}
    scale_of = [0.0] * 6
    for b, h, reference in _reference_slices(inputs, dy, mask, scale):
        for i, ref in enumerate(reference):
            scale_of[i] = max(scale_of[i], ref.abs().max().item() if ref.numel() else 0.0)
            for name, result in results.items():
                x = result[i][b:b + 1, h:h + 1].double()
                worst[name][i] = max(worst[name][i], (x - ref).abs().max().item() if ref.numel() else 0.0)
    for name, errors in worst.items():
        rel = [e / (s or 1.0) for e, s in zip(errors, scale_of)]
        records[name].extra["rel_errors"] = rel
        records[name].extra["max_rel_error"] = max(rel)
    ours, peer = records.get(OURS), records.get("floydnet")
    if ours is not None and peer is not None and "max_rel_error" in ours.extra and peer.extra.get("max_rel_error"):
        ours.extra["error_over_floydnet"] = ours.extra["max_rel_error"] / peer.extra["max_rel_error"]


def record_peak_over_compiled(bench: Run, case: dict) -> None:
    """Our peak memory over torch.compile(FloydNet)'s, per direction (``extra.peak_over_compiled``)."""
    for op in OPS:
        rows = {r.impl: r for r in bench.records if r.op == op and r.case == case and r.peak_bytes is not None}
        compiled = rows.get("compiled")
        if compiled is None or not compiled.peak_bytes:
            continue
        for name in OUR_IMPLS:
            if name in rows:
                rows[name].extra["peak_over_compiled"] = rows[name].peak_bytes / compiled.peak_bytes


_COMPILE_SCRIPT = r"""
import json, sys, time, torch
import gradops
from gradops.bench.floyd import make_inputs
from triton.runtime.jit import JITFunction
b, h, n, m, k, d = map(int, sys.argv[1].split(","))
dtype, device, strategy = getattr(torch, sys.argv[2]), sys.argv[3], sys.argv[4]
if strategy != "rule":
    from gradops.kernels import floyd_config
    floyd_config.STRATEGY = strategy
inputs, dy, mask = make_inputs((b, h, n, m, k, d), dtype, device, False)
def step():
    out, mx, sm = gradops.floyd_attention(*inputs, None, d ** -0.5, backend="triton")
    grads = gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, None, d ** -0.5, backend="triton")
    torch.cuda.synchronize()
seconds = []
for _ in range(2):
    t0 = time.perf_counter()
    step()
    seconds.append(time.perf_counter() - t0)
import gc
try:  # Triton's per-device cache of compiled specialisations (its layout varies across versions)
    kernels = sum(len(o.device_caches[torch.cuda.current_device()][0])
                  for o in gc.get_objects() if isinstance(o, JITFunction) and o.device_caches)
except Exception:
    kernels = None
print(json.dumps({"first_s": seconds[0], "second_s": seconds[1], "kernels": kernels}))
"""


COMPILE_TIMEOUT_SECONDS = 600  # the fused kernels' first step took over 180 s on an H100


def compile_seconds(shape: Shape, dtype: str, device: str, strategy: Optional[str] = None) -> dict:
    """A user's first step: forward + backward of ``shape`` in a fresh process with an empty
    Triton cache, so that every kernel it launches compiles. ``{"first_s", "second_s",
    "compile_s" (first - second), "kernels" (specialisations compiled)}``, or ``{"error"}``."""
    import json
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.pop("TRITON_INTERPRET", None)
        try:
            out = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, ",".join(map(str, shape)), dtype, device,
                                  strategy or "rule"], capture_output=True, text=True, env=env,
                                 timeout=COMPILE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {COMPILE_TIMEOUT_SECONDS} s"}
    if out.returncode != 0 or not out.stdout.strip():
        return {"error": out.stderr.strip().splitlines()[-1][:300] if out.stderr.strip() else f"exit {out.returncode}"}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["compile_s"] = result["first_s"] - result["second_s"]
    return result


def _raiser(error: Exception):
    def fn():
        raise error
    return fn


def _free(device: str):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gradops bench floyd", description=__doc__.split("\n\n")[0])
    harness.add_common_args(parser, dtype_help="default: bfloat16 on CUDA, float32 on CPU",
                            budget_help=(f"stop starting measurements after this long; the rest are recorded as "
                                         f"skipped (default: {GRID_BUDGET_SECONDS:.0f} for the default CUDA grid, "
                                         f"else none)"))
    parser.add_argument("--shape", action="append", type=parse_shape, metavar="B,H,N,M,K,D",
                        help="a case (repeatable; default: the issue's grid on CUDA, tiny ones on CPU)")
    parser.add_argument("--impl", nargs="+", action="extend", choices=IMPLS,
                        help="only these implementations (default: ours, both forced strategies and every peer "
                             "usable here)")
    parser.add_argument("--direction", action="append", choices=list(DIRECTIONS),
                        help="fwd, bwd (the backward alone) or fwdbwd (forward then backward); repeatable; "
                             "default: all three")
    parser.add_argument("--mask", action="store_true", help="a random [B,1,N,1,K] mask (10%% masked)")
    parser.add_argument("--scale", type=float, help="default: D**-0.5")
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false",
                        help="on CUDA, skip the error against float64 of each implementation's forward + backward "
                             "(recorded on its floyd_fwdbwd record; default: measured)")
    parser.add_argument("--compile-time", action="store_true",
                        help="on CUDA, also time a user's first forward + backward of ours in a fresh process with an "
                             "empty Triton cache (extra.compile on the floyd_fwdbwd records)")
    parser.add_argument("--compile-check", action="store_true",
                        help="compile the kernels for an H100 (sm_90) without a GPU and report shared memory, "
                             "registers, spills and the loads inside loops that wait where they stand (for each "
                             "--dtype, default bfloat16 float32, and D in 16..256; the chunked strategy's row "
                             "kernels at K = 128, 512, 2048 and 4096, its GEMM, and the hybrid row kernels)")
    parser.add_argument("--traffic", action="store_true",
                        help="count the bytes each launch loads and stores, forward and backward, through the Triton "
                             "interpreter on the CPU (gradops.bench.traffic; default --shape 1,2,64,64,64,16, "
                             "--dtype float16)")
    parser.add_argument("--strategy", action="append", metavar="NAME",
                        help="with --traffic: only this strategy (repeatable; default: each of "
                             "floyd_config.STRATEGIES); with --accuracy: ours forced to it (default: the rule's)")
    parser.add_argument("--accuracy", dest="accuracy_run", action="store_true",  # "accuracy": --no-accuracy's
                        help="ours' max relative error vs float64 (Y and the five gradients) against FloydNet "
                             "eager's, per seed (gradops.bench.floyd_accuracy; on a CPU through the Triton "
                             "interpreter; default --shape 1,2,64,64,64,16, --dtype float16); exit 1 where a "
                             "ratio exceeds 0.5")
    parser.add_argument("--seeds", type=int, default=5, help="with --accuracy: seeds 0 .. SEEDS-1 (default 5)")
    parser.add_argument("--dy-scale", type=float, default=1.0,
                        help="with --accuracy: dY multiplied by this before rounding (1e-4: bf16 training without "
                             "loss scaling; default 1)")
    parser.add_argument("--roofline", action="store_true",
                        help="print each strategy's roofline on an H100 (gradops.kernels.floyd_roofline: counted "
                             "bytes, FLOP at the tiles' shapes, launches) at --shape (default: the CUDA grid) for "
                             "--dtype (default bfloat16), and the rule's pick; no GPU needed")
    parser.add_argument("--half-bits", type=int, choices=(16, 24, 32),
                        help="with --accuracy: floyd_config.HALF_BITS for the run (default: its default)")
    return parser.parse_args(argv)


def prepare(args, need_device: bool = True):
    args = harness.prepare(args, reps=20, warmup=3, max_seconds=2.0, quick_reps=5, quick_warmup=2,
                           quick_max_seconds=2.0, need_device=need_device)
    if default_grid(args) and args.budget_seconds is None and args.deadline is None:
        import time

        args.budget_seconds = GRID_BUDGET_SECONDS
        args.deadline = time.monotonic() + GRID_BUDGET_SECONDS
    return args


def _size(nbytes: int) -> str:
    return f"{nbytes // 1024}KiB" if nbytes >= 1024 else f"{nbytes}B"


def _print_compile_row(row: dict, limit: int) -> int:
    where = f"D={row['D']:<4}" if row.get("D") is not None else f"K={row['K']:<4}"
    if row["kernel"].startswith("gemm"):
        where = f"T={row['D']:<4}"
    if "error" in row:
        print(f"{row['kernel']:12} {row['dtype']:9} {where} {row['tile']:14} {row['error']}")
        return 1
    over = row["shared"] > limit
    print(f"{row['kernel']:12} {row['dtype']:9} {where} {row['tile']:14} w{row['warps']} "
          f"shared={_size(row['shared'])}{' (over the H100 limit)' if over else ''} "
          f"registers={row['registers']} spill ld/st={row['spill_loads']}/{row['spill_stores']} "
          f"mma={row['mma']} (wgmma {row['wgmma']}) layout conversions={row['layout_conversions']} "
          f"fma.f32={row['fma_f32']} in loops: waiting loads={row['loop_loads']} "
          f"async copies={row['loop_async_copies']} barriers={row['loop_barriers']}", flush=True)
    return int(over)


def _compile_check(args) -> int:
    dtypes = [DTYPES[d] for d in args.dtypes] if args.dtypes else [torch.bfloat16, torch.float32]
    dims = sorted({s[5] for s in args.shape}) if args.shape else [16, 32, 64, 128, 256]
    limit = 227 * 1024
    worst = 0
    for dt in dtypes:
        for d in dims:
            for row in compile_check(dt, d):
                worst = max(worst, _print_compile_row(row, limit))
        if dt != torch.float64:
            for k in row_cases(args.shape):
                for row in compile_check_rows(dt, k):
                    worst = max(worst, _print_compile_row(row, limit))
            for row in compile_check_rows(dt, 1, masked=False):  # a single pivot: no FMA (ROW_FP_FUSION)
                worst = max(worst, _print_compile_row(row, limit))
            for row in compile_check_gemm(dt):
                worst = max(worst, _print_compile_row(row, limit))
            for d in dims:
                for row in compile_check_hybrid(dt, d):
                    worst = max(worst, _print_compile_row(row, limit))
    return worst


def _roofline(args) -> int:
    """``--roofline``: per shape and strategy that can take it, the bytes per score (HBM:
    distinct; L2: issued), FLOP, launches and the roofline time on an H100, and the rule's pick."""
    from ..kernels import floyd_config, floyd_roofline, floyd_strategy

    dtypes = [DTYPES[d] for d in args.dtypes] if args.dtypes else [torch.bfloat16]
    shapes = args.shape or [(GRID_B[s], GRID_H, s, s, s, d) for d in GRID_D for s in sorted(GRID_B)]
    print(f"Floyd attention forward + backward, roofline on an {floyd_roofline.H100.name} "
          f"(HBM {floyd_roofline.H100.hbm / 1e12:.2f} TB/s, L2 {floyd_roofline.H100.l2 / 1e12:.1f} TB/s, "
          f"{floyd_roofline.H100.mma / 1e12:.0f} TFLOP/s 16-bit, {floyd_roofline.H100.launch * 1e6:.0f} us a launch)")
    for dtype in dtypes:
        if dtype == torch.float64:
            print("float64 runs the fused kernels only: no roofline to rank")
            continue
        for shape in shapes:
            scores = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
            pick = floyd_strategy.strategy(*shape, dtype.itemsize)
            for name in floyd_config.runnable(shape[5], dtype.itemsize):
                e = floyd_roofline.roofline(name, tuple(shape), dtype, override=False)
                print(f"{','.join(map(str, shape)):>22} {str(dtype).replace('torch.', ''):9} {name:8}"
                      f"{' *' if name == pick else '  '} HBM {e.hbm_bytes / scores:7.1f} B/score  "
                      f"L2 {e.l2_bytes / scores:7.1f} B/score  {e.launches:5} launches  "
                      f"{e.seconds * 1e3:9.3f} ms ({e.bound})")
    print("* the rule's pick (floyd_strategy.strategy); a roofline bounds a time from below")
    return 0


def row_cases(shapes: Optional[Sequence[Shape]]) -> List[int]:
    """K of the row-kernel launches of the chunked strategy at ``shapes``, one per distinct
    row_config; without shapes, ROW_CHECK_K."""
    from ..kernels.floyd_config import row_config

    if not shapes:
        return list(ROW_CHECK_K)
    seen: Dict[tuple, int] = {}
    for shape in shapes:
        seen.setdefault(tuple(sorted(row_config(shape[4]).items())), shape[4])
    return list(seen.values())


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.traffic:  # on the CPU, through the interpreter it switches on itself
        from . import traffic

        return traffic.floyd_main(args)
    if args.accuracy_run:  # on a CPU through the interpreter it switches on itself
        from . import floyd_accuracy

        return floyd_accuracy.main(args)
    if args.compile_check:  # needs the interpreter off: no device rule applied
        return _compile_check(args)
    if args.roofline:  # arithmetic only: no device, no kernel
        return _roofline(args)
    args = prepare(args)
    harness.announce(args, FAMILY)
    bench = run(args)
    for line in strategy_lines(bench):
        print(line)
    harness.finish(bench, args, FAMILY, PLOT, GOALS)
    status = bench.exit_status()
    forced = [r for r in bench.records if r.impl in FORCED and r.error and not r.skipped]
    for r in forced:
        print(f"{r.impl} failed on {r.op} {r.case}: {r.error}", file=sys.stderr)
    return max(status, int(bool(forced)))


if __name__ == "__main__":
    raise SystemExit(main())
