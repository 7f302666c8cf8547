"""Validation helpers shared by every operator: one place decides how a rule is phrased
and which status code it carries.

Messages read ``"<op>: <param> <what is wrong>, expected <rule>"`` so that the parameter
and the rule are always named.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from ..errors import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    AclnnError,
)

TILING = ACLNN_ERR_INNER_TILING_ERROR  # shape rules CANN checks at tiling (OPERATORS.md)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(dtype_name(d) for d in dtypes)


def fail(op: str, status: int, message: str):
    raise AclnnError(status, f"{op}: {message}")


def invalid(op: str, message: str, status: int = ACLNN_ERR_PARAM_INVALID):
    fail(op, status, message)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of statistics and float accumulators for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def require_tensor(op: str, name: str, t, *, optional: bool = False) -> Optional[torch.Tensor]:
    """None -> 161001 (unless optional); a non-tensor -> 161002."""
    if t is None:
        if optional:
            return None
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected a tensor")
    if not isinstance(t, torch.Tensor):
        invalid(op, f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    return t


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]):
    if t.dtype not in allowed:
        invalid(op, f"{name} has dtype {dtype_name(t.dtype)}, expected dtype in {dtype_names(allowed)}")


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor):
    if t.dtype != ref.dtype:
        invalid(
            op,
            f"{name} has dtype {dtype_name(t.dtype)}, expected the dtype of {ref_name} "
            f"({dtype_name(ref.dtype)})",
        )


def check_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int], rule: str,
                status: int = ACLNN_ERR_PARAM_INVALID):
    if tuple(t.shape) != tuple(expected):
        fail(op, status, f"{name} has shape {tuple(t.shape)}, expected {rule} == {tuple(expected)}")


def check_rank(op: str, name: str, t: torch.Tensor, lo: int, hi: int,
               status: int = ACLNN_ERR_PARAM_INVALID):
    if not lo <= t.dim() <= hi:
        rule = f"{lo} dims" if lo == hi else f"{lo}..{hi} dims"
        fail(op, status, f"{name} has {t.dim()} dims (shape {tuple(t.shape)}), expected {rule}")


def check_same_device(op: str, named: Sequence[tuple]):
    """All given (name, tensor-or-None) pairs on one device."""
    first = None
    for name, t in named:
        if t is None:
            continue
        if first is None:
            first = (name, t)
        elif t.device != first[1].device:
            invalid(op, f"{name} is on {t.device}, expected the device of {first[0]} ({first[1].device})")


def check_int_attr(op: str, name: str, value, minimum: int) -> int:
    if value is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected an int >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value.item())
        else:
            invalid(op, f"{name} is {value!r}, expected an int >= {minimum}")
    if value < minimum:
        invalid(op, f"{name} is {value}, expected an int >= {minimum}")
    return int(value)


def check_float_attr(op: str, name: str, value) -> float:
    if value is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected a float")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        invalid(op, f"{name} is {value!r}, expected a float")
    return float(value)



def check_companion(op: str, name: str, t, ref_name: str, ref: torch.Tensor,
                    status: int = ACLNN_ERR_PARAM_INVALID) -> torch.Tensor:
    """A tensor that goes with ``ref`` element for element (a residual, its gradient): the
    same dtype (161002) and shape (``status``)."""
    require_tensor(op, name, t)
    check_same_dtype(op, name, t, ref_name, ref)
    check_shape(op, name, t, ref.shape, f"{ref_name}.shape", status=status)
    return t
