"""The hybrid strategy of the Triton Floyd attention backend (gradops/kernels/floyd_hybrid.py):
the n-side half of every score on chip, the m-side half through memory (float32, or 24 or 16
bits where set).

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

import gradops
from gradops import oracles

triton = pytest.importorskip("triton")
kernels = pytest.importorskip("gradops.kernels.floyd_attention")

from gradops.kernels import floyd_config as config
from gradops.kernels import floyd_gemm
from gradops.kernels import floyd_hybrid as hybrid
from helpers import record_launches
from test_floyd_attention import _one_hot_inputs, _winner
from test_floyd_chunked import SHAPES, Allocations, _ulps, check_against_oracle, flat
from test_kernels_floyd import FLT_MAX, GRAD_NAMES, TOL, assert_close, make_inputs, oracle, run_kernels

F64 = torch.float64
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
    real_plan = hybrid.plan_rows

    def plan(*args, **kwargs):
        result = real_plan(*args, **kwargs)
        seen.plans.append((args, result))
        return result

    monkeypatch.setattr(hybrid, "plan_rows", plan)

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


def slices_budget(slices, shape, dtype):
    """A budget that holds ``slices`` whole (b, h) slices of ``shape`` (and a few bytes)."""
    b, h, n, m, k, d = shape
    return slices * n * m * config.hybrid_pair_bytes(k, d, dtype) + 3


# ---------------------------------------------------------------------------------------------
# Against the float64 oracle
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,mask_kind", [(torch.float32, None), (torch.float16, "random"),
                                             (torch.float16, "full_rows")], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_float64_autograd(spy, shape, mask_kind, dtype, device):
    inputs, dy, mask = make_inputs(*shape, dtype, device, mask_kind)
    check_against_oracle(run_hybrid(spy, inputs, dy, mask), inputs, dy, mask, dtype)


@pytest.mark.parametrize("d,dtype", [(d, torch.bfloat16) for d in (16, 64, 96, 128, 256)]
                         + [(16, torch.float32), (128, torch.float32), (256, torch.float16)], ids=str)
def test_head_dims(spy, d, dtype, device):
    """Every row of the tile table (floyd_config.HYBRID_TILES), D = 96 padded to 128; bfloat16
    too (its tiles widened to float32 in the interpreter: exact products, float32 sums, as
    tensor cores)."""
    shape = (2, 1, 5, 6, 7, d)
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    check_against_oracle(run_hybrid(spy, inputs, dy, mask), inputs, dy, mask, dtype)


def test_bfloat16_tails(spy, device):
    shape = (1, 2, 19, 21, 23, 20)
    inputs, dy, mask = make_inputs(*shape, torch.bfloat16, device, "full_rows")
    check_against_oracle(run_hybrid(spy, inputs, dy, mask, 0.3), inputs, dy, mask, torch.bfloat16, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_head_dim_past_the_widest_runs_chunked(spy, dtype, device):
    """D = 300: the row kernels hold a whole head and stop at HYBRID_MAX_HEAD_DIM, so even a
    forced hybrid strategy gives the call to the chunked one."""
    b, h, n, m, k, d = 1, 2, 3, 4, 5, 300
    assert config.strategy(b, h, n, m, k, d, dtype.itemsize) == "chunked"
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "full_rows")
    result = run_kernels(inputs, dy, mask, SCALE)
    assert spy.launches == ["chunked forward", "chunked backward"]
    check_against_oracle(result, inputs, dy, mask, dtype)


# K past the row kernels' BLOCK_K (at most 64): the pivots are walked in several steps, the
# softmax online across them (first sweep), Dr summed over them.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("k", [129, 300])
def test_pivots_past_one_tile(spy, k, dtype, device):
    shape = (1, 2, 2, 3, k, 4)
    assert config.hybrid_config(4, dtype)["BLOCK_K"] < k
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    check_against_oracle(run_hybrid(spy, inputs, dy, mask), inputs, dy, mask, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_hot_in_a_later_pivot_tile(spy, dtype, device):
    """The winning pivot of every row past the first tiles of pivots: the first tiles' max is
    overtaken, and dQ, dK1, dK2 are still exactly zero."""
    gen = torch.Generator().manual_seed(11)
    b, h, n, m, k, d = 1, 2, 3, 4, 300, 4
    inputs = _one_hot_inputs(b, h, n, m, k, d, dtype, device, gen)
    shift = 260
    inputs = [inputs[0]] + [t.roll(shift, dims=3 if i < 2 else 2) for i, t in enumerate(inputs[1:])]
    assert all(config.hybrid_config(d, dtype)["BLOCK_K"] <= (_winner(i, k) + shift) % k for i in range(n))
    dy = torch.randn(b, h, n, m, d, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
    out, mx, sm, (dq, dk1, dv1, dk2, dv2) = run_hybrid(spy, inputs, dy, None, 0.8)
    assert torch.equal(sm, torch.ones_like(sm))
    for name, g in (("dq", dq), ("dk1", dk1), ("dk2", dk2)):
        assert torch.equal(g, torch.zeros_like(g)), (name, g.abs().max().item())
    _, _, dv1_ref, _, dv2_ref = oracles.floyd_attention_backward(dy, *inputs, scale=0.8)
    assert_close(dv1, dv1_ref, TOL[dtype], "dv1")
    assert_close(dv2, dv2_ref, TOL[dtype], "dv2")


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's nanmax
def test_nan_score_in_a_later_pivot_tile(spy, device):
    """A NaN score in a later tile of pivots only: the max of those rows is NaN (tl.max alone
    would skip it), as are their sum and output; no other row is touched."""
    b, h, n, m, k, d = 1, 2, 3, 4, 300, 4
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float32, device, "random")
    inputs = [t.clone() for t in inputs]
    inputs[1][0, 1, 2, 270, 0] = float("nan")
    mask[0, 0, 2, 0, 270] = False
    out, mx, sm = (t.cpu() for t in run_hybrid(spy, inputs, dy, mask)[:3])
    rows = torch.zeros(b, h, n, m, dtype=torch.bool, device="cpu")  # the results are moved to the CPU
    rows[0, 1, 2] = True
    y_ref, mx_ref = (t.cpu() for t in oracle(inputs, dy, mask, SCALE)[:2])
    assert torch.equal(torch.isnan(mx_ref), rows) and torch.equal(torch.isnan(mx), rows)
    assert torch.equal(torch.isnan(sm), rows) and torch.equal(torch.isnan(out).any(dim=-1), rows)
    assert_close(out[~rows], y_ref[~rows], TOL[torch.float32], "out")
    assert_close(mx[~rows], mx_ref[~rows], 1e-5, "max")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("scale", [1 / 3, -2.7182818284590451])
def test_scale_reaches_the_row_kernel_exactly(spy, dtype, scale, device):
    """With D = 1 each half of a score is one product (exact for 16-bit inputs, rounded once for
    float32), the two added in float32 and multiplied by the scale rounded to float32: the
    softmax max must be that expression, bitwise."""
    b, h, n, m, k, d = 1, 2, 5, 19, 20, 1
    inputs, _, _ = make_inputs(b, h, n, m, k, d, dtype, device)
    _, mx, _ = kernels.floyd_attention(*inputs, None, scale)
    assert spy.launches == ["forward"]
    q, k1, _, k2, _ = (t.float().cpu()[..., 0] for t in inputs)
    s = q[..., None] * k1[:, :, :, None, :] + q[..., None] * k2.transpose(2, 3)[:, :, None]
    assert torch.equal(mx.cpu(), (s * torch.tensor(scale, dtype=torch.float32, device="cpu")).amax(dim=-1))


# ---------------------------------------------------------------------------------------------
# Many chunks
# ---------------------------------------------------------------------------------------------
# (name, shape, budget as a function of (shape, dtype))
CHUNKINGS = [
    ("one_row", (1, 2, 5, 3, 7, 8), lambda s, dt: pairs_budget(1, s[4], dt, s[5])),  # every (n, m) row its own chunk
    ("split_n_and_m", (1, 1, 13, 11, 9, 8), lambda s, dt: pairs_budget(20, s[4], dt, s[5])),  # 5 x 4: tails on both
    ("short_n", (1, 2, 3, 17, 6, 8), lambda s, dt: pairs_budget(3 * 5 + 2, s[4], dt, s[5])),  # N whole, M split: 3 x 5
    ("whole_m_rows", (1, 2, 40, 3, 5, 8), lambda s, dt: pairs_budget(17 * 3 + 2, s[4], dt, s[5])),  # 17 x 3: M whole
    ("groups_of_4", (2, 3, 4, 5, 6, 8), lambda s, dt: slices_budget(4, s, dt)),  # slices 0-3, 4-5
]


@pytest.mark.parametrize("name,shape,budget_of,dtype", [c + (dt,) for c, dt in zip(
    CHUNKINGS, (torch.float32, torch.float16, torch.bfloat16, torch.float16, torch.float32))], ids=[c[0] for c in CHUNKINGS])
def test_many_chunks(spy, monkeypatch, name, shape, budget_of, dtype, device):
    """Small budgets: chunks of one row, chunks with tails on n and m, N whole and M split,
    rows of n with M whole, groups of slices with a short last group; the float32 dK1/dV1 sums
    over m-chunks and dK2/dV2 over n-chunks are the oracle's."""
    b, h, n, m, k, d = shape
    budget = budget_of(shape, dtype)
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", budget)
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    check_against_oracle(run_hybrid(spy, inputs, dy, mask), inputs, dy, mask, dtype)
    # the walk the test meant: both launchers planned this, and it splits what it says
    assert len(spy.plans) == 2 and spy.plans[0] == spy.plans[1]
    plan = spy.plans[0][1]
    assert plan == config.plan_rows(b * h, n, m, config.hybrid_pair_bytes(k, d, dtype), budget)
    expected = {"one_row": (1, 1, 1), "whole_m_rows": (1, 17, m), "groups_of_4": (4, n, m)}
    if name in expected:
        assert (plan.groups, plan.block_n, plan.block_m) == expected[name]
    if name == "split_n_and_m":
        assert plan.groups == 1 and 1 < plan.block_n < n and 1 < plan.block_m < m
        assert n % plan.block_n and m % plan.block_m  # tails on both
    if name == "short_n":
        assert plan.groups == 1 and plan.block_n == n and 1 < plan.block_m < m and m % plan.block_m
    if name == "groups_of_4":
        assert (b * h) % plan.groups  # the last group is short


def test_sums_across_chunks_are_float32(spy, monkeypatch, device):
    """The gradients of a bfloat16 call in 4 chunks (dK1/dV1 summed over 2 m-chunks, dK2/dV2
    over 2 n-chunks) against the same call in one chunk: the partial sums travel between
    chunks in float32, so the two round to at most one bfloat16 ulp apart."""
    b, h, n, m, k, d = 1, 1, 16, 16, 8, 16
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.bfloat16, device, None)
    whole = run_hybrid(spy, inputs, dy, mask)[3]
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(8 * 8, k, torch.bfloat16, d))
    split = run_hybrid(spy, inputs, dy, mask)[3]
    assert spy.plans[-1][1].count(b * h, n, m) == 4 and spy.plans[-1][1].block_m < m
    assert spy.plans[0][1].count(b * h, n, m) == 1
    for name, got, ref in zip(GRAD_NAMES, split, whole):
        assert _ulps(got, ref) <= 1.0, (name, _ulps(got, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("pairs", [None, 3], ids=["one_chunk", "chunks_of_3"])
def test_fully_masked_row_gradients(spy, monkeypatch, pairs, dtype, device):
    """dS is zero where masked, so Q, K1, K2 get exactly nothing from a fully masked row, and
    V1, V2 get P dY with the uniform P = 1/K."""
    b, h, n, m, k, d = 1, 2, 4, 5, 6, 8
    if pairs is not None:
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(pairs, k, dtype, d))
    inputs, dy, _ = make_inputs(b, h, n, m, k, d, dtype, device)
    mask = torch.zeros(b, 1, n, 1, k, dtype=torch.bool, device=device)
    mask[0, 0, 1] = True  # row n = 1: every pivot masked
    mask[0, 0, 2, 0, ::2] = True  # and some pivots of another row
    out, mx, sm, (dq, dk1, dv1, dk2, dv2) = run_hybrid(spy, inputs, dy, mask, 0.5)
    assert (dq[:, :, 1] == 0).all() and (dk1[:, :, 1] == 0).all()
    assert (mx[:, :, 1] == -FLT_MAX).all() and (sm[:, :, 1] == k).all()
    _, _, v1, _, v2 = (t.double() for t in inputs)
    tol = TOL[dtype]
    assert_close(out[:, :, 1], v1[:, :, 1].mean(dim=2, keepdim=True) + v2.mean(dim=2), tol, "uniform Y")
    assert_close(dv1[:, :, 1], dy[:, :, 1].double().sum(dim=2, keepdim=True).expand(-1, -1, k, -1) / k, tol, "dV1")
    rows = [0, 2, 3]
    _, _, _, grads_sub = oracle([t[:, :, rows] for t in inputs[:3]] + list(inputs[3:]), dy[:, :, rows],
                                mask[:, :, rows], 0.5)
    assert_close(dk2, grads_sub[3], tol, "dK2 without the masked row")
    check_against_oracle((out, mx, sm, (dq, dk1, dv1, dk2, dv2)), inputs, dy, mask, dtype, 0.5)


# ---------------------------------------------------------------------------------------------
# Exact zeros: P one-hot to the last bit (the same S in the backward as in the forward)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,dtype,budget", [("K1", torch.float32, "rows_of_10"), ("K1", torch.bfloat16, "groups_of_3"),
                                               ("one_hot", torch.float16, "rows_of_10"),
                                               ("one_hot", torch.bfloat16, "groups_of_3")], ids=str)
def test_one_hot_softmax_gives_exactly_zero_score_gradients(spy, monkeypatch, kind, dtype, budget, device):
    """With K = 1, or one pivot dominating every row, dQ, dK1, dK2 are exactly zero, over many
    chunks. That needs the backward's scores to be bitwise the forward's (P is exactly 1
    only then): the same S2 GEMM on the same chunks, stored in the same 24 bits, and the same
    n-side dot onto it, in every sweep of both row kernels."""
    gen = torch.Generator().manual_seed(3)
    b, h, n, m, d = 2, 2, 5, 8, 6
    k = 1 if kind == "K1" else 37
    if budget == "rows_of_10":
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(10, k, dtype, d))
    else:
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", slices_budget(3, (b, h, n, m, k, d), dtype))
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
    out, mx, sm, (dq, dk1, dv1, dk2, dv2) = run_hybrid(spy, inputs, dy, mask, 0.8)
    plan = spy.plans[0][1]
    assert spy.plans[1] == spy.plans[0]
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
# Layouts, statistics, determinism
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pairs", [99], ids=["a_slice_a_chunk"])
def test_non_contiguous_inputs_and_cann_statistics(spy, monkeypatch, pairs, device):
    """Views with arbitrary strides (inputs, dY, mask) give the contiguous inputs' results
    (within rounding), and the backward reads statistics from CANN's [B,H,N,M,8] layout (a
    stride-8 view, or through the public API) bitwise as from the compact ones."""
    b, h, n, m, k, d = 2, 1, 9, 11, 13, 12
    if pairs is not None:
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(pairs, k, torch.float32, d))
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float32, device, "random")
    views = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in inputs + (dy,)]
    views[1] = torch.cat([inputs[1], inputs[1]], dim=-1)[..., ::2]  # K1: stride 2 in D
    views[1].copy_(inputs[1])
    views[4] = inputs[4].permute(4, 0, 1, 2, 3).contiguous().permute(1, 2, 3, 4, 0)  # V2: D outermost
    mask_view = mask[:, 0, :, 0, :].permute(2, 1, 0).contiguous().permute(2, 1, 0)[:, None, :, None, :]
    assert torch.equal(mask_view, mask) and not mask_view.is_contiguous()
    assert not any(v.is_contiguous() for v in views)
    strided = run_hybrid(spy, views[:5], views[5], mask_view, 0.8)
    check_against_oracle(strided, inputs, dy, mask, torch.float32, 0.8)
    out, mx, sm, grads = run_hybrid(spy, inputs, dy, mask, 0.8)
    for a, c, name in zip(flat(strided), [out, mx, sm, *grads], ("out", "max", "sum") + GRAD_NAMES):
        assert_close(a, c, TOL[torch.float32], f"strided {name}")

    mx8 = mx.unsqueeze(-1).expand(b, h, n, m, 8).contiguous()
    sm8 = sm.unsqueeze(-1).expand(b, h, n, m, 8).contiguous()
    from_view = kernels.floyd_attention_grad(dy, *inputs, out, mx8[..., 0], sm8[..., 0], mask, 0.8)
    public = gradops.floyd_attention_grad(dy, *inputs, out, mx8, sm8, mask.to(torch.uint8), 0.8, backend="triton")
    assert spy.launches[-2:] == ["backward", "backward"]
    for a, p, c, name in zip(from_view, public, grads, GRAD_NAMES):
        assert torch.equal(a, c) and torch.equal(p, c), name


def test_deterministic(spy, monkeypatch, device):
    """Two runs are bitwise equal: many chunks (dK1/dV1 summed over m-chunks, dK2/dV2 over
    n-chunks), and groups of slices."""
    shape = (1, 3, 7, 5, 21, 16)
    inputs, dy, mask = make_inputs(*shape, torch.float16, device, "random")
    budgets = ((pairs_budget(20, 21, torch.float16, 16), 3 * 2 * 2),  # chunks of 5 x 4 rows
               (slices_budget(2, shape, torch.float16), 2))  # slices in groups of 2
    for budget, chunks in budgets:
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", budget)
        first, second = (flat(run_hybrid(spy, inputs, dy, mask, 0.6)) for _ in range(2))
        assert spy.plans[-1][1].count(3, 7, 5) == chunks
        for a, b_ in zip(first, second):
            assert torch.equal(a, b_)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's nanmax
@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_nan_in_q_stays_in_its_row(spy, monkeypatch, dtype, device):
    """A NaN in q[b,h,n,m] makes that row's max, sum and output NaN and nothing else, with
    chunks splitting n and m (the NaN's neighbours in its program, its chunk and the next
    chunks stay finite); the gradients' NaN pattern is the float64 oracle's."""
    b, h, n, m, k, d = 2, 1, 5, 11, 20, 6
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(24, k, dtype, d))
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "random")
    inputs = [t.clone() for t in inputs]
    where = (1, 0, 3, 6)
    inputs[0][where + (2,)] = float("nan")
    mask[where[0], 0, where[2], 0, :3] = True  # some masked pivots in the NaN's row
    out, mx, sm, grads = run_hybrid(spy, inputs, dy, mask, 0.6)
    out, mx, sm, grads = out.cpu(), mx.cpu(), sm.cpu(), [g.cpu() for g in grads]
    plan = spy.plans[0][1]
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


@pytest.mark.parametrize("shape", [(0, 2, 3, 4, 5, 8), (1, 1, 0, 4, 5, 8), (1, 1, 3, 0, 5, 8)])
def test_empty(spy, shape, device):
    b, h, n, m, k, d = shape
    inputs, dy, _ = make_inputs(*shape, torch.float16, device)
    out, mx, sm, grads = run_kernels(inputs, dy, None, 1.0)
    assert out.shape == (b, h, n, m, d) and mx.shape == (b, h, n, m)
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and (g == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_zero_head_dim(spy, dtype, device):
    """D = 0: every score is 0, so the max is 0 (-FLT_MAX in a fully masked row) and the sum the
    number of unmasked pivots, the output and every gradient empty: as the reference."""
    b, h, n, m, k, d = 2, 2, 3, 4, 5, 0
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, dtype, device, "full_rows")
    out, mx, sm = gradops.floyd_attention(*inputs, mask, 1.0, backend="triton")
    assert spy.launches == ["forward"]
    r_out, r_mx, r_sm = gradops.floyd_attention(*inputs, mask, 1.0, backend="reference")
    assert out.shape == r_out.shape and torch.equal(mx, r_mx) and torch.equal(sm, r_sm)
    grads = gradops.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, 1.0, backend="triton")
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and g.dtype == dtype


# ---------------------------------------------------------------------------------------------
# Launches, and the workspace: the two halves of a chunk, P and dS written over them
# ---------------------------------------------------------------------------------------------
ROW_KERNELS = {"_rows_forward", "_rows_backward"}


def _names(launches, since=0):
    return [fn.__name__ for fn, _, _ in launches[since:]]


@pytest.mark.parametrize("budget_pairs", [None, 5 * 8], ids=["one_chunk", "rows_of_5"])
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
    assert chunks == (1 if budget_pairs is None else 2 * 2)
    assert _names(launches) == ["_gemm_kernel", "_rows_forward", "_gemm_kernel"] * chunks
    before = len(launches)
    grads = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, SCALE)
    assert _names(launches, before) == ["_gemm_kernel", "_rows_backward", "_gemm_kernel", "_gemm_kernel"] * chunks
    products = [kwargs["PRODUCTS"] for fn, _, kwargs in launches[before:] if fn.__name__ == "_gemm_kernel"]
    assert products == [2, 3, 2] * chunks
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, torch.float16)


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


def test_narrower_halves_are_an_option_and_cost_accuracy(spy, monkeypatch, device):
    """HALF_BITS = 24 or 16 (or GRADOPS_FLOYD_HALF_BITS) keeps narrower halves for 16-bit
    inputs: 24 bits within the float16 tolerance of the oracle on a float16 problem, further
    from it than float32 halves (its statistics above all: the halves' rounding reaches the
    softmax sums); 16 bits (bfloat16 halves) for bfloat16 inputs only, within their tolerance
    and further than 24; float16 inputs keep 24 bits then, float32 inputs 32 always."""
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
def test_forward_and_backward_plan_the_same_chunks(spy, monkeypatch, device):
    """The plan is a function of the shape, dtype and budget alone: the backward of a call
    plans the chunks its forward planned, whatever the statistics or dY."""
    shape = (2, 2, 7, 6, 5, 4)
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", pairs_budget(20, 5, torch.float16, 4))
    inputs, dy, mask = make_inputs(*shape, torch.float16, device, "random")
    run_hybrid(spy, inputs, dy, mask)
    (fwd_args, fwd_plan), (bwd_args, bwd_plan) = spy.plans
    assert fwd_args == bwd_args and fwd_plan == bwd_plan
    assert len(list(fwd_plan.chunks(4, 7, 6))) > 4


def test_pair_bytes_and_tiles():
    """A chunk's (n, m) row holds its two halves (4 bytes a score each by default, 3 or 2 with
    narrower halves) and its float32 partial dQ1; every padded head dim up to
    HYBRID_MAX_HEAD_DIM has a tile, as wide as tl.dot needs (16) and a power of two."""
    assert config.hybrid_pair_bytes(512, 128, torch.bfloat16) == 2 * 512 * 4 + 4 * 128
    config.HALF_BITS = 24
    try:
        assert config.hybrid_pair_bytes(512, 128, torch.bfloat16) == 2 * 512 * 3 + 4 * 128
        assert config.hybrid_pair_bytes(512, 128, torch.float32) == 2 * 512 * 4 + 4 * 128
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
    (1.125 GiB) and the statistics, under 6.7 GiB; beyond the inputs (what a benchmark's peak
    counts) under half of what torch.compile(FloydNet) peaked at there (9 GiB)."""
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", None)
    monkeypatch.delenv("GRADOPS_FLOYD_HALF_BITS", raising=False)
    monkeypatch.setattr(config, "HALF_BITS", None)
    h100 = 81559 << 20
    bh, n, k, d = 8, 512, 512, 128
    pair = config.hybrid_pair_bytes(k, d, torch.bfloat16)
    plan = config.plan_rows(bh, n, n, pair, config.chunk_budget(h100, bh * n * n * pair))
    assert plan == config.ChunkPlan(1, n, n) and plan.count(bh, n, n) == 8
    assert 7 * plan.count(bh, n, n) <= 64
    tensor = bh * n * n * d * 2  # every input, Y and each gradient: 0.5 GiB
    workspace = plan.groups * n * n * pair
    stats = 2 * bh * n * n * 4
    peak = 11 * tensor + workspace + stats
    assert peak < 6.7 * 2 ** 30 and peak - 5 * tensor < 4.5 * 2 ** 30


# ---------------------------------------------------------------------------------------------
# Compiled for an H100 (sm_90) without a GPU
# ---------------------------------------------------------------------------------------------
_HYBRID_SM90 = r"""
import inspect, json, sys, torch, triton
from gradops.bench.floyd import compile_check_hybrid
from gradops.kernels import floyd_hybrid

compiled = []  # every triton.compile of the check, in order (None where it raised)
real_compile = triton.compile


def recording_compile(*args, **kwargs):
    try:
        result = real_compile(*args, **kwargs)
    except Exception:
        compiled.append(None)
        raise
    compiled.append(result)
    return result


triton.compile = recording_compile
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
    exact zeros rest on."""
    import inspect
    import json
    import os

    import triton

    from helpers import run_sm90_compile
    from test_kernels_floyd import H100_SHARED, _dot_locations, _dot_lowerings

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip("triton's bundled CUDA tools are not installed")
    cases = ("bfloat16:32", "bfloat16:64", "bfloat16:128", "float16:128", "float32:64")
    if triton_version == "3.6":
        cases = ("bfloat16:128",)
    script = "".join(inspect.getsource(f) for f in (_dot_locations, _dot_lowerings)) + _HYBRID_SM90
    stdout = run_sm90_compile(script, *cases, timeout=900, triton_version=triton_version)
    rows = [json.loads(line) for line in stdout.splitlines()]
    print("\n".join(map(json.dumps, rows)))
    assert len(rows) == 2 * len(cases)
    lowered = {}
    for row in rows:
        assert "error" not in row, row
        assert row["shared"] <= H100_SHARED and row["spill_loads"] == row["spill_stores"] == 0, row
        assert len(row["score_dots"]) == (2 if row["kernel"] == "hybrid_fwd" else 4), row
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
