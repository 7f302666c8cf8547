"""Profiles for a GPU run (benchmarks/gpu_validate.sh, issue 33): where the time of the calls
whose goals are furthest off goes, so that a missed goal can be explained, not only reported.

1. Floyd forward + backward, B=1, H=8, N=M=K=512, D=128 (--floyd-shape), bfloat16: gradops (the rule's
   strategy) and FloydNet eager, each kernel's GPU time over two steps (torch.profiler) and
   the step's time by CUDA events.
2. A norm call on tiny tensors (8 x 64, bfloat16), the call the host-cost goals are about:
   gradops.nn.functional.rms_norm forward + backward under cProfile (where the host time goes,
   by function) beside torch.nn.functional.rms_norm's time per call.

Each section stops at its own error and the next one runs. Prints to stdout.

    python benchmarks/gpu_profile.py            # on a CUDA machine
    python benchmarks/gpu_profile.py --device cpu --floyd-shape 1,1,16,16,16,16   # a wiring check
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

NORM_SHAPE = (8, 64)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kernel_table(fn, device: str, steps: int = 2, rows: int = 30) -> str:
    """The kernels of ``steps`` calls of ``fn`` (after one untimed call), by GPU time."""
    fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    averages = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if device == "cuda" else ("self_cpu_time_total",)
    for key in keys:  # the name changed across torch versions
        try:
            return averages.table(sort_by=key, row_limit=rows, max_name_column_width=70)
        except Exception:
            continue
    return averages.table(row_limit=rows)


def call_ms(fn, device: str, reps: int, warmup: int = 1) -> float:
    """Milliseconds per call of ``fn``, ``reps`` calls back to back after ``warmup``, synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps * 1e3


def floyd(device: str, shape) -> None:
    from gradops.bench import floyd as F

    inputs, dy, mask = F.make_inputs(shape, torch.bfloat16, device, masked=False)
    scale = shape[-1] ** -0.5
    print(f"the rule's strategy at {shape} bfloat16: {F.rule_strategy(shape, 2)}")
    impls = F.implementations([F.OURS, "floydnet"], device, ours="triton" if device == "cuda" else "reference")
    for name, build in impls.items():
        step = build(inputs, dy, mask, scale)["fwdbwd"]()
        print(f"\n--- {name}: forward + backward {call_ms(step, device, 5):.2f} ms a step (5 steps, synchronised)")
        print(kernel_table(step, device))


def norm_call(device: str) -> None:
    import torch.nn.functional as TF

    import gradops.nn.functional as GF

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(*NORM_SHAPE, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(NORM_SHAPE[-1], generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(*NORM_SHAPE, generator=gen).to(device, torch.bfloat16)

    def call(fn):
        def fwd_bwd():
            fn(x, (NORM_SHAPE[-1],), w, 1e-6).backward(dy)
        return fwd_bwd

    calls = 200
    for name, fn in (("torch.nn.functional.rms_norm", TF.rms_norm), ("gradops.nn.functional.rms_norm", GF.rms_norm)):
        print(f"{name} forward + backward at {NORM_SHAPE} bfloat16: "
              f"{call_ms(call(fn), device, calls, warmup=20) * 1e3:.1f} us a call ({calls} calls back to back)")
    prof = cProfile.Profile()
    f = call(GF.rms_norm)
    prof.enable()
    for _ in range(calls):
        f()
    sync(device)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(f"\ncProfile of {calls} gradops calls, by own time:")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default); cpu runs the reference backend, a wiring check")
    p.add_argument("--floyd-shape", default="1,8,512,512,512,128", metavar="B,H,N,M,K,D")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.floyd_shape.split(","))
    failed = 0
    for title, section in (("Floyd forward + backward", lambda: floyd(args.device, shape)),
                           ("norm call on tiny tensors", lambda: norm_call(args.device))):
        print(f"\n===== {title}", flush=True)
        t0 = time.monotonic()
        try:
            section()
        except Exception:
            failed = 1
            traceback.print_exc()
        print(f"({title}: {time.monotonic() - t0:.1f} s)", flush=True)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
