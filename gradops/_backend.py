"""Backend choice: the one place that decides which implementation runs a call.

Each operator family (``layer_norm``, ``rms_norm``, ``nsa_compress``, ``floyd_attention``,
``floyd3_attention``)
has a module under ``gradops/reference/`` (plain PyTorch, any device, any float dtype) and,
once its kernels exist, a module of the same name under ``gradops/kernels/`` (Triton).
Both expose the same functions with the same canonical arguments (see docs/backends.md);
``ops/`` validates and canonicalises, then calls ``implementation(family, backend, ...)``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Callable, Iterator, Optional

import torch

from .errors import ACLNN_ERR_PARAM_INVALID, AclnnError, AclnnTypeError

BACKENDS = ("auto", "reference", "triton")
FAMILIES = ("layer_norm", "rms_norm", "nsa_compress", "floyd_attention", "floyd3_attention")

# What backend=None means: "auto" unless set_default_backend/use_backend chose otherwise. One
# process-wide value (like torch.backends flags), so that autograd's backward threads and
# torch.compile see the same choice as the code that set it.
_default_backend = "auto"


def _check_name(op: str, backend) -> str:
    if not isinstance(backend, str):
        raise AclnnTypeError(ACLNN_ERR_PARAM_INVALID,
                             f"{op}: backend is a {type(backend).__name__}, expected one of {BACKENDS} or None")
    if backend not in BACKENDS:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                         f"{op}: backend is {backend!r}, expected one of {BACKENDS} or None")
    return backend


def default_backend() -> str:
    """The backend that calls with ``backend=None`` use (the modules, pivotal_attention,
    aclnn, ascendc and torch_npu always do)."""
    return _default_backend


def set_default_backend(backend: Optional[str]) -> str:
    """Make ``backend`` ("auto", "reference" or "triton"; None means "auto") what calls
    without an explicit backend use, process-wide (one setting shared by every thread, as
    torch.set_default_dtype; not thread-local); returns the previous default."""
    global _default_backend
    previous = _default_backend
    _default_backend = _check_name("set_default_backend", "auto" if backend is None else backend)
    return previous


@contextlib.contextmanager
def use_backend(backend: Optional[str]) -> Iterator[str]:
    """``with gradops.use_backend("triton"): ...``: set_default_backend for a block. The
    setting is process-wide, not per thread: other threads see it while the block runs."""
    previous = set_default_backend(backend)
    try:
        yield default_backend()
    finally:
        set_default_backend(previous)


def requested(backend: Optional[str]) -> str:
    """The backend a call asks for: its own argument, else the default."""
    return _default_backend if backend is None else backend


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def has_triton_kernels(family: str) -> bool:
    """True when gradops.kernels.<family> exists and triton imports."""
    if not triton_available():
        return False
    try:
        importlib.import_module(f"gradops.kernels.{family}")
    except ModuleNotFoundError as e:
        if e.name in (f"gradops.kernels.{family}", "triton"):
            return False
        raise
    return True


def _triton_usable_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreter_on())


def implementation(op: str, family: str, backend: Optional[str], device: torch.device,
                   *, kernel_limit: Optional[Callable[[object], Optional[str]]] = None):
    """The module implementing ``family`` for this call.

    ``kernel_limit(kernels_module)`` returns why the Triton kernels cannot take this
    particular call (None when they can): "auto" then falls back to the reference, and
    "triton" (as an argument or as the default) is refused with that reason.

    Meta tensors carry no data, only shapes and dtypes, which every backend plans alike:
    they always get the reference (whose ops also run on meta).
    """
    backend = explicit = _check_name(op, requested(backend))
    if device.type == "meta":
        backend = "reference"
    if backend == "auto":
        use_triton = device.type == "cuda" and has_triton_kernels(family)
        backend = "triton" if use_triton else "reference"
    if backend == "triton":
        if not has_triton_kernels(family):
            reason = "triton is not installed" if not triton_available() else \
                f"there are no Triton kernels for {family} yet"
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: backend='triton' unavailable: {reason}")
        if not _triton_usable_on(device):
            raise AclnnError(
                ACLNN_ERR_PARAM_INVALID,
                f"{op}: backend='triton' needs CUDA tensors (got {device}); on CPU it runs through "
                f"the Triton interpreter only when TRITON_INTERPRET=1 is set before triton is imported",
            )
    module = _module(backend, family)
    if backend == "triton" and kernel_limit is not None:
        reason = kernel_limit(module)
        if reason is not None:
            if explicit == "triton":
                raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                                 f"{op}: backend='triton' cannot run this call: {reason}; use backend='reference'")
            module = _module("reference", family)
    return module


@functools.lru_cache(maxsize=None)
def _module(backend: str, family: str):
    """gradops.reference.<family> or gradops.kernels.<family> (cached: every call asks)."""
    return importlib.import_module(f"gradops.{'kernels' if backend == 'triton' else 'reference'}.{family}")


def available_backends(family: str, device: torch.device) -> list:
    """Backends that can run ``family`` on ``device`` in this process."""
    out = ["reference"]
    if has_triton_kernels(family) and _triton_usable_on(device):
        out.append("triton")
    return out
