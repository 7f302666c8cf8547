"""Bound launches: a kernel's later calls of a signature go straight to the specialisation
Triton compiled for it, without ``JITFunction.run``'s per-call bookkeeping (issue 44).

``kernel[grid](*args, **kwargs)`` calls ``JITFunction.run``, which on every launch looks up
the device and stream, runs its generated binder (a ``native_specialize_impl`` call per
argument, a dict of all parameters), builds the cache key (``compute_cache_key``: the
specialisation and ``str`` of the options), looks up the compiled kernel, checks the
globals the kernel read, builds ``launch_metadata`` and calls the compiled kernel's launcher,
which calls the launch hook chains. On an H200 host (cProfile of 600 norm launches,
benchmarks/results/nvidia-h200-2026-11-28/profile.txt) the launcher took 0.018 s of
``JITFunction.run``'s 0.059: about 70 % of a launch's host time is bookkeeping.

A kernel defined under :func:`bind_launches` (above ``@triton.jit``) keeps that path for the
first call of each *signature*: the call compiles (or finds) and launches its specialisation,
and the ``CompiledKernel`` it returns is *bound* to the call's key. A later call with the
same key calls that kernel's launcher directly, with what ``JITFunction.run`` would pass it:
the grid, the current stream, ``kernel.function``, ``kernel.packed_metadata`` and every
argument in parameter order (the positional ones, then the keyword constexprs and the
parameters' defaults, fixed per key), with ``None`` for the launch metadata and both hooks
(the launcher skips a ``None`` hook; the JIT path is taken whenever a hook is registered).

The key is everything ``JITFunction.run`` specialises on, computed as it does:
- the current device (``driver.active.get_current_device()``; the stream is read per call);
- each positional argument through the binder's own ``native_specialize_impl(backend, arg,
  is_const, specialize, align)``, with the flags the binder passes for that parameter
  (``do_not_specialize``, ``do_not_specialize_on_alignment``): a tensor's dtype and its data
  pointer's 16-byte alignment, an integer's type (i32, i64, u64), divisibility by 16 and
  equality to 1 (type only for a ``do_not_specialize`` one, like the float64 words of
  ``_scalar_args``), a bool, a float, None;
- the keyword arguments (constexprs and launch options: num_warps, num_stages, maxnreg,
  enable_fp_fusion, ...), by name, value *and type* (True and 1 are equal in a dict key but
  compile differently);
- what ``JITFunction.run`` adds to the options from outside the call: the kernel's ``debug``,
  ``knobs.runtime.debug``, ``knobs.compilation.instrumentation_mode`` and, in 3.9,
  ``knobs.compilation.fpsan_homomorphic_casts``.
Two calls with one key therefore have one JIT cache key, and the JIT would launch the
specialisation bound to it. A call is bound only when its shape makes that argument sound:
no constexpr passed by position, no runtime parameter passed by keyword, keyword values
whose equality means equal ``str`` (bool, int, str, None, ``tl.dtype``), a tuple grid. Every
other call, a warm-up, and a call while a pre-run hook, a launch hook or (3.9) a stages
inspection hook is set, runs ``JITFunction.run``. The globals a kernel read when compiled are
checked on every bound launch as the JIT checks them (a changed one goes to the JIT, which
raises).

It relies on Triton internals, not public API, read in Triton 3.6 (the GPU image's) and 3.9
(CI's): ``runtime/jit.py`` (``JITFunction.run``, ``KernelInterface.__getitem__`` calling
``self.run``, ``device_caches[device] == (kernel_cache, key_cache, target, backend,
binder)``, ``KernelParam`` flags, ``native_specialize_impl``, ``pre_run_hooks``,
``used_global_vals``), ``compiler/compiler.py`` (``CompiledKernel.run``, ``.function``,
``.packed_metadata``), ``knobs.py`` (the options above, the ``HookChain`` launch hooks) and
``runtime/driver.py`` (``driver.active``). The two versions differ here only in the 3.9
knobs above and in 3.6 resolving async-compile futures (never bound: not a CompiledKernel).
So it is gated on those versions (:data:`TRITON_READ`); elsewhere :func:`bind_launches`
leaves the kernel as it is. Under the interpreter (``TRITON_INTERPRET=1``) kernels are
``InterpretedFunction`` objects, also left as they are.

The hook is an instance attribute: the kernel stays a plain ``JITFunction`` (what torch's
``wrap_triton`` and Inductor take, ``_traceable``) whose ``run`` is :meth:`_Launches.run`.
Whoever replaces ``JITFunction.run`` on the class (``gradops.bench.overhead.stubbed_launches``,
the tests' ``record_launches``) gets every launch, bound or not: a bound launch happens only
while ``JITFunction.run`` is Triton's own.

The switch: :data:`ENABLED`, from ``GRADOPS_BOUND_LAUNCH`` (``1`` on; unset or ``0`` off),
read per call. Off by default until a GPU run shows the bound path bitwise equal to the JIT
path and faster (``tests/test_bound_launch.py``, ``gradops bench overhead``'s ``bound`` rows).
"""
from __future__ import annotations

import os
from itertools import repeat
from typing import Dict, Optional

import triton

from .._versions import release

ENV = "GRADOPS_BOUND_LAUNCH"
ENABLED: bool = os.environ.get(ENV, "0") not in ("", "0")

# (major, minor) of the Triton releases whose internals this module was written against.
TRITON_READ = ((3, 6), (3, 9))


def version_supported(version: str) -> bool:
    return release(version)[:2] in TRITON_READ


try:
    from triton import knobs
    from triton.compiler import CompiledKernel
    from triton.knobs import HookChain
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction, native_specialize_impl

    _JIT_RUN = JITFunction.run
    VERSION_OK = version_supported(triton.__version__)
except ImportError:  # another layout of Triton than the versions read: the JIT path
    VERSION_OK = False

# Every kernel defined under bind_launches (compiled or interpreted), by its Python function:
# its _Launches where its launches are bound, else None.
DECLARED: Dict[object, "Optional[_Launches]"] = {}

# Types of keyword values for which equal value and type mean equal str() (the JIT's key)
_KEYED = frozenset((bool, int, str, type(None)))
_MISSING = object()


def bind_launches(kernel):
    """Decorator, above ``@triton.jit``: launches of ``kernel`` after the first of each
    signature go to its compiled specialisation while :data:`ENABLED` (this module's
    docstring). Returns ``kernel`` itself; an interpreted kernel, or one of a Triton outside
    :data:`TRITON_READ`, unchanged."""
    launches = None
    if VERSION_OK and type(kernel) is JITFunction:
        launches = _Launches(kernel)
        kernel.run = launches.run
    DECLARED[kernel.fn] = launches
    return kernel


def describe() -> str:
    """One line for ``gradops info``: the switch and, when on, whether this Triton is gated in."""
    if not ENABLED:
        return f"bound launches off (the JIT's path every launch; {ENV}=1 turns them on)"
    if not VERSION_OK:
        return (f"bound launches asked for ({ENV}) but off: written against triton "
                f"{', '.join('%d.%d' % v for v in TRITON_READ)}, this is {triton.__version__}")
    return f"bound launches on ({ENV}): a signature's later launches skip JITFunction.run's bookkeeping"


def bound_launch_counts() -> Dict[str, int]:
    """How many bound launches the kernels have made so far, by kernel name (the name
    ``stubbed_launches`` records; kernels of one name add up): for tests and benchmarks."""
    counts: Dict[str, int] = {}
    for fn, launches in DECLARED.items():
        if launches is not None:
            counts[fn.__name__] = counts.get(fn.__name__, 0) + launches.bound
    return counts


if VERSION_OK:
    _FPSAN = hasattr(type(knobs.compilation), "fpsan_homomorphic_casts")  # 3.9
    _STAGES_HOOK = hasattr(type(knobs.runtime), "add_stages_inspection_hook")  # 3.9

    def _silent(hook) -> bool:
        return hook is None or (type(hook) is HookChain and not hook.calls)

    def _outside_options(kernel) -> Optional[tuple]:
        """What JITFunction.run takes into a call's options from outside its arguments; None
        while a hook is set that a bound launch would not call (then the JIT launches)."""
        runtime, compilation = knobs.runtime, knobs.compilation
        if (kernel.pre_run_hooks or not _silent(runtime.launch_enter_hook) or not _silent(runtime.launch_exit_hook)
                or (_STAGES_HOOK and runtime.add_stages_inspection_hook is not None)):
            return None
        if _FPSAN:
            return (kernel.debug, runtime.debug, compilation.instrumentation_mode,
                    compilation.fpsan_homomorphic_casts)
        return kernel.debug, runtime.debug, compilation.instrumentation_mode


def _tail(params, nargs: int, kwargs: dict) -> Optional[tuple]:
    """The arguments after the positional ones, in parameter order (keyword constexprs and
    defaults), or None where the call's shape does not let its key stand for the JIT's."""
    if nargs > len(params) or any(p.is_constexpr for p in params[:nargs]):
        return None
    if any(type(value) not in _KEYED and not isinstance(value, triton.language.dtype) for value in kwargs.values()):
        return None
    tail = []
    for p in params[nargs:]:
        if p.name in kwargs:
            if not p.is_constexpr:
                return None
            tail.append(kwargs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


class _Launches:
    """One kernel's bound launches: key -> (launcher, function, packed metadata, tail, the
    CompiledKernel), and how many launches went through them."""
    __slots__ = ("kernel", "bindings", "flags", "bound")

    def __init__(self, kernel):
        self.kernel = kernel
        self.bindings = {}
        params = kernel.params
        # the flags the binder passes native_specialize_impl for each parameter
        self.flags = (tuple(p.is_const for p in params), tuple(not p.do_not_specialize for p in params),
                      tuple(not p.do_not_specialize_on_alignment for p in params))
        self.bound = 0

    def run(self, *args, grid, warmup, **kwargs):
        kernel = self.kernel
        if not ENABLED or warmup or JITFunction.run is not _JIT_RUN or type(grid) is not tuple:
            return JITFunction.run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        options = _outside_options(kernel)
        if options is None:
            return _JIT_RUN(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        active = _driver.active
        device = active.get_current_device()
        try:
            key = (device, len(args),
                   tuple(map(native_specialize_impl, repeat(kernel.device_caches[device][3]), args, *self.flags)),
                   tuple(kwargs.items()), tuple(map(type, kwargs.values())), options)
            binding = self.bindings.get(key)
        except Exception:  # an argument the specialisation or a dict refuses: the JIT says why
            return _JIT_RUN(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        if binding is None:
            return self._bind(key, args, grid, kwargs)
        for (name, _), (value, scope) in kernel.used_global_vals.items():
            if scope.get(name, _MISSING) != value:  # the JIT raises
                return _JIT_RUN(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        launcher, function, metadata, tail, compiled = binding
        size = len(grid)
        launcher(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, active.get_current_stream(device),
                 function, metadata, None, None, None, *args, *tail)
        self.bound += 1
        return compiled

    def _bind(self, key, args, grid, kwargs):
        """The JIT's launch, and the binding of what it launched to ``key``."""
        compiled = _JIT_RUN(self.kernel, *args, grid=grid, warmup=False, **kwargs)
        if isinstance(compiled, CompiledKernel):  # (not an async compile's future, nor a hook's None)
            tail = _tail(self.kernel.params, len(args), kwargs)
            if tail is not None:
                self.bindings[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail, compiled)
        return compiled
