"""Bound launches: after the first launch of a signature, a kernel launches the
specialisation Triton compiled for it directly, without ``JITFunction.run``'s per-call
bookkeeping (issue 44).

``kernel[grid](*args, **kwargs)`` calls ``JITFunction.run``, which on every launch asks for
the device and stream, runs its generated binder (``native_specialize_impl`` per argument,
a dict of every parameter), builds the cache key (``compute_cache_key``: the specialisation
and ``str`` of the options), looks the compiled kernel up, checks the globals the kernel
read, builds ``launch_metadata`` and calls the kernel's launcher, which calls the (empty)
launch hook chains. On an H200 host (cProfile of 600 norm launches,
benchmarks/results/nvidia-h200-2026-11-28/profile.txt) the launcher took 0.018 s of
``JITFunction.run``'s 0.059: about 70 % of a launch's host time is that bookkeeping.

A kernel defined under :func:`bind_launches` (above ``@triton.jit``) launches through
:meth:`_Launches.run`. The first launch of each *signature* (key, below) goes through
``JITFunction.run``, which compiles or finds the specialisation and launches it; the
``CompiledKernel`` it returns is *bound* to the key. A later launch with that key calls the
kernel's launcher as ``JITFunction.run`` calls it: ``kernel.run(grid0, grid1, grid2, stream,
kernel.function, kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``,
the arguments being every parameter in order (the positional ones, then the keyword
constexprs and the defaults, fixed per key), with ``None`` for the metadata and both hooks
(the launcher calls no ``None`` hook; while a hook is registered the JIT launches).

The key is what ``JITFunction.run`` specialises on, computed as it computes it:
- the current device (``driver.active.get_current_device()``; the stream is read per launch);
- each positional argument through the binder's own ``native_specialize_impl(backend, arg,
  is_const, specialize, align)``, with the binder's flags for its parameter: a tensor's dtype
  and its data pointer's 16-byte alignment; an integer's type (i32, i64, u64), divisibility
  by 16 and equality to 1, or its type alone when the parameter is ``do_not_specialize`` (the
  float64 words of ``_scalar_args``); a bool, a float or None by its type;
- the keyword arguments (constexprs; launch options: num_warps, num_stages, maxnreg,
  enable_fp_fusion, ...) by name, value and type (the JIT's key holds the options' ``str``:
  ``True`` and ``1`` are one dict key there, two JIT keys);
- what ``JITFunction.run`` takes into the options from elsewhere: the kernel's ``debug``,
  ``knobs.runtime.debug``, ``knobs.compilation.instrumentation_mode`` and (3.9)
  ``knobs.compilation.fpsan_homomorphic_casts``.
So two launches with one key have one JIT key, and the JIT would launch the kernel bound to
it. A launch is bound only where that holds by construction: a tuple grid, no constexpr
passed by position, no runtime parameter by keyword, keyword values whose equality means
equal ``str`` (bool, int, str, None, ``tl.dtype``). Everything else, a warm-up, and a launch
while a pre-run hook, a launch hook or (3.9) a stages-inspection hook is set, goes to
``JITFunction.run``; so does a bound launch whose kernel's globals changed (the JIT raises).

It relies on Triton internals, not public API, read in Triton 3.6 (the GPU image's) and 3.9
(CI's): ``runtime/jit.py`` (``JITFunction.run`` and its launch call above, ``__getitem__``
calling ``self.run``, ``device_caches[device] == (kernel_cache, key_cache, target, backend,
binder)``, the binder's ``native_specialize_impl`` and ``KernelParam`` flags,
``pre_run_hooks``, ``used_global_vals``), ``compiler/compiler.py`` (``CompiledKernel.run``,
``.function``, ``.packed_metadata``), ``knobs.py`` (the options above; the launch hooks,
``HookChain``s) and ``runtime/driver.py`` (``driver.active``). Between the two, only the 3.9
knobs above differ, and async compiles: 3.6 returns the resolved ``CompiledKernel`` (bound
like any), 3.9 its cache's entry (a pending compile is not a ``CompiledKernel``: not bound).
Hence the gate, :data:`TRITON_READ`: on another Triton :func:`bind_launches` leaves the
kernel as it is, as it leaves the interpreter's ``InterpretedFunction`` (``TRITON_INTERPRET=1``).

The kernel stays a plain ``JITFunction`` (what torch's ``wrap_triton`` and Inductor take,
``_traceable``): :meth:`_Launches.run` is an instance attribute. Whoever replaces
``JITFunction.run`` on the class (``gradops.bench.overhead.stubbed_launches``, the tests'
``record_launches``) gets every launch: a launch is bound only while ``JITFunction.run`` is
Triton's own.

The switch: :data:`ENABLED`, read per launch, set at import from ``GRADOPS_BOUND_LAUNCH``
(1, true, yes or on: on; unset or anything else: off). Off by default until a GPU run shows
the bound path bitwise equal to the JIT's and faster (``tests/test_bound_launch.py``;
``gradops bench overhead``'s ``bound`` records). On a CPU it takes 35 to 56 % off the Python
of a launch (docs/backends.md, "Kernel launches"; ``benchmarks/launch_cost.py``).
"""
from __future__ import annotations

import os
from itertools import repeat
from typing import Dict, Optional

import triton
import triton.language as tl

from .._versions import release

ENV = "GRADOPS_BOUND_LAUNCH"
ENABLED: bool = os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")

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

# Types of keyword values whose equal value and type mean equal str() (the JIT's key), with tl.dtype
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
        return f"bound launches off (every launch through JITFunction.run; {ENV}=1 turns them on)"
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
    if any(type(value) not in _KEYED and not isinstance(value, tl.dtype) for value in kwargs.values()):
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
