"""What the checks of a call concluded, kept per call signature.

A training step calls each norm with the same shapes, dtypes, devices and attributes every
time; validating them again on every call cost more host time than the kernel takes on a GPU
(issue 24). A ``prepare_*`` function keys its call with :func:`signature` and, for a key it
has validated before, takes its plan (the backend module, the row view, the output specs)
from :func:`lookup` instead of running the checks. Only calls that passed every check are
remembered, so bad input still fails every time with its own error.

The key holds everything the checks read: each tensor's exact type, shape, strides, dtype and
device, the attribute values (with their types, item by item; a tensor-valued attribute is
not keyed: such calls are not cached), the backend asked for, the default backend and
whether the Triton interpreter is on. Checks that read data pointers (an in-place call's
overlap rules) are not keyed either: such calls are not cached.
"""
from __future__ import annotations

import math
from typing import Hashable, Optional, Sequence

import torch

from .. import _backend

_is_compiling = torch.compiler.is_compiling
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter

MAX_PLANS = 4096  # a model has a handful of norm signatures; this only bounds a pathological caller
_plans: dict = {}


def signature(op: str, backend, tensors: Sequence[Optional[torch.Tensor]], attrs: Sequence[object], *,
              placement: bool = True) -> Optional[Hashable]:
    """A key of the call, or None when it cannot be keyed (a tensor subclass or a non-tensor
    where a tensor belongs) or should not be: while torch.compile traces the call (its checks
    then run once, at trace time, and a cache would only be traced into the graph). A key
    holding an unhashable attribute is no key either: :func:`lookup` finds nothing under it
    and :func:`remember` keeps nothing (hashing it here would hash every key twice a call).
    ``placement``: the checks choose the backend module, so the key holds the default backend
    and whether the Triton interpreter is on (False: checks that only resolve ``backend``,
    which the caller passes resolved)."""
    if _is_compiling():
        return None
    key = [op, backend, _backend.default_backend(), _backend.triton_interpreter_on()] if placement else [op, backend]
    append = key.append  # (a call's hot path: every norm and Floyd call computes its key)
    for t in tensors:
        if t is None:
            append(None)
        elif type(t) is _TENSOR or type(t) is _PARAMETER:
            append(t.shape)
            append(t.stride())
            append(t.dtype)
            append(t.device)
        else:
            return None
    for a in attrs:
        part = _attr_key(a)
        if part is None:
            return None
        append(part)
    return tuple(key)


def _attr_key(a):
    """An attribute as its key: its value and its type (1, 1.0 and True are equal in Python,
    not to the checks), a sequence item by item, a float with its sign (-0.0 == 0.0, but an
    offset of -0.0 gives other zeros than 0.0). None for what cannot be keyed by value: a
    tensor or an array (its values may change after the call, and a key would keep it alive)."""
    kind = type(a)
    if kind is int or kind is bool or kind is str or a is None:
        return kind, a
    if kind in (list, tuple, torch.Size):
        items = tuple(_attr_key(v) for v in a)
        return None if None in items else (kind, items)
    if kind is float:
        return kind, a, math.copysign(1.0, a)
    if isinstance(a, torch.Tensor) or hasattr(a, "__array__"):
        return None
    return kind, a


def lookup(key: Optional[Hashable]):
    if key is None:
        return None
    try:
        return _plans.get(key)
    except TypeError:  # an unhashable attribute
        return None


def remember(key: Optional[Hashable], plan):
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        try:
            _plans[key] = plan
        except TypeError:  # an unhashable attribute: not remembered
            pass
    return plan
