"""Shape canonicalisation shared by the norm families: leading rows x normalised columns."""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch

from ._checks import (
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    INT64_MAX,
    dtype_name,
    fail,
    invalid,
    is_int,
    short_repr,
    wrong_type,
)


def int_sequence(op: str, name: str, value, *, scalar_ok: bool = False) -> Tuple[int, ...]:
    """A sequence of ints (a list, tuple, torch.Size, numpy array) or a 1-D integer tensor ->
    tuple of ints; with ``scalar_ok`` a bare int too. None -> 161001; a tensor that cannot be
    read on the host (meta, sparse) or is not 1-D integer -> 161002; anything else that is not
    a sequence of ints -> 161002 as a TypeError."""
    if type(value) in (tuple, list, torch.Size) and all(type(v) is int for v in value):
        return _int64s(op, name, value)  # the common case, decided without the checks below
    if value is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected a sequence of ints")
    if scalar_ok and is_int(value):
        return _int64s(op, name, (value,))
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.device.type == "meta":
            where = "a meta tensor" if value.device.type == "meta" else \
                f"a {str(value.layout).replace('torch.', '')} tensor"
            invalid(op, f"{name} is {where}, expected a dense 1-D integer tensor whose values can be read")
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            invalid(op, f"{name} is a {dtype_name(value.dtype)} tensor of shape {tuple(value.shape)}, "
                        f"expected a 1-D integer tensor")
        return tuple(int(v) for v in value.tolist())
    # ordered sequences only (as torch takes): a set or a generator has no order to read dims in
    if not isinstance(value, (list, tuple, np.ndarray)) or getattr(value, "ndim", 1) != 1:
        wrong_type(op, f"{name} is {short_repr(value)}, expected a sequence of ints")
    items = tuple(value)
    for v in items:
        if not is_int(v):
            wrong_type(op, f"{name} is {short_repr(value)}, expected a sequence of ints")
    return _int64s(op, name, items)


def _int64s(op: str, name: str, items) -> Tuple[int, ...]:
    """Ints as int64 values (what a shape or a sequence table holds), else 161002."""
    for v in items:
        if not -INT64_MAX - 1 <= v <= INT64_MAX:
            invalid(op, f"{name} has a value {short_repr(v)} outside int64, expected int64 values")
    if type(items) is tuple and all(type(v) is int for v in items):
        return items
    return tuple(int(v) for v in items)


def as_int_tuple(op: str, name: str, value) -> Tuple[int, ...]:
    """A shape: an int, a sequence of ints or a torch.Size -> tuple of ints."""
    return int_sequence(op, name, value, scalar_ok=True)


def check_trailing(op: str, name: str, x: torch.Tensor, x_name: str, shape: Tuple[int, ...],
                   status: int = ACLNN_ERR_PARAM_INVALID, verb: str = "is"):
    """``shape`` (of ``name``) must equal the trailing dims of ``x``."""
    n = len(shape)
    if n < 1 or n > x.dim():
        fail(op, status, f"{name} {verb} {tuple(shape)} ({n} dims), expected 1..{x.dim()} dims: "
                         f"the trailing dims of {x_name} {tuple(x.shape)}")
    trailing = tuple(x.shape[x.dim() - n:])
    if tuple(shape) != trailing:
        fail(op, status, f"{name} {verb} {tuple(shape)}, expected {x_name}.shape[-{n}:] == {trailing}")


def rows_cols(x: torch.Tensor, n_norm: int) -> Tuple[int, int]:
    shape = x.shape
    if n_norm == 1 and len(shape) == 2:  # the common case, without the products
        return shape[0], shape[1]
    lead = shape[: len(shape) - n_norm]
    return math.prod(lead), math.prod(shape[len(shape) - n_norm:])


def as_shape(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.reshape(shape)``, or ``t`` itself when it has that shape already (a reshape that
    changes nothing still costs a call on every norm call)."""
    return t if t.shape == shape else t.reshape(shape)


def check_stat(op: str, name: str, t: torch.Tensor, x: torch.Tensor, n_norm: int, x_name: str = "x",
               status: int = ACLNN_ERR_PARAM_INVALID):
    """A per-row statistic: shape ``x.shape[:-n]`` or its keepdim form ``x.shape[:-n] + (1,)*n``."""
    lead = tuple(x.shape[: x.dim() - n_norm])
    allowed = (lead, lead + (1,) * n_norm)
    if tuple(t.shape) not in allowed:
        fail(op, status, f"{name} has shape {tuple(t.shape)}, expected {x_name}.shape[:-{n_norm}] == {lead} "
                         f"or its keepdim form {allowed[1]}")


def as_bool_triple(op: str, name: str, value) -> Tuple[bool, bool, bool]:
    if value is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected 3 bools")
    if isinstance(value, (str, bytes, dict, torch.Tensor)) or not hasattr(value, "__iter__"):
        wrong_type(op, f"{name} is {short_repr(value)}, expected a sequence of 3 bools")
    items = tuple(value)
    if len(items) != 3:
        invalid(op, f"{name} has length {len(items)}, expected length 3 (gradInput, gradWeight, gradBias)")
    for v in items:
        if not isinstance(v, (bool, int)) or isinstance(v, int) and v not in (0, 1):
            wrong_type(op, f"{name} is {short_repr(value)}, expected 3 bools")
    return tuple(bool(v) for v in items)


def aliases(view: torch.Tensor, t: torch.Tensor) -> bool:
    """True when ``view`` (a reshape of ``t``) shares ``t``'s memory rather than being a copy,
    so that writing into it writes into ``t``."""
    return view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def in_place_rows(dy: torch.Tensor, dy_rows: torch.Tensor, in_place: bool):
    """Where a backward writes dx: dy's own rows when ``in_place`` and they alias dy, else None
    (a fresh tensor; :func:`finish_dx` then copies it into dy)."""
    return dy_rows if in_place and aliases(dy_rows, dy) else None


def finish_dx(dx: torch.Tensor, dy: torch.Tensor, dx_out, in_place: bool, shape) -> torch.Tensor:
    """The dx a backward returns: ``dy`` itself when ``in_place``, else dx in ``shape``."""
    if not in_place:
        return as_shape(dx, shape)
    if dx_out is None:
        dy.copy_(dx.reshape(dy.shape))
    return dy
