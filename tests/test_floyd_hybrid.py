"""The hybrid strategy of the Triton Floyd attention backend (gradops/kernels/floyd_hybrid.py):
the n-side half of every score on chip, the m-side half through memory (24 bits by default
for 16-bit inputs, float32 or 16 bits where set). Its own tests (launches, the workspace, the
halves, the mask, compiles); what it promises alike with the chunked strategy is tested for
both in tests/test_floyd_memory_strategies.py.

On CPU its row kernels and GEMMs run through the Triton interpreter (bfloat16 tiles widened to
float32 as they are loaded, the interpreter's bf16 tl.dot being wrong). The oracle is the
float64 autograd one of tests/test_kernels_floyd.py (FloydNet's einsum formulation
differentiated by autograd, independent of every strategy), with its tolerances;
``floyd_config.STRATEGY`` forces the strategy, and a spy checks that the hybrid launchers
really ran. ``floyd_config.CHUNK_BUDGET_BYTES`` shrinks the chunks:
``hybrid_pair_bytes(K, D, dtype) * pairs`` bytes give chunks of ``pairs`` (n, m) rows.
"""
import math
import struct

import pytest
import torch

triton = pytest.importorskip("triton")
kernels = pytest.importorskip("gradops.kernels.floyd_attention")

from gradops.kernels import floyd_config as config
from gradops.kernels import floyd_strategy
from gradops.kernels import floyd_gemm
from gradops.kernels import floyd_hybrid as hybrid
from helpers import record_launches
from memory_harness import Allocations
from test_floyd_memory_strategies import check_against_oracle
from test_kernels_floyd import TOL, make_inputs, oracle, run_kernels

SCALE = 0.37


class Spy:
    """Which launchers ran (hybrid, chunked), and every chunk plan the hybrid launchers made."""

    def __init__(self):
        self.launches = []
        self.plans = []


@pytest.fixture
def spy(monkeypatch):
    """The hybrid strategy forced (default budget), its launchers and planner recorded, and the
    chunked launchers too (the fallback past the widest head)."""
    from gradops.kernels import floyd_chunked

    monkeypatch.setattr(config, "STRATEGY", "hybrid")
    monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)
    monkeypatch.delenv("GRADOPS_FLOYD_HALF_BITS", raising=False)
    seen = Spy()
    real_plan = hybrid.strategy_plan

    def plan(*args, **kwargs):
        result = real_plan(*args, **kwargs)
        seen.plans.append((args, result))
        return result

    monkeypatch.setattr(hybrid, "strategy_plan", plan)

    def recorded(name, real):
        def launcher(*args, **kwargs):
            seen.launches.append(name)
            return real(*args, **kwargs)
        return launcher

    for module, prefix in ((hybrid, ""), (floyd_chunked, "chunked ")):
        for name in ("forward", "backward"):
            monkeypatch.setattr(module, name, recorded(prefix + name, getattr(module, name)))
    return seen


def run_hybrid(spy, inputs, dy, mask, scale=SCALE):
    """(out, max, sum, grads) by the kernels' entry points; asserts the hybrid path ran both."""
    before = len(spy.launches)
    result = run_kernels(inputs, dy, mask, scale)
    assert spy.launches[before:] == ["forward", "backward"]
    return result


def pairs_budget(pairs, k, dtype, d):
    """A CHUNK_BUDGET_BYTES that gives chunks of ``pairs`` (n, m) rows of K pivots, head dim D."""
    return config.hybrid_pair_bytes(k, d, dtype) * pairs


# ---------------------------------------------------------------------------------------------
# Against the float64 oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_head_dim_past_the_widest_runs_chunked(spy, dtype, device):
    """D = 300: the row kernels hold a whole head and stop at HYBRID_MAX_HEAD_DIM, so even a
    forced hybrid strategy gives the call to the chunked one."""
    b, h, n, m, k, d = 1, 2, 3, 4, 5, 300
    assert floyd_strategy.strategy(b, h, n, m, k, d, dtype.itemsize) == "chunked"
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "full_rows")
    result = run_kernels(inputs, dy, mask, SCALE)
    assert spy.launches == ["chunked forward", "chunked backward"]
    check_against_oracle(result, inputs, dy, mask, dtype)


# K past the row kernels' BLOCK_K (at most 64): the pivots are walked in several steps, the
# softmax online across them (first sweep), Dr summed over them.


# ---------------------------------------------------------------------------------------------
# Launches, and the workspace: the two halves of a chunk, P and dS written over them
# ---------------------------------------------------------------------------------------------
ROW_KERNELS = {"_rows_forward", "_rows_backward"}


def _names(launches, since=0):
    return [fn.__name__ for fn, _, _ in launches[since:]]


@pytest.mark.parametrize("budget_pairs", [None, 40], ids=["one_chunk", "chunks_of_40"])
def test_launches_per_chunk(spy, monkeypatch, budget_pairs, device):
    """3 launches per chunk forward (S2; the row kernel; Y), 4 backward (S2 and dP2 in one; the
    row kernel; dQ, dK2, dV2 in one; dK1, dV1 in one): no Python loop over slices, rows or
    pivots, no elementwise pass of its own."""
    b, h, n, m, k, d = 2, 1, 9, 8, 13, 16
    if budget_pairs is not None:
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(budget_pairs, k, torch.float16, d))
    launches = record_launches(monkeypatch)
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float16, device, "random")
    out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
    chunks = spy.plans[0][1].count(b * h, n, m)
    assert chunks == (1 if budget_pairs is None else 2 * 2 * 2)  # tiles of 6 x 6 rows
    assert _names(launches) == ["_gemm_kernel", "_rows_forward", "_gemm_kernel"] * chunks
    before = len(launches)
    grads = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    assert _names(launches, before) == ["_gemm_kernel", "_rows_backward", "_gemm_kernel", "_gemm_kernel"] * chunks
    products = [kwargs["PRODUCTS"] for fn, _, kwargs in launches[before:] if fn.__name__ == "_gemm_kernel"]
    assert products == [2, 3, 2] * chunks
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, torch.float16)


def _mask_layouts(mask):
    """The same mask values in four layouts: contiguous and broadcast over the batch from one
    row (every pivot row's bytes contiguous and 4-byte aligned, K a multiple of 4: read as
    words), pivots 2 bytes apart, and shifted one byte off the allocation's alignment (both
    read as bytes). ``mask``'s batch entries are all its first's."""
    b, _, n, _, k = mask.shape
    spread = torch.zeros(b, 1, n, 1, 2 * k, dtype=torch.bool, device=mask.device)
    spread[..., ::2] = mask
    shifted = torch.zeros(mask.numel() + 1, dtype=torch.bool, device=mask.device)[1:].view(mask.shape)
    shifted.copy_(mask)
    return {"words": mask.contiguous(), "broadcast": mask[:1].expand_as(mask), "strided": spread[..., ::2],
            "unaligned": shifted}


def test_mask_read_as_words_or_bytes_alike(spy, monkeypatch, device):
    """A mask whose pivot rows are contiguous and 4-byte aligned (K a multiple of 4) reaches
    the row kernels as 4-byte words (MASK_WORDS, which the pipeliner copies ahead), a broadcast
    batch stride included, any other as bytes: the results bitwise the same, and the oracle's.
    K = 132 takes three steps of pivots (the words of a later step at their offset) and a
    short last one."""
    inputs, dy, mask = make_inputs(2, 1, 4, 3, 132, 16, torch.float16, device, "full_rows")
    mask = mask[:1].expand_as(mask).clone()
    assert config.hybrid_config(16, torch.float16)["BLOCK_K"] * 2 < 132
    launches = record_launches(monkeypatch)
    results = {}
    for name, layout in _mask_layouts(mask).items():
        assert torch.equal(layout, mask)
        before = len(launches)
        results[name] = run_hybrid(spy, inputs, dy, layout)
        words = {kwargs["MASK_WORDS"] for fn, _, kwargs in launches[before:] if fn.__name__.startswith("_rows")}
        assert words == {name in ("words", "broadcast")}, (name, words)
    check_against_oracle(results["words"], inputs, dy, mask, torch.float16, SCALE)
    flat = {name: [r[0], r[1], r[2], *r[3]] for name, r in results.items()}
    for name in ("broadcast", "strided", "unaligned"):
        assert all(torch.equal(a, b) for a, b in zip(flat[name], flat["words"])), name
    _, _, odd_mask = make_inputs(1, 1, 3, 4, 42, 16, torch.float16, device, "random")
    stride_b, stride_n, stride_k = odd_mask.stride(0), odd_mask.stride(2), odd_mask.stride(4)
    assert not hybrid.mask_words(odd_mask, (stride_b, stride_n, stride_k), True, 42)  # K % 4: bytes


# B*H = 1, N = 12, M = 10: 2 x 2 chunks of 6 x 5 (n, m) rows, no tails, so that every score-sized
# buffer has the same number of elements; D = 1 so that nothing else comes near that size.
MEMORY_SHAPE, MEMORY_PAIRS = (1, 1, 12, 10, 48, 1), 30


@pytest.mark.parametrize("launcher,dtype,bits", [("forward", torch.float16, 32), ("backward", torch.float16, 32),
                                                ("backward", torch.float16, 24), ("backward", torch.float32, 32)],
                         ids=str)
def test_workspace_is_one_chunks_halves(spy, monkeypatch, launcher, dtype, bits, device):
    """The score-sized buffers held at once are one chunk's m-side halves (forward S2, backward
    S2 and dP2), float32 or 24 bits (a 16-bit and an 8-bit plane), P and dS written over them:
    nothing else of the chunk's scores, nothing of B*H*N*M*K."""
    monkeypatch.setattr(config, "HALF_BITS", bits)
    b, h, n, m, k, d = MEMORY_SHAPE
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(MEMORY_PAIRS, k, dtype, d))
    plan = config.plan_rows(b * h, n, m, config.hybrid_pair_bytes(k, d, dtype), config.CHUNK_BUDGET_BYTES)
    assert plan.groups == 1 and (plan.block_n, plan.block_m) == (6, 5)
    inputs, dy, mask = make_inputs(*MEMORY_SHAPE, dtype, device, "random")
    chunk_scores = plan.block_n * plan.block_m * k
    halves = 1 if launcher == "forward" else 2
    held = halves * chunk_scores * bits // 8
    assert held <= config.CHUNK_BUDGET_BYTES
    if launcher == "forward":
        with Allocations(*inputs, mask, watch=chunk_scores) as seen:
            out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
        outputs = sum(t.untyped_storage().nbytes() for t in (out, mx, sm))
    else:
        out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
        with Allocations(*inputs, dy, mask, out, mx, sm, watch=chunk_scores) as seen:
            grads = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
        outputs = sum(g.untyped_storage().nbytes() for g in grads)
    assert seen.watched_peak == held, (seen.watched_peak, held)
    assert seen.largest < b * h * n * m * k
    # beyond the outputs: the halves, the float32 partial Y1 or dQ1 of a chunk and, where a sum
    # spans chunks, the float32 dK1/dV1 (one n range) and dK2/dV2 (every m) sums
    linear = 4 * (plan.block_n * plan.block_m + 2 * plan.block_n * k + 2 * k * m) * d
    assert seen.peak - outputs <= held + linear, (seen.peak, outputs, held, linear)


# ---------------------------------------------------------------------------------------------
# The halves in 24 (or 16) bits
# ---------------------------------------------------------------------------------------------
def _round_bits(x: float, bits: int) -> float:
    """``x`` (a float32) rounded to nearest, ties to even, at its top ``bits`` bits, by integer
    arithmetic on its IEEE-754 pattern in Python: the oracle of the GEMM's rounding."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    if math.isnan(x):
        return x
    drop = 32 - bits
    keep, rest = u >> drop, u & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    if rest > half or (rest == half and keep & 1):
        keep += 1
    return struct.unpack("<f", struct.pack("<I", (keep << drop) & 0xFFFFFFFF))[0]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf and NaN through the dot
@pytest.mark.parametrize("bits", [24, 16])
def test_halves_round_to_nearest_even(bits, device):
    """A float32 result stored in ``bits`` bits (floyd_gemm: the top 16 bits in an int16 plane,
    for 24 the next 8 in a uint8 one) and read back: rounded to nearest, ties to even, as the
    integer oracle above; infinities and signed zeros kept, a NaN still NaN, a finite value
    past the largest rounding to infinity (as IEEE), subnormals and float32's extremes kept
    in range (no underflow: the exponent is float32's)."""
    gen = torch.Generator().manual_seed(5)
    special = [0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), float("nan"), 3.4028234663852886e38,
               -3.4028234663852886e38, 1.1754943508222875e-38, 1e-40, -1e-45, 1e-4, 6.1e-5,
               1 + 2 ** -16, 1 + 3 * 2 ** -17, 1 + 2 ** -17, 1 + 2 ** -8, 1 + 3 * 2 ** -9, 65504.0]
    values = torch.tensor(special, dtype=torch.float32, device="cpu")
    values = torch.cat([values, torch.randn(300, generator=gen, device="cpu") * 10.0 ** torch.randint(
        -30, 30, (300,), generator=gen, device="cpu").float()]).to(device)
    r = values.numel()
    a = values.view(1, 1, r, 1)
    b = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=device)  # a @ b = a, exactly
    hi = torch.empty(1, 1, r, 1, dtype=torch.int16, device=device)
    lo = torch.zeros(1, 1, r, 1, dtype=torch.uint8, device=device)
    floyd_gemm.gemm(floyd_gemm.Product(a, b, hi, lo=lo if bits == 24 else None), half_bits=bits)
    pattern = (hi.view(-1).cpu().to(torch.int32) & 0xFFFF) << 16
    if bits == 24:
        pattern |= lo.view(-1).cpu().to(torch.int32) << 8
    got = pattern.view(torch.float32)
    for x, y in zip(values.cpu().tolist(), got.tolist()):
        want = _round_bits(x + 0.0, bits)  # the GEMM's sum starts from +0: -0.0 comes out +0.0
        if math.isnan(want):
            assert math.isnan(y), x
        else:
            assert y == want and math.copysign(1, y) == math.copysign(1, want), (x, y, want)
    if bits == 16:  # and a bfloat16 is exactly that: torch's own rounding agrees
        finite = torch.isfinite(values.cpu())
        assert torch.equal(got[finite], values.cpu()[finite].to(torch.bfloat16).float())


def _errors(result, inputs, dy, mask, scale):
    out, _, _, grads = result
    y_ref, _, _, grads_ref = oracle(inputs, dy, mask, scale)
    return [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip([out, *grads], [y_ref, *grads_ref])]


def test_half_formats_and_what_they_cost_in_accuracy(spy, monkeypatch, device):
    """HALF_BITS = 32, 24 or 16 (or GRADOPS_FLOYD_HALF_BITS) for 16-bit inputs, 24 unless set:
    24 bits within the float16 tolerance of the oracle on a float16 problem, further from it
    than float32 halves (its statistics above all: the halves' rounding reaches the softmax
    sums); 16 bits (bfloat16 halves) for bfloat16 inputs only, within their tolerance and
    further than 24; float16 inputs keep 24 bits then, float32 inputs 32 always."""
    monkeypatch.setattr(config, "HALF_BITS", None)
    monkeypatch.delenv("GRADOPS_FLOYD_HALF_BITS", raising=False)
    assert config.half_bits(torch.float16) == config.half_bits(torch.bfloat16) == 24
    assert config.half_bits(torch.float32) == 32
    shape = (1, 2, 12, 10, 40, 32)
    errors = {}
    for dtype, settings in ((torch.float16, (32, 24)), (torch.bfloat16, (24, 16))):
        inputs, dy, mask = make_inputs(*shape, dtype, device, "random")
        _, mx_ref, sm_ref, _ = oracle(inputs, dy, mask, 0.25)
        for bits in settings:
            monkeypatch.setenv("GRADOPS_FLOYD_HALF_BITS", str(bits))
            assert config.half_bits(dtype) == bits and config.half_bits(torch.float32) == 32
            result = run_hybrid(spy, inputs, dy, mask, 0.25)
            sums = ((result[2].double() - sm_ref).abs() / sm_ref).max().item()
            errors[dtype, bits] = (max(_errors(result, inputs, dy, mask, 0.25)), sums)
    assert errors[torch.float16, 32][0] <= TOL[torch.float16] and errors[torch.float16, 24][0] <= TOL[torch.float16]
    assert errors[torch.float16, 32][1] < errors[torch.float16, 24][1] < 1e-4, errors
    assert errors[torch.float16, 32][0] <= errors[torch.float16, 24][0], errors
    assert errors[torch.bfloat16, 16][0] <= TOL[torch.bfloat16] and errors[torch.bfloat16, 24][1] < errors[
        torch.bfloat16, 16][1], errors
    monkeypatch.setenv("GRADOPS_FLOYD_HALF_BITS", "16")
    assert config.half_bits(torch.float16) == 24 and config.half_bits(torch.bfloat16) == 16
    monkeypatch.setenv("GRADOPS_FLOYD_HALF_BITS", "20")
    with pytest.raises(ValueError, match="16, 24 or 32"):
        config.half_bits(torch.float16)


def test_small_gradients_do_not_underflow_in_the_halves(spy, device):
    """bfloat16 training without loss scaling: dY scaled by 1e-4 (dP2 then ~1e-3, its products
    smaller still) gives the same relative error against float64 as dY itself: the halves
    keep float32's exponent range, nothing flushes to zero."""
    shape = (1, 2, 9, 8, 24, 16)
    inputs, dy, mask = make_inputs(*shape, torch.bfloat16, device, "random")
    small = (dy.float() * 1e-4).to(torch.bfloat16)
    plain = _errors(run_hybrid(spy, inputs, dy, mask, 0.25), inputs, dy, mask, 0.25)
    scaled = _errors(run_hybrid(spy, inputs, small, mask, 0.25), inputs, small, mask, 0.25)
    assert max(scaled[1:]) <= TOL[torch.bfloat16]
    for a, b_ in zip(plain[1:], scaled[1:]):
        assert b_ <= 2 * a + 1e-3, (plain, scaled)


# ---------------------------------------------------------------------------------------------
# The plan and the tiles (no kernels)
# ---------------------------------------------------------------------------------------------


def test_pair_bytes_and_tiles():
    """A chunk's (n, m) row holds its two halves (3 bytes a score each by default for 16-bit
    inputs, 4 with float32 halves or inputs) and its float32 partial dQ1; every padded head dim
    up to HYBRID_MAX_HEAD_DIM has a tile, as wide as tl.dot needs (16) and a power of two."""
    assert config.hybrid_pair_bytes(512, 128, torch.bfloat16) == 2 * 512 * 3 + 4 * 128
    assert config.hybrid_pair_bytes(512, 128, torch.float32) == 2 * 512 * 4 + 4 * 128
    config.HALF_BITS = 32
    try:
        assert config.hybrid_pair_bytes(512, 128, torch.bfloat16) == 2 * 512 * 4 + 4 * 128
    finally:
        config.HALF_BITS = None
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (1, 15, 16, 17, 64, 100, 128, 200, 256):
            cfg = config.hybrid_config(d, dtype)
            assert cfg["BLOCK_D"] == config.padded_head_dim(d) and cfg["enable_fp_fusion"] is False
            for key in ("BLOCK_M", "BLOCK_K"):
                assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0
        with pytest.raises(ValueError, match="head dims up to"):
            config.hybrid_config(257, dtype)


def test_h100_plan_at_the_headline_shape(monkeypatch):
    """B = 1, H = 8, N = M = K = 512, D = 128 bf16 on an H100 (81559 MiB): one slice per chunk
    (8 chunks: 24 launches forward, 32 backward, 56 per step), and the forward + backward's
    peak from the plan: inputs, Y and the five gradients (5.5 GiB) plus one chunk's workspace
    (0.875 GiB with the default 24-bit halves) and the statistics, 6.39 GiB; beyond the inputs
    (what a benchmark's peak counts) 3.89 GiB, under half of what torch.compile(FloydNet)
    peaked at there (9 GiB)."""
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", None)
    monkeypatch.delenv("GRADOPS_FLOYD_HALF_BITS", raising=False)
    monkeypatch.setattr(config, "HALF_BITS", None)
    h100 = 81559 << 20
    bh, n, k, d = 8, 512, 512, 128
    pair = config.hybrid_pair_bytes(k, d, torch.bfloat16)
    plan = config.plan_rows(bh, n, n, pair, config.chunk_budget(h100, bh * n * n * pair, False))
    assert plan == config.ChunkPlan(1, n, n) and plan.count(bh, n, n) == 8
    assert 7 * plan.count(bh, n, n) <= 64
    tensor = bh * n * n * d * 2  # every input, Y and each gradient: 0.5 GiB
    workspace = plan.groups * n * n * pair
    stats = 2 * bh * n * n * 4
    peak = 11 * tensor + workspace + stats
    assert peak < 6.4 * 2 ** 30 and peak - 5 * tensor < 4.5 * 2 ** 30


# ---------------------------------------------------------------------------------------------
# Compiled for an H100 (sm_90) without a GPU
# ---------------------------------------------------------------------------------------------
_HYBRID_SM90 = r"""
import inspect, json, sys, torch, triton
from gradops.bench.floyd import compile_check_hybrid
from gradops.kernels import floyd_hybrid

# where the score (and dP) dot is: the one tl.dot of _half_products, every sweep of both kernels
source, first = inspect.getsourcelines(floyd_hybrid._half_products.fn)
line = first + next(i for i, text in enumerate(source) if "tl.dot(" in text)
half_dot = f'floyd_hybrid.py":{line}:'
for case in sys.argv[1:]:
    dtype_name, head_dim = case.split(":")
    del compiled[:]
    rows = compile_check_hybrid(getattr(torch, dtype_name), int(head_dim))
    assert len(compiled) == len(rows)
    for row, kernel in zip(rows, compiled):
        if kernel is not None:
            dots = _dot_locations(kernel.asm["ttgir"])
            row["dots"] = _dot_lowerings(kernel.asm["ttgir"], list(dict.fromkeys(dots.values())))
            row["score_dots"] = _dot_lowerings(kernel.asm["ttgir"], [w for w in dots.values() if half_dot in w])
        print(json.dumps(row), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("triton_version", ["installed", "3.6"])
def test_row_kernels_compile_for_sm90_on_tensor_cores_without_spills(triton_version):
    """Both row kernels, as floyd_config.hybrid_config ships them, for an H100: in bfloat16 and
    float16 at D = 32, 64, 128 every dot (the D- and K-contractions: S1, dP1, Y1, dQ1) on
    tensor cores (wgmma or mma, no dot lowered to FMA, no float32 FMA anywhere: the kernels run
    without contraction), no register spill, shared memory within the H100's; float32 (IEEE
    FMA dots) compiles too. And every score and dP dot (the one tl.dot of ``_half_products``:
    two sweeps of the forward, S and dP in two sweeps of the backward) is lowered alike in
    both kernels: the backward recomputes the forward's scores bitwise, which a one-hot P's
    exact zeros rest on. And every sweep is software-pipelined: no barrier in a loop, no load
    inside one that waits where it stands (the halves, the K1/V1 tiles and the mask's words
    are copied asynchronously, steps ahead)."""
    import inspect
    import json
    import os

    import triton

    from helpers import RECORD_COMPILES, run_sm90_compile
    from test_kernels_floyd import H100_SHARED, _dot_locations, _dot_lowerings

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip("triton's bundled CUDA tools are not installed")
    cases = ("bfloat16:32", "bfloat16:64", "bfloat16:128", "float16:128", "float32:64")
    if triton_version == "3.6":
        cases = ("bfloat16:128",)
    script = RECORD_COMPILES + "".join(inspect.getsource(f) for f in (_dot_locations, _dot_lowerings)) + _HYBRID_SM90
    stdout = run_sm90_compile(script, *cases, timeout=900, triton_version=triton_version)
    rows = [json.loads(line) for line in stdout.splitlines()]
    print("\n".join(map(json.dumps, rows)))
    assert len(rows) == 2 * len(cases)
    lowered = {}
    for row in rows:
        assert "error" not in row, row
        assert row["shared"] <= H100_SHARED and row["spill_loads"] == row["spill_stores"] == 0, row
        assert len(row["score_dots"]) == (2 if row["kernel"] == "hybrid_fwd" else 4), row
        assert row["loop_barriers"] == row["loop_loads"] == 0 and row["loop_async_copies"] > 0, row
        assert not {"missing", "ambiguous"} & set(row["dots"]), row
        if row["dtype"] != "float32":
            assert row["fma_f32"] == 0 and row["wgmma"] > 0, row
            assert all(" mma v" in dot for dot in row["dots"]), row
        lowered.setdefault((row["dtype"], row["D"]), set()).update(row["score_dots"])
    for case, kinds in lowered.items():
        assert len(kinds) == 1, (case, kinds)


def _specialisation(fn, bound, options):
    """What Triton's JIT compiles a launch for, as far as the arguments show it: the kernel,
    its constexprs and launch options, each tensor's dtype and 16-byte alignment, each
    integer's being 1 (then a constant) and a multiple of 16, but for the integers the row
    kernels do not specialise (floyd_hybrid.NOT_SPECIALISED)."""
    key = [fn.__name__, tuple(sorted(options.items()))]
    skip = hybrid.NOT_SPECIALISED if fn.__name__ in ROW_KERNELS else ()
    for name, value in bound.items():
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool) and name not in skip:
            key.append((name, value == 1, value % 16 == 0))
    return tuple(key)


@pytest.mark.parametrize("split", [False, True], ids=["one_chunk", "rows_of_16"])
def test_few_kernel_specialisations_per_step(spy, monkeypatch, split, device):
    """A user's first step compiles what it launches: a hybrid forward + backward launches the
    two row kernels and four kinds of GEMM launch (S2; Y; S2 and dP2; the m-side three; the
    n-side two: five), 7 specialisations however many chunks; N split into rows of 16 (dK2/dV2
    summed across chunks in float32: the m-side launch's first and last chunks) with a tail of
    4 rows adds at most 2 + 4 (the GEMMs whose sizes or batch strides the tail
    changes); the row kernels never specialise a chunk's sizes."""
    b, h, n, m, k, d = 1, 2, 20, 12, 16, 32
    if split:
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(16 * m, k, torch.float16, d))
    launches = record_launches(monkeypatch)
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float16, device, "random")
    out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
    kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    chunks = spy.plans[0][1].count(b * h, n, m)
    assert chunks == (4 if split else 1)
    assert len(launches) == 7 * chunks
    kinds = {_specialisation(*launch) for launch in launches}
    rows = {kind for kind in kinds if kind[0] in ROW_KERNELS}
    assert len(rows) == 2, rows
    assert len(kinds) <= (7 + 2 + 4 if split else 7), sorted(map(str, kinds))
