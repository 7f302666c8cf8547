"""``gradops bench overhead``: what a call costs the host, apart from its kernels.

For each public entry point (the nn.functional norms forward + backward, the modules, the
API and aclnn functions, NSA), the per-call host time against torch's nearest call and
against a *floor*: a bare ``torch.autograd.Function`` that allocates the same outputs and
makes the same number of kernel launches, with nothing else around them.

On a GPU the kernels run (host time = wall time of a call with the GPU queue never
drained, so launches overlap the host's next call; the profile of one call gives its kernel
count). On a CPU the Triton launches are *stubbed*: :func:`stubbed_launches` replaces the
launch of every Triton kernel (compiled or interpreted) with a recorder that returns at
once, so what is timed is gradops' Python around the launches: argument checks, configs,
allocations, views, autograd. The floor stubs its launches the same way, so the ratio
ours / floor is the Python gradops adds per launch budget (goal: within 2x).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List


@contextlib.contextmanager
def stubbed_launches(mark: bool = False) -> Iterator[List[str]]:
    """Record every Triton kernel launch (``kernel[grid](...)``) as the kernel's name, and
    run nothing: nothing is compiled, interpreted or written, the launch returns at once.
    ``mark``: each launch also leaves a ``triton::<name>`` range in the profiler's trace."""
    import torch
    from triton.runtime import interpreter, jit

    log: List[str] = []

    def run(self, *args, grid, warmup, **kwargs):
        log.append(self.fn.__name__)
        if mark:
            with torch.profiler.record_function("triton::" + self.fn.__name__):
                pass

    saved = [(cls, cls.run) for cls in (jit.JITFunction, interpreter.InterpretedFunction)]
    for cls, _ in saved:
        cls.run = run
    try:
        yield log
    finally:
        for cls, real in saved:
            cls.run = real


# ATen ops that launch no kernel: allocation, views, metadata, and the conversions that are
# no-ops unless they contain a copy (then the copy inside them is what is counted).
_NO_KERNEL = frozenset("""
empty empty_strided empty_like new_empty new_empty_strided view _unsafe_view reshape _reshape_alias
detach t expand expand_as as_strided alias slice select unsqueeze squeeze permute transpose narrow view_as
flatten unflatten split unbind chunk to contiguous lift_fresh resolve_conj resolve_neg result_type set_
size stride numel dim is_nonzero item _local_scalar_dense
""".split())


def kernels_launched(fn: Callable[[], object]) -> List[str]:
    """The kernels one call of ``fn`` launches, in order: each Triton launch by its kernel's name,
    and each ATen op that would launch a kernel on a GPU (an op outside ``_NO_KERNEL`` none of
    whose own ATen children does) as ``aten::name``. Read from the profiler's op tree, so it
    counts the same on a CPU as on a GPU; Triton launches are recorded, not run
    (:func:`stubbed_launches`)."""
    import torch

    found: List[str] = []

    def walk(ev):
        if ev.name.startswith("triton::"):
            found.append(ev.name[len("triton::"):])
            return
        if ev.name.startswith("aten::"):
            inner = [k for k in ev.cpu_children
                     if k.name.startswith("triton::") or (k.name.startswith("aten::") and k.name[6:] not in _NO_KERNEL)]
            if ev.name[6:] not in _NO_KERNEL and not inner:
                found.append(ev.name)
                return
        for k in ev.cpu_children:
            walk(k)

    with stubbed_launches(mark=True), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    for ev in prof.events():
        if ev.cpu_parent is None:
            walk(ev)
    return found
