"""The ``gradops`` command.

    gradops                 same as ``gradops selftest``
    gradops selftest        every operator, every available backend, against float64 oracles
    gradops info            versions, devices, backends
    gradops bench FAMILY    benchmarks (norm, nsa, floyd): see ``gradops bench FAMILY --help``
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _enable_interpreter_on_cpu(device: str):
    # Triton reads TRITON_INTERPRET when it is first imported: decide before anything imports it.
    if device == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def cmd_selftest(args) -> int:
    device = args.device or _default_device()
    _enable_interpreter_on_cpu(device)
    import torch

    from . import selftest

    dtypes = [getattr(torch, d) for d in args.dtype] if args.dtype else selftest.DTYPES
    print(f"gradops selftest on {device}: every operator and backend against float64 oracles", flush=True)
    print(selftest.HEADER, flush=True)
    t0 = time.perf_counter()
    failures = total = 0
    for r in selftest.run(device, args.backend, dtypes):
        total += 1
        failures += not r.ok
        print(selftest.format_row(r), flush=True)
        if r.error and args.verbose:
            print("    " + r.error, flush=True)
    print(f"{total - failures} passed, {failures} failed in {time.perf_counter() - t0:.1f} s")
    return 1 if failures or total == 0 else 0


def cmd_info(args) -> int:
    import platform

    import torch

    from . import __version__
    from ._backend import FAMILIES, available_backends, triton_available, triton_interpreter_on

    print(f"gradops {__version__}")
    print(f"python {platform.python_version()} ({platform.platform()})")
    print(f"torch {torch.__version__}")
    if triton_available():
        import triton

        print(f"triton {triton.__version__} (interpreter {'on' if triton_interpreter_on() else 'off'})")
    else:
        print("triton not installed")
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for dev in devices:
        name = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else platform.processor() or "cpu"
        print(f"device {dev}: {name}")
        for family in FAMILIES:
            print(f"  {family:<16} backends: {', '.join(available_backends(family, torch.device(dev)))}")
    return 0


BENCH_FAMILIES = ("norm", "nsa", "floyd")


def cmd_bench(args, rest) -> int:
    # Kernels on a CPU run only through the interpreter, which must be on before triton loads.
    if "--interpret" in rest or ("--quick" in rest and args.family == "nsa"):
        _enable_interpreter_on_cpu(_default_device())
    try:
        module = importlib.import_module(f"gradops.bench.{args.family}")
    except ModuleNotFoundError as e:
        print(f"gradops bench: no benchmark module for {args.family!r} ({e})", file=sys.stderr)
        return 2
    return module.main(rest)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="gradops", description="Fast, exact backward operators.")
    sub = parser.add_subparsers(dest="command")
    st = sub.add_parser("selftest", help="check every operator and backend against float64 oracles")
    st.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    st.add_argument("--backend", action="append", choices=["reference", "triton"],
                    help="only these backends (repeatable; default: every available one)")
    st.add_argument("--dtype", action="append", choices=["float64", "float32", "float16", "bfloat16"],
                    help="only these dtypes (repeatable)")
    st.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("info", help="versions, devices and backends")
    bench = sub.add_parser("bench", help="benchmarks against peers", add_help=False)
    bench.add_argument("family", choices=BENCH_FAMILIES)
    if not argv:
        argv = ["selftest"]
    if argv[0] == "bench":
        args, rest = parser.parse_known_args(argv)
        return cmd_bench(args, rest)
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    return cmd_selftest(args)


if __name__ == "__main__":
    sys.exit(main())
