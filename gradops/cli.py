"""The ``gradops`` command.

    gradops                 same as ``gradops selftest``
    gradops selftest        every operator, every available backend, against float64 oracles
    gradops info            versions (and the tested range), devices, backends
    gradops bench FAMILY    benchmarks (norm, nsa, floyd, floyd3, model, overhead, floydnet, all): see
                            ``gradops bench FAMILY --help``
    gradops bench all       every family at its GPU shapes, one folder of results and a summary

Every ``gradops bench`` command takes the same options (gradops.bench.harness.add_common_args),
and ``--dtype`` takes one set of names everywhere, ``gradops selftest`` included: torch's
(float32, float16, bfloat16, float64), or their aliases fp32, fp16, bf16, fp64.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from .bench.harness import dtype_choices, dtype_name


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_selftest(args) -> int:
    from . import selftest  # imports torch, not triton

    device = args.device or _default_device()
    selftest.use_interpreter_on_cpu(device)  # before anything imports triton
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("gradops selftest: --device cuda, but no CUDA device is visible", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, d) for d in args.dtype] if args.dtype else selftest.DTYPES
    plan = selftest.backends_here(device, args.backend)
    print(f"gradops selftest on {device}: every operator and backend against float64 oracles", flush=True)
    print("\n".join(selftest.describe_backends(plan, device)), flush=True)
    print(selftest.HEADER, flush=True)
    t0 = time.perf_counter()
    failures = total = 0
    for r in selftest.run(device, args.backend, dtypes, plan=plan):
        total += 1
        failures += not r.ok
        print(selftest.format_row(r), flush=True)
        if r.error and args.verbose:
            print("    " + r.error, flush=True)
    skipped = selftest.skipped_summary(plan, device)
    print(f"{total - failures} passed, {failures} failed in {time.perf_counter() - t0:.1f} s"
          + (f"; {skipped}" if skipped else ""))
    if total == 0:
        print("gradops selftest: nothing ran", file=sys.stderr)
    return 1 if failures or total == 0 else 0


def cmd_info(args) -> int:
    import platform

    from . import __version__, _versions, selftest

    # The same rule as `gradops selftest --device cpu`, so that both list the same backends.
    user_interpret = os.environ.get("TRITON_INTERPRET")
    selftest.use_interpreter_on_cpu("cpu")
    import torch

    from ._backend import triton_available, triton_interpreter_on

    print(f"gradops {__version__}")
    print(f"python {platform.python_version()} ({platform.platform()})")
    print(f"torch {torch.__version__}")
    if triton_available():
        import triton

        rule = (f"TRITON_INTERPRET={user_interpret} is set" if user_interpret is not None else
                "compiled on CUDA devices; on the CPU through the Triton interpreter, which gradops "
                "switches on (TRITON_INTERPRET=1) for CPU runs")
        print(f"triton {triton.__version__} ({rule})")
        if triton_interpreter_on():
            from .kernels import _interpreter

            if _interpreter.APPLIED:
                print(f"  Triton interpreter: {_interpreter.APPLIED}")
        from .kernels import _launch

        print(f"  compiled kernels' launches: {_launch.describe()}")
    else:
        print(f"triton not installed ({selftest.TRITON_INSTALL_HINT})")
    print(f"tested: torch {_versions.tested_range('torch')}, triton {_versions.tested_range('triton')} "
          f"(CI runs the oldest pair and the newest)")
    installed = {"torch": torch.__version__}
    if triton_available():
        installed["triton"] = triton.__version__
    for package, version in installed.items():
        why = _versions.outside_tested(package, version)
        if why:
            print(f"  untested: {package} {version} is {why}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        name = torch.cuda.get_device_name(0) if dev == "cuda" else platform.processor() or "cpu"
        count = torch.cuda.device_count() if dev == "cuda" else 0
        print(f"device {dev}: {name}" + (f" ({count} devices)" if count > 1 else ""))
        print("\n".join(selftest.describe_backends(selftest.backends_here(dev), dev)))
    return 0


BENCH_FAMILIES = ("norm", "nsa", "floyd", "floyd3", "model", "overhead", "floydnet", "all")
SELFTEST_DTYPES = ("float64", "float32", "float16", "bfloat16")


def bench_help() -> str:
    """`gradops bench --help`: the families and the options every one of them takes."""
    from .bench import harness

    p = argparse.ArgumentParser(prog="gradops bench {" + ",".join(BENCH_FAMILIES) + "}", add_help=False,
                                description="Benchmarks against peers, side by side (docs/benchmarks.md). "
                                            "Every family takes the options below; see "
                                            "`gradops bench FAMILY --help` for its own.")
    harness.add_common_args(p, family=False)
    return p.format_help()


def cmd_bench(args, rest) -> int:
    # Each benchmark applies gradops.selftest.use_interpreter_on_cpu itself, once it knows its device.
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
    st.add_argument("--dtype", nargs="+", action="extend", type=dtype_name, choices=SELFTEST_DTYPES,
                    metavar="DTYPE", help="only these dtypes (repeatable): " + dtype_choices(SELFTEST_DTYPES))
    st.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("info", help="versions, devices and backends")
    bench = sub.add_parser("bench", help="benchmarks against peers", add_help=False)
    bench.add_argument("family", choices=BENCH_FAMILIES)
    if not argv:
        argv = ["selftest"]
    if argv[0] == "bench" and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(bench_help())
        return 0 if len(argv) > 1 else 2
    if argv[0] == "bench":
        args, rest = parser.parse_known_args(argv)
        return cmd_bench(args, rest)
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    return cmd_selftest(args)


if __name__ == "__main__":
    sys.exit(main())
