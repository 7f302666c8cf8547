"""Floyd attention's error against float64: ours (the Triton backend) against FloydNet eager's.

Issue 32's goal: with float16 inputs at B = 1, H = 2, N = M = K = 64, D = 16, the largest
relative error against a float64 oracle over Y and the five gradients (dQ, dK1, dV1, dK2,
dV2) of gradops' Triton backend is at most 0.5x FloydNet eager's on each of 5 seeds; and in
bf16 training without loss scaling (bfloat16 inputs, dY scaled by 1e-4) too. The error of
one tensor is max |x - ref| / max |ref| over the whole tensor (as ``bench floyd``'s
``record_accuracy`` measures it on a GPU); a run's error is the largest of the six.

- The inputs: :func:`gradops.bench.traffic.floyd_inputs`' recipe (normal draws in float32
  from a CPU generator seeded with the seed, then rounded), dY multiplied by ``dy_scale`` in
  float32 before it is rounded (what a loss scaled down and never scaled back up hands the
  backward), then moved to the device: every implementation and the oracle see the same
  rounded tensors, so the error measured is the computation's, not the inputs' rounding.
- The oracle (:func:`oracle`): FloydNet's formulation (:func:`floyd_einsum`: the
  [N, M, K] scores materialised, softmax, the two output einsums) in float64, differentiated
  by autograd, one (b, h) slice at a time. Not gradops' reference backend: that one's
  backward is the same hand-derived formulas the kernels implement (dS = P * (dP - rowsum(dY
  * Y)) and the rest), so a mistake shared by the derivation would not show; autograd
  derives the gradients of the forward alone. Float64's 2^-53 leaves the oracle's own error
  some 10^10 below the 16-bit errors it measures.
- ``gradops``: ``gradops.floyd_attention`` then ``floyd_attention_grad`` (backend="triton"),
  with ``floyd_config.STRATEGY`` forced to ``strategy`` for the call when given (None: the
  rule's choice) and restored after; ``floydnet``: FloydNet's own ``pivotal_attention`` (PyPI
  ``floydnet``) under autograd in the input dtype; ``reference``: gradops' reference backend
  in the input dtype (a control). FloydNet multiplies q by ``scale`` before its score einsums
  (default 1/sqrt(2D)), ours multiplies the scores: both are called with the same ``scale``
  (default D**-0.5), as ``bench floyd`` calls them, so both compute the same function.

On a CPU our kernels run through the Triton interpreter, whose bfloat16 ``tl.dot`` is wrong
(triton#11584): gradops widens bfloat16 tiles to float32 there, so bfloat16 numbers on a CPU
measure the storage and rounding path (inputs, halves and outputs in bfloat16, float32
accumulation), not the tensor cores' products. The interpreter also rounds float32 to
bfloat16 toward zero where a GPU (and torch) rounds to nearest even: :func:`gpu_rounding`
patches that one conversion for the run (the tests do the same, tests/interpreter_fixes.py),
so that our bfloat16 stores are not charged an error a GPU does not make.

``gradops bench floyd --accuracy`` runs :func:`compare` (:func:`main`).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, int, int, int, int, int]  # B, H, N, M, K, D
IMPLS = ("gradops", "floydnet", "reference")
TENSORS = ("Y", "dQ", "dK1", "dV1", "dK2", "dV2")
GOAL_RATIO = 0.5  # issue 32: ours <= 0.5x FloydNet eager's on each seed
DEFAULT_SHAPE: Shape = (1, 2, 64, 64, 64, 16)
DEFAULT_DTYPE = "float16"


def _dtype(dtype) -> torch.dtype:
    from .traffic import _dtype as resolve

    return resolve(dtype)


def pair_mask(b: int, n: int, k: int) -> torch.Tensor:
    """FloydNet's mask of a padded grid, ``[B,1,N,1,K]``: its models pass ``~pair_mask[:, None,
    :, None, :]`` where ``pair_mask [B,N,N]`` is 0 on padding rows and columns; here the last
    tenth of the nodes (at least one) pad, so those rows of n are masked entirely."""
    pad = max(1, n // 10)
    pair = torch.ones(b, n, k, dtype=torch.bool)
    pair[:, n - pad:, :] = False
    pair[:, :, k - min(pad, k - 1):] = False  # (a pivot stays for the rows that are not padding)
    return ~pair[:, None, :, None, :]


def draw(shape: Shape, dtype, seed: int, dy_scale: float = 1.0, masked=False, device="cpu"):
    """``(q, k1, v1, k2, v2), dy, mask`` on ``device``: ``traffic.floyd_inputs``' draws (the
    same stream: drawn in float32 from a CPU generator seeded with ``seed``), rounded to
    ``dtype``, dY multiplied by ``dy_scale`` in float32 first (scaled after rounding, a
    float16 dY times 1e-4 would be rounded twice). ``masked``: False, True (about 10% of the
    pivots removed at random) or "pair" (:func:`pair_mask`)."""
    from .traffic import floyd_inputs

    dtype = _dtype(dtype)
    inputs, dy, mask = floyd_inputs(shape, torch.float32, masked is True, seed)
    if masked == "pair":
        mask = pair_mask(shape[0], shape[2], shape[4])
    inputs = tuple(t.to(dtype).to(device) for t in inputs)
    dy = (dy * dy_scale).to(dtype).to(device)
    return inputs, dy, None if mask is None else mask.to(device)


# FloydNet's formulation (the oracle, run in float64) and FloydNet's own function (a peer); bench floyd
# times both as well
def floyd_einsum(q, k1, v1, k2, v2, mask, scale):
    scores = torch.einsum("bhnmd,bhnkd->bhnmk", q, k1) + torch.einsum("bhnmd,bhkmd->bhnmk", q, k2)
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhnmk,bhnkd->bhnmd", p, v1) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2)


def _floydnet():
    """floydnet's ``pivotal_attention``, None where floydnet does not import."""
    try:
        from floydnet.functional import pivotal_attention

        return pivotal_attention
    except Exception:
        return None


def floydnet_pivotal(q, k1, v1, k2, v2, mask, scale, inf: float = 1e9):
    """FloydNet's own function, in our argument order (its order is q, k1, k2, v1, v2); ``inf``:
    the magnitude its boolean mask writes (its default 1e9 overflows float16: 1e4 there)."""
    return _floydnet()(q, k1, k2, v1, v2, attn_mask=mask, scale=scale, inf=inf)


def oracle(inputs, dy, mask, scale: float) -> List[torch.Tensor]:
    """Y and the five gradients (dQ, dK1, dV1, dK2, dV2) in float64: FloydNet's formulation
    (:func:`floyd_einsum`) on the float64 copies of the (already rounded) inputs,
    differentiated by autograd, one (b, h) slice at a time (the float64 scores and their
    softmax of one slice, N*M*K*8 bytes each, not of the whole batch). Independent of every
    gradops backend: no gradops operator runs."""
    return float64_autograd(floyd_einsum, inputs, dy, mask, scale)


def float64_autograd(formula, inputs, dy, mask, scale: float) -> List[torch.Tensor]:
    """Y and the gradient of each of ``inputs`` in float64: ``formula(*inputs, mask, scale)``
    on the float64 copies of the inputs, differentiated by autograd, one (b, h) slice at a
    time (``mask``, [B, 1, ...], sliced along b; its heads broadcast). The oracle of
    :func:`oracle` and of ``floyd3_accuracy``; Y is shaped as ``dy``."""
    b_, h_ = inputs[0].shape[:2]
    out = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in (dy, *inputs)]
    for b in range(b_):
        for h in range(h_):
            leaves = [t[b:b + 1, h:h + 1].double().requires_grad_() for t in inputs]
            m = None if mask is None else mask[b:b + 1]
            with torch.enable_grad():
                y = formula(*leaves, m, scale)
                grads = torch.autograd.grad(y, leaves, dy[b:b + 1, h:h + 1].double())
            for i, t in enumerate([y.detach(), *grads]):
                out[i][b:b + 1, h:h + 1] = t
    return out


def run_impl(impl: str, inputs, dy, mask, scale: float, inf: float = 1e9) -> List[torch.Tensor]:
    """Y and the five gradients of one forward and its backward by ``impl`` (``IMPLS``), in
    the inputs' dtype. The strategy and the halves' bits are whatever floyd_config holds
    (:func:`errors` sets them); ``inf``: FloydNet's masked magnitude (ours and the oracle
    exclude a masked pivot exactly)."""
    import gradops

    if impl in ("gradops", "reference"):
        backend = "triton" if impl == "gradops" else "reference"
        out, mx, sm = gradops.floyd_attention(*inputs, mask, scale, backend=backend)
        return [out, *gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, scale, backend=backend)]
    if impl == "floydnet":
        if _floydnet() is None:
            raise RuntimeError("floydnet is not importable: pip install floydnet")
        leaves = [t.detach().requires_grad_() for t in inputs]
        with torch.enable_grad():
            y = floydnet_pivotal(*leaves, mask, scale, inf)
            return [y.detach(), *torch.autograd.grad(y, leaves, dy)]
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")


def relative_errors(results: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> List[float]:
    """max |x - ref| / max |ref| of each tensor (an all-zero reference: the absolute error)."""
    rel = []
    for x, ref in zip(results, reference):
        if ref.numel() == 0:
            rel.append(0.0)
            continue
        err = (x.double() - ref).abs().max().item()
        rel.append(err / (ref.abs().max().item() or 1.0))
    return rel


@contextlib.contextmanager
def forced_half_bits(bits: Optional[int]):
    """``floyd_config.HALF_BITS = bits`` (16, 24 or 32; None: the default or
    GRADOPS_FLOYD_HALF_BITS) for the block, restored after it, also on errors."""
    from ..kernels import floyd_config

    if bits is not None and bits not in (16, 24, 32):
        raise ValueError(f"half bits must be 16, 24 or 32, got {bits}")
    old = floyd_config.HALF_BITS
    floyd_config.HALF_BITS = bits
    try:
        yield
    finally:
        floyd_config.HALF_BITS = old


@contextlib.contextmanager
def gpu_rounding():
    """For the block, the Triton interpreter's float32 -> bfloat16 conversion rounds to
    nearest even, as a GPU's does, where Triton 3.x's interpreter truncates (doubling the
    worst rounding error and biasing it); nothing else of the interpreter changes, and the
    conversion is restored after. Yields how float32 -> bfloat16 rounds in the block:
    "nearest-even" (patched here, or already by tests/interpreter_fixes.py), "interpreter's
    own" (an interpreter of a shape this does not know), or None (the interpreter is off:
    compiled kernels round as the GPU does)."""
    from .._backend import triton_interpreter_on
    from ..kernels._interpreter import round_bfloat16_to_nearest

    if not triton_interpreter_on():
        yield None
        return
    undo = round_bfloat16_to_nearest()
    if undo is None:
        yield "interpreter's own"
        return
    try:
        yield "nearest-even"
    finally:
        undo()


def _measure(impls: Sequence[str], shape: Shape, dtype, seed: int, scale: Optional[float], dy_scale: float,
             strategy: Optional[str], masked, device, inf: float = 1e9) -> Dict[str, dict]:
    """:func:`errors` of each of ``impls`` on one draw, against one oracle."""
    from .traffic import forced_strategy, rule_strategy

    dtype = _dtype(dtype)
    inputs, dy, mask = draw(shape, dtype, seed, dy_scale, masked, device)
    scale = shape[5] ** -0.5 if scale is None else float(scale)
    reference = oracle(inputs, dy, mask, scale)
    found = {}
    for impl in impls:
        start = time.perf_counter()
        ours = impl == "gradops"
        with forced_strategy(strategy if ours else None), gpu_rounding() as rounding:
            results = run_impl(impl, inputs, dy, mask, scale, inf)
            ran = rule_strategy(shape, dtype.itemsize) if ours else None
        seconds = time.perf_counter() - start
        rel = relative_errors(results, reference)
        found[impl] = {"impl": impl, "rel_errors": dict(zip(TENSORS, rel)), "max_rel_error": max(rel),
                       "worst_tensor": TENSORS[rel.index(max(rel))], "strategy": ran, "seconds": seconds,
                       "bf16_rounding": rounding if ours else None}
    return found


def errors(shape: Shape, dtype, impl: str, seed: int, scale: Optional[float] = None, dy_scale: float = 1.0,
           strategy: Optional[str] = None, masked: bool = False, device="cpu") -> dict:
    """The error against float64 of one forward and backward by ``impl`` (``IMPLS``) on the
    inputs :func:`draw` makes from ``seed``: ``{"rel_errors": {tensor: max |x - ref| / max
    |ref|} for Y, dQ, dK1, dV1, dK2, dV2, "max_rel_error", "worst_tensor", "strategy" (the
    one ours ran, else None), "seconds"}``. ``strategy`` forces ours' (one of
    ``floyd_config.STRATEGIES``; None: the rule's choice); ``scale`` defaults to D**-0.5."""
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")
    return _measure([impl], shape, dtype, seed, scale, dy_scale, strategy, masked, device)[impl]


def compare(shape: Shape, dtype, seeds: Sequence[int], strategy: Optional[str] = None, dy_scale: float = 1.0,
            half_bits: Optional[int] = None, *, scale: Optional[float] = None, masked=False,
            device="cpu", inf: float = 1e9) -> List[dict]:
    """One row per seed: ours' and FloydNet eager's :func:`errors` on the same draw against the
    same oracle, and ``ratio`` = ours' max relative error / FloydNet's (the goal: <= 0.5).
    ``half_bits`` (16, 24 or 32; None: the default) sets ``floyd_config.HALF_BITS`` for the run
    and restores it after; ``masked`` as :func:`draw`'s, ``inf`` FloydNet's masked magnitude."""
    rows = []
    with forced_half_bits(half_bits):
        for seed in seeds:
            found = _measure(("gradops", "floydnet"), shape, dtype, seed, scale, dy_scale, strategy, masked, device,
                             inf)
            ours, peer = found["gradops"], found["floydnet"]
            rows.append({"shape": dict(zip("BHNMKD", shape)), "dtype": str(_dtype(dtype)).replace("torch.", ""),
                         "seed": seed, "dy_scale": dy_scale, "masked": masked, "strategy": strategy,
                         "strategy_run": ours["strategy"], "half_bits": half_bits,
                         "ours": ours["max_rel_error"], "floydnet": peer["max_rel_error"],
                         "ratio": ours["max_rel_error"] / peer["max_rel_error"] if peer["max_rel_error"] else None,
                         "ours_rel_errors": ours["rel_errors"], "floydnet_rel_errors": peer["rel_errors"],
                         "ours_seconds": ours["seconds"], "floydnet_seconds": peer["seconds"],
                         "interpreter_bf16_rounding": ours["bf16_rounding"]})
    return rows


# ---------------------------------------------------------------------------------------------
# gradops bench floyd --accuracy
# ---------------------------------------------------------------------------------------------
QUICK_SHAPE: Shape = (1, 2, 32, 32, 32, 8)  # --quick: the default's D / N; ~12 s a seed (hybrid) in the interpreter


def _e(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3e}"


def row_line(row: dict) -> str:
    """One seed: ours' and FloydNet's max relative error (and the tensor it is on), the ratio."""
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
    worst = max(row["ours_rel_errors"], key=row["ours_rel_errors"].get)
    peer_worst = max(row["floydnet_rel_errors"], key=row["floydnet_rel_errors"].get)
    over = f"  > {GOAL_RATIO}" if _fails(row) else ""
    return (f"seed {row['seed']}: ours {_e(row['ours'])} ({worst}), floydnet {_e(row['floydnet'])} ({peer_worst}), "
            f"ratio {ratio}{over}  [{row['strategy_run']}, {row['ours_seconds']:.1f} s]")


def _fails(row: dict) -> bool:
    if row["ratio"] is None:  # FloydNet exact: ours must be too
        return row["ours"] > 0
    return row["ratio"] > GOAL_RATIO


def _header(shape: Shape, dtype: str, strategy: Optional[str], bits: Optional[int], dy_scale: float,
            masked: bool, device: str) -> str:
    how = "Triton interpreter" if device == "cpu" else "compiled"
    halves = "" if bits is None else f", halves {bits} bits"
    return (f"Floyd max relative error vs float64 (Y, dQ, dK1, dV1, dK2, dV2), B,H,N,M,K,D = "
            f"{','.join(map(str, shape))}, {dtype}, dY x {dy_scale:g}{', masked' if masked else ''}: ours "
            f"(triton, {how}, strategy {strategy or 'the rule'}{halves}) against FloydNet eager")


def main(args) -> int:
    """``gradops bench floyd --accuracy``: :func:`compare` for each --shape (default
    :data:`DEFAULT_SHAPE`, :data:`QUICK_SHAPE` with --quick), --dtype (default float16) and
    --strategy (default the rule's choice) over seeds 0 .. --seeds - 1, with --dy-scale and
    --half-bits; a line per seed, the worst ratio, and the rows as JSON where the bench's
    results go (--out, --tag). On a CPU (the default without a GPU) it switches the Triton
    interpreter on itself, before triton is imported. Exit status 1 when some seed's ratio
    exceeds :data:`GOAL_RATIO` (each is named), 2 when it cannot run."""
    from . import harness
    from ..selftest import use_interpreter_on_cpu

    device = args.device = args.device or harness.default_device()
    if device == "cpu":
        use_interpreter_on_cpu("cpu")
    from ..kernels import floyd_config

    strategies = args.strategy or [None]
    unknown = [s for s in strategies if s is not None and s not in floyd_config.STRATEGIES]
    if unknown:
        print(f"gradops bench floyd: unknown strategy {', '.join(unknown)}; expected one of "
              f"{', '.join(floyd_config.STRATEGIES)}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("gradops bench floyd: --seeds must be at least 1", file=sys.stderr)
        return 2
    seeds = list(range(args.seeds))
    bits = args.half_bits
    rows: List[dict] = []
    start = time.perf_counter()
    try:
        for shape in args.shape or [QUICK_SHAPE if args.quick else DEFAULT_SHAPE]:
            for dtype in args.dtypes or [DEFAULT_DTYPE]:
                for strategy in strategies:
                    print(_header(shape, dtype, strategy, bits, args.dy_scale, args.mask, device), flush=True)
                    if device == "cpu" and dtype == "bfloat16":
                        print("note: on a CPU, bfloat16 tiles are widened to float32 (the interpreter's bf16 tl.dot "
                              "is wrong, triton#11584): the storage and rounding path, not tensor-core products",
                              flush=True)
                    for seed in seeds:  # a seed at a time: its line printed as it comes
                        row = compare(shape, dtype, [seed], strategy, args.dy_scale, bits, scale=args.scale,
                                      masked=args.mask, device=device)[0]
                        rows.append(row)
                        print(row_line(row), flush=True)
    except Exception as e:  # no interpreter, no floydnet, a strategy that cannot take the case
        print(f"gradops bench floyd --accuracy: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    ratios = [r for r in rows if r["ratio"] is not None]
    if ratios:
        worst = max(ratios, key=lambda r: r["ratio"])
        print(f"worst ratio {worst['ratio']:.3f} (seed {worst['seed']}, {worst['dtype']}, strategy "
              f"{worst['strategy_run']}); goal <= {GOAL_RATIO}; {seconds:.0f} s")
    write_json(args, "floyd-accuracy", {
        "benchmark": "gradops bench floyd --accuracy", "meta": harness.device_info(device), "goal_ratio": GOAL_RATIO,
        "seconds": seconds,
        "oracle": "FloydNet's formulation (bench.floyd_accuracy.floyd_einsum) in float64 under autograd", "rows": rows})
    failed = [r for r in rows if _fails(r)]
    for r in failed:
        ratio = "- (FloydNet exact, ours not)" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"over the goal: seed {r['seed']} ({r['dtype']}, strategy {r['strategy_run']}, dY x {r['dy_scale']:g}): "
              f"ratio {ratio} > {GOAL_RATIO}", file=sys.stderr)
    return int(bool(failed))


def write_json(args, prefix: str, data: dict) -> str:
    """Write ``data`` as ``<--tag or prefix-<UTC time>>.json`` where the bench's results go
    (``harness.output_dir``: --out, else the scratch folder on a CPU), print the path, return it."""
    from . import harness

    out, why = harness.output_dir(args)
    stem = args.tag or f"{prefix}-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = os.path.join(out, stem + ".json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}" + (f" ({why})" if why else ""))
    return path
