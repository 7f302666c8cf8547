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
of ``--repeat`` rounds of ``--number`` launches, the paths taking turns within each round.

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
    """(label, kernel, grid, args, kwargs) of the first launch of each kernel in a few gradops
    calls on small CPU tensors (norms forward and backward, NSA forward and backward, Floyd
    forward and backward by each strategy), recorded without running them."""
    from gradops.kernels import floyd_attention, floyd_config, layer_norm, nsa_compress, rms_norm

    recorded = []

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, grid, args, kwargs))

    def calls():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        w = torch.randn(64, generator=gen)
        rstd = torch.rand(8, generator=gen) + 0.5
        mean = torch.randn(8, generator=gen)
        yield "rms_norm fwd", lambda: rms_norm.rms_norm(x, w, 1e-6)
        yield "rms_norm bwd", lambda: rms_norm.rms_norm_grad(x, x, rstd, w, grad_dtype=w.dtype)
        yield "layer_norm fwd", lambda: layer_norm.layer_norm(x, w, w, 1e-5)
        yield "layer_norm bwd", lambda: layer_norm.layer_norm_backward(x, x, mean, rstd, w, (True, True, True))
        xs = torch.randn(100, 4, 16, generator=gen)
        nw = torch.randn(32, 4, generator=gen)
        out = torch.randn(3, 4, 16, generator=gen)
        yield "nsa fwd", lambda: nsa_compress.nsa_compress(xs, nw, 32, 16, [0, 40, 100], 3)
        yield "nsa bwd", lambda: nsa_compress.nsa_compress_grad(out, xs, nw, 32, 16, [0, 40, 100], 3)
        q = torch.randn(1, 2, 16, 16, 16, generator=gen).to(torch.bfloat16)
        stat = torch.zeros(1, 2, 16, 16)
        for strategy in ("fused", "hybrid", "chunked"):
            def floyd(strategy=strategy):
                floyd_config.STRATEGY = strategy
                floyd_attention.floyd_attention(q, q, q, q, q, None, 0.25)
                floyd_attention.floyd_attention_grad(q, q, q, q, q, q, q, stat, stat, None, 0.25)
            yield f"floyd {strategy}", floyd

    saved, strategy = jit.JITFunction.run, None
    jit.JITFunction.run = record
    try:
        from gradops.kernels import floyd_config

        strategy = floyd_config.STRATEGY
        launches, seen = [], set()
        for label, call in calls():
            del recorded[:]
            call()
            for k, grid, args, kwargs in recorded:
                if k.fn not in seen:
                    seen.add(k.fn)
                    launches.append((f"{label}: {k.fn.__name__}", k, grid, args, kwargs))
    finally:
        jit.JITFunction.run = saved
        floyd_config.STRATEGY = strategy
    return launches


def interleaved_best_us(fns: dict, number: int, repeat: int) -> dict:
    """Microseconds per call of each function, the best of ``repeat`` rounds of ``number``
    calls; the functions take turns within each round, so a busy spell of a shared machine
    falls on all of them alike."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number, timer=time.thread_time) / number * 1e6)
    return best


def switched(call, on: bool):
    def launch():
        _launch.ENABLED = on
        call()
    return launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=2000, help="launches per round (default 2000)")
    p.add_argument("--repeat", type=int, default=15, help="rounds; the best is kept (default 15)")
    args = p.parse_args(argv)
    if not _launch.VERSION_OK:
        print(f"triton {triton.__version__}: bound launches are not written for it ({_launch.TRITON_READ})")
        return 1
    print(f"triton {triton.__version__}, torch {torch.__version__}; us per launch (CPU time, best of "
          f"{args.repeat} x {args.number}, taking turns)")
    print(f"{'launch':48} {'args':>4} {'JIT':>7} {'bound':>7} {'saved':>6} {'binder':>7} {'+key':>7}")
    was = _launch.ENABLED
    with stand_ins():
        try:
            for label, kernel, grid, a, kw in gradops_launches():
                launch = kernel[grid]
                _launch.ENABLED = False
                launch(*a, **kw)  # compiles (stands in) and fills the JIT's caches
                _launch.ENABLED = True
                launch(*a, **kw)  # binds
                before = _launch.DECLARED[kernel.fn].bound
                launch(*a, **kw)
                assert _launch.DECLARED[kernel.fn].bound == before + 1, f"{label}: not bound"
                binder, key_cache = kernel.device_caches[0][4], {}

                def binder_and_key():
                    _, specialization, options = binder(*a, **kw)
                    return jit.compute_cache_key(key_cache, specialization, options)

                us = interleaved_best_us({"jit": switched(lambda: launch(*a, **kw), False),
                                          "bound": switched(lambda: launch(*a, **kw), True),
                                          "binder": lambda: binder(*a, **kw), "key": binder_and_key},
                                         args.number, args.repeat)
                print(f"{label:48} {len(a):>4} {us['jit']:7.2f} {us['bound']:7.2f} {1 - us['bound'] / us['jit']:6.0%} "
                      f"{us['binder']:7.2f} {us['key']:7.2f}")
        finally:
            _launch.ENABLED = was
    return 0


if __name__ == "__main__":
    sys.exit(main())
