"""``gradops bench overhead``: what a call costs the host, apart from its kernels.

For each public entry point (the nn.functional norms forward + backward, the modules, the
API and aclnn functions, NSA), the per-call host time against torch's nearest call and
against a *floor*: a bare ``torch.autograd.Function`` that allocates the same outputs and
makes the same number of kernel launches, with nothing else around them.

On a GPU the kernels run (host time = wall time of a call with the GPU queue never
drained, so launches overlap the host's next call; the profile of one call gives its kernel
count). On a CPU the Triton launches are *stubbed*: :func:`stubbed_launches` replaces the
launch of every Triton kernel (compiled or interpreted) with a recorder that returns at
once, so what is timed is gradops' Python around the launches: argument checks, configs,
allocations, views, autograd. The floor stubs its launches the same way, so the ratio
ours / floor is the Python gradops adds per launch budget (goal: within 2x).

On a GPU each of our entry points is also timed on the other launch path (``bound``, or
``jit`` when ``GRADOPS_BOUND_LAUNCH`` is on): the same calls with ``gradops.kernels._launch``'s
switch flipped, so that one run says what bound launches save (docs/backends.md, "Kernel
launches"); its record counts the launches one call made through the bound path.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Callable, Dict, Iterator, List

import torch

from . import harness
from .harness import OURS, Goal, Record, Run


@contextlib.contextmanager
def _launches_replaced(run) -> Iterator[None]:
    """Every Triton kernel launch (``kernel[grid](...)``, compiled or interpreted) calls ``run``
    instead, for the block."""
    from triton.runtime import interpreter, jit

    saved = [(cls, cls.run) for cls in (jit.JITFunction, interpreter.InterpretedFunction)]
    for cls, _ in saved:
        cls.run = run
    try:
        yield
    finally:
        for cls, real in saved:
            cls.run = real


@contextlib.contextmanager
def stubbed_launches(mark: bool = False) -> Iterator[List[str]]:
    """Record every Triton kernel launch (``kernel[grid](...)``) as the kernel's name, and
    run nothing: nothing is compiled, interpreted or written, the launch returns at once.
    ``mark``: each launch also leaves a ``triton::<name>`` range in the profiler's trace."""
    log: List[str] = []

    def run(self, *args, grid, warmup, **kwargs):
        log.append(self.fn.__name__)
        if mark:
            with torch.profiler.record_function("triton::" + self.fn.__name__):
                pass

    with _launches_replaced(run):
        yield log


@contextlib.contextmanager
def recorded_launches() -> Iterator[List[tuple]]:
    """As :func:`stubbed_launches`, keeping each launch as ``(kernel, grid, args, kwargs)``, so
    that it can be replayed (the floor of a call whose launches are worked out elsewhere)."""
    log: List[tuple] = []

    def run(self, *args, grid, warmup, **kwargs):
        log.append((self, grid, args, kwargs))

    with _launches_replaced(run):
        yield log


# ATen ops that launch no kernel: allocation, views, metadata, and the ops that are no-ops
# unless they contain a kernel-launching op (then that op inside them is what is counted): the
# conversions (a copy) and dropout (nothing at p = 0 or in eval; else its native_dropout or
# bernoulli_ and mul).
_NO_KERNEL = frozenset("""
empty empty_strided empty_like new_empty new_empty_strided view _unsafe_view reshape _reshape_alias
detach t expand expand_as as_strided alias slice select unsqueeze squeeze permute transpose narrow view_as
flatten unflatten split unbind chunk to contiguous lift_fresh resolve_conj resolve_neg result_type set_
size stride numel dim is_nonzero item _local_scalar_dense dropout
""".split())


# The prefix of the kernels Inductor generates (torch/_inductor/codegen/triton.py names them
# triton_<kind>_<fused ops>): its launcher's profiler range carries that name.
_INDUCTOR_KERNEL = "triton_"


def kernels_launched(fn: Callable[[], object]) -> List[str]:
    """The kernels one call of ``fn`` launches, in order: each Triton launch by its kernel's name,
    and each ATen op that would launch a kernel on a GPU (an op outside ``_NO_KERNEL`` none of
    whose own ATen children does) as ``aten::name``. Read from the profiler's op tree, so it
    counts the same on a CPU as on a GPU; Triton launches are recorded, not run
    (:func:`stubbed_launches`). Code torch.compile generated for a GPU launches its Triton
    kernels through Inductor's own launcher, which runs them and, under the profiler, opens a
    range named after the kernel (``triton_poi_fused_...``, ``triton_red_...``): each counts."""
    found: List[str] = []

    def walk(ev):
        if ev.name.startswith("triton::"):
            found.append(ev.name[len("triton::"):])
            return
        if ev.name.startswith(_INDUCTOR_KERNEL):
            found.append(ev.name)
            return
        if ev.name.startswith("aten::"):
            inner = [k for k in ev.cpu_children
                     if k.name.startswith("triton::") or (k.name.startswith("aten::") and k.name[6:] not in _NO_KERNEL)]
            if ev.name[6:] not in _NO_KERNEL and not inner:
                found.append(ev.name)
                return
        for k in ev.cpu_children:
            walk(k)

    with stubbed_launches(mark=True), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    for ev in prof.events():
        if ev.cpu_parent is None:
            walk(ev)
    return found


# --------------------------------------------------------------------------- the benchmark
FAMILY = "overhead"
SHAPE = (8, 64)  # the goal's shape: a call whose kernels are negligible, so a call is its host cost
CALLS_PER_REP = 200  # calls timed back to back in one repetition (one sync at its end on a GPU)
PLOT = dict(x_key="N", metric="median_ms")
FLOYD_SHAPE = dict(B=1, H=6, D=64)  # FloydNet's TSP model under bf16 autocast (width 384, 6 heads)
FLOYD_GRIDS = (32, 100)  # FloydNet's TSP training grids are 20-100 nodes
FLOYD_OPS = tuple(f"pivotal_attention fwd+bwd L={grid}" for grid in FLOYD_GRIDS)

GOALS = (
    Goal("on a CPU, gradops' Python around a Triton launch within 2x the bare autograd.Function floor "
         "(nn.functional rms_norm and layer_norm, forward + backward)", ("F.rms_norm fwd+bwd", "F.layer_norm fwd+bwd"),
         "speedup:floor", 0.5, device="cpu", gpu=None),
    # a ratio to torch's call on the same machine: a goal on any GPU (set for the H100 by mistake
    # until the H200 run of 2026-11-28 left it unevaluated)
    Goal("host time of an nn.functional rms_norm / layer_norm forward + backward at 8x64 within 1.5x torch's",
         ("F.rms_norm fwd+bwd", "F.layer_norm fwd+bwd"), "speedup:torch", 1 / 1.5, gpu=None),
    Goal("on a CPU, the host cost of a pivotal_attention forward + backward at FloydNet's shapes (B = 1, H = 6, "
         "D = 64, bf16, a pair mask, L = 32 and 100) within 1.5x the floor of its launches", FLOYD_OPS,
         "speedup:floor", 1 / 1.5, device="cpu", gpu=None),
)


class _FloorRmsNorm(torch.autograd.Function):
    """The least an RMSNorm autograd.Function can do: allocate its outputs and launch gradops'
    kernels, with a config computed once, outside the call."""

    @staticmethod
    def forward(ctx, x, w, fwd, bwd, red):
        from ..kernels import rms_norm as K
        import triton.language as tl

        from ..kernels._scalar_args import float64_bits

        m, n = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        K._rms_fwd_fused_kernel[(fwd.grid,)](x, x, x, y, w, rstd, m, n, n, n, n, n, *float64_bits(1e-6), 0, 0,
                                            fwd.tiles_per_program, fwd.grid, HAS_W=True, HAS_RES=False,
                                            ROUND_XHAT=False, ACC=tl.float32, BLOCK_M=fwd.block_m,
                                            BLOCK_N=fwd.block_n, NUM_STAGES=fwd.num_stages, **fwd.launch())
        ctx.save_for_backward(x, w, rstd)
        ctx.cfg = bwd, red
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..kernels import rms_norm as K
        import triton.language as tl

        from ..kernels._norm_common import _sum_rows_kernel

        x, w, rstd = ctx.saved_tensors
        bwd, red = ctx.cfg
        m, n = x.shape
        dx = torch.empty_like(x)
        partial = torch.empty((bwd.grid, n), dtype=torch.float32, device=x.device)
        dw = torch.empty(n, dtype=w.dtype, device=x.device)
        K._rms_bwd_fused_kernel[(bwd.grid,)](dy, x, w, rstd, x, dx, partial, m, n, n, n, n, n, n, 0, 0,
                                            bwd.tiles_per_program, bwd.grid, HAS_W=True, HAS_DRES=False,
                                            ROUND_XHAT=False, ACC=tl.float32, BLOCK_M=bwd.block_m,
                                            BLOCK_N=bwd.block_n, NUM_STAGES=bwd.num_stages, **bwd.launch())
        _sum_rows_kernel[(red.grid,)](partial, dw, dw, bwd.grid, n, n, n, BLOCK_R=red.block_r,
                                      BLOCK_N=red.block_n, **red.launch())
        return dx, dw, None, None, None


class _FloorLayerNorm(torch.autograd.Function):
    """As :class:`_FloorRmsNorm`, for LayerNorm with weight and bias."""

    @staticmethod
    def forward(ctx, x, w, b, fwd, bwd, red):
        from ..kernels import layer_norm as K
        import triton.language as tl

        from ..kernels._scalar_args import float64_bits

        m, n = x.shape
        y = torch.empty_like(x)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        K._ln_fwd_fused_kernel[(fwd.grid,)](x, x, x, y, w, b, mean, rstd, m, n, n, n, n, n, *float64_bits(1e-5),
                                           fwd.tiles_per_program, fwd.grid, HAS_W=True, HAS_B=True, HAS_RES=False,
                                           ACC=tl.float32, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n,
                                           NUM_STAGES=fwd.num_stages, **fwd.launch())
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.cfg = bwd, red
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..kernels import layer_norm as K
        import triton.language as tl

        from ..kernels._norm_common import _sum_rows_kernel

        x, w, mean, rstd = ctx.saved_tensors
        bwd, red = ctx.cfg
        m, n = x.shape
        dx = torch.empty_like(x)
        partial = torch.empty((bwd.grid, 2 * n), dtype=torch.float32, device=x.device)
        dw = torch.empty(n, dtype=w.dtype, device=x.device)
        db = torch.empty(n, dtype=w.dtype, device=x.device)
        K._ln_bwd_fused_kernel[(bwd.grid,)](dy, x, w, mean, rstd, x, dx, partial, partial[:, n:], m, n, n, n, n, n,
                                           2 * n, bwd.tiles_per_program, bwd.grid, HAS_W=True, HAS_DRES=False,
                                           WANT_DX=True, WANT_DW=True, WANT_DB=True, ACC=tl.float32,
                                           BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n, NUM_STAGES=bwd.num_stages,
                                           **bwd.launch())
        _sum_rows_kernel[(red.grid,)](partial, dw, db, bwd.grid, 2 * n, n, 2 * n, BLOCK_R=red.block_r,
                                      BLOCK_N=red.block_n, **red.launch())
        return dx, dw, db, None, None, None


class _FloorReplay(torch.autograd.Function):
    """The least a differentiable call can do around given launches: allocate outputs and
    gradients of the given (shape, dtype) and launch the forward's and the backward's kernels
    as one real call recorded them (:func:`recorded_launches`: the same kernels, grids and
    arguments, nothing worked out)."""

    @staticmethod
    def forward(ctx, record, *inputs):
        outputs = [torch.empty(shape, dtype=dtype, device=inputs[0].device) for shape, dtype in record.outputs]
        for kernel, grid, args, kwargs in record.forward:
            kernel[grid](*args, **kwargs)
        ctx.save_for_backward(*inputs, *outputs)  # what a backward needs: the inputs, Y and its statistics
        ctx.record = record
        return outputs[0]

    @staticmethod
    def backward(ctx, dy):
        record = ctx.record
        _ = ctx.saved_tensors  # (a backward reads what its forward saved)
        grads = [torch.empty(shape, dtype=dtype, device=dy.device) for shape, dtype in record.grads]
        for kernel, grid, args, kwargs in record.backward:
            kernel[grid](*args, **kwargs)
        return (None, *grads)


class _Recorded:
    """One call's launches, forward and backward, and its outputs' and gradients' (shape, dtype)."""

    def __init__(self, call: Callable[[], torch.Tensor], inputs, dy):
        with recorded_launches() as self.forward:
            out = call()
        with recorded_launches() as self.backward:
            grads = torch.autograd.grad(out, inputs, dy)
        # the forward's outputs: Y and the two float32 statistics ([B,H,N,M]) of Floyd attention
        stat = (tuple(out.shape[:4]), torch.float32)
        self.outputs = [(tuple(out.shape), out.dtype), stat, stat]
        self.grads = [(tuple(g.shape), g.dtype) for g in grads]



def floyd_entry_points(device: str) -> Dict[str, tuple]:
    """{op: (case, {impl: callable})}: ``gradops.pivotal_attention`` forward + backward at
    FloydNet's shapes with its padding pair mask (ours), and the floor of the launches the call
    makes; FloydNet's own ``pivotal_attention`` beside them on a GPU (on a CPU it would time the
    CPU's einsums, not a host)."""
    import gradops

    from .floyd_accuracy import pair_mask

    b, h, d = FLOYD_SHAPE["B"], FLOYD_SHAPE["H"], FLOYD_SHAPE["D"]
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    found = {}
    for grid in FLOYD_GRIDS:
        inputs = [torch.randn(b, h, grid, grid, d, generator=gen).to(device=dev, dtype=torch.bfloat16)
                  .requires_grad_() for _ in range(5)]
        mask = pair_mask(b, grid, grid).to(dev)  # FloydNet's attn_mask of a padded grid, [B,1,N,1,N]
        dy = torch.randn(b, h, grid, grid, d, generator=gen).to(device=dev, dtype=torch.bfloat16)

        def ours(inputs=inputs, mask=mask):
            return gradops.pivotal_attention(*inputs, attn_mask=mask)

        record = _Recorded(ours, inputs, dy)
        impls = {OURS: _fwd_bwd(ours, inputs, dy),
                 "floor": _fwd_bwd(lambda record=record, inputs=inputs: _FloorReplay.apply(record, *inputs),
                                   inputs, dy)}
        if dev.type == "cuda":
            try:
                import floydnet
            except ImportError:
                pass
            else:
                impls["floydnet"] = _fwd_bwd(lambda inputs=inputs, mask=mask: floydnet.pivotal_attention(
                    *inputs, attn_mask=mask), inputs, dy)
        other = other_launch_path(device)
        if other is not None:
            impls[other[0]] = _launching(impls[OURS], other[1])
        case = dict(B=b, H=h, L=grid, D=d, dtype="bfloat16", mask="pair")
        found[FLOYD_OPS[FLOYD_GRIDS.index(grid)]] = (case, impls)
    return found


def _configs(m: int, n: int, device, dtype: torch.dtype):
    from ..kernels import norm_config as C

    bwd = C.fused_config(m, n, device, elem_bytes=dtype.itemsize)
    fwd = C.fused_config(m, n, device, kind="fwd", elem_bytes=dtype.itemsize, streams=1)
    return fwd, bwd, C.reduce_config(bwd.grid, 2 * n, device)


ENTRY_POINTS = ("F.rms_norm fwd+bwd", "F.layer_norm fwd+bwd", "nn.RMSNorm fwd+bwd", "nn.LayerNorm fwd+bwd",
                "gradops.rms_norm", "gradops.layer_norm", "gradops.layer_norm_backward", "gradops.rms_norm_grad",
                "F.nsa_compress fwd+bwd")


def cases(args) -> List[tuple]:
    """(entry point, dtype) of a run (``gradops bench all --dry-run`` counts them)."""
    return [(op, dt) for dt in args.dtypes for op in ENTRY_POINTS] + [(op, "bfloat16") for op in FLOYD_OPS]


def impl_names(args) -> List[str]:
    other = other_launch_path(args.device)
    return [OURS, "torch", "floor"] + ([other[0]] if other else [])


def other_launch_path(device: str):
    """(record name, switch value) of the launch path our calls do not take, timed beside them
    on a GPU (on a CPU the launches are stubbed: there is no launch to compare); None where
    there is none (a CPU, or a Triton that bound launches are not written for)."""
    from ..kernels import _launch

    if device != "cuda" or not _launch.VERSION_OK:
        return None
    return ("jit", False) if _launch.ENABLED else ("bound", True)


def _launching(call: Callable[[], object], bound: bool) -> Callable[[], object]:
    """``call`` with bound launches switched to ``bound`` while it runs."""
    from ..kernels import _launch

    def switched():
        was, _launch.ENABLED = _launch.ENABLED, bound
        try:
            return call()
        finally:
            _launch.ENABLED = was
    return switched


def bound_launches_of(call: Callable[[], object]) -> int:
    """How many of the launches one call of ``call`` made went through the bound path."""
    from ..kernels import _launch

    before = sum(_launch.bound_launch_counts().values())
    call()
    return sum(_launch.bound_launch_counts().values()) - before


def optional_peers(device: str) -> Dict[str, str]:
    return {}  # torch's calls and the floor run wherever gradops does


def _no_grad(call: Callable[[], object]) -> Callable[[], object]:
    def wrapped():
        with torch.no_grad():
            return call()
    return wrapped


def _fwd_bwd(forward: Callable[[], torch.Tensor], inputs, dy) -> Callable[[], object]:
    def step():
        torch.autograd.grad(forward(), inputs, dy)
    return step


def entry_points(device: str, dtype: torch.dtype):
    """{op: {impl: callable}}: each public entry point (ours), torch's nearest call and the floor."""
    import gradops
    import gradops.nn.functional as GF
    import torch.nn.functional as F

    m, n = SHAPE
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=gen).to(device=dev, dtype=dtype).requires_grad_()
    w = torch.randn(n, generator=gen).to(device=dev, dtype=dtype).requires_grad_()
    b = torch.randn(n, generator=gen).to(device=dev, dtype=dtype).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to(device=dev, dtype=dtype)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    fwd, bwd, red = _configs(m, n, dev, dtype)
    _, mean, rstd = torch.native_layer_norm(xd, (n,), wd, bd, 1e-5)
    rms_rstd = torch.rsqrt(xd.float().pow(2).mean(-1) + 1e-6)
    rms_module = gradops.nn.RMSNorm(n, eps=1e-6, device=dev, dtype=dtype)
    ln_module = gradops.nn.LayerNorm(n, device=dev, dtype=dtype)
    torch_rms_module = torch.nn.RMSNorm(n, eps=1e-6, device=dev, dtype=dtype)
    torch_ln_module = torch.nn.LayerNorm(n, device=dev, dtype=dtype)
    floor_fwd = lambda function, *args: _no_grad(lambda: function.apply(*args))  # noqa: E731
    ends = [40, 100]
    xs = torch.randn(100, 4, 16, generator=gen).to(device=dev, dtype=dtype).requires_grad_()
    nsa_w = torch.randn(32, 4, generator=gen).to(device=dev, dtype=dtype).requires_grad_()
    with stubbed_launches():  # its shape and dtype
        nsa_dy = torch.ones_like(GF.nsa_compress(xs, nsa_w, 32, 16, ends))

    timed = {
        "F.rms_norm fwd+bwd": {
            OURS: _fwd_bwd(lambda: GF.rms_norm(x, (n,), w, 1e-6), (x, w), dy),
            "torch": _fwd_bwd(lambda: F.rms_norm(x, (n,), w, 1e-6), (x, w), dy),
            "floor": _fwd_bwd(lambda: _FloorRmsNorm.apply(x, w, fwd, bwd, red), (x, w), dy)},
        "F.layer_norm fwd+bwd": {
            OURS: _fwd_bwd(lambda: GF.layer_norm(x, (n,), w, b, 1e-5), (x, w, b), dy),
            "torch": _fwd_bwd(lambda: F.layer_norm(x, (n,), w, b, 1e-5), (x, w, b), dy),
            "floor": _fwd_bwd(lambda: _FloorLayerNorm.apply(x, w, b, fwd, bwd, red), (x, w, b), dy)},
        "nn.RMSNorm fwd+bwd": {
            OURS: _fwd_bwd(lambda: rms_module(x), (x, rms_module.weight), dy),
            "torch": _fwd_bwd(lambda: torch_rms_module(x), (x, torch_rms_module.weight), dy),
            "floor": _fwd_bwd(lambda: _FloorRmsNorm.apply(x, w, fwd, bwd, red), (x, w), dy)},
        "nn.LayerNorm fwd+bwd": {
            OURS: _fwd_bwd(lambda: ln_module(x), (x, ln_module.weight, ln_module.bias), dy),
            "torch": _fwd_bwd(lambda: torch_ln_module(x), (x, torch_ln_module.weight, torch_ln_module.bias), dy),
            "floor": _fwd_bwd(lambda: _FloorLayerNorm.apply(x, w, b, fwd, bwd, red), (x, w, b), dy)},
        "gradops.rms_norm": {
            OURS: lambda: gradops.rms_norm(xd, wd, 1e-6),
            "torch": _no_grad(lambda: F.rms_norm(xd, (n,), wd, 1e-6)),
            "floor": floor_fwd(_FloorRmsNorm, xd, wd, fwd, bwd, red)},
        "gradops.layer_norm": {
            OURS: lambda: gradops.layer_norm(xd, (n,), wd, bd, 1e-5),
            "torch": lambda: torch.native_layer_norm(xd, (n,), wd, bd, 1e-5),
            "floor": floor_fwd(_FloorLayerNorm, xd, wd, bd, fwd, bwd, red)},
        "gradops.layer_norm_backward": {
            OURS: lambda: gradops.layer_norm_backward(dy, xd, (n,), mean, rstd, wd, bd,
                                                      output_mask=(True, True, True)),
            "torch": lambda: torch.ops.aten.native_layer_norm_backward(dy, xd, (n,), mean, rstd, wd, bd,
                                                                       (True, True, True))},
        "gradops.rms_norm_grad": {
            OURS: lambda: gradops.rms_norm_grad(dy, xd, rms_rstd, wd)},
        "F.nsa_compress fwd+bwd": {
            OURS: _fwd_bwd(lambda: GF.nsa_compress(xs, nsa_w, 32, 16, ends), (xs, nsa_w), nsa_dy)},
    }
    other = other_launch_path(device)
    if other is not None:
        name, bound = other
        for impls in timed.values():
            impls[name] = _launching(impls[OURS], bound)
    return timed


def _timed_calls(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """ms per call of ``calls`` calls of ``fn`` back to back, then one ``sync``: with kernels
    shorter than the host's work the GPU queue never backs up, so this is what the host spends."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / calls


def host_times(impls: Dict[str, Callable[[], object]], args) -> Dict[str, List[float]]:
    """Per-call host time (ms) of each implementation, one value per repetition. The
    implementations take turns within each repetition, so a slow spell of the machine (a
    shared host's noise) falls on all of them alike rather than on whichever ran then."""
    calls = max(1, CALLS_PER_REP // (10 if args.quick else 1))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: Dict[str, List[float]] = {name: [] for name in impls}
    for fn in impls.values():
        for _ in range(max(1, args.warmup)):
            fn()
    start = time.perf_counter()
    for rep in range(args.reps):
        for name, fn in impls.items():
            times[name].append(_timed_calls(fn, calls, sync))
        if rep >= 2 and time.perf_counter() - start > args.max_seconds:
            break
    return times


def run(args) -> Run:
    import gradops

    result = Run(f"gradops bench {FAMILY}", args.device, getattr(args, "deadline", None))
    on_cpu = args.device != "cuda"
    result.meta["backend_ours"] = "triton, launches stubbed (Python only)" if on_cpu else "triton"
    result.meta["shape"] = list(SHAPE)
    result.meta["calls_per_rep"] = CALLS_PER_REP
    other = other_launch_path(args.device)
    with gradops.use_backend("triton"):
        calls = [(op, {"M": SHAPE[0], "N": SHAPE[1], "dtype": dtype_name}, impls)
                 for dtype_name in args.dtypes
                 for op, impls in entry_points(args.device, harness.DTYPES[dtype_name]).items()]
        try:
            with stubbed_launches() if on_cpu else contextlib.nullcontext():
                calls += [(op, case, impls) for op, (case, impls) in floyd_entry_points(args.device).items()]
        except Exception as e:  # the Floyd rows' failure is their record, not the run's end
            for op in FLOYD_OPS:
                result.add(Record(op, {}, OURS, [], error=f"{type(e).__name__}: {e}"[:300]))
        for op, case, impls in calls:
            if result.out_of_time():
                for impl in impls:
                    result.skip([op], case, impl)
                continue
            working, failed = {}, {}
            for name, fn in impls.items():  # one call each first: a peer's failure is the peer's record
                try:
                    with stubbed_launches() if on_cpu else contextlib.nullcontext():
                        fn()
                    working[name] = fn
                except Exception as e:
                    failed[name] = f"{type(e).__name__}: {e}"[:300]
            with stubbed_launches() if on_cpu else contextlib.nullcontext():
                times = host_times(working, args)
            for name in impls:
                if name in failed:
                    result.add(Record(op, case, name, [], error=failed[name]))
                else:
                    extra = {"launches": kernels_launched(impls[name])}
                    if other is not None and name == other[0]:
                        extra["bound_launches"] = bound_launches_of(impls[name])
                    result.add(Record(op, case, name, times[name], extra=extra))
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench overhead", description=__doc__.split("\n\n")[0])
    harness.add_common_args(p, dtype_help="default: bfloat16 on a GPU, float32 on a CPU")
    return p.parse_args(argv)


def prepare(args, need_device: bool = True):
    args.device = args.device or harness.default_device()
    # gradops runs its Triton path on a CPU only under the interpreter, which is switched on; the
    # launches are stubbed all the same, so nothing is interpreted
    args.interpret = args.device != "cuda"
    harness.prepare(args, reps=21, warmup=20, max_seconds=20.0, quick_reps=3, quick_warmup=3,
                    need_device=need_device, gpu_dtypes=("bfloat16",), cpu_dtypes=("float32",))
    args.interpret = False  # (for the CPU caveat: nothing is interpreted)
    return args


def main(argv=None) -> int:
    args = prepare(parse_args(sys.argv[1:] if argv is None else list(argv)))
    harness.announce(args, FAMILY)
    if args.device != "cuda":
        print("note: on a CPU every Triton launch is stubbed (recorded, not run): ours and the floor time "
              "the Python around the launches; torch runs its CPU kernels", flush=True)
    result = run(args)
    harness.finish(result, args, FAMILY, PLOT, GOALS)
    for row in result.ratios():
        launches = row["extra"].get("launches")
        if launches is not None and row["impl"] == OURS:
            print(f"launches per call, {row['op']}: {len(launches)} ({', '.join(launches)})")
        if "bound_launches" in row["extra"]:
            print(f"bound launches per call, {row['op']} ({row['impl']}): {row['extra']['bound_launches']}")
    return result.exit_status()


if __name__ == "__main__":
    sys.exit(main())
