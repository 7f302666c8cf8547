"""Validation helpers shared by every operator: one place decides how a rule is phrased
and which status code it carries.

Messages read ``"<op>: <param> <what is wrong>, expected <rule>"`` so that the parameter
and the rule are always named.
"""
from __future__ import annotations

import numbers
import re
from typing import Dict, Iterable, Optional, Sequence

import torch

from ..errors import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    AclnnError,
    AclnnTypeError,
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


def wrong_type(op: str, message: str):
    """An argument of the wrong Python type: 161002, raised as :class:`AclnnTypeError` (also a
    TypeError, as torch raises for the same mistake)."""
    raise AclnnTypeError(ACLNN_ERR_PARAM_INVALID, f"{op}: {message}")


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
        wrong_type(op, f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.layout != torch.strided:
        invalid(op, f"{name} has layout {str(t.layout).replace('torch.', '')}, expected a strided (dense) tensor")
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


def is_int(v) -> bool:
    """An int or a numpy integer, not a bool."""
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def most_common(values):
    """The value most of ``values`` equal, the first seen in a tie. By comparison, not hashing:
    under torch.compile with dynamic shapes sizes are SymInts, which do not hash."""
    best, best_count = values[0], 0
    for v in values:
        count = sum(1 for w in values if w == v)
        if count > best_count:
            best, best_count = v, count
    return best


def check_same_device(op: str, named: Sequence[tuple]):
    """All given (name, tensor-or-None) pairs on one device. The tensor blamed is the first
    off the device most of them share (the first tensor's, in a tie): one tensor moved to
    another device is named, not the ones beside it."""
    given = [(name, t) for name, t in named if t is not None]
    devices = [t.device for _, t in given]
    if len(set(devices)) <= 1:
        return
    common = most_common(devices)
    holders = ", ".join(name for name, t in given if t.device == common)
    name, t = next((name, t) for name, t in given if t.device != common)
    invalid(op, f"{name} is on {t.device}, expected the device of {holders} ({common})")


INT64_MAX = 2**63 - 1


def _is_host_integer_scalar(value) -> bool:
    """A one-element integer tensor whose value can be read (not bool, not on the meta device)."""
    return (isinstance(value, torch.Tensor) and value.numel() == 1 and value.layout == torch.strided
            and value.device.type != "meta" and not value.is_floating_point() and not value.is_complex()
            and value.dtype != torch.bool)


def check_int_attr(op: str, name: str, value, minimum: int) -> int:
    """An int attribute (an int, a numpy integer, or a one-element integer tensor) in
    ``minimum..INT64_MAX``."""
    if value is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected an int >= {minimum}")
    if not is_int(value):
        if not _is_host_integer_scalar(value):
            wrong_type(op, f"{name} is {short_repr(value)}, expected an int >= {minimum}")
        value = int(value.item())
    if not minimum <= value <= INT64_MAX:
        invalid(op, f"{name} is {short_repr(value)}, expected an int in {minimum}..{INT64_MAX} (int64)")
    return int(value)


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters for a message (an int of 400 digits, a
    long list)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str() limit
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_float_attr(op: str, name: str, value) -> float:
    """A float attribute: a Python int or float (not bool, not a string) that fits a double."""
    if type(value) is float:  # the common case (a Python float always fits float64)
        return value
    if value is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected a float")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy floats and ints are Real
        wrong_type(op, f"{name} is {short_repr(value)}, expected a float")
    try:
        return float(value)
    except OverflowError:
        invalid(op, f"{name} is {short_repr(value)}, expected a float within float64's range")


def check_bool_attr(op: str, name: str, value) -> bool:
    """A bool flag: True or False (None -> 161001; anything else, 0/1 included -> 161002 as a
    TypeError)."""
    if value is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected a bool")
    if not isinstance(value, bool):
        wrong_type(op, f"{name} is {short_repr(value)}, expected a bool")
    return value


def element_offsets(t: torch.Tensor) -> torch.Tensor:
    """The storage offset of each element of ``t``, in elements, from its sizes and strides
    alone (no data is read): an int64 CPU tensor of t's shape."""
    offsets = torch.tensor(t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets


def _has_internal_overlap(t: torch.Tensor) -> bool:
    status = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: too hard to tell cheaply
    if status != 2:
        return status == 1
    # Dims ordered by stride, each stride past the reach of the smaller ones (a permuted or
    # sliced dense tensor): no overlap, decided without enumerating the elements.
    dims = sorted((abs(stride), size) for size, stride in zip(t.shape, t.stride()) if size > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    offsets = element_offsets(t).reshape(-1)
    return offsets.unique().numel() != offsets.numel()


def check_writable(op: str, name: str, t: torch.Tensor, *, requires_grad_ok: bool = False):
    """A tensor the call will write into (an output, or an input overwritten in place): every
    element its own memory (no stride-0 or other self-overlapping view), strided, writable
    here (not an inference tensor outside inference mode), and, unless ``requires_grad_ok``,
    not requiring grad (torch's rule for ``out=`` tensors). Checked before anything is written,
    so a call never fails half-way through its writes. A meta tensor passes (a call wholly on
    meta is a dry run; one beside real tensors fails the device rule)."""
    if t.layout != torch.strided:
        invalid(op, f"{name} has layout {str(t.layout).replace('torch.', '')}, expected a strided (dense) tensor")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        invalid(op, f"{name} is an inference tensor, expected a tensor that can be written outside "
                    f"torch.inference_mode()")
    if t.requires_grad and not requires_grad_ok:
        invalid(op, f"{name} requires grad, expected an output tensor that does not (as torch's out= "
                    f"arguments)")
    if t.numel() > 1 and _has_internal_overlap(t):
        invalid(op, f"{name} has elements that share memory (shape {tuple(t.shape)}, strides {t.stride()}), "
                    f"expected a tensor whose every element can be written (not an expanded or stride-0 view)")


def check_overwritten(op, name, t, others):
    """``t`` is written by the call (in_place, reuse_source): writable (every element its own
    memory), and sharing no memory with the inputs ``others`` (name, tensor-or-None) the call
    still reads, which a write would change under it."""
    check_writable(op, name, t, requires_grad_ok=True)
    for other_name, other in others:
        if other is not None and shares_memory(t, other):
            invalid(op, f"{name} shares memory with {other_name}, expected {name}, which this call "
                        f"overwrites, to share no memory with the other inputs")


def _address(t: torch.Tensor) -> int:
    """Where t's first element lies: its address, or, on meta (where every storage starts at
    0), its offset in its storage."""
    return t.storage_offset() * t.element_size() if t.device.type == "meta" else t.data_ptr()


def _byte_span(t: torch.Tensor):
    start = _address(t)
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start, start + (extent + 1) * t.element_size()


def _fills_span(t: torch.Tensor) -> bool:
    """Dense in some order of its dims (a contiguous tensor, permuted): every element slot
    from its first to its last address is one of its elements."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether writing ``a`` can change ``b``: some byte of an element of one is in an element
    of the other (exact for views of one dtype, conservative across dtypes). Decided from
    addresses, not storages: two storages over one buffer (numpy arrays, DLPack) count too."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.device.type == "meta" and a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False  # meta tensors have no memory: only views of one storage share
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.element_size() != b.element_size() or (a0 - b0) % a.element_size():
        return True
    if _fills_span(a) and _fills_span(b):
        return True  # the spans meet, and each tensor has an element at every address of its own
    step = a.element_size()
    a_at = element_offsets(a) - a.storage_offset() + a0 // step
    b_at = element_offsets(b) - b.storage_offset() + b0 // step
    return bool(torch.isin(a_at, b_at).any())


def check_no_shared_outputs(op: str, named: Sequence[tuple]):
    """Output tensors (``(name, tensor-or-None)``) that do not share memory with each other:
    written one after the other, two outputs in one memory would leave one result wrong."""
    given = [(name, t) for name, t in named if t is not None]
    for i, (name_a, a) in enumerate(given):
        for name_b, b in given[i + 1:]:
            if shares_memory(a, b):
                invalid(op, f"{name_a} and {name_b} share memory, expected separate output tensors")


def check_companion(op: str, name: str, t, ref_name: str, ref: torch.Tensor,
                    status: int = ACLNN_ERR_PARAM_INVALID) -> torch.Tensor:
    """A tensor that goes with ``ref`` element for element (a residual, its gradient): the
    same dtype (161002) and shape (``status``)."""
    require_tensor(op, name, t)
    check_same_dtype(op, name, t, ref_name, ref)
    check_shape(op, name, t, ref.shape, f"{ref_name}.shape", status=status)
    return t


_STATUS_SUFFIX = re.compile(r" \[[A-Z_]+ \d+\]$")


class renamed_errors:
    """Errors of the shared validator name the Python API's parameters (``x``, ``block_size``);
    re-raise them naming the caller's (CANN's ``input``, ``compressBlockSize``), same status.
    (A class, not a generator context manager: it is entered on a norm functional's first call.)"""

    def __init__(self, names: Dict[str, str]):
        self.names = names

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is None or not issubclass(kind, AclnnError):
            return False
        message = _STATUS_SUFFIX.sub("", str(e))
        for py_name, cann_name in self.names.items():
            message = re.sub(rf"(?<![\w.]){re.escape(py_name)}(?!\w)", cann_name, message)
        raise type(e)(e.status, message) from None  # an AclnnTypeError stays one
