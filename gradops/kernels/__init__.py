"""Triton kernels, one module per operator family, each with the same functions and
arguments as its counterpart in ``gradops.reference`` (see docs/backends.md).

On CUDA tensors they run compiled; on CPU tensors they run through the Triton interpreter
when ``TRITON_INTERPRET=1`` was set before triton was first imported (that is how the test
suite exercises them without a GPU). Every kernel they launch is defined under
``_launch.bind_launches``: with ``GRADOPS_BOUND_LAUNCH=1`` a compiled kernel's repeated launches
skip Triton's per-launch bookkeeping (docs/backends.md, "Kernel launches").
"""

from .._backend import triton_available, triton_interpreter_on

if triton_interpreter_on() and triton_available():
    from . import _interpreter

    _interpreter.fix()
