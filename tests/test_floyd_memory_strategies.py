"""What the two Floyd strategies that go through memory promise alike, each forced in turn: the
hybrid one (gradops/kernels/floyd_hybrid.py) and the chunked one (floyd_chunked.py). Their own
tests (launches, workspace, halves, row tiles, compiles) are in test_floyd_hybrid.py and
test_floyd_chunked.py.

On CPU their kernels run through the Triton interpreter (bfloat16 tiles widened to float32 as
they are loaded, the interpreter's bf16 tl.dot being wrong). The oracle is the float64 autograd
one of tests/test_kernels_floyd.py (FloydNet's einsum formulation differentiated by autograd,
independent of every strategy), with its tolerances. ``floyd_config.CHUNK_BUDGET_BYTES``
shrinks the chunks (``Memory.pairs_budget``). The hybrid strategy, what the rule gives 16-bit
calls, takes the larger grids; the chunked one a part of each.
"""
import math

import pytest
import torch

import gradops
from gradops import oracles

triton = pytest.importorskip("triton")
kernels = pytest.importorskip("gradops.kernels.floyd_attention")

from gradops.kernels import floyd_chunked, floyd_hybrid
from gradops.kernels import floyd_config as config
from test_floyd_attention import _one_hot_inputs, _winner
from test_kernels_floyd import FLT_MAX, GRAD_NAMES, TOL, assert_close, assert_stats, make_inputs, oracle, run_kernels

F64 = torch.float64
SCALE = 0.37
BOTH = ("hybrid", "chunked")


class Memory:
    """One memory strategy forced, its launchers and its planner recorded: ``launches`` (the
    names of its launchers that ran), ``plans`` (every chunk plan it made). "hybrid32" is the
    hybrid strategy with its opt-in float32 halves (16-bit P and dS over them after a barrier,
    rows 2K elements apart), "hybrid" with the default halves."""

    def __init__(self, name, monkeypatch):
        self.name = name
        self.strategy = "hybrid" if name.startswith("hybrid") else name
        self.launches = []
        self.plans = []
        self._monkeypatch = monkeypatch
        monkeypatch.setattr(config, "STRATEGY", self.strategy)
        monkeypatch.setattr(config, "HALF_BITS", 32 if name == "hybrid32" else None)
        monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)
        monkeypatch.delenv("GRADOPS_FLOYD_HALF_BITS", raising=False)
        hybrid = self.strategy == "hybrid"
        module = floyd_hybrid if hybrid else floyd_chunked
        real_plan = module.strategy_plan

        def plan(*args, **kwargs):
            result = real_plan(*args, **kwargs)
            self.plans.append(result)
            return result

        monkeypatch.setattr(module, "strategy_plan", plan)
        for launcher in ("forward", "backward"):
            def recorded(*args, _real=getattr(module, launcher), _name=launcher, **kwargs):
                self.launches.append(_name)
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, launcher, recorded)

    def run(self, inputs, dy, mask, scale=SCALE):
        """(out, max, sum, grads) by the kernels' entry points; asserts this strategy ran both."""
        before = len(self.launches)
        result = run_kernels(inputs, dy, mask, scale)
        assert self.launches[before:] == ["forward", "backward"]
        return result

    def pair_bytes(self, k, d, dtype):
        """The strategy's workspace bytes per (n, m) row of a chunk."""
        if self.strategy == "hybrid":
            return config.hybrid_pair_bytes(k, d, dtype)
        return config.pair_bytes(k, d, dtype.itemsize)

    def pairs_budget(self, pairs, k, dtype, d):
        """A CHUNK_BUDGET_BYTES that gives chunks of ``pairs`` (n, m) rows of K pivots, head dim D."""
        return self.pair_bytes(k, d, dtype) * pairs

    def slices_budget(self, slices, shape, dtype):
        """A budget that holds ``slices`` whole (b, h) slices of ``shape`` (and a few bytes)."""
        b, h, n, m, k, d = shape
        return slices * n * m * self.pair_bytes(k, d, dtype) + 3

    def budget(self, value):
        self._monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", value)

    def expected_plan(self, bh, n, m, k, d, dtype, budget):
        return config.plan_rows(bh, n, m, self.pair_bytes(k, d, dtype), budget)

    def pivot_step(self, k, d, dtype):
        """The pivots a step of the strategy's row kernels takes: the hybrid row kernels' BLOCK_K;
        the chunked ones' row tile (256 pivots here: see ``short_row_tiles``)."""
        if self.strategy == "hybrid":
            return config.hybrid_config(d, dtype)["BLOCK_K"]
        return config.row_config(k)["BLOCK_K"]


@pytest.fixture
def memory(request, monkeypatch):
    """A memory strategy forced (``request.param``: "hybrid", "hybrid32" or "chunked"), recorded; for the
    chunked one, row tiles of 256 pivots (ROW_ELEMENTS), so that a few hundred pivots take
    several tiles (the path K > 2048 takes, at a tenth of the interpreter's cost)."""
    if request.param == "chunked":
        monkeypatch.setattr(config, "ROW_ELEMENTS", 256)
        config.row_config.cache_clear()
    yield Memory(request.param, monkeypatch)
    config.row_config.cache_clear()  # monkeypatch restores ROW_ELEMENTS after this


def case_id(value) -> str:
    """A parameter's test id, the same in every process (a budget function's is "budget", not
    its address: xdist's workers must collect the same ids)."""
    if callable(value):
        return "budget"
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value).replace("torch.", "")


def with_memory(cases, names=None):
    """``cases`` (tuples of parameters) for each strategy in ``names`` (default both), for a
    parametrize whose first name is "memory" (indirect)."""
    return [(name,) + tuple(case) for name in (names or BOTH) for case in cases]


def stats_tolerance(inputs, scale, dtype) -> float:
    """The softmax statistics' tolerance against float64 for the strategy forced: 1e-5 where
    the scores are float32 sums of exact products; with the hybrid strategy's narrower halves
    (16-bit inputs: 24 bits by default, or 16) each score carries its half's rounding too, at
    most ``e = u * |scale * Q.K2|`` (u = 2^-16 for 24 bits, 2^-8 for 16), which shifts the max
    by as much and the sum by a factor within exp(+-2e) (its exponents and the max
    subtracted)."""
    bits = config.half_bits(dtype)
    if config.STRATEGY != "hybrid" or bits == 32:
        return 1e-5
    q, _, _, k2, _ = (t.double().cpu() for t in inputs)
    s2 = torch.einsum("bhnmd,bhkmd->bhnmk", q, k2).abs().max().item() * abs(scale)
    return 1e-5 + math.expm1(2 * 2.0 ** -(bits - 8) * s2)


def check_against_oracle(result, inputs, dy, mask, dtype, scale=SCALE):
    out, mx, sm, grads = result
    y_ref, mx_ref, sm_ref, grads_ref = oracle(inputs, dy, mask, scale)
    b, h, n, m, _ = inputs[0].shape
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert mx.dtype == sm.dtype == torch.float32 and mx.shape == sm.shape == (b, h, n, m)
    tol = TOL[dtype]
    assert_close(out, y_ref, tol, "out")
    assert_stats(mx, sm, mx_ref, sm_ref, mask, inputs[1].shape[3], "stats", stats_tolerance(inputs, scale, dtype))
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        assert_close(g, g_ref, tol, name)


def flat(result):
    out, mx, sm, grads = result
    return [out, mx, sm, *grads]


# ---------------------------------------------------------------------------------------------
# Against the float64 oracle
# ---------------------------------------------------------------------------------------------
# (B, H, N, M, K, D): single elements, odd sizes, N = 1 and M = 1, K past a row kernel's step
# (K = 33: 64 lanes, 31 dead), D not a power of two.
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 3, 5, 7, 3, 8),
    (1, 2, 19, 21, 23, 20),
    (2, 1, 17, 3, 37, 8),
    (1, 1, 3, 18, 33, 72),
    (3, 1, 1, 13, 40, 5),
    (1, 3, 11, 1, 9, 12),
]
# float32 without a mask, float16 with a random mask and with fully masked rows, in turn
MASKS_AND_DTYPES = ((None, torch.float32), ("random", torch.float16), ("full_rows", torch.float16))
ORACLE_CASES = (
    # the hybrid strategy: every shape, with each mask and dtype in turn (bfloat16: test_head_dims)
    with_memory([(s, *MASKS_AND_DTYPES[i % 3]) for i, s in enumerate(SHAPES)]
                + [(SHAPES[1], *MASKS_AND_DTYPES[0]), (SHAPES[3], *MASKS_AND_DTYPES[2])], ["hybrid"])
    # the chunked one (heads past 256, float32 where the rule gives it): two shapes, two dtypes
    + with_memory([(SHAPES[2], None, torch.float32), (SHAPES[4], "full_rows", torch.float16)], ["chunked"]))


@pytest.mark.parametrize("memory,shape,mask_kind,dtype", ORACLE_CASES, indirect=["memory"], ids=case_id)
def test_against_float64_autograd(memory, shape, mask_kind, dtype, device):
    inputs, dy, mask = make_inputs(*shape, dtype, device, mask_kind)
    check_against_oracle(memory.run(inputs, dy, mask), inputs, dy, mask, dtype)


@pytest.mark.parametrize("memory,d,dtype", with_memory(
    [(16, torch.bfloat16), (64, torch.bfloat16), (96, torch.float16), (128, torch.bfloat16), (128, torch.float32),
     (256, torch.bfloat16)], ["hybrid"])
    + with_memory([(96, torch.float16), (256, torch.bfloat16)], ["chunked"]), indirect=["memory"], ids=case_id)
def test_head_dims(memory, d, dtype, device):
    """Head dims from 16 to 256 (the hybrid tile table's rows, D = 96 padded to 128); bfloat16
    too (its tiles widened to float32 in the interpreter: exact products, float32 sums, as
    tensor cores)."""
    shape = (2, 1, 5, 6, 7, d)
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    check_against_oracle(memory.run(inputs, dy, mask), inputs, dy, mask, dtype)


@pytest.mark.parametrize("memory", ["hybrid", "hybrid32"], indirect=True)  # chunked: test_head_dims at D = 256
def test_bfloat16_tails(memory, device):
    shape = (1, 2, 19, 21, 23, 20)
    inputs, dy, mask = make_inputs(*shape, torch.bfloat16, device, "full_rows")
    check_against_oracle(memory.run(inputs, dy, mask, 0.3), inputs, dy, mask, torch.bfloat16, 0.3)


# K past the hybrid row kernels' step of pivots: the softmax online across them, Dr summed over
# them (the chunked row kernels' tiles of pivots: test_floyd_chunked.py::test_pivots_past_one_row_block).
@pytest.mark.parametrize("memory,k,dtype", with_memory(
    [(k, dt) for k in (129, 300) for dt in (torch.float32, torch.float16)], ["hybrid"])
    + with_memory([(300, torch.float16)], ["hybrid32"]), indirect=["memory"], ids=case_id)
def test_pivots_past_one_step(memory, k, dtype, device):
    shape = (1, 2, 2, 3, k, 4)
    assert memory.pivot_step(k, 4, dtype) < k
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    check_against_oracle(memory.run(inputs, dy, mask), inputs, dy, mask, dtype)


@pytest.mark.parametrize("memory,dtype", with_memory([(torch.float32,), (torch.bfloat16,)], ["hybrid"])
                         + with_memory([(torch.bfloat16,)], ["hybrid32", "chunked"]), indirect=["memory"],
                         ids=case_id)
def test_one_hot_in_a_later_pivot_step(memory, dtype, device):
    """The winning pivot of every row past the first step of pivots: the first steps' max is
    overtaken, and dQ, dK1, dK2 are still exactly zero."""
    gen = torch.Generator().manual_seed(11)
    b, h, n, m, k, d = 1, 2, 3, 4, 300, 4
    inputs = _one_hot_inputs(b, h, n, m, k, d, dtype, device, gen)
    shift = 260  # the softmax is over k in any order: roll the winners past the first step
    inputs = [inputs[0]] + [t.roll(shift, dims=3 if i < 2 else 2) for i, t in enumerate(inputs[1:])]
    assert all(memory.pivot_step(k, d, dtype) <= (_winner(i, k) + shift) % k for i in range(n))
    dy = torch.randn(b, h, n, m, d, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
    out, mx, sm, (dq, dk1, dv1, dk2, dv2) = memory.run(inputs, dy, None, 0.8)
    assert torch.equal(sm, torch.ones_like(sm))
    for name, g in (("dq", dq), ("dk1", dk1), ("dk2", dk2)):
        assert torch.equal(g, torch.zeros_like(g)), (name, g.abs().max().item())
    _, _, dv1_ref, _, dv2_ref = oracles.floyd_attention_backward(dy, *inputs, scale=0.8)
    assert_close(dv1, dv1_ref, TOL[dtype], "dv1")
    assert_close(dv2, dv2_ref, TOL[dtype], "dv2")


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's nanmax
@pytest.mark.parametrize("memory", BOTH, indirect=True)
def test_nan_score_in_a_later_pivot_step(memory, device):
    """A NaN score in a later step of pivots only (K1[n, k] for k past it): the max of those
    rows is NaN (tl.max alone would skip it, and the first steps' max would stand), as are
    their sum and output; no other row is touched."""
    b, h, n, m, k, d = 1, 2, 3, 4, 300, 4
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float32, device, "random")
    inputs = [t.clone() for t in inputs]
    inputs[1][0, 1, 2, 270, 0] = float("nan")
    mask[0, 0, 2, 0, 270] = False
    out, mx, sm = (t.cpu() for t in memory.run(inputs, dy, mask)[:3])
    rows = torch.zeros(b, h, n, m, dtype=torch.bool, device="cpu")  # the results are moved to the CPU
    rows[0, 1, 2] = True
    y_ref, mx_ref = (t.cpu() for t in oracle(inputs, dy, mask, SCALE)[:2])
    assert torch.equal(torch.isnan(mx_ref), rows) and torch.equal(torch.isnan(mx), rows)
    assert torch.equal(torch.isnan(sm), rows) and torch.equal(torch.isnan(out).any(dim=-1), rows)
    assert_close(out[~rows], y_ref[~rows], TOL[torch.float32], "out")
    assert_close(mx[~rows], mx_ref[~rows], 1e-5, "max")


@pytest.mark.parametrize("memory,dtype,scale", with_memory(
    [(dt, s) for dt in (torch.float16, torch.bfloat16, torch.float32) for s in (1 / 3, -2.7182818284590451)],
    ["hybrid"]) + with_memory([(torch.bfloat16, -2.7182818284590451)], ["chunked"]),
    indirect=["memory"], ids=case_id)
def test_scale_reaches_the_row_kernel_exactly(memory, dtype, scale, device):
    """With D = 1 each half of a score is one product, the two added and multiplied by the scale
    rounded to float32: the softmax max must be that expression, bitwise. The inputs are
    multiples of 1/8 up to 2, so the products, the stored half and their sum are exact in every
    dtype and in any order or accumulator: only the scale's product rounds. (With random inputs
    a GPU's dot gives other last bits than float32 additions: tensor cores accumulate fp16
    products in their own way, float32 fuses the product and the add. The GPU run of
    2026-11-28 failed here on them, not on the scale.)"""
    b, h, n, m, k, d = 1, 2, 5, 19, 20, 1
    gen = torch.Generator(device="cpu").manual_seed(5)
    inputs = tuple((torch.randint(-16, 17, shape, generator=gen, device="cpu") / 8).to(dtype).to(device)
                   for shape in ((b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)))
    _, mx, _ = kernels.floyd_attention(*inputs, None, scale)
    assert memory.launches == ["forward"]
    q, k1, _, k2, _ = (t.float().cpu()[..., 0] for t in inputs)
    s = q[..., None] * k1[:, :, :, None, :] + q[..., None] * k2.transpose(2, 3)[:, :, None]
    assert torch.equal(mx.cpu(), (s * torch.tensor(scale, dtype=torch.float32, device="cpu")).amax(dim=-1))


# ---------------------------------------------------------------------------------------------
# Many chunks
# ---------------------------------------------------------------------------------------------
# (name, shape, budget as a function of (memory, shape, dtype))
CHUNKINGS = [
    ("one_row", (1, 2, 5, 3, 7, 8), lambda mem, s, dt: mem.pairs_budget(1, s[4], dt, s[5])),  # a row a chunk
    ("split_n_and_m", (1, 1, 13, 11, 9, 8), lambda mem, s, dt: mem.pairs_budget(20, s[4], dt, s[5])),  # tails on both
    ("short_n", (1, 2, 3, 17, 6, 8), lambda mem, s, dt: mem.pairs_budget(3 * 5 + 2, s[4], dt, s[5])),  # M split: 3 x 5
    ("whole_m_rows", (1, 2, 40, 3, 5, 8), lambda mem, s, dt: mem.pairs_budget(17 * 3 + 2, s[4], dt, s[5])),  # 17 x 3
    ("whole_slices", (2, 3, 4, 5, 6, 8), lambda mem, s, dt: mem.slices_budget(1, s, dt)),  # a slice a chunk
    ("groups_of_4", (2, 3, 4, 5, 6, 8), lambda mem, s, dt: mem.slices_budget(4, s, dt)),  # slices 0-3, 4-5
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16)


@pytest.mark.parametrize("memory,name,shape,budget_of,dtype", with_memory(
    [c + (dt,) for c, dt in zip(CHUNKINGS, DTYPES)], ["hybrid"])
    + with_memory([c + (dt,) for c, dt in zip(CHUNKINGS, DTYPES) if c[0] in ("split_n_and_m", "groups_of_4")],
                  ["chunked"])
    + with_memory([c + (dt,) for c, dt in zip(CHUNKINGS, DTYPES) if c[0] == "split_n_and_m"], ["hybrid32"]),
    indirect=["memory"], ids=case_id)
def test_many_chunks(memory, name, shape, budget_of, dtype, device):
    """Small budgets: chunks of one row, chunks with tails on n and m, N whole and M split, rows
    of n with M whole, whole slices, and groups of slices with a short last group; the float32
    dK1/dV1 sums over m-chunks and dK2/dV2 over n-chunks are the oracle's."""
    b, h, n, m, k, d = shape
    budget = budget_of(memory, shape, dtype)
    memory.budget(budget)
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    check_against_oracle(memory.run(inputs, dy, mask), inputs, dy, mask, dtype)
    # the walk the test meant: both launchers planned this, and it splits what it says
    assert len(memory.plans) == 2 and memory.plans[0] == memory.plans[1]
    plan = memory.plans[0]
    assert plan == memory.expected_plan(b * h, n, m, k, d, dtype, budget)
    expected = {"one_row": (1, 1, 1), "whole_m_rows": (1, 17, m), "whole_slices": (1, n, m), "groups_of_4": (4, n, m)}
    if name in expected:
        assert (plan.groups, plan.block_n, plan.block_m) == expected[name]
    if name == "split_n_and_m":
        assert plan.groups == 1 and 1 < plan.block_n < n and 1 < plan.block_m < m
        assert n % plan.block_n and m % plan.block_m  # tails on both
    if name == "short_n":
        assert plan.groups == 1 and plan.block_n == n and 1 < plan.block_m < m and m % plan.block_m
    if name == "groups_of_4":
        assert (b * h) % plan.groups  # the last group is short


def _ulps(x, y):
    """|x - y| in units in the last place of bfloat16 at |y| (subnormals aside)."""
    x, y = x.float(), y.float()
    exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0 ** -120)))
    return ((x - y).abs() / torch.exp2(exponent - 7)).max().item()


@pytest.mark.parametrize("memory", BOTH, indirect=True)
def test_sums_across_chunks_are_float32(memory, device):
    """The gradients of a bfloat16 call in 4 chunks of 8 x 8 (n, m) rows (dK1/dV1 summed over 2
    m-chunks, dK2/dV2 over 2 n-chunks) against the same call in one chunk: the partial sums
    travel between chunks in float32, so the two differ by float32 reassociation only and round
    to at most one bfloat16 ulp apart (with the sums rounded to bfloat16 between chunks they
    differ by hundreds of ulps at small elements)."""
    b, h, n, m, k, d = 1, 1, 16, 16, 8, 16
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.bfloat16, device, None)
    whole = memory.run(inputs, dy, mask)[3]
    memory.budget(memory.pairs_budget(8 * 8, k, torch.bfloat16, d))
    split = memory.run(inputs, dy, mask)[3]
    assert memory.plans[-1].count(b * h, n, m) == 4 and memory.plans[-1].block_m < m
    assert memory.plans[0].count(b * h, n, m) == 1
    for name, got, ref in zip(GRAD_NAMES, split, whole):
        assert _ulps(got, ref) <= 1.0, (name, _ulps(got, ref))


@pytest.mark.parametrize("memory,pairs,dtype", with_memory([(3, torch.float16)], ["hybrid", "hybrid32", "chunked"]),
                         indirect=["memory"], ids=case_id)
def test_fully_masked_row_gradients(memory, pairs, dtype, device):
    """As the fused kernels (test_kernels_floyd.py::test_fully_masked_row_gradients): dS is zero
    where masked, so Q, K1, K2 get exactly nothing from a fully masked row, and V1, V2 get P dY
    with the uniform P = 1/K."""
    b, h, n, m, k, d = 1, 2, 4, 5, 6, 8
    if pairs is not None:
        memory.budget(memory.pairs_budget(pairs, k, dtype, d))
    inputs, dy, _ = make_inputs(b, h, n, m, k, d, dtype, device)
    mask = torch.zeros(b, 1, n, 1, k, dtype=torch.bool, device=device)
    mask[0, 0, 1] = True  # row n = 1: every pivot masked
    mask[0, 0, 2, 0, ::2] = True  # and some pivots of another row
    out, mx, sm, (dq, dk1, dv1, dk2, dv2) = memory.run(inputs, dy, mask, 0.5)
    assert (dq[:, :, 1] == 0).all() and (dk1[:, :, 1] == 0).all()
    assert (mx[:, :, 1] == -FLT_MAX).all() and (sm[:, :, 1] == k).all()
    _, _, v1, _, v2 = (t.double() for t in inputs)
    tol = TOL[dtype]
    assert_close(out[:, :, 1], v1[:, :, 1].mean(dim=2, keepdim=True) + v2.mean(dim=2), tol, "uniform Y")
    assert_close(dv1[:, :, 1], dy[:, :, 1].double().sum(dim=2, keepdim=True).expand(-1, -1, k, -1) / k, tol, "dV1")
    # dS is zero in row 1, so dK2 is the gradient of the other rows alone ...
    rows = [0, 2, 3]
    _, _, _, grads_sub = oracle([t[:, :, rows] for t in inputs[:3]] + list(inputs[3:]), dy[:, :, rows],
                                mask[:, :, rows], 0.5)
    assert_close(dk2, grads_sub[3], tol, "dK2 without the masked row")
    # ... and the whole result is the oracle's
    check_against_oracle((out, mx, sm, (dq, dk1, dv1, dk2, dv2)), inputs, dy, mask, dtype, 0.5)


# ---------------------------------------------------------------------------------------------
# Exact zeros: P one-hot to the last bit (the same S in the backward as in the forward)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("memory,kind,dtype,budget", with_memory(
    [("K1", torch.bfloat16, "groups_of_3"), ("one_hot", torch.float16, "rows_of_10"),
     ("one_hot", torch.bfloat16, "groups_of_3")], ["hybrid"])
    + with_memory([("one_hot", torch.float16, "rows_of_10")], ["hybrid32"])
    + with_memory([("one_hot", torch.float32, "rows_of_10")], ["chunked"]),
    indirect=["memory"], ids=case_id)
def test_one_hot_softmax_gives_exactly_zero_score_gradients(memory, kind, dtype, budget, device):
    """test_floyd_attention.py's exactness test with many chunks: with K = 1, or one pivot
    dominating every row, dQ, dK1, dK2 are exactly zero. That needs the backward's scores to be
    bitwise the forward's (P = exp(S - max) / sum is exactly 1 only then): the same GEMMs on the
    same chunks, the same dot of the n-side half in every sweep; every (b, h) group boundary,
    n- and m-chunk edge must keep it."""
    gen = torch.Generator().manual_seed(3)
    b, h, n, m, d = 2, 2, 5, 8, 6
    k = 1 if kind == "K1" else 37
    if budget == "rows_of_10":
        memory.budget(memory.pairs_budget(10, k, dtype, d))
    else:
        memory.budget(memory.slices_budget(3, (b, h, n, m, k, d), dtype))
    if kind == "K1":
        inputs = [torch.randn(s, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
                  for s in [(b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)]]
        mask = torch.rand(b, 1, n, 1, k, generator=gen, device="cpu") < 0.4
    else:
        inputs = _one_hot_inputs(b, h, n, m, k, d, dtype, device, gen)
        mask = torch.rand(b, 1, n, 1, k, generator=gen, device="cpu") < 0.4  # some of the losers
        for i in range(n):
            mask[:, :, i, :, _winner(i, k)] = False
    mask[0, 0, n - 1] = True  # a fully masked row: uniform P, dS zero by the mask
    mask = mask.to(device)
    dy = torch.randn(b, h, n, m, d, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
    out, mx, sm, (dq, dk1, dv1, dk2, dv2) = memory.run(inputs, dy, mask, 0.8)
    plan = memory.plans[0]
    assert memory.plans[1] == plan
    if budget == "rows_of_10":  # tails on n and m
        assert plan.groups == 1 and n % plan.block_n and m % plan.block_m
    else:  # slices 0-2, then 3
        assert plan.groups == 3
    for name, g in (("dq", dq), ("dk1", dk1), ("dk2", dk2)):
        assert torch.equal(g, torch.zeros_like(g)), (name, g.abs().max().item())
    _, _, dv1_ref, _, dv2_ref = oracles.floyd_attention_backward(dy, *inputs, mask=mask, scale=0.8)
    assert_close(dv1, dv1_ref, TOL[dtype], "dv1")
    assert_close(dv2, dv2_ref, TOL[dtype], "dv2")


# ---------------------------------------------------------------------------------------------
# Layouts, statistics, determinism, NaN, empty problems
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("memory,slices", with_memory([(1,)], ["hybrid"]) + with_memory([(None,)], ["chunked"]),
                         indirect=["memory"], ids=case_id)
def test_non_contiguous_inputs_and_cann_statistics(memory, slices, device):
    """Views with arbitrary strides (inputs, dY, mask) give the contiguous inputs' results
    (within rounding: the GEMMs may see other layouts), and the backward reads statistics from
    CANN's [B,H,N,M,8] layout (a stride-8 view, or through the public API) bitwise as from the
    compact ones; in chunks of one slice (a chunk's views of strided inputs) or one chunk."""
    b, h, n, m, k, d = 2, 1, 9, 11, 13, 12
    if slices is not None:
        memory.budget(memory.slices_budget(slices, (b, h, n, m, k, d), torch.float32))
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float32, device, "random")
    views = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in inputs + (dy,)]
    views[1] = torch.cat([inputs[1], inputs[1]], dim=-1)[..., ::2]  # K1: stride 2 in D
    views[1].copy_(inputs[1])
    views[4] = inputs[4].permute(4, 0, 1, 2, 3).contiguous().permute(1, 2, 3, 4, 0)  # V2: D outermost
    mask_view = mask[:, 0, :, 0, :].permute(2, 1, 0).contiguous().permute(2, 1, 0)[:, None, :, None, :]
    assert torch.equal(mask_view, mask) and not mask_view.is_contiguous()
    assert not any(v.is_contiguous() for v in views)
    for v, t in zip(views, inputs + (dy,)):
        assert torch.equal(v, t)
    strided = memory.run(views[:5], views[5], mask_view, 0.8)
    check_against_oracle(strided, inputs, dy, mask, torch.float32, 0.8)
    out, mx, sm, grads = memory.run(inputs, dy, mask, 0.8)
    for a, c, name in zip(flat(strided), [out, mx, sm, *grads], ("out", "max", "sum") + GRAD_NAMES):
        assert_close(a, c, TOL[torch.float32], f"strided {name}")

    mx8 = mx.unsqueeze(-1).expand(b, h, n, m, 8).contiguous()
    sm8 = sm.unsqueeze(-1).expand(b, h, n, m, 8).contiguous()
    from_view = kernels.floyd_attention_grad(dy, *inputs, out, mx8[..., 0], sm8[..., 0], mask, 0.8)
    public = gradops.floyd_attention_grad(dy, *inputs, out, mx8, sm8, mask.to(torch.uint8), 0.8, backend="triton")
    assert memory.launches[-2:] == ["backward", "backward"]
    for a, p, c, name in zip(from_view, public, grads, GRAD_NAMES):
        assert torch.equal(a, c) and torch.equal(p, c), name


@pytest.mark.parametrize("memory", BOTH, indirect=True)
def test_deterministic(memory, device):
    """Two runs are bitwise equal: many chunks (dK1/dV1 summed over m-chunks, dK2/dV2 over
    n-chunks), and groups of slices."""
    shape = (1, 3, 5, 4, 9, 8)
    inputs, dy, mask = make_inputs(*shape, torch.float16, device, "random")
    budgets = ((memory.pairs_budget(10, 9, torch.float16, 8), 3 * 2 * 2),  # chunks of 3 x 3 rows
               (memory.slices_budget(2, shape, torch.float16), 2))  # slices in groups of 2
    for budget, chunks in budgets:
        memory.budget(budget)
        first, second = (flat(memory.run(inputs, dy, mask, 0.6)) for _ in range(2))
        assert memory.plans[-1].count(3, 5, 4) == len(list(memory.plans[-1].chunks(3, 5, 4))) == chunks
        for a, b_ in zip(first, second):
            assert torch.equal(a, b_)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's nanmax
@pytest.mark.parametrize("memory,dtype", with_memory([(torch.float16,)], ["hybrid"])
                         + with_memory([(torch.float32,)], ["chunked"]), indirect=["memory"], ids=case_id)
def test_nan_in_q_stays_in_its_row(memory, dtype, device):
    """A NaN in q[b,h,n,m] makes that row's max, sum and output NaN and nothing else, with chunks
    splitting n and m (the NaN's neighbours in its program, its chunk and the next chunks stay
    finite); the gradients' NaN pattern is the float64 oracle's."""
    b, h, n, m, k, d = 2, 1, 5, 11, 20, 6
    memory.budget(memory.pairs_budget(18, k, dtype, d))  # chunks of 4 x 4 rows
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "random")
    inputs = [t.clone() for t in inputs]
    where = (1, 0, 3, 6)
    inputs[0][where + (2,)] = float("nan")
    mask[where[0], 0, where[2], 0, :3] = True  # some masked pivots in the NaN's row
    out, mx, sm, grads = memory.run(inputs, dy, mask, 0.6)
    out, mx, sm, grads = out.cpu(), mx.cpu(), sm.cpu(), [g.cpu() for g in grads]
    plan = memory.plans[0]
    assert plan.block_n < n and 1 < plan.block_m < m
    row = torch.zeros(b, h, n, m, dtype=torch.bool, device="cpu")  # the results are moved to the CPU
    row[where] = True
    assert torch.equal(torch.isnan(mx), row) and torch.equal(torch.isnan(sm), row)
    assert torch.equal(torch.isnan(out).any(dim=-1), row) and torch.isnan(out[where]).all()
    y_ref, _, _, grads_ref = oracle(inputs, dy, mask, 0.6)
    assert_close(out[~row], y_ref.cpu()[~row], TOL[dtype], "out")
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        g_ref = g_ref.cpu()
        nan = torch.isnan(g)
        assert torch.equal(nan, torch.isnan(g_ref)), name
        assert_close(g[~nan], g_ref[~nan], TOL[dtype], name)
    bi, hi, ni, mi = where
    assert torch.equal(torch.isnan(grads[0]).any(dim=-1), row)
    for g in grads[1:3]:  # dK1, dV1: row n only
        assert torch.isnan(g).sum() == torch.isnan(g[bi, hi, ni]).sum() > 0
    for g in grads[3:]:  # dK2, dV2: column m only
        assert torch.isnan(g).sum() == torch.isnan(g[bi, hi, :, mi]).sum() > 0


@pytest.mark.parametrize("memory,shape", with_memory([((0, 2, 3, 4, 5, 8),), ((1, 1, 0, 4, 5, 8),),
                                                      ((1, 1, 3, 0, 5, 8),)]), indirect=["memory"], ids=case_id)
def test_empty(memory, shape, device):
    b, h, n, m, k, d = shape
    inputs, dy, _ = make_inputs(*shape, torch.float16, device)
    out, mx, sm, grads = run_kernels(inputs, dy, None, 1.0)
    assert out.shape == (b, h, n, m, d) and mx.shape == (b, h, n, m)
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and (g == 0).all()


@pytest.mark.parametrize("memory,dtype", with_memory([(torch.float16,), (torch.float32,)]), indirect=["memory"],
                         ids=case_id)
def test_zero_head_dim(memory, dtype, device):
    """D = 0 (docs/operators.md, section 5): every score is 0, so the max is 0 (-FLT_MAX in a
    fully masked row) and the sum the number of unmasked pivots (K in a fully masked row), the
    output and every gradient empty: as the reference backend and the fused kernels."""
    b, h, n, m, k, d = 2, 2, 3, 4, 5, 0
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "full_rows")
    out, mx, sm = gradops.floyd_attention(*inputs, mask, 1.0, backend="triton")
    assert memory.launches == ["forward"]
    r_out, r_mx, r_sm = gradops.floyd_attention(*inputs, mask, 1.0, backend="reference")
    assert out.shape == r_out.shape and torch.equal(mx, r_mx) and torch.equal(sm, r_sm)
    grads = gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, 1.0, backend="triton")
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and g.dtype == dtype


@pytest.mark.parametrize("strategy", ["fused", "hybrid", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=case_id)
def test_kv2_in_the_accumulation_dtype(monkeypatch, strategy, dtype, device):
    """``kv2_dtype=float32`` (gradops.distributed's partial sums over its rows of n) stores dK2/dV2
    before their rounding to the input dtype and changes nothing else: rounded, they are the
    default call's bits, dQ/dK1/dV1 are its bits; for the memory strategies in 4 chunks, whose
    sums over n travel through the float32 accumulators."""
    monkeypatch.setattr(config, "STRATEGY", strategy)
    b, h, n, m, k, d = 1, 1, 16, 16, 8, 16  # 4 chunks of 8 x 8 (n, m) rows, as test_sums_across_chunks_are_float32
    if strategy != "fused":
        pair_bytes = (config.hybrid_pair_bytes(k, d, dtype) if strategy == "hybrid"
                      else config.pair_bytes(k, d, dtype.itemsize))
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pair_bytes * 8 * 8)
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "random")
    out, mx, sm = kernels.floyd_attention(*inputs, mask, SCALE)
    rounded = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    partial = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE, kv2_dtype=torch.float32)
    for name, a, r in zip(GRAD_NAMES, partial, rounded):
        assert a.dtype == (torch.float32 if name in ("dk2", "dv2") else dtype), name
        assert torch.equal(a.to(dtype), r), name
    if dtype == torch.float16:  # the float32 values are not the rounded ones
        assert not torch.equal(partial[3], rounded[3].float())
