"""Benchmark of Floyd (pivotal) attention, forward and backward: ``gradops bench floyd``.

Implementations measured side by side, same process, same inputs:

- ``gradops``: the Triton kernels (backend="triton"; on CPU only with ``--interpret``, and
  then only to see that it runs: interpreter timings mean nothing);
- ``reference``: the chunked PyTorch reference (backend="reference"), bounded memory;
- ``einsum``: FloydNet's formulation (two einsums for the scores, softmax, two einsums for
  the output) under autograd: it materialises the [B,H,N,M,K] scores, so it runs out of
  memory where the others do not (recorded as an error, not a crash);
- ``floydnet``: FloydNet's own ``pivotal_attention`` (PyPI ``floydnet``) under autograd, when
  it imports: the same formulation, from its authors;
- ``compiled``: ``torch.compile`` of the einsum formulation (CUDA only).

Forward FLOP 8*B*H*N*M*K*D, backward 20*B*H*N*M*K*D (docs/benchmarks.md). The backward of
``gradops``/``reference`` is the standalone grad operator fed with its forward's outputs;
the backward of ``einsum``/``compiled`` is ``autograd.grad`` on a retained graph.
Defaults: on CUDA bf16 and the shapes of issue 6 (N = M = K in 128..1024, D in 32, 64,
128), a JSON file under benchmarks/results/; ``--quick`` runs a few tiny fp32 shapes on the
CPU in well under a minute (reference against einsum; ``--interpret`` adds our kernels).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import harness
from .harness import DTYPES, OURS, Goal, Run, progress

FAMILY = "floyd"
IMPLS = (OURS, "reference", "einsum", "floydnet", "compiled")
Shape = Tuple[int, int, int, int, int, int]  # B, H, N, M, K, D
PLOT = dict(x_key="N", metric="tflops", group_keys=("op", "D", "dtype"))
# The goals for Floyd attention (docs/benchmarks.md; H100). The memory goal, O(inputs), is measured
# by tests/test_floyd_memory.py; the JSON holds each implementation's peak memory.
GOALS = (
    Goal("Floyd bwd >= 300 TFLOP/s bf16 at D = 128", ("floyd_bwd",), "tflops", 300.0,
         lambda c: c["dtype"] == "bfloat16" and c["D"] == 128),
    Goal("Floyd fwd >= 450 TFLOP/s bf16 at D = 128", ("floyd_fwd",), "tflops", 450.0,
         lambda c: c["dtype"] == "bfloat16" and c["D"] == 128),
    Goal("Floyd bwd >= 150 TFLOP/s bf16 at D = 32/64", ("floyd_bwd",), "tflops", 150.0,
         lambda c: c["dtype"] == "bfloat16" and c["D"] in (32, 64)),
)


def fwd_flops(shape: Shape) -> float:
    b, h, n, m, k, d = shape
    return 8.0 * b * h * n * m * k * d


def bwd_flops(shape: Shape) -> float:
    b, h, n, m, k, d = shape
    return 20.0 * b * h * n * m * k * d


def default_shapes(quick: bool, device: str) -> List[Shape]:
    if quick or not device.startswith("cuda"):
        return [(1, 2, 16, 16, 16, 16), (1, 2, 32, 32, 32, 32), (2, 4, 48, 48, 48, 32)]
    shapes = []
    for d in (32, 64, 128):
        for s in (128, 256, 512, 1024):
            # B*H shrinks as the cube grows, keeping each case between ~0.1 and ~5 TFLOP
            b, h = {128: (4, 16), 256: (2, 16), 512: (1, 8), 1024: (1, 4)}[s]
            shapes.append((b, h, s, s, s, d))
    return shapes


def parse_shape(text: str) -> Shape:
    parts = [int(p) for p in text.replace("x", ",").split(",")]
    if len(parts) != 6 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B,H,N,M,K,D (all >= 1)")
    return tuple(parts)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# FloydNet's formulation: everything materialised, differentiated by autograd
# ---------------------------------------------------------------------------------------------
def floyd_einsum(q, k1, v1, k2, v2, mask, scale):
    scores = torch.einsum("bhnmd,bhnkd->bhnmk", q, k1) + torch.einsum("bhnmd,bhkmd->bhnmk", q, k2)
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhnmk,bhnkd->bhnmd", p, v1) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2)


def _floydnet():
    try:
        from floydnet.functional import pivotal_attention

        return pivotal_attention
    except Exception:
        return None


def optional_peers(device: str) -> Dict[str, Optional[str]]:
    """Peers that need a package or a device: name -> None when usable here, else why not."""
    try:
        from floydnet.functional import pivotal_attention  # noqa: F401
        floydnet = None
    except Exception as e:
        floydnet = f"not importable ({type(e).__name__}: {e})"[:200]
    return {"floydnet": floydnet, "compiled": None if device == "cuda" else "CUDA only (compile time dwarfs a CPU run)"}


def floydnet_pivotal(q, k1, v1, k2, v2, mask, scale):
    """FloydNet's own function, in our argument order (its order is q, k1, k2, v1, v2)."""
    return _floydnet()(q, k1, k2, v1, v2, attn_mask=mask, scale=scale)


def make_inputs(shape: Shape, dtype: torch.dtype, device: str, masked: bool):
    b, h, n, m, k, d = shape
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = rnd(b, h, n, m, d)
    k1, v1, k2, v2 = rnd(b, h, n, k, d), rnd(b, h, n, k, d), rnd(b, h, k, m, d), rnd(b, h, k, m, d)
    dy = rnd(b, h, n, m, d)
    mask = None
    if masked:
        mask = torch.rand(b, 1, n, 1, k, generator=gen, device=device) < 0.1
    return (q, k1, v1, k2, v2), dy, mask


def _gradops_fns(backend: str, inputs, dy, mask, scale):
    import gradops

    def fwd():
        return gradops.floyd_attention(*inputs, mask, scale, backend=backend)

    out, mx, sm = fwd()

    def bwd():
        return gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, scale, backend=backend)

    return fwd, bwd


def _autograd_fns(fn: Callable, inputs, dy, mask, scale):
    leaves = [t.detach().requires_grad_() for t in inputs]

    def fwd():
        return fn(*leaves, mask, scale)

    y = fwd()

    def bwd():
        return torch.autograd.grad(y, leaves, dy, retain_graph=True)

    return fwd, bwd


def implementations(names: Sequence[str], device: str, ours: str = "triton") -> Dict[str, Callable]:
    """name -> builder(inputs, dy, mask, scale) -> (fwd, bwd)."""
    builders: Dict[str, Callable] = {}
    compiled_fn = None
    for name in names:
        if name == OURS:
            builders[name] = lambda *a: _gradops_fns(ours, *a)
        elif name == "reference":
            builders[name] = lambda *a: _gradops_fns("reference", *a)
        elif name == "einsum":
            builders[name] = lambda *a: _autograd_fns(floyd_einsum, *a)
        elif name == "floydnet":
            builders[name] = lambda *a: _autograd_fns(floydnet_pivotal, *a)
        elif name == "compiled":
            if compiled_fn is None:
                compiled_fn = torch.compile(floyd_einsum, dynamic=False)
            builders[name] = lambda *a, _f=compiled_fn: _autograd_fns(_f, *a)
    return builders


def default_impls(device: str, interpret: bool) -> List[str]:
    """Ours (on a CPU only through the interpreter) and every peer usable here."""
    unusable = {name for name, why in optional_peers(device).items() if why is not None}
    names = [i for i in IMPLS if i not in unusable]
    return names if device == "cuda" or interpret else [i for i in names if i != OURS]


def cases(args) -> List[tuple]:
    """(shape, dtype) for every case this run measures."""
    return [(shape, dt) for dt in args.dtypes for shape in (args.shape or default_shapes(args.quick, args.device))]


def _unusable(args) -> Dict[str, str]:
    why = {name: reason for name, reason in optional_peers(args.device).items() if reason}
    if args.device != "cuda" and not args.interpret:
        why[OURS] = "the Triton kernels need CUDA, or --interpret on a CPU"
    return why


def impl_names(args) -> List[str]:
    """The implementations measured: those asked for (default: all) that can run here."""
    unusable = _unusable(args)
    return [i for i in (args.impl or default_impls(args.device, args.interpret)) if i not in unusable]


def run(args) -> Run:
    """Measure every case of ``args`` (parsed by :func:`parse_args`, resolved by ``prepare``)."""
    device = args.device
    impls = impl_names(args)
    for name, why in _unusable(args).items():
        if name in (args.impl or ()):
            print(f"gradops bench floyd: leaving out {name}: {why}", file=sys.stderr)
    directions = args.direction or ["fwd", "bwd"]
    bench = Run(FAMILY, device, args.deadline)
    bench.meta["backend_ours"] = harness.ours_backend(args) if OURS in impls else None
    builders = implementations(impls, device, bench.meta["backend_ours"] or "triton")
    for shape, dt in progress(cases(args), "floyd"):
        b, h, n, m, k, d = shape
        case = {"B": b, "H": h, "N": n, "M": m, "K": k, "D": d, "dtype": dt, "mask": args.mask}
        if bench.out_of_time():
            bench.skip([f"floyd_{direction}" for direction in directions], case)
            continue
        inputs, dy, mask = make_inputs(shape, DTYPES[dt], device, args.mask)
        sc = d ** -0.5 if args.scale is None else args.scale
        for name, build in builders.items():
            if bench.out_of_time():  # building a peer runs its forward (and may compile it)
                bench.skip([f"floyd_{direction}" for direction in directions], case, impl=name)
                continue
            try:
                fwd, bwd = build(inputs, dy, mask, sc)
            except Exception as e:  # e.g. out of memory building the peer's graph: a result
                for direction in directions:
                    bench.time(f"floyd_{direction}", case, name, _raiser(e))
                _free(device)
                continue
            for direction in directions:
                fn, flops = (fwd, fwd_flops(shape)) if direction == "fwd" else (bwd, bwd_flops(shape))
                bench.time(f"floyd_{direction}", case, name, fn, flops=flops, memory=device == "cuda",
                           reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds, flush_l2=False)
            del fwd, bwd
            _free(device)
    return bench


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile check: no GPU needed
# ---------------------------------------------------------------------------------------------
# Stride arguments the JIT turns into the constant 1 for contiguous tensors.
_UNIT_STRIDES = ("sq_d", "sk1_d", "sv1_d", "sk2_d", "sv2_d", "so_d", "sdy_d", "sdq_d", "sg_d", "smk_k",
                 "sst_m", "smax_m", "ssum_m", "sok_d", "sov_d", "sxk_d", "sxv_d")
# _bwd_dkv_kernel sees the [B,H,N,M] statistics and Dr as [own, loop]: m, their unit stride,
# is the looped axis of the dK1/dV1 launch and the own axis of the dK2/dV2 launch.
_UNIT_STRIDES_DKV = {"bwd_dk1": ("smax_loop", "ssum_loop", "sdr_loop"),
                     "bwd_dk2": ("smax_own", "ssum_own", "sdr_own")}


def compile_check(dtype: torch.dtype, head_dim: int, arch: int = 90) -> List[dict]:
    """Compile the four kernels for ``sm_<arch>`` without a GPU (Triton's bundled ptxas),
    specialised as the JIT would for contiguous tensors whose sizes are multiples of 16, and
    report shared memory (bytes), the registers a thread uses and its local-memory spill
    instructions, read from the SASS. Needs TRITON_INTERPRET unset when triton was imported."""
    import re
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..kernels import floyd_attention as fa
    from ..kernels.floyd_config import floyd_config

    ptr = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}[dtype]
    acc = "*fp64" if dtype == torch.float64 else "*fp32"
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    rows = []
    for name, kernel in (("fwd", fa._fwd_kernel), ("bwd_dq", fa._bwd_dq_kernel),
                         ("bwd_dk1", fa._bwd_dkv_kernel), ("bwd_dk2", fa._bwd_dkv_kernel)):
        cfg = floyd_config(name, head_dim, torch.empty((), dtype=dtype).element_size())
        consts = dict(HAS_MASK=True, PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32",
                      ACC=tl.float64 if dtype == torch.float64 else tl.float32, IDX=tl.int32, UPCAST=False)
        if kernel is fa._bwd_dkv_kernel:
            consts.update({k: v for k, v in fa._dkv_meta(name, cfg).items() if k not in ("num_warps", "num_stages")})
        else:
            consts.update(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d,
                          GROUP=cfg.group)
        sig, attrs = {}, {}
        for idx, arg in enumerate(kernel.arg_names):
            if kernel.params[idx].is_constexpr:
                continue
            if arg in _UNIT_STRIDES or arg in _UNIT_STRIDES_DKV.get(name, ()):
                sig[arg], consts[arg] = "constexpr", 1
                continue
            if arg == "scale":  # the float64's bit pattern (do_not_specialize: no attributes)
                sig[arg] = "i64"
                continue
            if arg.endswith("_ptr"):
                sig[arg] = "*u8" if arg == "mask_ptr" else acc if arg in ("max_ptr", "sum_ptr", "dr_ptr") else ptr
            else:
                sig[arg] = "i32"
            attrs[(idx,)] = [["tt.divisibility", 16]]
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "D": head_dim,
               "tile": f"{cfg.block_n}x{cfg.block_m}x{cfg.block_k}x{cfg.block_d}", "warps": cfg.num_warps}
        try:
            compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            with tempfile.TemporaryDirectory() as tmp:
                cubin = os.path.join(tmp, "k.cubin")
                with open(cubin, "wb") as f:
                    f.write(compiled.asm["cubin"])
                sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
            regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
            row.update(shared=compiled.metadata.shared, registers=max(regs) + 1 if regs else None,
                       spill_loads=sass.count("LDL"), spill_stores=sass.count("STL"),
                       mma=sass.count("HMMA") + sass.count("DMMA"))
        except Exception as e:  # e.g. out of shared memory: the finding this check exists for
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[-1][:200] if str(e) else ''}"
        rows.append(row)
    return rows


def _raiser(error: Exception):
    def fn():
        raise error
    return fn


def _free(device: str):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gradops bench floyd", description=__doc__.split("\n\n")[0])
    harness.add_common_args(parser, dtype_help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--shape", action="append", type=parse_shape, metavar="B,H,N,M,K,D",
                        help="a case (repeatable; default: the issue's grid on CUDA, tiny ones on CPU)")
    parser.add_argument("--impl", nargs="+", action="extend", choices=IMPLS,
                        help="only these implementations (default: ours and every peer usable here)")
    parser.add_argument("--direction", action="append", choices=["fwd", "bwd"], help="default: both")
    parser.add_argument("--mask", action="store_true", help="a random [B,1,N,1,K] mask (10%% masked)")
    parser.add_argument("--scale", type=float, help="default: D**-0.5")
    parser.add_argument("--compile-check", action="store_true",
                        help="compile the kernels for an H100 (sm_90) without a GPU and report shared memory, "
                             "registers and spills (for each --dtype, default bfloat16 float32, and D in 16..256)")
    return parser.parse_args(argv)


def prepare(args, need_device: bool = True):
    return harness.prepare(args, reps=20, warmup=3, max_seconds=10.0, quick_reps=5, quick_warmup=2,
                           quick_max_seconds=2.0, need_device=need_device)


def _compile_check(args) -> int:
    dtypes = [DTYPES[d] for d in args.dtypes] if args.dtypes else [torch.bfloat16, torch.float32]
    dims = sorted({s[5] for s in args.shape}) if args.shape else [16, 32, 64, 128, 256]
    limit = 227 * 1024
    worst = 0
    for dt in dtypes:
        for d in dims:
            for row in compile_check(dt, d):
                if "error" in row:
                    worst = 1
                    print(f"{row['kernel']:8} {row['dtype']:9} D={row['D']:<4} {row['tile']:14} {row['error']}")
                    continue
                over = row["shared"] > limit
                worst = max(worst, int(over))
                print(f"{row['kernel']:8} {row['dtype']:9} D={row['D']:<4} {row['tile']:14} w{row['warps']} "
                      f"shared={row['shared'] // 1024}KiB{' (over the H100 limit)' if over else ''} "
                      f"registers={row['registers']} spill ld/st={row['spill_loads']}/{row['spill_stores']} "
                      f"mma={row['mma']}", flush=True)
    return worst


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.compile_check:  # needs the interpreter off: no device rule applied
        return _compile_check(args)
    args = prepare(args)
    harness.announce(args, FAMILY)
    bench = run(args)
    harness.finish(bench, args, FAMILY, PLOT)
    return bench.exit_status()


if __name__ == "__main__":
    raise SystemExit(main())
