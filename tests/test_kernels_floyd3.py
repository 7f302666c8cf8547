"""The 3-Floyd attention Triton kernels (gradops/kernels/floyd3_attention.py): the backend
functions against an independent float64 oracle, their launches, chunks, memory, layouts and
determinism, the traffic counter (gradops/bench/traffic.floyd3_traffic) and the sm_90 compile
check (gradops/bench/floyd3_compile.py).

On CPU the kernels run through the Triton interpreter (tests/conftest.py switches it on), so
the shapes are tiny (the interpreter pays ~10 ms per GEMM program, and a GEMM has a program per
batch entry: B*H*(J*K + I*K + I*J) per product), every axis a tail (no size a multiple of 16),
I, J, K, P all different. bfloat16 is left out here: the interpreter's bf16 ``tl.dot`` is wrong
(triton issue 11584; the GEMM widens bf16 tiles there, which the 2-pivot tests cover).

The oracle: FloydNet's einsum formulation of ``pivotal_attention3`` written here on float64
copies of the (rounded) inputs, with the masked score the constant -FLT_MAX, differentiated by
autograd: the backward is checked against the exact derivative, not against our formula.

Tolerances, relative to the largest magnitude of the expected tensor (as
tests/test_kernels_floyd.py, whose reasoning carries over: the sums here are over 3 P terms
instead of 2 K, at most a few dozen):
- float32 inputs: IEEE products (never TF32) and float32 sums over at most 3*max(P, D, I, J, K)
  < 100 terms: errors of a few ulps (2^-24 each); 2e-5 is ~170 ulps of headroom.
- float16 inputs: P and dS float32, split into two float16 halves for their GEMMs (22 bits of
  each), and every result rounded to float16 once: a few units of 2^-11 each; 4e-3 is ~8 ulps
  of float16.
- the statistics are float32 from the same rounded inputs: 1e-5 relative; a fully masked row
  exactly max -FLT_MAX and sum P, its dQ exactly 0.
"""
import json

import pytest
import torch

triton = pytest.importorskip("triton")
f3 = pytest.importorskip("gradops.kernels.floyd3_attention")

from gradops.kernels import floyd_config as config  # noqa: E402
from helpers import record_launches, run_sm90_compile  # noqa: E402
from memory_harness import Allocations  # noqa: E402

FLT_MAX = 3.4028234663852886e38
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
STAT_TOL = 1e-5
SCALE = 0.37
GRAD_NAMES = ("dq", "dk1", "dv1", "dk2", "dv2", "dk3", "dv3")


# ---------------------------------------------------------------------------------------------
# The float64 oracle, inputs, comparisons
# ---------------------------------------------------------------------------------------------
def oracle(inputs, dy, mask, scale):
    """(out, max, sum, grads) in float64 from the (rounded) inputs: einsum scores, masked
    -FLT_MAX (a constant: no gradient through it), softmax over the pivot, autograd."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in inputs]
    q, k1, v1, k2, v2, k3, v3 = leaves
    s = (torch.einsum("bhijkd,bhpjkd->bhijkp", q, k1) + torch.einsum("bhijkd,bhipkd->bhijkp", q, k2)
         + torch.einsum("bhijkd,bhijpd->bhijkp", q, k3)) * scale
    if mask is not None:
        s = s.masked_fill(mask.cpu(), -FLT_MAX)
    row_max = s.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(s - row_max)
    row_sum = e.sum(dim=-1, keepdim=True)
    p = e / row_sum
    y = (torch.einsum("bhijkp,bhpjkd->bhijkd", p, v1) + torch.einsum("bhijkp,bhipkd->bhijkd", p, v2)
         + torch.einsum("bhijkp,bhijpd->bhijkd", p, v3))
    grads = torch.autograd.grad(y, leaves, dy.detach().cpu().double()) if y.numel() else [torch.zeros_like(t)
                                                                                          for t in leaves]
    return y.detach(), row_max[..., 0], row_sum[..., 0].detach(), grads


def make_inputs(shape, dtype, device, mask_kind=None, seed=0):
    """``(q, k1, v1, k2, v2, k3, v3), dy, mask`` of ``shape`` (B, H, I, J, K, P, D), drawn on the
    CPU and moved to ``device``. ``mask_kind``: None; "random" ([B, 1, I, J, K, P], ~35% removed);
    "full_rows" (random, and every pivot of two (i, j, k) rows removed: uniform softmax there)."""
    b, h, i, j, k, p, d = shape
    gen = torch.Generator().manual_seed(seed * 7919 + b * 1009 + h * 101 + i * 31 + j * 17 + k * 7 + p * 3 + d)

    def rnd(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64, device="cpu").to(dtype).to(device)

    inputs = (rnd(b, h, i, j, k, d), rnd(b, h, p, j, k, d), rnd(b, h, p, j, k, d), rnd(b, h, i, p, k, d),
              rnd(b, h, i, p, k, d), rnd(b, h, i, j, p, d), rnd(b, h, i, j, p, d))
    dy = rnd(b, h, i, j, k, d)
    mask = None
    if mask_kind is not None:
        mask = torch.rand(b, 1, i, j, k, p, generator=gen, device="cpu") < 0.35
        if mask_kind == "full_rows":
            mask[0, 0, 0, 0, 0] = True
            mask[-1, 0, i - 1, j - 1, k // 2] = True
        mask = mask.to(device)
    return inputs, dy, mask


def run(inputs, dy, mask, scale=SCALE):
    out, mx, sm = f3.floyd3_attention(*inputs, mask, scale)
    grads = f3.floyd3_attention_grad(dy, *inputs, mx, sm, mask, scale)
    return out, mx, sm, grads


def assert_close(actual, expected, tol, name):
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if expected.numel() == 0:
        return
    bound = tol * max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def full_rows(mask, shape):
    """[B, H, I, J, K] bool: the rows whose every pivot is masked."""
    b, h, i, j, k, p, d = shape
    if mask is None:
        return torch.zeros(b, h, i, j, k, dtype=torch.bool)
    return mask.cpu().all(dim=-1).expand(b, h, i, j, k)


def check_against_oracle(result, inputs, dy, mask, dtype, scale=SCALE):
    out, mx, sm, grads = result
    shape = (*inputs[0].shape[:5], inputs[1].shape[2], inputs[0].shape[5])
    y_ref, mx_ref, sm_ref, grads_ref = oracle(inputs, dy, mask, scale)
    tol = TOL[dtype]
    assert out.dtype == dtype and mx.dtype == sm.dtype == torch.float32
    assert all(g.dtype == dtype for g in grads)
    assert_close(out, y_ref, tol, "out")
    full = full_rows(mask, shape)
    mx, sm = mx.cpu(), sm.cpu()
    assert (mx[full] == -FLT_MAX).all() and (sm[full] == shape[5]).all(), "fully masked rows: max -FLT_MAX, sum P"
    assert_close(mx[~full], mx_ref[~full], STAT_TOL, "softmax_max")
    assert_close(sm[~full], sm_ref[~full], STAT_TOL, "softmax_sum")
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        assert_close(g, g_ref, tol, name)
    # a fully masked row: dS is exactly 0 there, so nothing reaches dQ (exact zeros)
    assert (grads[0].cpu()[full] == 0).all()


def _kernel_counts(launches, since=0):
    """(GEMM launches, row-kernel launches) among ``launches[since:]``; nothing else runs."""
    names = [fn.__name__ for fn, _, _ in launches[since:]]
    assert set(names) <= {"_gemm_kernel", "_softmax_rows3", "_grad_rows3"}, names
    return names.count("_gemm_kernel"), len(names) - names.count("_gemm_kernel")


@pytest.fixture
def pairs_budget(monkeypatch):
    """Sets floyd_config.CHUNK_BUDGET_BYTES (the one override of the chunk budget) to chunks of
    ``pairs`` (i, j) rows of a shape; returns the plan the call will walk."""
    def set_budget(pairs, shape, dtype):
        b, h, i, j, k, p, d = shape
        monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", f3.pair_bytes(k, p, d) * pairs)
        return f3.chunk_plan(b * h, i, j, k, p, d, dtype.itemsize, torch.device("cpu"))
    return set_budget


# ---------------------------------------------------------------------------------------------
# Against the oracle
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_against_float64_oracle_in_one_chunk_of_7_and_7_launches(monkeypatch, dtype, device):
    """I, J, K, P all different, every one a tail; a random mask with two fully masked rows
    (uniform softmax: Y the mean of the three values' rows); one chunk (the device's budget):
    the forward launches 6 GEMMs and 1 row kernel, the backward 6 and 1 (S and dP side by side,
    each side's dQ term with its keys' and values' gradients)."""
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", None)
    shape = (1, 2, 3, 5, 2, 6, 8)
    inputs, dy, mask = make_inputs(shape, dtype, device, "full_rows")
    launches = record_launches(monkeypatch)
    out, mx, sm = f3.floyd3_attention(*inputs, mask, SCALE)
    assert _kernel_counts(launches) == (6, 1) and len(launches) == f3.FORWARD_LAUNCHES
    before = len(launches)
    grads = f3.floyd3_attention_grad(dy, *inputs, mx, sm, mask, SCALE)
    assert _kernel_counts(launches, before) == (6, 1) and len(launches) - before == f3.BACKWARD_LAUNCHES
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, dtype)
    # the uniform rows: Y[i,j,k] = mean_p (V1[p,j,k] + V2[i,p,k] + V3[i,j,p])
    q, k1, v1, k2, v2, k3, v3 = (t.double().cpu() for t in inputs)
    for b, i, j, k in ((0, 0, 0, 0), (0, 2, 4, 1)):
        uniform = v1[b, :, :, j, k].mean(1) + v2[b, :, i, :, k].mean(1) + v3[b, :, i, j, :].mean(1)
        assert_close(out[b, :, i, j, k], uniform, TOL[dtype], "uniform Y")


def test_batch_and_heads_with_a_broadcast_mask(device):
    """B, H > 1 and a mask expanded from [1, 1, I, 1, K, P] (stride 0 over b and j: read in
    place, never materialised), float32."""
    shape = (2, 2, 2, 3, 2, 5, 4)
    b, h, i, j, k, p, d = shape
    inputs, dy, _ = make_inputs(shape, torch.float32, device)
    small = torch.rand(1, 1, i, 1, k, p, generator=torch.Generator().manual_seed(5), device="cpu") < 0.4
    small[0, 0, 1, 0, 0] = True  # (i=1, k=0) fully masked for every b, j
    mask = small.to(device).expand(b, 1, i, j, k, p)
    assert mask.stride(0) == mask.stride(3) == 0
    check_against_oracle(run(inputs, dy, mask), inputs, dy, mask, torch.float32)


def test_long_pivot_rows_walked_in_tiles(monkeypatch, device):
    """P past the row kernels' tile (ROW_ELEMENTS shrunk to 16): the softmax's online max and
    sum, and Dr summed over tiles, which rows of one tile never take."""
    monkeypatch.setattr(config, "ROW_ELEMENTS", 16)
    config.row_config.cache_clear()
    try:
        shape = (1, 1, 2, 3, 2, 37, 4)
        assert not config.row_config(37)["ONE_TILE"]
        inputs, dy, mask = make_inputs(shape, torch.float32, device, "full_rows")
        check_against_oracle(run(inputs, dy, mask), inputs, dy, mask, torch.float32)
    finally:
        monkeypatch.undo()
        config.row_config.cache_clear()


# ---------------------------------------------------------------------------------------------
# Chunks forced by the budget: sums across chunks, tails, determinism
# ---------------------------------------------------------------------------------------------
# (shape, (i, j) rows per chunk, the plan it gives: (slices, rows of i, rows of j))
CHUNKS = {
    "slices": ((1, 3, 3, 2, 2, 4, 8), 12, (2, 3, 2)),  # 2 whole slices of 3, then the tail slice
    "rows_of_i": ((1, 2, 3, 2, 3, 4, 8), 4, (1, 2, 2)),  # i split, j whole: dK1/dV1 summed across chunks
    "tiles": ((1, 1, 3, 5, 2, 4, 8), 5, (1, 2, 2)),  # i and j split: dK1/dV1 and dK2/dV2 across chunks
}


@pytest.mark.parametrize("case", list(CHUNKS))
def test_several_chunks(pairs_budget, monkeypatch, case, device):
    """Budgets (floyd_config.CHUNK_BUDGET_BYTES) that force several chunks, each kind the plan
    makes, with tails: against the oracle, 7 + 7 launches per chunk; the tiles twice, bitwise
    equal (a fixed walk, no atomics)."""
    shape, pairs, expected = CHUNKS[case]
    b, h, i, j = shape[:4]
    plan = pairs_budget(pairs, shape, torch.float16)
    assert (plan.groups, plan.block_n, plan.block_m) == expected
    chunks = plan.count(b * h, i, j)
    assert chunks > 1
    inputs, dy, mask = make_inputs(shape, torch.float16, device, "full_rows")
    launches = record_launches(monkeypatch)
    result = run(inputs, dy, mask)
    assert len(launches) == (f3.FORWARD_LAUNCHES + f3.BACKWARD_LAUNCHES) * chunks
    check_against_oracle(result, inputs, dy, mask, torch.float16)
    if case == "tiles":
        again = run(inputs, dy, mask)
        for first, second in zip([*result[:3], *result[3]], [*again[:3], *again[3]]):
            assert torch.equal(first, second)


def test_no_hypercube_allocation(pairs_budget, device):
    """Chunks of 2 x 2 (i, j) rows: no tensor of B*H*I*J*K*P elements is allocated, forward or
    backward; the largest is a chunk's score buffer or input-sized (an input, an output, a
    float32 sum across chunks), and the bytes held beyond the outputs stay within one chunk's
    workspace (``pair_bytes`` per (i, j) row: the budget) plus the float32 accumulators."""
    shape = (1, 1, 3, 5, 2, 4, 1)  # D = 1: inputs far smaller than the hypercube
    b, h, i, j, k, p, d = shape
    plan = pairs_budget(4, shape, torch.float32)
    assert (plan.groups, plan.block_n, plan.block_m) == (1, 2, 2)
    inputs, dy, mask = make_inputs(shape, torch.float32, device, "random")
    cube = b * h * i * j * k * p
    chunk_scores = plan.block_n * plan.block_m * k * p
    io = max(t.numel() for t in inputs)
    workspace = config.CHUNK_BUDGET_BYTES
    accumulators = 4 * 2 * (p * j * k * d + plan.block_n * p * k * d)
    assert chunk_scores < cube and io < cube
    with Allocations(*inputs, dy, mask) as fwd:
        out, mx, sm = f3.floyd3_attention(*inputs, mask, SCALE)
    outputs = sum(t.untyped_storage().nbytes() for t in (out, mx, sm))
    assert fwd.largest <= max(chunk_scores, io) < cube
    assert fwd.peak - outputs <= workspace, (fwd.peak, outputs, workspace)
    with Allocations(*inputs, dy, mask, out, mx, sm) as bwd:
        grads = f3.floyd3_attention_grad(dy, *inputs, mx, sm, mask, SCALE)
    outputs = sum(g.untyped_storage().nbytes() for g in grads)
    assert bwd.largest <= max(chunk_scores, io) < cube
    assert bwd.peak - outputs <= workspace + accumulators, (bwd.peak, outputs, workspace + accumulators)
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, torch.float32)


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------
def _stored(t, order):
    """The same values stored with their dims in ``order``, viewed back in t's order."""
    inverse = [order.index(a) for a in range(t.dim())]
    return t.permute(order).contiguous().permute(inverse)


def test_strided_inputs_statistics_and_mask(device):
    """Views of every kind give bitwise the contiguous inputs' results: Q stored with j and k
    swapped and K2 with b and h swapped (their rows do not merge: copied once), K1 a slice of
    a wider head (rows of stride 2D: read in place), V2 with D strided (stored [.., D, K]), V3
    every other pivot of a larger tensor, K3 expanded over i (stride 0), dY with i and j
    swapped; the statistics stored transposed, the mask stored permuted."""
    shape = (2, 2, 2, 3, 2, 3, 4)
    b, h, i, j, k, p, d = shape
    inputs, dy, mask = make_inputs(shape, torch.float32, device, "full_rows")
    q, k1, v1, k2, v2, k3, v3 = inputs
    k3 = k3[:, :, :1].expand(b, h, i, j, p, d)  # one K3 row for every i
    inputs = (q, k1, v1, k2, v2, k3, v3)
    wide = torch.cat([k1, torch.full_like(k1, float("nan"))], dim=-1)
    big_v3 = torch.stack([v3, torch.full_like(v3, float("nan"))], dim=5).reshape(b, h, i, j, 2 * p, d)
    views = (_stored(q, (0, 1, 2, 4, 3, 5)), wide[..., :d], v1, _stored(k2, (1, 0, 2, 3, 4, 5)),
             _stored(v2, (0, 1, 2, 3, 5, 4)), k3, big_v3[:, :, :, :, ::2])
    for view, t in zip(views, inputs):
        assert torch.equal(view, t)
    assert not views[0].is_contiguous() and views[1].stride(-2) == 2 * d and views[4].stride(-1) == k
    dy_view = _stored(dy, (0, 1, 3, 2, 4, 5))
    mask_view = _stored(mask, (5, 3, 1, 0, 2, 4))
    assert torch.equal(mask_view, mask) and not mask_view.is_contiguous()

    out, mx, sm, grads = run(inputs, dy, mask)
    out_v, mx_v, sm_v = f3.floyd3_attention(*views, mask_view, SCALE)
    assert torch.equal(out_v, out) and torch.equal(mx_v, mx) and torch.equal(sm_v, sm)
    mx_t, sm_t = (_stored(t, (0, 1, 4, 3, 2)) for t in (mx, sm))  # the statistics stored [B, H, K, J, I]
    grads_v = f3.floyd3_attention_grad(dy_view, *views, mx_t, sm_t, mask_view, SCALE)
    for a, c, name in zip(grads_v, grads, GRAD_NAMES):
        assert torch.equal(a, c), name
    check_against_oracle((out, mx, sm, grads), inputs, dy, mask, torch.float32)


# ---------------------------------------------------------------------------------------------
# Empty problems, float64, D = 0
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 2, 3, 4, 5, 6, 8), (1, 1, 0, 4, 5, 6, 8), (1, 1, 3, 0, 5, 6, 8),
                                   (1, 1, 3, 4, 0, 6, 8), (1, 2, 0, 3, 4, 0, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_empty(shape, device):
    """No rows: correctly shaped results, zeros where a sum is over nothing (dK1 over no i, ...)."""
    inputs, dy, _ = make_inputs(shape, torch.float16, device)
    out, mx, sm, grads = run(inputs, dy, None)
    b, h, i, j, k, p, d = shape
    assert out.shape == (b, h, i, j, k, d) and out.dtype == torch.float16
    assert mx.shape == sm.shape == (b, h, i, j, k) and mx.dtype == sm.dtype == torch.float32
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and g.dtype == t.dtype and (g == 0).all()


def test_head_dim_zero(device):
    """D = 0: every score is 0 (a dot over nothing), -FLT_MAX where masked: max 0 and sum the
    unmasked pivots' count, a fully masked row -FLT_MAX and P, as the oracle; empty Y and grads."""
    shape = (1, 2, 3, 2, 4, 5, 0)
    inputs, dy, mask = make_inputs(shape, torch.float32, device, "full_rows")
    out, mx, sm, grads = run(inputs, dy, mask)
    _, mx_ref, sm_ref, _ = oracle(inputs, dy, mask, SCALE)
    assert out.shape == inputs[0].shape and all(g.shape == t.shape for g, t in zip(grads, inputs))
    assert torch.equal(mx.cpu().double(), mx_ref) and torch.equal(sm.cpu().double(), sm_ref)


def test_unsupported():
    """float64 takes the reference ("auto" falls back to it); 16-bit and float32 the kernels."""
    assert "float64" in f3.unsupported(torch.empty(1, 1, 1, 1, 1, 4, dtype=torch.float64))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert f3.unsupported(torch.empty(1, 1, 1, 1, 1, 4, dtype=dtype)) is None


def test_a_chunk_stays_within_the_inputs_bytes(monkeypatch):
    """No chunk's workspace (S, dP, P, dS float32, 16 bytes a score) grows into the L^4
    hypercube: at most the seven inputs' bytes, O(L^3 D) (64 MiB at least: small calls in one
    chunk). BREC's sizes (B*H = 8, D = 32, bfloat16) on an H200: one chunk at L = 16, two at 32
    and 48, three at 64; at L = 128 a chunk holds 1/32 of the hypercube's workspace."""
    monkeypatch.setattr(f3, "total_memory", lambda device: 150_000_000_000)  # an H200's 141 GiB
    for side, chunks in ((16, 1), (32, 2), (48, 2), (64, 3), (128, 16)):
        plan = f3.chunk_plan(8, side, side, side, side, 32, 2, torch.device("cpu"))
        workspace = plan.groups * plan.block_n * plan.block_m * f3.pair_bytes(side, side, 32)
        inputs = 8 * 32 * 2 * 7 * side ** 3
        assert workspace <= max(config.MIN_CHUNK_BUDGET_BYTES, inputs), side
        assert plan.count(8, side, side) == chunks, side


# ---------------------------------------------------------------------------------------------
# Traffic (counted through the interpreter: CPU only)
# ---------------------------------------------------------------------------------------------
def test_traffic_counts_each_launch(device, capsys):
    """floyd3_traffic labels 7 + 7 launches of one chunk and counts their bytes; the row kernels'
    are exactly what they must move: S read and P written (4 + 4 bytes per score: P is float32,
    split by the GEMMs that read it) and the two statistics (8 bytes per row) forward; S, dP and
    the statistics read, P and dS written backward; the first score GEMM writes S (4 per
    score). floyd3_main prints them."""
    if device != "cpu":
        pytest.skip("traffic is counted through the Triton interpreter")
    from gradops.bench import traffic

    shape = (1, 1, 2, 3, 2, 5, 8)
    b, h, i, j, k, p, d = shape
    result = traffic.floyd3_traffic(shape, "float16")
    scores, rows = result["scores"], b * h * i * j * k
    assert scores == rows * p and result["chunks"] == 1
    fwd, bwd = result["fwd"]["launches"], result["bwd"]["launches"]
    assert [x["label"] for x in fwd] == list(f3.FORWARD_NAMES)
    assert [x["label"] for x in bwd] == list(f3.BACKWARD_NAMES)
    assert (fwd[3]["distinct_load"], fwd[3]["distinct_store"]) == (4 * scores, 4 * scores + 8 * rows)
    assert (bwd[3]["distinct_load"], bwd[3]["distinct_store"]) == (8 * scores + 8 * rows, 8 * scores)
    assert fwd[0]["distinct_store"] == 4 * scores and bwd[0]["distinct_store"] == 8 * scores
    assert not result["fwd"]["torch_ops"] and not result["bwd"]["torch_ops"]  # no copies: contiguous inputs
    assert result["total"]["distinct"] == result["fwd"]["totals"]["distinct"] + result["bwd"]["totals"]["distinct"]
    assert traffic.floyd3_main(["--traffic", "--shape", "1,1,2,4", "--mask"]) == 0
    printed = capsys.readouterr().out
    assert "3-Floyd attention traffic, B,H,I,J,K,P,D = 1,1,2,2,2,2,4" in printed and "_grad_rows3" in printed


# ---------------------------------------------------------------------------------------------
# sm_90 ahead-of-time compiles (no GPU needed)
# ---------------------------------------------------------------------------------------------
_COMPILE_SM90 = r"""
import json, sys, torch
from gradops.bench.floyd3_compile import compile_check_floyd3
dtype = getattr(torch, sys.argv[1])
for n, head_dim in enumerate(sys.argv[2:]):
    for row in compile_check_floyd3(dtype, int(head_dim), rows_kernels=n == 0):
        print(json.dumps(row), flush=True)
"""
H100_SHARED = 227 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernels_compile_for_sm90_without_spills(dtype):
    """Every kind of launch (floyd3_compile.gemm_kinds: the GEMMs of a forward and a backward,
    and a sum across chunks; the two row kernels) compiled for an H100 at L = 32 and D = 32,
    64: no register spill, shared memory within the H100's, the GEMMs on tensor cores, and
    every load inside a loop issued ahead by the pipeliner (none waiting where it stands)."""
    from gradops.bench.floyd3_compile import gemm_kinds

    stdout = run_sm90_compile(_COMPILE_SM90, dtype, "32", "64", timeout=900)
    rows = [json.loads(line) for line in stdout.splitlines()]
    print("\n".join(map(json.dumps, rows)))
    gemms = [row for row in rows if not row["kernel"].startswith("rows3")]
    assert len(gemms) == 2 * len(gemm_kinds(32, 32)) and len(rows) - len(gemms) == 2
    for row in rows:
        assert "error" not in row, row
        assert row["spill_loads"] == row["spill_stores"] == 0, row
        assert row["shared"] <= H100_SHARED, row
        assert row["loop_loads"] == 0 and row["loop_barriers"] == 0, row
        if row in gemms:
            assert row["mma"] > 0 and row["loop_async_copies"] > 0, row
            assert row["fma_f32"] == 0, row
        else:
            assert row["fma_f32"] == 0, row  # the row kernels round every product (ROW_FP_FUSION)
