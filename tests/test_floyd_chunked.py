"""The chunked strategy of the Triton Floyd attention backend (gradops/kernels/floyd_chunked.py):
its own tests (row tiles, launches, compiles, memory, the plan and the budget). What it promises
alike with the hybrid strategy (the float64 oracle, chunks, exact zeros, layouts, determinism,
NaN) is tested for both in tests/test_floyd_memory_strategies.py; the rule in
tests/test_floyd_roofline.py.

On CPU the GEMM and row kernels run through the Triton interpreter (bfloat16 tiles widened
to float32 as they are loaded, the interpreter's bf16 tl.dot being wrong): tiny shapes,
tails on every axis. ``floyd_config.STRATEGY`` forces the strategy, and a spy checks that the
chunked launchers really ran. ``floyd_config.CHUNK_BUDGET_BYTES`` shrinks the chunks:
``pair_bytes(K, D, element_size) * pairs`` bytes give chunks of ``pairs`` (n, m) rows.
"""
import itertools
import random

import pytest
import torch

import gradops
from gradops import oracles

triton = pytest.importorskip("triton")
kernels = pytest.importorskip("gradops.kernels.floyd_attention")

from gradops.kernels import floyd_chunked as chunked
from gradops.kernels import floyd_config as config
from gradops.kernels import floyd_strategy
from helpers import raises_status, record_launches
from memory_harness import Allocations
from test_floyd_memory_strategies import check_against_oracle
from test_kernels_floyd import make_inputs, run_kernels

SCALE = 0.37


class Spy:
    """Which chunked launchers ran, and every chunk plan they made (arguments and result)."""

    def __init__(self):
        self.launches = []
        self.plans = []


@pytest.fixture
def spy(monkeypatch):
    """The chunked strategy forced (default budget), its launchers and planner recorded."""
    monkeypatch.setattr(config, "STRATEGY", "chunked")
    monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)
    seen = Spy()
    real_plan = chunked.strategy_plan

    def plan(*args, **kwargs):
        result = real_plan(*args, **kwargs)
        seen.plans.append((args, kwargs, result))
        return result

    monkeypatch.setattr(chunked, "strategy_plan", plan)
    def recorded(name, real):
        def launcher(*args, **kwargs):
            seen.launches.append(name)
            return real(*args, **kwargs)
        return launcher

    for name in ("forward", "backward"):
        monkeypatch.setattr(chunked, name, recorded(name, getattr(chunked, name)))
    return seen


def run_chunked(spy, inputs, dy, mask, scale=SCALE):
    """(out, max, sum, grads) by the kernels' entry points; asserts the chunked path ran both."""
    before = len(spy.launches)
    result = run_kernels(inputs, dy, mask, scale)
    assert spy.launches[before:] == ["forward", "backward"]
    return result


def pairs_budget(pairs, k, dtype, d):
    """A CHUNK_BUDGET_BYTES that gives chunks of ``pairs`` (n, m) rows of K pivots, head dim D."""
    return config.pair_bytes(k, d, dtype.itemsize) * pairs


# ---------------------------------------------------------------------------------------------
# Against the float64 oracle (the rest of the oracle tests, shared with the hybrid strategy:
# tests/test_floyd_memory_strategies.py)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def small_row_tiles(monkeypatch):
    """Row-kernel tiles of 256 pivots (ROW_ELEMENTS), so that a few hundred pivots take
    several tiles: the path K > 2048 takes, at interpreter cost a tenth of it."""
    monkeypatch.setattr(config, "ROW_ELEMENTS", 256)
    config.row_config.cache_clear()
    yield 256
    config.row_config.cache_clear()  # monkeypatch restores ROW_ELEMENTS after this


# K past the row kernels' BLOCK_K: the softmax and dS walk the pivots in tiles (online max and
# sum, Dr summed over tiles), which shorter rows never do; K = 129 is one tile of 256 pivots,
# 127 of them dead; K = 2100 is past the real tile of 2048.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("k", [129, 300, 2100])
def test_pivots_past_one_row_block(spy, request, k, dtype, device):
    if k < 2048:
        request.getfixturevalue("small_row_tiles")
    elif dtype == torch.float32 and device == "cpu":
        pytest.skip("the real 2048-pivot tiles once, in float16 (the interpreter's cost)")
    shape = (1, 2, 2, 3, k, 4)
    assert config.row_config(k)["ONE_TILE"] == (k <= config.ROW_ELEMENTS) == (k == 129)
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    check_against_oracle(run_chunked(spy, inputs, dy, mask), inputs, dy, mask, dtype)


# ---------------------------------------------------------------------------------------------
# Launches: a few GEMMs per chunk, and only as many chunks as the memory bound forces
# ---------------------------------------------------------------------------------------------
def _count(launches, since=0):
    """(GEMM launches, row-kernel launches) among ``launches[since:]``; nothing else runs."""
    names = [fn.__name__ for fn, _, _ in launches[since:]]
    assert set(names) <= {"_gemm_kernel", "_softmax_rows", "_grad_rows"}, names
    return names.count("_gemm_kernel"), len(names) - names.count("_gemm_kernel")


@pytest.mark.parametrize("shape", [(2, 1, 17, 20, 5, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_count_does_not_grow_with_the_problem(spy, monkeypatch, shape, device):
    """With the budget from the device's memory these problems are one chunk: the forward
    launches 4 GEMMs and 1 row kernel, the backward 10 and 1, at every N, M, K, B*H (no
    Python loop over slices, rows or pivots, no elementwise pass of its own)."""
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", None)
    launches = record_launches(monkeypatch)
    inputs, dy, mask = make_inputs(*shape, torch.float16, device, "random")
    out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
    assert _count(launches) == (4, 1)
    before = len(launches)
    grads = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    assert _count(launches, before) == (10, 1)
    assert spy.plans[0][2].count(shape[0] * shape[1], shape[2], shape[3]) == 1
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, torch.float16)


@pytest.mark.parametrize("rows", [40])
def test_gemm_count_grows_only_with_the_chunks_the_budget_forces(spy, monkeypatch, rows, device):
    """A budget of ``rows`` rows of n (every m and pivot): 14 GEMMs and 2 row kernels per
    chunk, forward + backward, and no more chunks than twice the fewest the budget allows
    (rows are rounded down to multiples of 16 past 32)."""
    b, h, n, m, k, d = 1, 2, 64, 8, 8, 16
    budget = pairs_budget(rows * m, k, torch.float16, d)
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", budget)
    launches = record_launches(monkeypatch)
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float16, device, "random")
    out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
    fwd = _count(launches)
    before = len(launches)
    grads = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    chunks = spy.plans[0][2].count(b * h, n, m)
    fewest = -(-b * h * n * m * config.pair_bytes(k, d, 2) // budget)
    assert fewest <= chunks <= 2 * fewest and spy.plans[0][2].block_m == m
    assert fwd == (4 * chunks, chunks) and _count(launches, before) == (10 * chunks, chunks)
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, torch.float16)


def _specialisation(fn, bound, options):
    """What Triton's JIT compiles a launch for, as far as the arguments show it: the kernel,
    its constexprs and launch options, each tensor's dtype and 16-byte alignment (chunk views
    start inside their buffers), each integer's being 1 (then a constant) and a multiple of
    16 (an alignment hint), but for the integers the kernel does not specialise
    (floyd_chunked.NOT_SPECIALISED)."""
    key = [fn.__name__, tuple(sorted(options.items()))]
    for name, value in bound.items():
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool) and name not in chunked.NOT_SPECIALISED.get(fn.__name__, ()):
            key.append((name, value == 1, value % 16 == 0))
    return tuple(key)


@pytest.mark.parametrize("split", [False, True], ids=["one_chunk", "rows_of_16"])
def test_few_kernel_specialisations_per_step(spy, monkeypatch, split, device):
    """A user's first step compiles what it launches: a chunked forward + backward launches
    the two row kernels and 6 kinds of GEMM at most (S and dP; the same with the other half
    accumulated; Y and dQ's two halves; dK1/dV1 and dK2/dV2, one kind where their
    contractions, M and N, take the same blocks, two here), 8 specialisations, however many
    chunks; a sum across chunks (dK2/dV2 here, N split into rows of 16) adds 3, its first
    (float32 out), middle and last chunks (accumulating); a tail chunk (4 rows of n) adds at
    most one per GEMM whose sizes or batch strides it changes (6: the two halves of S, of dP
    and of Y or dQ, and the dK1/dV1 and dK2/dV2 products), since the GEMM is specialised on
    them (floyd_chunked.NOT_SPECIALISED): not one per chunk, slice or row (compile time,
    issue 25; the fused kernels' first step took over 180 s on an H100)."""
    b, h, n, m, k, d = 1, 2, 36, 20, 16, 32
    if split:
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(16 * m, k, torch.float16, d))
    launches = record_launches(monkeypatch)
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float16, device, "random")
    out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
    kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    chunks = spy.plans[0][2].count(b * h, n, m)
    assert chunks == (6 if split else 1)
    kinds = {_specialisation(*launch) for launch in launches}
    assert len(launches) == 16 * chunks
    assert len(kinds) <= (8 + 3 + 6 if split else 8), sorted(map(str, kinds))


# ---------------------------------------------------------------------------------------------
# Layouts, statistics, determinism
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Memory: nothing of B*H*N*M*K; the workspace within the budget
# ---------------------------------------------------------------------------------------------
# B*H = 1, N = 18, M = 15: 3 x 3 chunks of 6 x 5 (n, m) rows, no tails, so that every score-sized
# buffer has the same number of elements; D = 1 so that nothing else comes near that size.
MEMORY_SHAPE, MEMORY_PAIRS = (1, 1, 18, 15, 48, 1), 30


def _memory_problem(monkeypatch, dtype, device):
    b, h, n, m, k, d = MEMORY_SHAPE
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(MEMORY_PAIRS, k, dtype, d))
    plan = config.chunk_plan(b * h, n, m, k, dtype.itemsize, config.CHUNK_BUDGET_BYTES, head_dim=d)
    assert plan.groups == 1 and 1 < plan.block_n < n and 1 < plan.block_m < m
    assert n % plan.block_n == 0 and m % plan.block_m == 0 and plan.block_n * plan.block_m <= MEMORY_PAIRS
    inputs, dy, mask = make_inputs(*MEMORY_SHAPE, dtype, device, "random")
    return plan, inputs, dy, mask


def _linear_bound(plan, n, m, k, d):
    """Bytes linear in D a chunked call may hold beyond its outputs and score buffers: the
    float32 partial Y or dQ of a chunk, and the float32 sums across chunks of dK1/dV1 (one
    n range) and dK2/dV2 (every m of a group of slices); the GEMMs copy no operand."""
    return 4 * plan.groups * (plan.block_n * plan.block_m + 2 * plan.block_n * k + 2 * k * m) * d


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_no_cubic_allocation(spy, monkeypatch, dtype, device):
    """No tensor of B*H*N*M*K elements, forward or backward: the largest is a chunk's score
    buffer (or an input or output); and the bytes held at once beyond the outputs stay under
    one chunk's score buffers (allocated once per call) plus terms linear in D, well under
    the cube."""
    plan, inputs, dy, mask = _memory_problem(monkeypatch, dtype, device)
    b, h, n, m, k, d = MEMORY_SHAPE
    cube = b * h * n * m * k
    chunk_scores = plan.groups * plan.block_n * plan.block_m * k
    io = max(t.numel() for t in inputs)
    bound = chunk_scores * config.score_bytes(dtype.itemsize) + _linear_bound(plan, n, m, k, d)
    assert bound < cube * config.score_bytes(dtype.itemsize) / 4  # the check can tell

    with Allocations(*inputs, dy, mask) as fwd:
        out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
    outputs = sum(t.untyped_storage().nbytes() for t in (out, mx, sm))
    assert fwd.largest <= max(chunk_scores, io) < cube
    assert fwd.peak - outputs <= bound, (fwd.peak, outputs, bound)
    with Allocations(*inputs, dy, mask, out, mx, sm) as bwd:
        grads = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    outputs = sum(g.untyped_storage().nbytes() for g in grads)
    assert bwd.largest <= max(chunk_scores, io) < cube
    assert bwd.peak - outputs <= bound, (bwd.peak, outputs, bound)
    assert spy.launches == ["forward", "backward"]
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, dtype)

    # the same measurement sees the cube of a naive formulation
    with Allocations(*inputs) as naive:
        oracles.floyd_attention(*inputs, mask, SCALE)
    assert naive.largest >= cube and naive.peak >= cube * 8


@pytest.mark.parametrize("launcher,dtype", [("forward", torch.float16), ("backward", torch.float32)], ids=str)
def test_score_workspace_within_the_chunk_budget(spy, monkeypatch, launcher, dtype, device):
    """The score-sized buffers held at once (S and dP in float32, P and dS in the input
    dtype; the forward S and P) within one chunk's scores at ``score_bytes`` each: the
    CHUNK_BUDGET_BYTES the plan was made for."""
    plan, inputs, dy, mask = _memory_problem(monkeypatch, dtype, device)
    chunk_scores = plan.groups * plan.block_n * plan.block_m * MEMORY_SHAPE[4]
    workspace = chunk_scores * config.score_bytes(dtype.itemsize)
    assert workspace <= config.CHUNK_BUDGET_BYTES
    if launcher == "forward":
        with Allocations(*inputs, mask, watch=chunk_scores) as seen:
            kernels.floyd_attention(*inputs, mask, SCALE)
    else:
        out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
        with Allocations(*inputs, dy, mask, out, mx, sm, watch=chunk_scores) as seen:
            kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    # every score buffer, once: the watch sees them
    held = (4 + dtype.itemsize) if launcher == "forward" else config.score_bytes(dtype.itemsize)
    assert seen.watched_peak == held * chunk_scores <= workspace, (seen.watched_peak, workspace)


# ---------------------------------------------------------------------------------------------
# The scale, and empty problems
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Head dims past the fused kernels' limit
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def rule(monkeypatch):
    """floyd_config's rule alone: no override, from the environment either."""
    monkeypatch.setattr(config, "STRATEGY", None)
    monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_head_dim_past_256_runs_chunked_on_the_triton_backend(rule, dtype, device):
    """D = 300: no fused tile fits, the rule gives it to the chunked strategy, and
    backend="triton" takes it (it used to refuse D > 256)."""
    b, h, n, m, k, d = 1, 2, 3, 4, 5, 300
    assert floyd_strategy.strategy(b, h, n, m, k, d, dtype.itemsize) == "chunked"
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "full_rows")
    assert kernels.unsupported(inputs[0]) is None
    out, mx, sm = gradops.floyd_attention(*inputs, mask, SCALE, backend="triton")
    grads = gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE, backend="triton")
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, dtype)


@pytest.mark.parametrize("forced,dtype,d", [("chunked", torch.float64, 129), (None, torch.float64, 129)])
def test_head_dim_past_the_fused_limit_is_refused_where_only_fused_runs(monkeypatch, forced, dtype, d, device):
    """Where the fused kernels must run the call (float64, which is always fused) a head dim
    past their limit is refused with ACLNN_ERR_PARAM_INVALID, naming the head dim; "auto"
    falls back to the reference there."""
    monkeypatch.setattr(config, "STRATEGY", forced)
    monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)
    inputs, dy, _ = make_inputs(1, 1, 2, 3, 4, d, dtype, device)
    assert kernels.unsupported(inputs[0]) is not None
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "head dim", str(d)):
        gradops.floyd_attention(*inputs, None, 1.0, backend="triton")
    out, mx, sm = gradops.floyd_attention(*inputs, None, 1.0, backend="reference")
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "head dim", str(d)):
        gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, None, 1.0, backend="triton")
    if device == "cpu":  # "auto" is the reference on CPU anyway; on CUDA it falls back
        return
    auto = gradops.floyd_attention(*inputs, None, 1.0, backend="auto")
    assert torch.equal(auto[0], out)


@pytest.mark.parametrize("dtype,d", [(torch.float16, 300), (torch.float32, 257)])
def test_a_forced_fused_strategy_past_its_widest_head_runs_chunked(monkeypatch, dtype, d, device):
    """A forced strategy runs every call it can take: past the fused kernels' widest head the
    chunked strategy runs (as past the hybrid row kernels'), with no refusal that a call
    signature planned before the strategy was forced would skip (ops/ remembers what the
    kernels can take per signature)."""
    monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)
    inputs, dy, mask = make_inputs(1, 1, 2, 3, 4, d, dtype, device)
    planned = gradops.floyd_attention(*inputs, mask, SCALE, backend="triton")  # remembered, unforced
    monkeypatch.setattr(config, "STRATEGY", "fused")
    assert kernels.unsupported(inputs[0]) is None and floyd_strategy.strategy(1, 1, 2, 3, 4, d, dtype.itemsize) == \
        "chunked"
    out, mx, sm = gradops.floyd_attention(*inputs, mask, SCALE, backend="triton")
    assert torch.equal(out, planned[0])
    grads = gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE, backend="triton")
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, dtype)


# ---------------------------------------------------------------------------------------------
# The plan (floyd_config.chunk_plan): no kernels (the rule: tests/test_floyd_roofline.py)
# ---------------------------------------------------------------------------------------------
def _plan_cases():
    """(bh, n, m, k, d, element_size, budget): edge cases, then a random sweep."""
    cases = [(1, 1, 1, 1, 1, 2, 1), (1, 1, 1, 1000, 8, 4, 10), (3, 1, 1, 5, 8, 2, 10 ** 9),
             (6, 4, 5, 6, 8, 2, (12 * 6 + 32) * 4 * 5 * 4 + 1), (1, 100, 100, 64, 64, 2, 256 << 20),
             (2, 40, 33, 17, 8, 4, 16 * 17 * 40), (1, 300, 7, 50, 1, 2, 12 * 50 * 64), (5, 7, 300, 3, 1, 2, 12 * 3 * 40),
             (1, 1000, 40, 8, 16, 2, (12 * 8 + 64) * 40 * 16), (1, 1000, 40, 8, 16, 2, (12 * 8 + 64) * 40 * 16 - 1),
             (2, 2048, 2048, 64, 256, 2, 2_650_000_000)]  # D large next to K: the partial dQ counts
    rng = random.Random(1234)
    for _ in range(300):
        bh, n, m, k = (rng.choice([1, 2, 3, 5, 8, 17, 33, 64, 100, 257]) for _ in range(4))
        d = rng.choice([1, 16, 128, 300])
        es = rng.choice([2, 4])
        budget = rng.choice([1, 100, 10 ** 3, 10 ** 4, 10 ** 5, 10 ** 6, 10 ** 7, 256 << 20])
        cases.append((bh, n, m, k, d, es, budget))
    return cases


def test_chunk_plan_invariants():
    """Every (slice, n, m) in exactly one chunk, slices outermost, then n, m innermost; a
    chunk's rows at pair_bytes each (K scores and the float32 partial dQ) within the budget
    unless a single 1 x 1 x K row exceeds it (then chunks of one row); groups > 1 only for
    whole slices; M split only when 16 rows of n with every m do not fit; a function of its
    arguments alone."""
    for bh, n, m, k, d, es, budget in _plan_cases():
        case = (bh, n, m, k, d, es, budget)
        plan = config.chunk_plan(bh, n, m, k, es, budget, head_dim=d)
        assert plan == config.chunk_plan(bh, n, m, k, es, budget, head_dim=d)
        assert 1 <= plan.groups <= bh and 1 <= plan.block_n <= n and 1 <= plan.block_m <= m
        per_pair = config.pair_bytes(k, d, es)
        if per_pair > budget:
            assert (plan.groups, plan.block_n, plan.block_m) == (1, 1, 1), case
        else:
            assert plan.groups * plan.block_n * plan.block_m * per_pair <= budget, case
        if plan.groups > 1:
            assert (plan.block_n, plan.block_m) == (n, m)
            assert plan.groups * n * m * per_pair <= budget
        if plan.block_m < m:
            assert 16 * m * per_pair > budget, case
        if plan.count(bh, n, m) > 50_000:  # the walk of one-row chunks of 257^3 rows: the same code, 20 s
            continue
        walk = list(plan.chunks(bh, n, m))
        assert len(walk) == plan.count(bh, n, m)
        assert walk == sorted(walk)  # slices, then n, then m
        for axis, size, block in ((0, bh, plan.groups), (2, n, plan.block_n), (4, m, plan.block_m)):
            ranges = sorted({(c[axis], c[axis + 1]) for c in walk})
            assert ranges[0][0] == 0 and ranges[-1][1] == size
            assert all(a1 == b0 for (_, a1), (b0, _) in itertools.pairwise(ranges))
            assert all(0 < r1 - r0 <= block for r0, r1 in ranges)
        assert len(walk) == len({(c[0], c[2], c[4]) for c in walk})
        if len(walk) <= 200:  # and, where small, by counting
            count = torch.zeros(bh, n, m, dtype=torch.int32, device="cpu")
            for g0, g1, n0, n1, m0, m1 in walk:
                count[g0:g1, n0:n1, m0:m1] += 1
            assert torch.all(count == 1), case


def test_chunk_budget_follows_the_device_and_the_problem(monkeypatch):
    """The budget is the smaller of the device's total memory / CHUNK_MEMORY_DIVISOR and the
    whole problem's workspace / CHUNK_PROBLEM_DIVISOR (at least MIN_CHUNK_BUDGET_BYTES),
    never the free memory; CHUNK_BUDGET_BYTES, when set, replaces it. On an H100 (81559 MiB)
    a bf16 B = 1, H = 8, N = M = K = 512, D = 128 problem is 16 chunks of 14 GEMMs (about
    1,800 bmm calls per step before), whose peak with Y and the gradients stays under half of
    what torch.compile(FloydNet) peaked at there (9 GiB)."""
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", None)
    h100 = 81559 << 20
    bh, n, k, d = 8, 512, 512, 128
    problem = bh * n * n * config.pair_bytes(k, d, 2)
    assert config.chunk_budget(h100, problem, False) == h100 // config.CHUNK_MEMORY_DIVISOR < problem // 3
    assert config.chunk_budget(h100, 3 * 10 ** 9, False) == 10 ** 9  # the problem's third, under the device's share
    assert config.chunk_budget(h100, 3 * 10 ** 8, True) == 3 * 10 ** 8  # a small grid's problem is not divided
    assert config.chunk_budget(h100, 3 * 10 ** 9, True) == h100 // config.CHUNK_MEMORY_DIVISOR  # (the share still)
    assert (config.chunk_budget(10 ** 6, problem, False) == config.chunk_budget(h100, 10, False)
            == config.MIN_CHUNK_BUDGET_BYTES)
    plan = config.chunk_plan(bh, n, n, k, 2, config.chunk_budget(h100, problem, False), head_dim=d)
    assert plan == config.ChunkPlan(1, 384, 512) and plan.count(bh, n, n) == 16
    workspace = plan.block_n * n * config.pair_bytes(k, d, 2) + 2 * k * n * d * 4  # + the float32 dK2/dV2 sums
    outputs = 6 * bh * n * n * d * 2  # Y and the five gradients
    assert workspace + outputs < 4.5 * 2 ** 30
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", 12345)
    assert config.chunk_budget(h100, problem, False) == config.chunk_budget(h100, problem, True) == 12345
    cpu = torch.device("cpu")
    assert config.total_memory(cpu) > 2 ** 28
    # a call's plan reads the total, not the free memory: the same plan whatever is allocated
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", None)
    before = chunked._plan(torch.empty(2, 4, 64, 64, 32, dtype=torch.float16), 64)
    hog = torch.empty(2 ** 26, dtype=torch.uint8)
    assert chunked._plan(torch.empty(2, 4, 64, 64, 32, dtype=torch.float16), 64) == before
    del hog


def test_chunk_plan_uses_the_budget():
    """Chunks use the budget they get (not much less: rows of n with every m, or square-ish
    tiles, in multiples of 16 once past 32)."""
    for n, m, k in ((1000, 1000, 512), (4096, 300, 512), (300, 4096, 512), (2048, 2048, 2048)):
        budget = 256 << 20
        plan = config.chunk_plan(8, n, m, k, 2, budget, head_dim=64)
        pairs = budget // config.pair_bytes(k, 64, 2)
        assert plan.block_n * plan.block_m * 2 >= pairs, plan
        for side in (plan.block_n, plan.block_m):
            assert side < 32 or side % 16 == 0 or side in (n, m)


def test_row_config():
    for k in (1, 2, 7, 37, 1000, 1024, 2048, 2049, 5000):
        cfg = config.row_config(k)
        r, bk = cfg["BLOCK_R"], cfg["BLOCK_K"]
        assert r & (r - 1) == 0 and bk & (bk - 1) == 0
        assert bk >= min(k, config.ROW_ELEMENTS) and bk <= config.ROW_ELEMENTS
        assert r * bk <= max(config.ROW_ELEMENTS, bk) and r <= config.ROW_MAX_ROWS
        assert cfg["ONE_TILE"] == (k <= bk)


def test_gemm_config():
    """The GEMM tiles: powers of two from 16 (tl.dot's least) to the table's widest, a
    function of the GEMM's shape and element size alone."""
    for rows, cols, inner in ((1, 1, 1), (7, 300, 5), (512, 512, 128), (4096, 64, 1000)):
        for es in (2, 4):
            cfg = config.gemm_config(rows, cols, inner, es)
            assert cfg == config.gemm_config(rows, cols, inner, es)
            for key, size, top in (("BLOCK_R", rows, config.GEMM_BLOCK[es]), ("BLOCK_C", cols, config.GEMM_BLOCK[es]),
                                   ("BLOCK_T", inner, config.GEMM_STEP[es])):
                block = cfg[key]
                assert block & (block - 1) == 0 and 16 <= block <= top
                assert block >= min(top, size)


def test_spy_sees_the_fused_strategy_too(monkeypatch, device):
    """The check the tests above rely on: with the rule choosing fused, the chunked launchers
    do not run (so the spy's ``launches`` proves which strategy ran)."""
    calls = []
    monkeypatch.setattr(config, "STRATEGY", "fused")
    monkeypatch.setattr(chunked, "forward", lambda *a, **k: calls.append("forward"))
    inputs, dy, mask = make_inputs(1, 1, 2, 3, 4, 8, torch.float16, device)
    kernels.floyd_attention(*inputs, mask, 1.0)
    assert calls == []
