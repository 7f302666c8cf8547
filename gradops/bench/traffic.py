"""Exact memory traffic of Triton launches, counted through the Triton interpreter.

What a kernel must move between memory and the chip bounds its speed on a GPU wherever it is
memory-bound, and an estimate from the tensor shapes misses what the code really does (a
tile re-read by every program of a row, a float32 workspace written and read back, an
argument copied by torch before the launch). :func:`count_traffic` runs a callable whose
Triton kernels execute in the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1`` set
before triton was imported) and records every ``tl.load``, ``tl.store`` and atomic of every
launch, lane by lane, from the byte addresses the interpreter dereferences:

- **distinct** bytes of a launch: the size of the union of the byte ranges
  ``[addr, addr + element size)`` of every masked-in lane of its loads (and, apart, of its
  stores): what the launch must move at least, each byte once (a perfect cache);
- **issued** bytes: every masked-in lane of every load or store counted each time it is
  issued: what the launch asks of its caches (a tile re-read by several programs counts
  several times);
- atomics (read-modify-write and compare-and-swap) count as a load and a store of their lanes;
- each launch's bytes are attributed to the kernel's tensor arguments by address range (a
  view's range runs from its ``data_ptr`` over its extent, from its sizes and strides); a lane
  in no argument's range goes to ``"other"``, one in several ranges (two views of one buffer)
  to the first in argument order.

Torch operations the callable runs outside the launches (copies, conversions, fills,
elementwise ops and reductions) move data too; they are recorded from torch's dispatcher
(:class:`TorchOpTraffic`: the extent of each tensor read and of each tensor written), while
ops that move no data (allocations, views, size queries) are not, and nor are the ops the
interpreter runs inside a launch (its own copies of the arguments).

The counts are exact for what the interpreter executes: one program after another, every
lane of every load and store. On a GPU, what a launch moves to and from DRAM lies roughly
between its distinct bytes (everything it reads again still cached) and its issued bytes
(nothing), rounded up to the 32-byte sectors the memory moves.

:func:`floyd_traffic` counts Floyd attention's forward and backward under one strategy
(:func:`forced_strategy`, which ``bench floyd`` and ``floyd_accuracy`` force theirs with too), and
``gradops bench floyd --traffic`` prints it (:func:`floyd_main`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

OTHER = "other"  # where a lane in no tensor argument's range is attributed

# Pending lanes of one launch held before they are reduced to unique addresses and counts:
# bounds the memory of a launch that issues hundreds of millions of lanes (32 MiB of addresses).
_COMPACT_LANES = 1 << 22


# ---------------------------------------------------------------------------------------------
# The records
# ---------------------------------------------------------------------------------------------
@dataclass
class ArgTraffic:
    """Bytes of one launch attributed to one of its tensor arguments (or to ``"other"``)."""

    distinct_load: int = 0
    distinct_store: int = 0
    issued_load: int = 0
    issued_store: int = 0


@dataclass
class LaunchTraffic:
    """One Triton launch: its kernel's name, its distinct and issued bytes loaded and stored,
    and those bytes by tensor argument (argument order, ``"other"`` last; arguments the launch
    never touched are left out)."""

    kernel: str
    distinct_load: int
    distinct_store: int
    issued_load: int
    issued_store: int
    by_arg: Dict[str, ArgTraffic] = field(default_factory=dict)

    @property
    def distinct(self) -> int:
        return self.distinct_load + self.distinct_store

    @property
    def issued(self) -> int:
        return self.issued_load + self.issued_store

    def to_dict(self, scores: Optional[int] = None) -> dict:
        d = dataclasses.asdict(self)
        if scores:
            d.update({f"{key}_per_score": d[key] / scores for key in _FOUR})
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LaunchTraffic":
        return cls(kernel=d["kernel"], **{key: d[key] for key in _FOUR},
                   by_arg={name: ArgTraffic(**a) for name, a in d.get("by_arg", {}).items()})


@dataclass
class TorchOpTraffic:
    """One torch operation run outside the Triton launches: the bytes it read (the extent of
    each tensor input) and wrote (of each output)."""

    op: str
    read: int
    write: int


_FOUR = ("distinct_load", "distinct_store", "issued_load", "issued_store")


@dataclass
class Traffic:
    """What a call moved: its Triton launches in order and the torch operations around them.

    The totals add the torch operations' bytes (read + written) to the launches' distinct
    bytes (``distinct``) and to their issued bytes (``issued``): a torch operation's bytes are
    counted once either way."""

    launches: List[LaunchTraffic] = field(default_factory=list)
    torch_ops: List[TorchOpTraffic] = field(default_factory=list)

    def _sum(self, key: str) -> int:
        return sum(getattr(launch, key) for launch in self.launches)

    @property
    def torch_read(self) -> int:
        return sum(op.read for op in self.torch_ops)

    @property
    def torch_write(self) -> int:
        return sum(op.write for op in self.torch_ops)

    @property
    def distinct(self) -> int:
        return self._sum("distinct_load") + self._sum("distinct_store") + self.torch_read + self.torch_write

    @property
    def issued(self) -> int:
        return self._sum("issued_load") + self._sum("issued_store") + self.torch_read + self.torch_write

    def totals(self, scores: Optional[int] = None) -> dict:
        """The launches' four sums, the torch operations' bytes and the two totals (and each
        per score when ``scores`` is given)."""
        t = {key: self._sum(key) for key in _FOUR}
        t.update(torch_read=self.torch_read, torch_write=self.torch_write, distinct=self.distinct,
                 issued=self.issued)
        if scores:
            t.update({f"{key}_per_score": value / scores for key, value in list(t.items())})
        return t

    def to_dict(self, scores: Optional[int] = None) -> dict:
        return {"launches": [launch.to_dict(scores) for launch in self.launches],
                "torch_ops": [dataclasses.asdict(op) for op in self.torch_ops],
                "totals": self.totals(scores)}

    @classmethod
    def from_dict(cls, d: dict) -> "Traffic":
        return cls([LaunchTraffic.from_dict(launch) for launch in d["launches"]],
                   [TorchOpTraffic(**op) for op in d["torch_ops"]])

    def table(self, scores: Optional[int] = None) -> str:
        """One line per launch (distinct and issued bytes, loaded and stored; each followed by
        its bytes per score when ``scores`` is given), the torch operations by op, then the
        totals."""
        def cell(nbytes: int) -> str:
            return f"{nbytes:>12}" + (f" {nbytes / scores:>7.2f}" if scores else "")

        def total(nbytes: int) -> str:
            return f"{nbytes} bytes" + (f" ({nbytes / scores:.2f} per score)" if scores else "")

        width = 20 if scores else 14
        lines = [f"{'#':>3} {'kernel':<26} " + " ".join(f"{h:>{width}}" for h in
                                                        ("distinct load", "distinct store", "issued load",
                                                         "issued store"))
                 + ("   bytes (per score)" if scores else "   bytes")]
        for i, launch in enumerate(self.launches):
            lines.append(f"{i:>3} {launch.kernel:<26} " + " ".join(f"{cell(getattr(launch, k)):>{width}}"
                                                                   for k in _FOUR))
        by_op: Dict[str, List[int]] = {}
        for op in self.torch_ops:
            row = by_op.setdefault(op.op, [0, 0, 0])
            row[0] += 1
            row[1] += op.read
            row[2] += op.write
        for name, (count, read, write) in by_op.items():
            lines.append(f"{'':>3} torch {name} x{count}: read {total(read)}, wrote {total(write)}")
        sums = [self._sum(k) for k in _FOUR]
        lines.append(f"{'':>3} {'launches':<26} " + " ".join(f"{cell(s):>{width}}" for s in sums))
        lines.append(f"total: distinct {total(self.distinct)}, issued {total(self.issued)}"
                     + (f" (torch ops' {self.torch_read + self.torch_write} bytes in both)"
                        if self.torch_ops else ""))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Addresses of one launch
# ---------------------------------------------------------------------------------------------
def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last, from its sizes and strides
    (a transposed or sliced view spans more than its elements; an expanded one less)."""
    if t.numel() == 0:
        return 0
    try:
        span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    except RuntimeError:  # no strides (sparse, nested): its elements
        return t.numel() * t.element_size()
    return span * t.element_size()


def _merge_counts(u0: np.ndarray, c0: np.ndarray, u1: np.ndarray, c1: np.ndarray):
    """Two sorted unique address arrays with their counts, as one."""
    a = np.concatenate((u0, u1))
    c = np.concatenate((c0, c1))
    order = np.argsort(a, kind="stable")
    a, c = a[order], c[order]
    starts = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1])))
    return a[starts], np.add.reduceat(c, starts)


class _Addresses:
    """Start addresses of the lanes of one direction (loads or stores) of one launch, by
    element size: kept as unique addresses with how often each was issued, so that a launch
    that re-reads a tile many times holds it once."""

    def __init__(self):
        self._pending: Dict[int, List[np.ndarray]] = {}
        self._lanes = 0
        self._unique: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    def add(self, size: int, addrs: np.ndarray) -> None:
        if addrs.size == 0:
            return
        self._pending.setdefault(size, []).append(addrs)
        self._lanes += addrs.size
        if self._lanes >= _COMPACT_LANES:
            self._compact()

    def _compact(self) -> None:
        for size, arrays in self._pending.items():
            u, c = np.unique(np.concatenate(arrays), return_counts=True)
            c = c.astype(np.int64)
            if size in self._unique:
                u, c = _merge_counts(*self._unique[size], u, c)
            self._unique[size] = (u, c)
        self._pending.clear()
        self._lanes = 0

    def by_size(self) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
        self._compact()
        return self._unique


def _owners(addrs: np.ndarray, ranges: Sequence[Tuple[int, int]]) -> np.ndarray:
    """The index of the first range holding each address, ``len(ranges)`` where none does."""
    owner = np.full(addrs.shape, len(ranges), dtype=np.intp)
    for i in reversed(range(len(ranges))):  # the first match wins: written last
        lo, hi = ranges[i]
        owner[(addrs >= np.uint64(lo)) & (addrs < np.uint64(hi))] = i
    return owner


def _summarise(addresses: _Addresses, ranges: Sequence[Tuple[int, int]]):
    """(distinct, issued, distinct by owner, issued by owner) of one direction of a launch.

    Distinct bytes are the size of the union of the lanes' byte ranges. Where every lane has
    one element size and no two unique addresses are closer than it, that is the count of
    unique addresses times the size; otherwise (element sizes mixed, or ranges overlapping)
    the ranges are swept in order of their start, each adding what lies past every earlier
    range's end: exact without expanding anything to bytes."""
    owners = len(ranges) + 1
    issued_by = np.zeros(owners, dtype=np.int64)
    starts, sizes, owner_of = [], [], []
    for size, (u, c) in addresses.by_size().items():
        owner = _owners(u, ranges)
        issued_by += np.bincount(owner, weights=c, minlength=owners).round().astype(np.int64) * size
        starts.append(u)
        sizes.append(np.full(u.shape, size, dtype=np.int64))
        owner_of.append(owner)
    if not starts:
        return 0, 0, np.zeros(owners, dtype=np.int64), issued_by
    start = np.concatenate(starts).astype(np.int64)  # user-space addresses are below 2^63
    size = np.concatenate(sizes)
    owner = np.concatenate(owner_of)
    if len(starts) == 1 and (start.size < 2 or int(np.diff(start).min()) >= int(size[0])):
        covered = size  # sorted by np.unique, apart by at least the element size
    else:
        order = np.argsort(start, kind="stable")
        start, size, owner = start[order], size[order], owner[order]
        end = start + size
        reached = np.concatenate(([np.iinfo(np.int64).min], np.maximum.accumulate(end)[:-1]))
        covered = np.clip(end - np.maximum(start, reached), 0, None)
    distinct_by = np.bincount(owner, weights=covered, minlength=owners).round().astype(np.int64)
    return int(covered.sum()), int(issued_by.sum()), distinct_by, issued_by


def _tensor_args(names_values: Iterable[Tuple[str, object]]) -> List[Tuple[str, int, int]]:
    """(name, first byte, end) of each tensor among a launch's arguments, in order (a tuple's
    elements as ``name[i]``, a tensor descriptor as its base, a reinterpreted tensor as its
    base's extent)."""
    found: List[Tuple[str, int, int]] = []
    for name, value in names_values:
        if isinstance(value, tuple):
            found += _tensor_args((f"{name}[{i}]", v) for i, v in enumerate(value))
        elif hasattr(value, "data_ptr"):
            # triton's TensorWrapper (reinterpret) holds the tensor as ``base``, the same bytes
            # (a torch view's ``base`` is the tensor it views, whose extent is not the view's)
            shape_of = value if isinstance(value, torch.Tensor) else getattr(value, "base", value)
            lo = int(value.data_ptr())
            found.append((name, lo, lo + extent_bytes(shape_of)))
        elif hasattr(value, "base") and hasattr(getattr(value, "base"), "data_ptr"):  # a TensorDescriptor
            found += _tensor_args([(name, value.base)])
    return found


class _Launch:
    """The lanes of one launch while it runs."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.args: Optional[List[Tuple[str, int, int]]] = None
        self.loads = _Addresses()
        self.stores = _Addresses()

    def set_args(self, fn, args_hst, kwargs_hst) -> None:
        try:
            bound = inspect.getcallargs(fn, *args_hst, **kwargs_hst)
        except TypeError:  # the interpreter binds them the same way and will say what is wrong
            bound = {f"arg{i}": v for i, v in enumerate(args_hst)} | dict(kwargs_hst)
        self.args = _tensor_args(bound.items())

    def finish(self) -> LaunchTraffic:
        args = self.args or []
        ranges = [(lo, hi) for _, lo, hi in args]
        dl, il, dl_by, il_by = _summarise(self.loads, ranges)
        ds, is_, ds_by, is_by = _summarise(self.stores, ranges)
        by_arg = {}
        for i, name in enumerate([name for name, _, _ in args] + [OTHER]):
            counts = (int(dl_by[i]), int(ds_by[i]), int(il_by[i]), int(is_by[i]))
            if any(counts):
                by_arg[name] = ArgTraffic(*counts)
        return LaunchTraffic(self.kernel, dl, ds, il, is_, by_arg)


def _element_size(ptrs) -> int:
    return (ptrs.get_element_ty().primitive_bitwidth + 7) // 8  # int1 (bool) pointers: 1 byte


def _lanes(ptrs, mask) -> np.ndarray:
    """The addresses of a pointer block's masked-in lanes (every lane where no mask)."""
    addrs = np.asarray(ptrs.data)
    if mask is None:
        return addrs.reshape(-1).astype(np.uint64, copy=False)
    m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)
    return addrs[m].astype(np.uint64, copy=False)


# ---------------------------------------------------------------------------------------------
# Torch operations outside the launches
# ---------------------------------------------------------------------------------------------
# Ops that move no data whatever their schema says: allocations, metadata, and views whose
# schema does not mark them as aliases (_unsafe_view). Views marked as such are recognised
# from the schema (every return an alias of an input).
_NO_DATA = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "empty_permuted",
            "_unsafe_view", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size",
            "stride", "numel", "dim", "is_contiguous", "is_same_size", "set_", "resize_", "record_stream",
            "_has_compatible_shallow_copy_type"}
# In-place ops that overwrite their mutated argument without reading it.
_OVERWRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_",
               "geometric_", "cauchy_", "log_normal_"}


def _tensors(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _op_bytes(func, args, kwargs) -> Optional[Tuple[int, List[int]]]:
    """(bytes read, the indices of the mutated arguments) of one dispatched op, or None when
    it moves no data. A mutated argument counts as read too (``add_`` reads what it adds to),
    except where the op overwrites it (``copy_``, ``fill_``, ...) or it is an ``out=``
    argument."""
    name = func.overloadpacket.__name__
    schema = func._schema
    if name in _NO_DATA:
        return None
    returns = schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return None  # a view: every return aliases an input
    read, mutated = 0, []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written = arg.alias_info is not None and arg.alias_info.is_write
        if written:
            mutated.append(i)
            if name in _OVERWRITES or arg.kwarg_only:
                continue
        read += sum(extent_bytes(t) for t in _tensors(value))
    return read, mutated


class _TorchOps(TorchDispatchMode):
    """Records the ops torch dispatches while no launch runs (the interpreter's own copies of
    a launch's arguments happen inside it)."""

    def __init__(self, counter: "_Counter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.current is not None:
            return func(*args, **kwargs)
        moved = _op_bytes(func, args, kwargs)
        out = func(*args, **kwargs)
        if moved is not None:
            read, mutated = moved
            outputs = _tensors(out)
            if not func._schema.returns:  # (in-place ops with no return: what they mutated)
                outputs = [t for i in mutated for t in _tensors(args[i] if i < len(args) else
                                                               kwargs.get(func._schema.arguments[i].name))]
            write = sum(extent_bytes(t) for t in outputs)
            if read or write:
                self.counter.torch_ops.append(TorchOpTraffic(str(func), read, write))
        return out


# ---------------------------------------------------------------------------------------------
# The hooks
# ---------------------------------------------------------------------------------------------
class _Counter:
    def __init__(self):
        self.current: Optional[_Launch] = None
        self.launches: List[LaunchTraffic] = []
        self.torch_ops: List[TorchOpTraffic] = []


_ACTIVE: Optional[_Counter] = None
_MISSING = object()


def _require_interpreter():
    """The interpreter module, or a RuntimeError saying why the launches would not go through it."""
    from .._backend import triton_interpreter_on

    if not triton_interpreter_on():
        raise RuntimeError("count_traffic needs the Triton interpreter: set TRITON_INTERPRET=1 before triton is "
                           "imported (gradops bench floyd --traffic does so itself on a CPU) and pass CPU tensors")
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and not knobs.runtime.interpret:
        raise RuntimeError("count_traffic needs the Triton interpreter, which triton reports off "
                           "(triton.knobs.runtime.interpret is False)")
    from triton.runtime import interpreter

    return interpreter


@contextlib.contextmanager
def _patched(obj, name: str, value):
    """``obj.name = value`` for the block; the previous state (an attribute of ``obj`` itself,
    or none, so that its class's is seen again) restored after it, also on errors."""
    own = vars(obj).get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


@contextlib.contextmanager
def _hooks(counter: _Counter):
    """The interpreter's memory operations and launches patched to record into ``counter``,
    a compiled launch refused, and the torch dispatch mode entered."""
    interpreter = _require_interpreter()
    from triton.runtime.jit import JITFunction

    builder = interpreter.interpreter_builder
    executor = interpreter.GridExecutor
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
    call, init_args = executor.__call__, executor._init_args_hst

    # The wrappers take the originals' parameter names (the same in Triton 3.6 and 3.9), so
    # that a call naming them binds as before; the rest passes through unchanged.
    def create_masked_load(ptrs, mask, *args, **kwargs):
        if counter.current is not None:
            counter.current.loads.add(_element_size(ptrs), _lanes(ptrs, mask))
        return load(ptrs, mask, *args, **kwargs)

    def create_masked_store(ptrs, value, mask, *args, **kwargs):
        if counter.current is not None:
            counter.current.stores.add(_element_size(ptrs), _lanes(ptrs, mask))
        return store(ptrs, value, mask, *args, **kwargs)

    def create_atomic_rmw(rmwOp, ptr, val, mask, *args, **kwargs):
        if counter.current is not None:
            lanes, size = _lanes(ptr, mask), _element_size(ptr)
            counter.current.loads.add(size, lanes)
            counter.current.stores.add(size, lanes)
        return rmw(rmwOp, ptr, val, mask, *args, **kwargs)

    def create_atomic_cas(ptr, cmp, val, *args, **kwargs):
        if counter.current is not None:  # no mask: every lane compares (and may swap)
            lanes, size = _lanes(ptr, None), _element_size(ptr)
            counter.current.loads.add(size, lanes)
            counter.current.stores.add(size, lanes)
        return cas(ptr, cmp, val, *args, **kwargs)

    def grid_call(self, *args, **kwargs):
        if counter.current is not None:  # a launch from inside a launch: not something Triton does
            return call(self, *args, **kwargs)
        launch = _Launch(getattr(self.fn, "__name__", repr(self.fn)))
        counter.current = launch
        try:
            result = call(self, *args, **kwargs)
        finally:
            counter.current = None
        counter.launches.append(launch.finish())
        return result

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        if counter.current is not None and counter.current.args is None:
            counter.current.set_args(self.fn, args_hst, kwargs_hst)  # the tensors the kernel dereferences
        return args_hst, kwargs_hst

    def compiled_run(self, *args, **kwargs):
        raise RuntimeError(f"count_traffic: {getattr(self.fn, '__name__', self)} was launched compiled, not through "
                           f"the Triton interpreter (it was defined before TRITON_INTERPRET=1 was set): its "
                           f"traffic cannot be counted")

    with contextlib.ExitStack() as stack:
        for name, value in (("create_masked_load", create_masked_load), ("create_masked_store", create_masked_store),
                            ("create_atomic_rmw", create_atomic_rmw), ("create_atomic_cas", create_atomic_cas)):
            stack.enter_context(_patched(builder, name, value))
        stack.enter_context(_patched(executor, "__call__", grid_call))
        stack.enter_context(_patched(executor, "_init_args_hst", init_args_hst))
        stack.enter_context(_patched(JITFunction, "run", compiled_run))
        stack.enter_context(_TorchOps(counter))
        yield


def count_traffic(fn: Callable[[], object]):
    """``(fn(), Traffic)``: ``fn`` run with every Triton launch's loads, stores and atomics
    recorded through the Triton interpreter, and the torch operations around the launches
    (module docstring). Raises RuntimeError where the interpreter is off, and where a launch
    runs compiled. Not reentrant."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("count_traffic calls do not nest")
    counter = _Counter()
    _ACTIVE = counter
    try:
        with _hooks(counter):
            result = fn()
    finally:
        _ACTIVE = None
    return result, Traffic(counter.launches, counter.torch_ops)


# ---------------------------------------------------------------------------------------------
# Floyd attention
# ---------------------------------------------------------------------------------------------
Shape = Tuple[int, int, int, int, int, int]  # B, H, N, M, K, D
DEFAULT_SHAPE: Shape = (1, 2, 64, 64, 64, 16)
QUICK_SHAPE: Shape = (1, 2, 16, 16, 16, 16)  # --quick: seconds in the interpreter, not a minute
DEFAULT_DTYPE = "float16"  # float16 and bfloat16 move the same bytes


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    from .harness import DTYPES, dtype_name

    return DTYPES[dtype_name(dtype)]


def floyd_inputs(shape: Shape, dtype, masked: bool = False, seed: int = 0):
    """``(q, k1, v1, k2, v2), dy, mask``: CPU inputs of ``shape`` (B, H, N, M, K, D) drawn
    from a CPU generator seeded with ``seed``, normal in float32 rounded to ``dtype``; with
    ``masked``, a [B,1,N,1,K] bool mask with about 10% of the pivots removed (as
    ``gradops bench floyd --mask``)."""
    b, h, n, m, k, d = shape
    dtype = _dtype(dtype)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float32).to(dtype)

    inputs = (rnd(b, h, n, m, d), rnd(b, h, n, k, d), rnd(b, h, n, k, d), rnd(b, h, k, m, d), rnd(b, h, k, m, d))
    dy = rnd(b, h, n, m, d)
    mask = torch.rand(b, 1, n, 1, k, generator=gen) < 0.1 if masked else None
    return inputs, dy, mask


@contextlib.contextmanager
def forced_strategy(name: Optional[str]):
    """``floyd_config.STRATEGY = name`` for the block, the previous value restored after it
    (None: nothing forced, nothing touched)."""
    if name is None:
        yield
        return
    from ..kernels import floyd_config

    old = floyd_config.STRATEGY
    floyd_config.STRATEGY = name
    try:
        yield
    finally:
        floyd_config.STRATEGY = old


def rule_strategy(shape: Shape, element_size: int, forced: Optional[str] = None) -> str:
    """The strategy our Triton backend runs a call of this shape with: floyd_strategy's rule
    (with any override of STRATEGY / GRADOPS_FLOYD_STRATEGY in force), or ``forced``'s."""
    from ..kernels import floyd_strategy

    with forced_strategy(forced):
        return floyd_strategy.strategy(*shape, element_size)


def floyd_traffic(shape: Shape, dtype, strategy: Optional[str], masked: bool = False, seed: int = 0,
                  scale: Optional[float] = None) -> dict:
    """The traffic of Floyd attention's forward and, counted apart, its backward (the grad
    operator fed with the forward's outputs) with ``strategy`` forced
    (``floyd_config.STRATEGY``; None: the rule's choice), at ``shape`` (B, H, N, M, K, D) and
    ``dtype``, on inputs from :func:`floyd_inputs`. A JSON-able dict: the case, the strategy
    that ran, and for ``fwd`` and ``bwd`` the launches, the torch operations and the totals
    in bytes and in bytes per score (scores = B*H*N*M*K), with ``total`` their sum and the
    seconds each count took (the interpreter's)."""
    import gradops
    from ..kernels import floyd_strategy

    b, h, n, m, k, d = shape
    dtype = _dtype(dtype)
    scores = b * h * n * m * k
    scale = d ** -0.5 if scale is None else float(scale)
    inputs, dy, mask = floyd_inputs(shape, dtype, masked, seed)
    result = {"shape": dict(zip("BHNMKD", shape)), "dtype": str(dtype).replace("torch.", ""), "masked": masked,
              "seed": seed, "scale": scale, "scores": scores, "strategy": strategy}
    with forced_strategy(strategy):
        result["strategy_run"] = floyd_strategy.strategy(*shape, dtype.itemsize)
        start = time.perf_counter()
        (out, smax, ssum), fwd = count_traffic(
            lambda: gradops.floyd_attention(*inputs, mask, scale, backend="triton"))
        fwd_seconds = time.perf_counter() - start
        start = time.perf_counter()
        _, bwd = count_traffic(
            lambda: gradops.floyd_attention_grad(dy, *inputs, out, smax, ssum, mask, scale, backend="triton"))
        bwd_seconds = time.perf_counter() - start
    result["fwd"] = fwd.to_dict(scores) | {"seconds": fwd_seconds}
    result["bwd"] = bwd.to_dict(scores) | {"seconds": bwd_seconds}
    distinct, issued = fwd.distinct + bwd.distinct, fwd.issued + bwd.issued
    result["total"] = {"distinct": distinct, "issued": issued, "distinct_per_score": distinct / scores,
                       "issued_per_score": issued / scores}
    return result


def floyd_report(result: dict) -> str:
    """The text of one :func:`floyd_traffic` result: the tables of the forward and the
    backward, then the bytes per score of each and of both."""
    scores = result["scores"]
    case = ",".join(str(v) for v in result["shape"].values())
    lines = [f"Floyd attention traffic, B,H,N,M,K,D = {case}, {result['dtype']}, strategy {result['strategy_run']}"
             + (" (the rule's)" if result["strategy"] is None else "")
             + (", masked" if result["masked"] else "") + f": {scores} scores"]
    for key, title in (("fwd", "forward"), ("bwd", "backward")):
        lines += [f"{title} ({result[key]['seconds']:.1f} s in the interpreter):",
                  Traffic.from_dict(result[key]).table(scores)]
    per = {key: result[key]["totals"] for key in ("fwd", "bwd")} | {"total": result["total"]}
    for key, title in (("fwd", "forward"), ("bwd", "backward"), ("total", "forward+backward")):
        lines.append(f"{title:>16} per score: distinct {per[key]['distinct_per_score']:.2f}, "
                     f"issued {per[key]['issued_per_score']:.2f}")
    return "\n".join(lines)


def floyd_main(args) -> int:
    """``gradops bench floyd --traffic``: :func:`floyd_traffic` for each --shape (default
    :data:`DEFAULT_SHAPE`), --dtype (default float16) and --strategy (default every one of
    ``floyd_config.STRATEGIES``), printed, and the results written as JSON where the bench's
    results go (--out, --tag). Runs on the CPU through the Triton interpreter, which it
    switches on (gradops' rule) before triton is imported."""
    from . import harness
    from ..selftest import use_interpreter_on_cpu

    if args.device == "cuda":
        print("gradops bench floyd --traffic: counts through the Triton interpreter on the CPU (no --device cuda)",
              file=sys.stderr)
        return 2
    args.device = "cpu"
    use_interpreter_on_cpu("cpu")
    from ..kernels import floyd_config

    strategies = args.strategy or list(floyd_config.STRATEGIES)
    unknown = [s for s in strategies if s not in floyd_config.STRATEGIES]
    if unknown:
        print(f"gradops bench floyd: unknown strategy {', '.join(unknown)}; expected one of "
              f"{', '.join(floyd_config.STRATEGIES)}", file=sys.stderr)
        return 2
    results = []
    try:
        for shape in args.shape or [QUICK_SHAPE if args.quick else DEFAULT_SHAPE]:
            for dtype in args.dtypes or [DEFAULT_DTYPE]:
                for strategy in strategies:
                    results.append(floyd_traffic(shape, dtype, strategy, args.mask, scale=args.scale))
                    print(floyd_report(results[-1]), flush=True)
                    print()
    except RuntimeError as e:
        print(f"gradops bench floyd --traffic: {e}", file=sys.stderr)
        return 2
    out, why = harness.output_dir(args)
    stem = args.tag or "floyd-traffic-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = os.path.join(out, stem + ".json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": "gradops bench floyd --traffic", "results": results}, f, indent=1)
    print(f"wrote {path}" + (f" ({why})" if why else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# 3-Floyd attention (gradops/kernels/floyd3_attention.py)
# ---------------------------------------------------------------------------------------------
Shape3 = Tuple[int, ...]  # B, H, I, J, K, P, D (or B, H, L, D: a cube of side L)
FLOYD3_DEFAULT_SHAPE: Shape3 = (1, 1, 32, 32, 32, 32, 32)  # one slice of BREC's L = 32, D = 32 (bytes scale with B*H)
FLOYD3_QUICK_SHAPE: Shape3 = (1, 1, 8, 8, 8, 8, 16)


def floyd3_shape(shape: Sequence[int]) -> Tuple[int, int, int, int, int, int, int]:
    """(B, H, I, J, K, P, D) from a 7-tuple, or from (B, H, L, D): I = J = K = P = L."""
    shape = tuple(int(x) for x in shape)
    if len(shape) == 4:
        b, h, side, d = shape
        return b, h, side, side, side, side, d
    if len(shape) != 7:
        raise ValueError(f"a 3-Floyd shape is B,H,I,J,K,P,D or B,H,L,D, got {shape}")
    return shape


def floyd3_inputs(shape: Sequence[int], dtype, masked: bool = False, seed: int = 0):
    """``(q, k1, v1, k2, v2, k3, v3), dy, mask``: CPU inputs of ``shape`` (:func:`floyd3_shape`)
    drawn from a CPU generator seeded with ``seed``, normal in float32 rounded to ``dtype``;
    with ``masked``, a padded graph's mask: about 10% of the pivots removed, [B, 1, 1, 1, 1, P]
    expanded to [B, 1, I, J, K, P] (stride 0: what a mask of padded nodes is)."""
    b, h, i, j, k, p, d = floyd3_shape(shape)
    dtype = _dtype(dtype)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float32).to(dtype)

    inputs = (rnd(b, h, i, j, k, d), rnd(b, h, p, j, k, d), rnd(b, h, p, j, k, d), rnd(b, h, i, p, k, d),
              rnd(b, h, i, p, k, d), rnd(b, h, i, j, p, d), rnd(b, h, i, j, p, d))
    dy = rnd(b, h, i, j, k, d)
    mask = None
    if masked:
        mask = (torch.rand(b, 1, 1, 1, 1, p, generator=gen) < 0.1).expand(b, 1, i, j, k, p)
    return inputs, dy, mask


def _labelled(traffic: dict, names: Sequence[str]) -> dict:
    """Each launch's record with ``label``: its place in a chunk's launches (``names``, in order)."""
    for n, launch in enumerate(traffic["launches"]):
        launch["label"] = names[n % len(names)]
    return traffic


def floyd3_traffic(shape: Sequence[int], dtype, masked: bool = False, seed: int = 0,
                   scale: Optional[float] = None) -> dict:
    """The traffic of one 3-Floyd forward and, counted apart, one backward (fed with the
    forward's statistics) through the kernels' backend functions, at ``shape`` (B, H, I, J, K,
    P, D, or B, H, L, D) and ``dtype``, on :func:`floyd3_inputs`. A JSON-able dict as
    :func:`floyd_traffic`'s: the case, ``chunks`` (the plan's), for ``fwd`` and ``bwd`` the
    launches (each with its ``label``, ``floyd3_attention.FORWARD_NAMES`` / ``BACKWARD_NAMES``),
    the torch operations and the totals in bytes and per score (scores = B*H*I*J*K*P), ``total``
    their sum, and the interpreter's seconds."""
    from ..kernels import floyd3_attention as f3

    b, h, i, j, k, p, d = floyd3_shape(shape)
    dtype = _dtype(dtype)
    scores = b * h * i * j * k * p
    scale = (3 * d) ** -0.5 if scale is None else float(scale)  # FloydNet's default, 1/sqrt(3 D)
    inputs, dy, mask = floyd3_inputs((b, h, i, j, k, p, d), dtype, masked, seed)
    plan = f3.chunk_plan(b * h, i, j, k, p, d, inputs[0].element_size(), inputs[0].device)
    result = {"shape": dict(zip(("B", "H", "I", "J", "K", "P", "D"), (b, h, i, j, k, p, d))),
              "dtype": str(dtype).replace("torch.", ""), "masked": masked, "seed": seed, "scale": scale,
              "scores": scores, "chunks": plan.count(b * h, i, j)}
    start = time.perf_counter()
    (out, smax, ssum), fwd = count_traffic(lambda: f3.floyd3_attention(*inputs, mask, scale))
    fwd_seconds = time.perf_counter() - start
    start = time.perf_counter()
    _, bwd = count_traffic(lambda: f3.floyd3_attention_grad(dy, *inputs, smax, ssum, mask, scale))
    bwd_seconds = time.perf_counter() - start
    result["fwd"] = _labelled(fwd.to_dict(scores), f3.FORWARD_NAMES) | {"seconds": fwd_seconds}
    result["bwd"] = _labelled(bwd.to_dict(scores), f3.BACKWARD_NAMES) | {"seconds": bwd_seconds}
    distinct, issued = fwd.distinct + bwd.distinct, fwd.issued + bwd.issued
    result["total"] = {"distinct": distinct, "issued": issued, "distinct_per_score": distinct / scores,
                       "issued_per_score": issued / scores}
    return result


def floyd3_report(result: dict) -> str:
    """The text of one :func:`floyd3_traffic` result: per launch (labelled) its distinct and
    issued bytes loaded and stored and per score, then the totals."""
    scores = result["scores"]
    case = ",".join(str(v) for v in result["shape"].values())
    lines = [f"3-Floyd attention traffic, B,H,I,J,K,P,D = {case}, {result['dtype']}"
             + (", masked" if result["masked"] else "") + f": {scores} scores, {result['chunks']} chunk(s)"]
    for key, title in (("fwd", "forward"), ("bwd", "backward")):
        lines.append(f"{title} ({result[key]['seconds']:.1f} s in the interpreter), bytes per score:")
        lines.append(f"{'#':>3} {'launch':<34} {'dist load':>10} {'dist store':>10} {'iss load':>10} "
                     f"{'iss store':>10}")
        for n, launch in enumerate(result[key]["launches"]):
            lines.append(f"{n:>3} {launch['label']:<34} " + " ".join(
                f"{launch[f'{part}_per_score']:>10.2f}" for part in _FOUR))
        for op in result[key]["torch_ops"]:
            lines.append(f"    torch {op['op']}: read {op['read']}, wrote {op['write']} bytes")
        totals = result[key]["totals"]
        lines.append(f"    {title} total: distinct {totals['distinct']} bytes ({totals['distinct_per_score']:.2f} per "
                     f"score), issued {totals['issued']} ({totals['issued_per_score']:.2f})")
    total = result["total"]
    lines.append(f"forward+backward: distinct {total['distinct_per_score']:.2f}, issued "
                 f"{total['issued_per_score']:.2f} bytes per score")
    return "\n".join(lines)


def floyd3_main(argv=None) -> int:
    """``gradops bench floyd3 --traffic``: :func:`floyd3_traffic` for each --shape (B,H,I,J,K,P,D
    or B,H,L,D; default :data:`FLOYD3_DEFAULT_SHAPE`, --quick :data:`FLOYD3_QUICK_SHAPE`) and
    --dtype (default float16), printed, and with --json PATH the results written there. Takes
    an argv list (``--traffic`` itself is accepted and ignored) or an argparse namespace with
    those attributes (``shape`` as lists of ints, ``dtypes``, ``mask``, ``quick``, ``scale``).
    Runs on the CPU through the Triton interpreter, which it switches on before triton is
    imported."""
    import argparse

    from ..selftest import use_interpreter_on_cpu

    if argv is None or isinstance(argv, (list, tuple)):
        parser = argparse.ArgumentParser(prog="gradops bench floyd3 --traffic")
        parser.add_argument("--traffic", action="store_true", help="(this command: accepted, ignored)")
        parser.add_argument("--shape", action="append", default=None, type=lambda s: [int(x) for x in s.split(",")],
                            help="B,H,I,J,K,P,D or B,H,L,D (repeatable)")
        parser.add_argument("--dtype", dest="dtypes", action="append", default=None)
        parser.add_argument("--mask", action="store_true", help="a padded graph's pivot mask")
        parser.add_argument("--quick", action="store_true")
        parser.add_argument("--scale", type=float, default=None)
        parser.add_argument("--json", default=None, help="write the results there")
        parser.add_argument("--device", default="cpu", help="cpu (the count runs through the interpreter)")
        args = parser.parse_args(list(argv or []))
    else:
        args = argv
    if getattr(args, "device", "cpu") == "cuda":
        print("gradops bench floyd3 --traffic: counts through the Triton interpreter on the CPU (no --device cuda)",
              file=sys.stderr)
        return 2
    use_interpreter_on_cpu("cpu")
    shapes = getattr(args, "shape", None) or [FLOYD3_QUICK_SHAPE if getattr(args, "quick", False)
                                              else FLOYD3_DEFAULT_SHAPE]
    results = []
    try:
        for shape in shapes:
            for dtype in getattr(args, "dtypes", None) or [DEFAULT_DTYPE]:
                results.append(floyd3_traffic(shape, dtype, bool(getattr(args, "mask", False)),
                                              scale=getattr(args, "scale", None)))
                print(floyd3_report(results[-1]), flush=True)
                print()
    except (RuntimeError, ValueError) as e:
        print(f"gradops bench floyd3 --traffic: {e}", file=sys.stderr)
        return 2
    path = getattr(args, "json", None)
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": "gradops bench floyd3 --traffic", "results": results}, f, indent=1)
        print(f"wrote {path}")
    return 0
