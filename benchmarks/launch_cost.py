"""The host cost of one Triton launch, measured on a CPU: ``JITFunction.run`` against a bound
launch (``gradops.kernels._launch``), for gradops' own kernels with the arguments gradops
gives them, everything real but the GPU.

The kernels are compiled ``JITFunction``s (the Triton interpreter off), launched through
``kernel[grid](...)`` as gradops launches them. Three things stand in for a GPU: a driver
whose current device and stream are 0 (both paths ask for them once a launch; on a GPU each
costs what it costs on either path), ``triton.compiler.compile``, which returns a
``CompiledKernel`` that holds no binary, and that kernel's launcher, which only calls the
launch hooks it is given, as the real one does before and after the launch (the C launch
itself, the same on both paths, is what is left out). So the times are the Python of a
launch on each path, and their difference is what the bound path saves. Times are CPU time
of this thread (``time.thread_time``, steadier than wall time on a shared machine), the best
of ``--repeat`` rounds of ``--number`` launches.

    python benchmarks/launch_cost.py                                  # the installed triton
    PYTHONPATH=.ci/triton-3.6 python benchmarks/launch_cost.py        # triton 3.6 beside it

Each row also gives the JIT path's binder alone and the binder with ``compute_cache_key``
(the specialisation and key a bound launch replaces with its own).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import timeit

os.environ.pop("TRITON_INTERPRET", None)  # compiled JITFunctions, before triton is imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.compiler  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime import jit  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from gradops.kernels import _launch  # noqa: E402


class StandInDriver:
    """Device 0, stream 0, an H100's target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class StandInKernel(CompiledKernel):
    """A compiled kernel without a binary: ``launch_metadata`` is CompiledKernel's own; the
    launcher calls the hooks it is passed and launches nothing."""
    module = True  # (its handles count as loaded)
    function = 0
    packed_metadata = (4, 1, 0)

    def __init__(self, src):
        self.src, self.name = src, src.fn.__name__
        src.fn.cache_key  # what a compile computes: the globals the kernel reads

    def __del__(self):
        pass

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        if enter_hook is not None:
            enter_hook(launch_metadata)
        if exit_hook is not None:
            exit_hook(launch_metadata)


@contextlib.contextmanager
def stand_ins():
    saved, active = triton.compiler.compile, driver._active
    triton.compiler.compile = lambda src, target=None, options=None, **kwargs: StandInKernel(src)
    driver.set_active(StandInDriver())
    try:
        yield
    finally:
        triton.compiler.compile, driver._active = saved, active


def gradops_launches():
    """(label, kernel, grid, args, kwargs) of the launches of a few gradops calls on small
    CPU tensors, recorded without running them."""
    from gradops.kernels import floyd_attention, layer_norm, nsa_compress, rms_norm

    recorded = []

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, grid, args, kwargs))

    def calls():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(8, 64, generator=gen)
        w = torch.randn(64, generator=gen)
        yield "rms_norm fwd", lambda: rms_norm.rms_norm(x, w, 1e-6)
        rstd = torch.rand(8, generator=gen) + 0.5
        yield "rms_norm bwd", lambda: rms_norm.rms_norm_grad(x, x, rstd, w)
        mean = torch.randn(8, generator=gen)
        yield "layer_norm bwd", lambda: layer_norm.layer_norm_backward(x, x, mean, rstd, w, (True, True, True))
        xs = torch.randn(100, 4, 16, generator=gen)
        nw = torch.randn(32, 4, generator=gen)
        yield "nsa fwd", lambda: nsa_compress.nsa_compress(xs, nw, 32, 16, [0, 40, 100], 3)
        q = torch.randn(1, 2, 16, 16, 16, generator=gen)
        yield "floyd fused fwd", lambda: floyd_attention._fused_forward(q, q, q, q, q, None, 0.25)

    saved = jit.JITFunction.run
    jit.JITFunction.run = record
    try:
        launches = []
        for label, call in calls():
            del recorded[:]
            call()
            launches += [(f"{label}: {k.fn.__name__}", k, grid, args, kwargs) for k, grid, args, kwargs in recorded]
    finally:
        jit.JITFunction.run = saved
    return launches


def best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat, timer=time.thread_time)) / number * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=5000, help="launches per round (default 5000)")
    p.add_argument("--repeat", type=int, default=7, help="rounds; the best is kept (default 7)")
    args = p.parse_args(argv)
    if not _launch.VERSION_OK:
        print(f"triton {triton.__version__}: bound launches are not written for it ({_launch.TRITON_READ})")
        return 1
    print(f"triton {triton.__version__}, torch {torch.__version__}; us per launch (CPU time, best of "
          f"{args.repeat} x {args.number})")
    print(f"{'launch':48} {'args':>4} {'JIT':>7} {'bound':>7} {'saved':>6} {'binder':>7} {'+key':>7}")
    was = _launch.ENABLED
    with stand_ins():
        for label, kernel, grid, a, kw in gradops_launches():
            launch = kernel[grid]
            _launch.ENABLED = False
            launch(*a, **kw)  # compiles (stands in) and fills the JIT's caches
            jit_us = best_us(lambda: launch(*a, **kw), args.number, args.repeat)
            _launch.ENABLED = True
            launch(*a, **kw)  # binds
            before = _launch.DECLARED[kernel.fn].bound
            bound_us = best_us(lambda: launch(*a, **kw), args.number, args.repeat)
            assert _launch.DECLARED[kernel.fn].bound > before, f"{label}: no bound launch"
            _launch.ENABLED = was
            binder = kernel.device_caches[0][4]
            key_cache = {}
            binder_us = best_us(lambda: binder(*a, **kw), args.number, args.repeat)

            def binder_and_key():
                _, specialization, options = binder(*a, **kw)
                return jit.compute_cache_key(key_cache, specialization, options)

            key_us = best_us(binder_and_key, args.number, args.repeat)
            print(f"{label:48} {len(a):>4} {jit_us:7.2f} {bound_us:7.2f} {1 - bound_us / jit_us:6.0%} "
                  f"{binder_us:7.2f} {key_us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
