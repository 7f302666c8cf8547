"""Kernel launches that torch can trace, for the Triton ops of ``gradops.nn``.

Under ``torch.compile`` on a GPU the norm forwards are ``torch.library.triton_op``s
(``gradops::triton_layer_norm``, ``gradops::triton_rms_norm``): AOTAutograd traces their
body, and each launch in it must be a ``torch.library.wrap_triton`` call, which the graph
records as a call of the kernel that Inductor compiles and launches itself (no Python of
gradops at run time, and CUDA graphs capture it). Inside :func:`traced_launches` the
launch helpers below give that call; everywhere else (the eager paths, the API, aclnn)
the plain ``kernel[grid]``, which costs nothing extra.

Inductor compiles a traced kernel with its own compile options: the launch options
``enable_fp_fusion`` and ``maxnreg`` are not among them (torch 2.13,
``torch._inductor.codegen.wrapper.define_user_defined_triton_kernel``). So a traced launch
leaves them out, and a kernel whose results rest on contraction being off (the norm
backwards, ``norm_config.fp_fusion``) is never traced: it raises here rather than compile
into something that gives other bits. Without ``maxnreg`` a forward may take more
registers than its grid assumed (fewer programs per SM), never other results.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Tuple

import torch

from .._backend import triton_interpreter_on

_state = threading.local()

# Launch options Inductor's compile of a user kernel does not take.
NOT_TRACED_OPTIONS = ("enable_fp_fusion", "maxnreg")


@contextlib.contextmanager
def traced_launches() -> Iterator[None]:
    """Launches made inside go through ``torch.library.wrap_triton`` (a triton_op's body)."""
    previous = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = previous


def tracing_launches() -> bool:
    return getattr(_state, "on", False)


def traced(kernel, grid: tuple, options: dict) -> Tuple[object, dict]:
    """``wrap_triton(kernel)[grid]`` and the launch options Inductor takes (``num_warps``)."""
    if options.get("enable_fp_fusion", True) is False:
        raise RuntimeError(
            f"gradops: {kernel.fn.__name__} runs without floating-point contraction, which a launch traced for "
            f"Inductor cannot ask for (Inductor compiles it with its own options): it must stay in an opaque op")
    kept = {k: v for k, v in options.items() if k not in NOT_TRACED_OPTIONS}
    if triton_interpreter_on():  # nothing traces the interpreter's kernels (torch 2.11's wrap_triton refuses them)
        return kernel[grid], kept
    return torch.library.wrap_triton(kernel)[grid], kept


def launcher(kernel, grid: tuple, options: dict) -> Tuple[object, dict]:
    """``(kernel[grid], options)``, or inside :func:`traced_launches` :func:`traced`'s."""
    if tracing_launches():
        return traced(kernel, grid, options)
    return kernel[grid], options
