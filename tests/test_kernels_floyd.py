"""The Floyd attention Triton kernels (gradops/kernels/floyd_attention.py).

On CPU they run through the Triton interpreter (tests/conftest.py switches it on), at tiny
shapes with tails on every axis; GRADOPS_TEST_DEVICE=cuda runs the same tests compiled.
Two independent oracles: a float64 einsum formulation written here, differentiated by
autograd (so the backward is checked against the exact derivative, not our formula), and
the chunked reference backend (gradops.reference.floyd_attention).

Tolerances, relative to the largest magnitude of the expected tensor:
- float32 / float64 inputs: every product is IEEE in the input precision with sums over at
  most D*K ~ 1e3 terms; 2e-5 (float32) is ~170 ulps of headroom over that bound's typical
  size, 1e-12 for float64.
- float16 inputs: the kernels round P and dS to float16 before their products (as every
  flash-attention kernel does) and round the results to float16: a few units of 2^-11 each;
  4e-3 (~8 ulps of float16). bfloat16 likewise with 2^-8: 3e-2 (~8 ulps).
- the statistics are float32 whatever the input dtype, computed from the same (already
  rounded) inputs: 1e-5 relative; masked rows exactly -FLT_MAX and K.
"""
import pytest
import torch

import gradops
from gradops.kernels import floyd_config as config
from gradops.reference import floyd_attention as reference

from helpers import RECORD_COMPILES, record_launches, run_sm90_compile, skip_if_floyd_float64_refused

kernels = pytest.importorskip("gradops.kernels.floyd_attention")

FLT_MAX = 3.4028234663852886e38
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}


# ---------------------------------------------------------------------------------------------
# The float64 oracle: FloydNet's einsum formulation, differentiated by autograd
# ---------------------------------------------------------------------------------------------
def oracle_forward(q, k1, v1, k2, v2, mask, scale):
    s = (torch.einsum("bhnmd,bhnkd->bhnmk", q, k1) + torch.einsum("bhnmd,bhkmd->bhnmk", q, k2)) * scale
    if mask is not None:  # a masked score is the constant -FLT_MAX (CANN): no gradient through it
        s = s.masked_fill(mask, -FLT_MAX)
    row_max = s.amax(dim=-1, keepdim=True).detach()
    e = torch.exp(s - row_max)
    row_sum = e.sum(dim=-1, keepdim=True)
    p = e / row_sum
    y = torch.einsum("bhnmk,bhnkd->bhnmd", p, v1) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2)
    return y, row_max[..., 0], row_sum[..., 0]


def oracle(inputs, dy, mask, scale):
    """(out, max, sum, (dq, dk1, dv1, dk2, dv2)) in float64 from the (rounded) inputs."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    y, mx, sm = oracle_forward(*leaves, mask, scale)
    grads = torch.autograd.grad(y, leaves, dy.double())
    return y.detach(), mx.detach(), sm.detach(), grads


def make_inputs(b, h, n, m, k, d, dtype, device, mask_kind=None):
    gen = torch.Generator().manual_seed(b * 1000003 + h * 10007 + n * 101 + m * 11 + k + 7 * d)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, device="cpu").to(dtype).to(device)

    q = rnd(b, h, n, m, d)
    k1, v1 = rnd(b, h, n, k, d), rnd(b, h, n, k, d)
    k2, v2 = rnd(b, h, k, m, d), rnd(b, h, k, m, d)
    dy = rnd(b, h, n, m, d)
    mask = None
    if mask_kind is not None:
        mask = torch.rand(b, 1, n, 1, k, generator=gen, device="cpu") < 0.35
        if mask_kind == "full_rows":  # every pivot of some rows masked: uniform softmax there
            mask[0, 0, 0] = True
            if n > 2:
                mask[-1, 0, n // 2] = True
        mask = mask.to(device)
    return (q, k1, v1, k2, v2), dy, mask


def assert_close(actual, expected, tol, name):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    bound = tol * max(1.0, expected.abs().max().item()) if expected.numel() else 0.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def assert_stats(mx, sm, mx_ref, sm_ref, mask, k, name, tol=1e-5):
    assert mx.dtype == sm.dtype
    mx, sm, mx_ref, sm_ref = (t.double().cpu() for t in (mx, sm, mx_ref, sm_ref))
    masked_rows = mx_ref == -FLT_MAX
    if mask is not None:  # rows whose every pivot is masked: exactly CANN's values
        full = mask.cpu().all(dim=-1).expand_as(mx_ref)  # [B,1,N,1] -> [B,H,N,M]
        assert torch.equal(masked_rows, full)
        assert (mx[full] == -FLT_MAX).all(), f"{name}: fully masked rows must have max -FLT_MAX"
        assert (sm[full] == k).all(), f"{name}: fully masked rows must have sum K"
    live = ~masked_rows
    assert_close(mx[live], mx_ref[live], tol, f"{name} softmax_max")
    assert_close(sm[live], sm_ref[live], tol, f"{name} softmax_sum")


def run_kernels(inputs, dy, mask, scale):
    out, mx, sm = kernels.floyd_attention(*inputs, mask, scale)
    grads = kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, scale)
    return out, mx, sm, grads


GRAD_NAMES = ("dq", "dk1", "dv1", "dk2", "dv2")


@pytest.fixture(autouse=True)
def _fused_strategy(monkeypatch):
    """These are the fused kernels' tests: the rule would give wide heads (float32 D > 16,
    16-bit D > 64) to the chunked strategy, tested in tests/test_floyd_chunked.py."""
    monkeypatch.setattr(config, "STRATEGY", "fused")


# (B, H, N, M, K, D): single elements, odd sizes, tails past one tile on N, M and K, several
# steps of every loop (steps are 16: K=70 is five), head dims that are not powers of two
# (D=72 pads to 128, where the tiles shrink to 8x8).
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 3, 5, 7, 3, 8),
    (1, 2, 19, 21, 23, 20),
    (2, 1, 17, 3, 70, 8),
    (1, 1, 3, 18, 33, 72),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask_kind", [None, "random", "full_rows"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_float64_autograd(shape, mask_kind, dtype, device):
    b, h, n, m, k, d = shape
    inputs, dy, mask = make_inputs(*shape, dtype, device, mask_kind)
    scale = 0.37
    out, mx, sm, grads = run_kernels(inputs, dy, mask, scale)
    y_ref, mx_ref, sm_ref, grads_ref = oracle(inputs, dy, mask, scale)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert mx.dtype == torch.float32 and mx.shape == (b, h, n, m)
    tol = TOL[dtype]
    assert_close(out, y_ref, tol, "out")
    assert_stats(mx, sm, mx_ref, sm_ref, mask, k, "stats")
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        assert g.shape == g_ref.shape
        assert_close(g, g_ref, tol, name)


def test_small_tiles_many_programs(monkeypatch, device):
    """Tiles of 4 (8 on K) and loop steps of 16 with a grouped program order of 2: several
    tiles on every axis, partial groups, several loop steps in every kernel."""
    small = {"fwd": dict(block_n=4, block_m=4, block_k=16), "bwd_dq": dict(block_n=4, block_m=4, block_k=16),
             "bwd_dk1": dict(block_n=4, block_m=16, block_k=8), "bwd_dk2": dict(block_n=16, block_m=4, block_k=8)}
    for kernel, sizes in small.items():
        monkeypatch.setitem(config.OVERRIDES, kernel, dict(sizes, group=2))
    shape = (1, 1, 11, 9, 33, 8)
    inputs, dy, mask = make_inputs(*shape, torch.float32, device, "full_rows")
    out, mx, sm, grads = run_kernels(inputs, dy, mask, 0.7)
    y_ref, mx_ref, sm_ref, grads_ref = oracle(inputs, dy, mask, 0.7)
    assert_close(out, y_ref, TOL[torch.float32], "out")
    assert_stats(mx, sm, mx_ref, sm_ref, mask, shape[4], "stats")
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        assert_close(g, g_ref, TOL[torch.float32], name)


@pytest.mark.parametrize("element_size", [2, 4, 8])
def test_config_shapes(element_size):
    """Powers of two; every tl.dot contraction (block_d, the loop step) >= 16, as Triton
    requires for 16-bit operands; tiles never grow with the head dim."""
    looped_axis = {"fwd": "block_k", "bwd_dq": "block_k", "bwd_dk1": "block_m", "bwd_dk2": "block_n"}
    for kernel in config.KERNELS:
        previous = None
        for head_dim in (1, 8, 16, 20, 32, 64, 100, 128, 256, 512):
            cfg = config.floyd_config(kernel, head_dim, element_size)
            sides = [cfg.block_n, cfg.block_m, cfg.block_k, cfg.block_d]
            assert all(v & (v - 1) == 0 for v in sides)
            assert cfg.block_d >= max(16, head_dim) and getattr(cfg, looped_axis[kernel]) >= 16
            volume = cfg.block_n * cfg.block_m * cfg.block_k
            assert previous is None or volume <= previous
            previous = volume


def test_config_overrides(monkeypatch):
    monkeypatch.setitem(config.OVERRIDES, "fwd", {"block_k": 128, "num_warps": 2})
    cfg = config.floyd_config("fwd", 64)
    assert cfg.block_k == 128 and cfg.num_warps == 2
    monkeypatch.setenv("GRADOPS_FLOYD_CONFIG", '{"bwd_dq": {"group": 3}}')
    assert config.floyd_config("bwd_dq", 64).group == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_against_reference_backend(dtype, device):
    shape = (2, 2, 18, 17, 19, 20)
    inputs, dy, mask = make_inputs(*shape, dtype, device, "full_rows")
    scale = 1.3
    out, mx, sm, grads = run_kernels(inputs, dy, mask, scale)
    r_out, r_mx, r_sm = reference.floyd_attention(*inputs, mask, scale)
    # The reference's backward from the kernels' own forward: the two backends must agree
    # on the same statistics, and the kernels' statistics must match the reference's.
    r_grads = reference.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, scale)
    tol = TOL[dtype]
    assert_close(out, r_out, tol, "out")
    assert_stats(mx, sm, r_mx, r_sm, mask, shape[4], "stats")
    for g, g_ref, name in zip(grads, r_grads, GRAD_NAMES):
        assert_close(g, g_ref, tol, name)


def test_fully_masked_row_gradients(device):
    """dS is zero where masked: Q, K1, K2 get nothing from a fully masked row; V1, V2 get P*dY."""
    inputs, dy, _ = make_inputs(1, 2, 4, 5, 6, 8, torch.float32, device)
    mask = torch.zeros(1, 1, 4, 1, 6, dtype=torch.bool, device=device)
    mask[0, 0, 1] = True  # row n = 1: every pivot masked
    out, mx, sm, (dq, dk1, dv1, dk2, dv2) = run_kernels(inputs, dy, mask, 0.5)
    assert (dq[:, :, 1] == 0).all() and (dk1[:, :, 1] == 0).all()
    # uniform softmax: Y[1,m] = mean_k (V1[1,k] + V2[k,m]); dV1[1,k] = sum_m dY[1,m] / K
    q, k1, v1, k2, v2 = inputs
    assert_close(out[:, :, 1], (v1[:, :, 1].mean(dim=2, keepdim=True) + v2.mean(dim=2)), 2e-5, "uniform Y")
    assert_close(dv1[:, :, 1], dy[:, :, 1].sum(dim=2, keepdim=True).expand(-1, -1, 6, -1) / 6, 2e-5, "dV1")
    # with only row 1 masked and dS zero there, dK2 equals the gradient computed without row 1
    rows = [0, 2, 3]
    _, _, _, grads_sub = oracle((q[:, :, rows], k1[:, :, rows], v1[:, :, rows], k2, v2), dy[:, :, rows], None, 0.5)
    assert_close(dk2, grads_sub[3], 2e-5, "dK2 without the masked row")


def test_non_contiguous_inputs_and_cann_statistics(device):
    """Views with arbitrary strides, and statistics read from CANN's [B,H,N,M,8] layout."""
    b, h, n, m, k, d = 2, 2, 9, 11, 13, 12
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float32, device, "random")
    views = []
    for t in inputs + (dy,):
        # the same values stored with their two middle axes swapped, then viewed back
        views.append(t.transpose(2, 3).contiguous().transpose(2, 3))
    assert not views[0].is_contiguous()
    # the mask stored [K, N, B] and viewed as [B, 1, N, 1, K]
    mask_view = mask[:, 0, :, 0, :].permute(2, 1, 0).contiguous().permute(2, 1, 0)[:, None, :, None, :]
    assert torch.equal(mask_view, mask) and not mask_view.is_contiguous()
    out, mx, sm = kernels.floyd_attention(*views[:5], mask_view, 0.8)
    out_c, mx_c, sm_c = kernels.floyd_attention(*inputs, mask, 0.8)
    assert torch.equal(out, out_c) and torch.equal(mx, mx_c) and torch.equal(sm, sm_c)
    mx8 = mx.unsqueeze(-1).expand(b, h, n, m, 8).contiguous()
    sm8 = sm.unsqueeze(-1).expand(b, h, n, m, 8).contiguous()
    g = kernels.floyd_attention_grad(views[5], *views[:5], out.transpose(2, 3).contiguous().transpose(2, 3),
                                     mx8[..., 0], sm8[..., 0], mask_view, 0.8)
    g_c = kernels.floyd_attention_grad(dy, *inputs, out_c, mx_c, sm_c, mask, 0.8)
    for a, c, name in zip(g, g_c, GRAD_NAMES):
        assert torch.equal(a, c), name


def test_int64_index_path(monkeypatch, device):
    """Tensors whose offsets pass 2^31 get int64 index vectors; same results as int32."""
    import triton.language as tl

    inputs, dy, mask = make_inputs(1, 2, 9, 10, 11, 8, torch.float32, device, "full_rows")
    narrow = run_kernels(inputs, dy, mask, 0.4)
    index_dtype = kernels._index_dtype
    monkeypatch.setattr(kernels, "_index_dtype", lambda *tensors: tl.int64)
    wide = run_kernels(inputs, dy, mask, 0.4)
    for a, b_ in zip([*narrow[:3], *narrow[3]], [*wide[:3], *wide[3]]):
        assert torch.equal(a, b_)
    big = ((1, 1, 2, 2, 2), (0, 0, 2**30, 1, 1))  # the (shape, strides) of a view whose (b, h) slice spans 2^31
    assert index_dtype(big) is tl.int64
    assert index_dtype(kernels._layout(inputs[0]), None) is tl.int32


def test_no_cubic_allocation(monkeypatch, device):
    """The launchers allocate outputs, statistics, Dr and the scale: nothing of N*M*K."""
    b, h, n, m, k, d = 1, 1, 24, 24, 24, 4
    inputs, dy, mask = make_inputs(b, h, n, m, k, d, torch.float32, device, "random")
    sizes = []
    real_empty = torch.empty

    def recording_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        sizes.append(t.numel())
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)
    run_kernels(inputs, dy, mask, 1.0)
    assert sizes and max(sizes) <= max(n * m * d, n * k * d, k * m * d) < n * m * k


def test_deterministic(device):
    inputs, dy, mask = make_inputs(1, 2, 20, 18, 37, 16, torch.float16, device, "random")
    first = run_kernels(inputs, dy, mask, 0.6)
    second = run_kernels(inputs, dy, mask, 0.6)
    flat = lambda r: [r[0], r[1], r[2], *r[3]]  # noqa: E731
    for a, b_ in zip(flat(first), flat(second)):
        assert torch.equal(a, b_)


def test_float64(device):
    skip_if_floyd_float64_refused("triton", device)
    shape = (1, 2, 6, 17, 5, 8)
    inputs, dy, mask = make_inputs(*shape, torch.float64, device, "full_rows")
    out, mx, sm, grads = run_kernels(inputs, dy, mask, 0.9)
    y_ref, mx_ref, sm_ref, grads_ref = oracle(inputs, dy, mask, 0.9)
    assert mx.dtype == torch.float64 and out.dtype == torch.float64
    assert_close(out, y_ref, 1e-12, "out")
    assert (mx[mx_ref == -FLT_MAX] == -FLT_MAX).all()
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        assert_close(g, g_ref, 1e-12, name)


@pytest.mark.parametrize("shape", [(0, 2, 3, 4, 5, 8), (1, 1, 0, 4, 5, 8), (1, 1, 3, 0, 5, 8)])
def test_empty(shape, device):
    b, h, n, m, k, d = shape
    inputs, dy, _ = make_inputs(*shape, torch.float32, device)
    out, mx, sm, grads = run_kernels(inputs, dy, None, 1.0)
    assert out.shape == (b, h, n, m, d) and mx.shape == (b, h, n, m)
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and (g == 0).all()  # sums over nothing


def test_public_api_runs_the_kernels(device):
    """gradops.floyd_attention(backend="triton") dispatches here; uint8 mask, CANN stats."""
    shape = (1, 2, 5, 6, 7, 8)
    inputs, dy, mask = make_inputs(*shape, torch.float32, device, "full_rows")
    out, mx, sm = gradops.floyd_attention(*inputs, mask.to(torch.uint8), 0.5, backend="triton")
    k_out, k_mx, k_sm = kernels.floyd_attention(*inputs, mask, 0.5)
    assert torch.equal(out, k_out) and torch.equal(mx, k_mx) and torch.equal(sm, k_sm)
    mx8 = mx.unsqueeze(-1).expand(*mx.shape, 8).contiguous()
    sm8 = sm.unsqueeze(-1).expand(*sm.shape, 8).contiguous()
    grads = gradops.floyd_attention_grad(dy, *inputs, out, mx8, sm8, mask, 0.5, backend="triton")
    for g, g_k in zip(grads, kernels.floyd_attention_grad(dy, *inputs, out, mx, sm, mask, 0.5)):
        assert torch.equal(g, g_k)


def test_bfloat16_interpreter(device):
    """bfloat16 loads, stores and casts through the interpreter. Its bf16 tl.dot is wrong
    (triton issue 11584), so on CPU the kernels widen bf16 tiles to float32 as they load
    them (UPCAST); the bf16 tensor-core path itself is tested on CUDA only (below)."""
    if device != "cpu":
        pytest.skip("the interpreter path; CUDA runs test_bfloat16_cuda")
    shape = (1, 2, 19, 21, 23, 20)
    inputs, dy, mask = make_inputs(*shape, torch.bfloat16, device, "full_rows")
    out, mx, sm, grads = run_kernels(inputs, dy, mask, 0.3)
    y_ref, mx_ref, sm_ref, grads_ref = oracle(inputs, dy, mask, 0.3)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert_close(out, y_ref, TOL[torch.bfloat16], "out")
    assert_stats(mx, sm, mx_ref, sm_ref, mask, shape[4], "stats")
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        assert_close(g, g_ref, TOL[torch.bfloat16], name)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="bfloat16 tl.dot is wrong in the Triton interpreter (triton issue 11584): CUDA only")
def test_bfloat16_cuda(device):
    if device != "cuda":
        pytest.skip("run with GRADOPS_TEST_DEVICE=cuda")
    shape = (2, 2, 33, 40, 70, 64)
    inputs, dy, mask = make_inputs(*shape, torch.bfloat16, device, "full_rows")
    out, mx, sm, grads = run_kernels(inputs, dy, mask, 0.125)
    y_ref, mx_ref, sm_ref, grads_ref = oracle(inputs, dy, mask, 0.125)
    assert_close(out, y_ref, TOL[torch.bfloat16], "out")
    assert_stats(mx, sm, mx_ref, sm_ref, mask, shape[4], "stats")
    for g, g_ref, name in zip(grads, grads_ref, GRAD_NAMES):
        assert_close(g, g_ref, TOL[torch.bfloat16], name)


def test_bench_quick_runs(capsys, tmp_path):
    from gradops.bench import floyd as bench

    assert bench.main(["--device", "cpu", "--quick", "--shape", "1,1,4,5,6,8", "--reps", "1",
                       "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "floyd_fwd" in text and "floyd_bwd" in text and "einsum" in text and "reference" in text
    assert bench.fwd_flops((1, 2, 3, 4, 5, 6)) == 8 * 720 and bench.bwd_flops((1, 2, 3, 4, 5, 6)) == 20 * 720


# ---------------------------------------------------------------------------------------------
# The scale: a kernel argument, exact (no per-call host-to-device copy)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [0.1, 1 / 3, -2.7182818284590451])
def test_scale_reaches_the_kernels_exactly(dtype, scale, device):
    """The scores are multiplied by the scale rounded to float32 (16/32-bit inputs, as the
    reference's float32 multiply does) or by the float64 scale itself (float64 inputs: not
    rounded to float32 on the way in). The inputs are small integers and D = 1, so each
    score's two products and their sum are exact however a device accumulates them (IEEE
    adds in the interpreter, an FMA chain or tensor-core MMA on a GPU): the multiply by the
    scale is the only rounding, and the softmax max must equal it, bitwise."""
    skip_if_floyd_float64_refused("triton", device, dtype)
    b, h, n, m, k, d = 1, 2, 5, 19, 20, 1
    gen = torch.Generator().manual_seed(17)
    shapes = [(b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)]
    # |q k1 + q k2| <= 2 * 15 * 15: exact in every dtype's products and in float32 sums
    exact = [torch.randint(-15, 16, s, generator=gen, device="cpu").double() for s in shapes]
    inputs = [t.to(dtype).to(device) for t in exact]
    _, mx, _ = kernels.floyd_attention(*inputs, None, scale)
    q, k1, _, k2, _ = (t[..., 0] for t in exact)
    s = q[..., None] * k1[:, :, :, None, :] + q[..., None] * k2.transpose(2, 3)[:, :, None]  # [B,H,N,M,K]
    if dtype == torch.float64:
        expected = (s * scale).amax(dim=-1)
        other = (s * float(torch.tensor(scale, dtype=torch.float32, device="cpu"))).amax(dim=-1)
    else:  # s times the float32 scale is exact in float64: .float() is the one rounding
        expected = (s * float(torch.tensor(scale, dtype=torch.float32, device="cpu"))).float().amax(dim=-1)
        other = (s * scale).float().amax(dim=-1)
    assert torch.equal(mx.cpu(), expected)
    # ... and the test can tell: the other rounding of the scale gives other maxima
    assert not torch.equal(other, expected)
    r_mx = reference.floyd_attention(*inputs, None, scale)[1]
    assert torch.equal(r_mx.cpu(), expected)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile for an H100 (sm_90): resources, and the order of each score's sum
# ---------------------------------------------------------------------------------------------
# The interpreter says nothing about registers or shared memory. Compile each kernel for
# sm_90 with Triton's bundled ptxas, specialised as the JIT specialises contiguous tensors
# whose sizes are multiples of 16, and read shared memory from the metadata and registers and
# local-memory spills (LDL/STL) from the SASS. Run in a child process: the interpreter is on
# in this one. Prints one JSON line per kernel (pytest -s shows them; docs/kernels-floyd.md
# records them).
#
# The same compiles say how each kernel sums a score's two products, which the interpreter
# cannot: it never folds an add into a dot, while the compiler's combiner does, and on a GPU
# the order of a dot's accumulation is part of its result (an FMA chain in float32, MMA for
# 16-bit inputs). A one-hot P is exactly one-hot in a backward pass only if that pass
# computes every score bitwise as the forward did. The TTIR (after the combiner) shows each
# score and dP product as a ``tt.dot`` whose left operand is loaded from Q or dY and whose
# right one from a key or value tensor; _score_chains traces every such dot to the kernel
# arguments those loads read, and pairs it with the dot whose result it accumulates onto.
def _score_chains(ttir):
    """[(pointer argument of the accumulating dot's keys/values, of the dot it accumulates
    onto), ...] for every score or dP product of a kernel's TTIR, the number of such
    products in no chain of two (products summed by an add the combiner left alone, or a
    chain of another shape), and each product's source location (``_dot_locations``). Names
    are resolved to their nearest earlier definition, as MLIR's scoping allows (sibling loop
    bodies may reuse a name; nested ones may not shadow)."""
    import re

    func = re.search(r"tt\.func public @\w+\((.*?)\) attributes", ttir)
    args = set(re.findall(r"%([\w$.-]+): ", func.group(1)))
    defs = {}  # name -> [(line number, op, operand names, text)]
    for number, line in enumerate(ttir.splitlines()):
        found = re.match(r"\s*%([\w$.-]+)(?::\d+)? = ([\w.]+)\b(.*)", line)
        if found:
            name, op, rest = found.groups()
            operands = re.findall(r"%([\w$.-]+)", rest.split(" : ")[0].split(" loc(")[0])
            defs.setdefault(name, []).append((number, op, operands, rest))

    def definition(name, at):
        earlier = [d for d in defs.get(name, ()) if d[0] < at]
        return earlier[-1] if earlier else None

    def through(name, at, ops):
        """The op defining ``name`` once the ops in ``ops`` (data movement) are passed."""
        d = definition(name, at)
        while d is not None and d[1] in ops:
            d = definition(d[2][0], d[0])
        return d

    def loaded_from(name, at, moves):
        """The kernel argument whose pointer a value was loaded through, or None."""
        d = through(name, at, moves)
        if d is None or d[1] != "tt.load":
            return None
        ptr, at = d[2][0], d[0]
        while ptr not in args:
            d = definition(ptr, at)
            if d is None or d[1] not in ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims"):
                return None
            ptr, at = d[2][0], d[0]
        return ptr

    casts = ("arith.extf", "arith.truncf", "ttg.convert_layout")
    products = {}  # line of a score/dP dot -> (its acc operand, the keys' or values' argument)
    for number, op, operands, _ in (d for entries in defs.values() for d in entries):
        if op == "tt.dot":
            left = loaded_from(operands[0], number, casts + ("tt.trans",))
            right = loaded_from(operands[1], number, casts)  # untransposed: batched as stored
            if left in ("q_ptr", "dy_ptr") and right is not None:
                products[number] = (operands[2], right)
    chains, paired = [], set()
    for number, (acc, right) in products.items():
        inner = through(acc, number, casts + ("tt.trans",))
        if inner is not None and inner[0] in products:
            zero = through(products[inner[0]][0], inner[0], casts)
            if zero is not None and zero[1] == "arith.constant" and re.search(r"dense<0\.0", zero[3]):
                chains.append((right, products[inner[0]][1]))
                paired.update({number, inner[0]})
    where = _dot_locations(ttir)
    return chains, len(products) - len(paired), [where[number] for number in sorted(products)]


# How each score and dP dot is lowered for the GPU, which the TTIR does not say yet: the TTGIR
# gives each dot its result encoding (#ttg.nvidia_mma: tensor-core MMA of that version;
# #ttg.blocked: FMA) and its operands' types. Accumulation orders agree only where both the
# kind of dot and the K each dot covers (the k-step over D) agree, so every pass must lower
# its score and dP dots alike. The dots are matched to the TTIR's products by their source
# location (names and call sites included), which lowering keeps.
def _dot_locations(ir):
    """{line number: source location spelled out} of every dot in an MLIR text."""
    import re

    aliases = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)$", ir, re.M))
    spelled = {}

    def spell(alias):
        if alias not in spelled:
            spelled[alias] = re.sub(r"#loc\d*", lambda m: spell(m.group(0)), aliases[alias])
        return spelled[alias]

    found = {}
    for number, line in enumerate(ir.splitlines()):
        if re.match(r"\s*%[\w$.-]+(?::\d+)? = (tt\.dot|ttng\.warp_group_dot)\b", line):
            found[number] = spell(re.search(r"loc\((#loc\d*)\)\s*$", line).group(1))
    return found


def _dot_lowerings(ttgir, locations):
    """For each source location, how the TTGIR's dot there is lowered: "<op> <operand type>
    K=<the operands' shared dimension> -> <result type> <encoding> <input precision>", the
    encoding an MMA's version and instruction shape or "blocked" (FMA), the precision IEEE
    where the TTGIR leaves out that default; "missing" or "ambiguous" where not exactly one
    dot is there."""
    import re

    encodings = dict(re.findall(r"^(#[\w.]+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    lines = ttgir.splitlines()
    at = {}
    for number, where in _dot_locations(ttgir).items():
        at.setdefault(where, []).append(lines[number])
    lowered = []
    for where in locations:
        if len(at.get(where, ())) != 1:
            lowered.append("missing" if where not in at else "ambiguous")
            continue
        line = at[where][0]
        op = re.search(r"= ([\w.]+) ", line).group(1)
        a_shape, a_type = re.search(r" : (?:tensor|!ttg\.memdesc)<([\dx]+)x(\w+)[,>]", line).groups()
        out_type, out_encoding = re.search(r"-> tensor<[\dx]+x(\w+), (#[\w.]+)>", line).groups()
        encoding = encodings[out_encoding]
        if encoding.startswith("#ttg.nvidia_mma"):
            version = ".".join(re.search(r"versionMajor = (\d+), versionMinor = (\d+)", encoding).groups())
            shape = re.search(r"instrShape = (\[[^]]*\])", encoding).group(1)
            kind = f"mma v{version} instrShape {shape}"
        else:
            kind = encoding.split("<")[0].removeprefix("#ttg.")
        precision = re.search(r"inputPrecision = (\w+)", line)
        lowered.append(f"{op} {a_type} K={a_shape.split('x')[-1]} -> {out_type} {kind}"
                       + f" {precision.group(1) if precision else 'ieee'}")
    return lowered


_COMPILE_SM90 = r"""
import json, sys, torch, triton
from gradops.bench.floyd import compile_check

for case in sys.argv[1:]:
    dtype_name, head_dim = case.split(":")
    del compiled[:]
    rows = compile_check(getattr(torch, dtype_name), int(head_dim))
    assert len(compiled) == len(rows)
    for row, kernel in zip(rows, compiled):
        if kernel is not None:
            row["score_chains"], row["score_products_unchained"], where = _score_chains(kernel.asm["ttir"])
            row["score_dots"] = _dot_lowerings(kernel.asm["ttgir"], where)
        print(json.dumps(row), flush=True)
"""

H100_SHARED = 227 * 1024
# the widths of floyd_config's table that the compiled tests and benchmarks use most
SM90_CASES = ("bfloat16:16", "bfloat16:32", "bfloat16:64", "bfloat16:128", "float32:16", "float32:32",
              "float32:64", "float64:32")


def _shipped(dtype_name: str, head_dim: int) -> bool:
    """Whether floyd_config's rule may give calls of this dtype and head dim to the fused
    kernels (float64, for checking, left out): there they must not spill."""
    element_size = getattr(torch, dtype_name).itemsize
    return element_size < 8 and "fused" in config.runnable(head_dim, element_size)


def _recorded_launches(monkeypatch):
    """{launch: which of K1, V1, K2, V2 each pointer argument of the launched kernel is}, from
    one fused forward and backward on CPU; asserts that the launchers pass the constexprs and
    launch options the compile check compiles with (floyd_config, _dkv_meta)."""
    inputs, dy, mask = make_inputs(1, 1, 2, 3, 4, 8, torch.float32, "cpu", "random")
    storages = {name: t.untyped_storage().data_ptr() for name, t in zip(("K1", "V1", "K2", "V2"), inputs[1:])}
    with monkeypatch.context() as patch:
        patch.setattr(config, "STRATEGY", "fused")
        seen = record_launches(patch)
        run_kernels(inputs, dy, mask, 0.5)
    launches = {}
    for fn, bound, kwargs in seen:
        sides = {arg: name for arg, t in bound.items() if isinstance(t, torch.Tensor)
                 for name, ptr in storages.items() if t.untyped_storage().data_ptr() == ptr}
        real = getattr(kernels, fn.__name__)
        if real is kernels._bwd_dkv_kernel:
            names = [n for n in ("bwd_dk1", "bwd_dk2")
                     if kernels._dkv_meta(n, config.floyd_config(n, 8, 4)).items() <= kwargs.items()]
        else:
            names = [n for n in ("fwd", "bwd_dq") if (real is kernels._fwd_kernel) == (n == "fwd")
                     and kernels._meta(config.floyd_config(n, 8, 4)).items() <= kwargs.items()]
        assert len(names) == 1 and names[0] not in launches, (real, kwargs)
        launches[names[0]] = sides
    assert sorted(launches) == sorted(config.KERNELS)
    return launches


def _assert_scores_summed_alike(rows, launches):
    """In every compiled kernel, each score and each dP is one chain of two dots: the product
    batched over n (K1, V1) accumulated onto the product batched over m (K2, V2), computed
    from zero; the forward holds one chain (S), the dQ kernel four (S, dP, in each of its two
    walks), each dK/dV launch two."""
    expected = {"fwd": 1, "bwd_dq": 4, "bwd_dk1": 2, "bwd_dk2": 2}
    for row in rows:
        sides = launches[row["kernel"]]
        chains = [tuple(sides[arg] for arg in chain) for chain in row["score_chains"]]
        assert row["score_products_unchained"] == 0 and len(chains) == expected[row["kernel"]], row
        assert all(chain in (("K1", "K2"), ("V1", "V2")) for chain in chains), (
            f"{row['kernel']} {row['dtype']} D={row['D']} sums its scores in another order than "
            f"'n-batched onto m-batched' (accumulating product, product it accumulates onto): {chains}")


@pytest.mark.slow
@pytest.mark.parametrize("triton_version", ["installed", "3.6"])
def test_kernels_compile_for_sm90_within_resources(triton_version, monkeypatch):
    """Every kernel compiles for an H100 at these configurations, within its shared memory;
    wherever floyd_config's rule ships the fused kernels (16-bit D <= 64, float32 D <= 16),
    without a register spill. (The spills of the configurations only a forced strategy
    reaches are recorded in docs/kernels-floyd.md.) And every pass computes each score and
    dP the same way: the forward, the dQ kernel and both dK/dV launches, as the launchers
    bind K1, V1, K2, V2 to each kernel's arguments, accumulate the n-batched product onto
    the m-batched one (a one-hot P is then one-hot in every pass on a GPU, where the dK2/dV2
    launch used to sum the other way round), and lower those dots alike: one kind of dot over
    one K per dtype and head dim, whatever each launch's tile (the dK2/dV2 launch's is 16x8 at
    widths <= 32 where the others' are 16x16)."""
    import inspect
    import json
    import os

    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip("triton's bundled CUDA tools are not installed")
    cases = SM90_CASES
    if triton_version == "3.6":
        # Triton 3.6 cannot lower the float64 batched dots for sm_90 (its LLVM pipeline fails):
        # float64 inputs on a GPU need Triton >= 3.9 (the interpreter runs them on any)
        cases = tuple(c for c in cases if not c.startswith("float64"))
    monkeypatch.setattr(config, "STRATEGY", None)  # the rule itself says what ships
    monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)
    helpers = "".join(inspect.getsource(f) for f in (_score_chains, _dot_locations, _dot_lowerings))
    script = RECORD_COMPILES + helpers + _COMPILE_SM90
    stdout = run_sm90_compile(script, *cases, timeout=900, triton_version=triton_version)
    rows = [json.loads(line) for line in stdout.splitlines()]
    print("\n".join(map(json.dumps, rows)))
    assert len(rows) == 4 * len(cases)
    for row in rows:
        assert "error" not in row, row
        assert row["shared"] <= H100_SHARED, row
        if _shipped(row["dtype"], row["D"]):
            assert row["spill_loads"] == row["spill_stores"] == 0, row
    _assert_scores_summed_alike(rows, _recorded_launches(monkeypatch))
    _assert_scores_lowered_alike(rows)


def _assert_scores_lowered_alike(rows):
    """Per dtype and head dim, every score and dP dot of the four kernels is lowered alike:
    one kind of dot over one K (``_dot_lowerings``)."""
    cases = {}
    for row in rows:
        assert len(row["score_dots"]) == 2 * len(row["score_chains"]), row
        assert not {"missing", "ambiguous"} & set(row["score_dots"]), row
        cases.setdefault((row["dtype"], row["D"]), {}).setdefault(row["kernel"], set()).update(row["score_dots"])
    for (dtype, head_dim), kernels_lowered in cases.items():
        assert len(set().union(*kernels_lowered.values())) == 1, (
            f"{dtype} D={head_dim}: the score and dP dots are lowered differently across passes "
            f"(their accumulation orders may differ on a GPU): {kernels_lowered}")
