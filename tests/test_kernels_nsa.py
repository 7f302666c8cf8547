"""The NSA compression Triton kernels (gradops.kernels.nsa_compress) against a float64
oracle written here (torch.unfold per sequence, gradients by autograd through it) and
against the reference backend (gradops.reference.nsa_compress).

On CPU the kernels run through the Triton interpreter (tests/conftest.py switches it on),
so shapes are small; GRADOPS_TEST_DEVICE=cuda runs the same tests compiled on a GPU.

Tolerances are error bounds, not fitted numbers. A result accumulated in float32 and
rounded once to its dtype differs from the exact (float64) value by at most
``ulp_half(dtype) * |exact| + n * 2**-24 * sum|terms|`` where n is the number of additions
in the longest accumulation chain and ``sum|terms|`` is the same formula applied to the
absolute values (so cancellation cannot hide an error). The oracle computes both.
"""
from __future__ import annotations

import math

import pytest
import torch

from gradops.kernels import nsa_compress as kernels
from gradops.kernels.nsa_config import BackwardConfig, ForwardConfig
from gradops.reference import nsa_compress as reference

from helpers import run_sm90_compile

F64 = torch.float64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Half a unit in the last place of each result dtype, relative (under the interpreter too:
# tests/conftest.py makes its float32 -> bfloat16 conversion round to nearest, as a GPU's).
ROUNDING = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
            torch.bfloat16: 2.0 ** -8}
# Half the spacing of the subnormals: the absolute rounding error near zero.
SUBNORMAL = {torch.float64: 0.0, torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25,
             torch.bfloat16: 2.0 ** -134}


# ---------------------------------------------------------------------------------------
# Oracle


def cumulative(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def blocks_in(length, block_size, stride):
    return (length - block_size) // stride + 1 if length >= block_size else 0


def oracle_forward(x, weight, block_size, stride, cu):
    """out[c] = sum_j w[j] x[start_c + j] in float64: unfold each sequence into its
    windows (batch order), weight them, sum over the window."""
    x, weight = x.to(F64), weight.to(F64)
    outs = []
    for b in range(len(cu) - 1):
        seq = x[cu[b]:cu[b + 1]]
        if blocks_in(seq.shape[0], block_size, stride) == 0:
            continue
        windows = seq.unfold(0, block_size, stride)  # [n_b, N, D, l]
        outs.append(torch.einsum("cndj,jn->cnd", windows, weight))
    if not outs:
        return x.new_zeros((0,) + tuple(x.shape[1:]))
    return torch.cat(outs)


def oracle_backward(dout, x, weight, block_size, stride, cu):
    """(dx, dweight) in float64 by autograd through :func:`oracle_forward`."""
    xl = x.detach().to(F64).requires_grad_()
    wl = weight.detach().to(F64).requires_grad_()
    out = oracle_forward(xl, wl, block_size, stride, cu)
    if out.numel() == 0:
        return torch.zeros_like(xl), torch.zeros_like(wl)
    dx, dw = torch.autograd.grad(out, (xl, wl), dout.to(F64), allow_unused=True)
    return (torch.zeros_like(xl) if dx is None else dx), (torch.zeros_like(wl) if dw is None else dw)


def assert_within(got, exact, magnitude, chain, what):
    """|got - exact| <= rounding(got.dtype)*|exact| + chain * 2^-24 * magnitude (elementwise)
    where magnitude is the exact result of the same formula on absolute values."""
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    if got.numel() == 0:
        return
    acc_eps = 2.0 ** -53 if got.dtype == F64 else 2.0 ** -24
    bound = ROUNDING[got.dtype] * exact.abs() + (chain + 1) * acc_eps * magnitude + SUBNORMAL[got.dtype]
    err = (got.to(F64) - exact).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements exceed their bound, e.g. error "
                           f"{err[bad].max().item():.3g} against bound {bound[bad].min().item():.3g}")


def check_forward(out, x, weight, block_size, stride, cu):
    exact = oracle_forward(x, weight, block_size, stride, cu)
    magnitude = oracle_forward(x.abs(), weight.abs(), block_size, stride, cu)
    assert out.dtype == x.dtype
    assert_within(out, exact, magnitude, block_size, "out")


def check_backward(dx, dw, dout, x, weight, block_size, stride, cu):
    exact_dx, exact_dw = oracle_backward(dout, x, weight, block_size, stride, cu)
    mag_dx, mag_dw = oracle_backward(dout.abs(), x.abs(), weight.abs(), block_size, stride, cu)
    assert dx.dtype == x.dtype and dw.dtype == x.dtype
    covering = math.ceil(block_size / stride)
    assert_within(dx, exact_dx, mag_dx, covering, "dx")
    # dweight sums C*D products per entry: bound the chain by that count.
    assert_within(dw, exact_dw, mag_dw, max(1, dout.shape[0] * dout.shape[2]), "dweight")


def make(lengths, heads, head_dim, block_size, dtype, device):
    cu = cumulative(lengths)
    x = torch.randn(cu[-1], heads, head_dim, dtype=F64).to(dtype).to(device)
    weight = torch.randn(block_size, heads, dtype=F64).to(dtype).to(device)
    return cu, x, weight


def num_blocks_of(cu, block_size, stride):
    return sum(blocks_in(b - a, block_size, stride) for a, b in zip(cu[:-1], cu[1:]))


def run_both(x, weight, block_size, stride, cu, *, fwd_cfg=None, bwd_cfg=None, dout=None):
    c = num_blocks_of(cu, block_size, stride)
    if fwd_cfg is None:
        out = kernels.nsa_compress(x, weight, block_size, stride, cu, c)
    else:
        out = kernels._forward(x, weight, block_size, stride, cu, c, fwd_cfg)
    if dout is None:
        dout = torch.randn(out.shape, dtype=F64).to(x.dtype).to(x.device)
    if bwd_cfg is None:
        dx, dw = kernels.nsa_compress_grad(dout, x, weight, block_size, stride, cu, c)
    else:
        dx, dw = kernels._backward(dout, x, weight, block_size, stride, cu, c, bwd_cfg)
    return out, dout, dx, dw


# Sequence mixes: empty, shorter than a block, exactly one block, several blocks with a
# tail, and empty sequences between others.
MIXES = {
    "mixed": [0, 3, 8, 0, 21, 13],
    "single": [37],
    "tails": [9, 10, 11, 12],
}
# (block_size, stride): divisible, non-divisible, equal, stride > block, stride 1, block 1;
# (11, 2) covers a token by 6 blocks, more than the kernel unrolls (a run-time loop).
BLOCK_STRIDES = [(8, 4), (5, 3), (4, 4), (3, 5), (4, 1), (1, 1), (6, 4), (11, 2)]


# ---------------------------------------------------------------------------------------
# Formula and reference


@pytest.mark.parametrize("block_size,stride", BLOCK_STRIDES)
@pytest.mark.parametrize("mix", list(MIXES))
def test_against_oracle_fp32(device, block_size, stride, mix):
    cu, x, weight = make(MIXES[mix], 3, 5, block_size, torch.float32, device)
    out, dout, dx, dw = run_both(x, weight, block_size, stride, cu)
    check_forward(out.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)
    check_backward(dx.cpu(), dw.cpu(), dout.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=str)
@pytest.mark.parametrize("heads,head_dim", [(1, 1), (2, 24), (4, 5)])
def test_dtypes_and_head_dims(device, dtype, heads, head_dim):
    block_size, stride = 6, 4
    cu, x, weight = make([0, 4, 19, 6, 14], heads, head_dim, block_size, dtype, device)
    out, dout, dx, dw = run_both(x, weight, block_size, stride, cu)
    check_forward(out.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)
    check_backward(dx.cpu(), dw.cpu(), dout.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,stride", [(8, 4), (5, 3), (3, 5)])
def test_against_reference_backend(device, dtype, block_size, stride):
    """Same inputs through the reference backend: both are float32-accumulated, so they
    agree within the sum of their two error bounds."""
    cu, x, weight = make(MIXES["mixed"], 2, 7, block_size, dtype, device)
    c = num_blocks_of(cu, block_size, stride)
    out, dout, dx, dw = run_both(x, weight, block_size, stride, cu)
    ref_out = reference.nsa_compress(x, weight, block_size, stride, cu, c)
    ref_dx, ref_dw = reference.nsa_compress_grad(dout, x, weight, block_size, stride, cu, c)
    for got, ref, what in ((out, ref_out, "out"), (dx, ref_dx, "dx"), (dw, ref_dw, "dweight")):
        assert got.shape == ref.shape and got.dtype == ref.dtype, what
    xc, wc, gc = x.cpu(), weight.cpu(), dout.cpu()
    exact_dx, exact_dw = oracle_backward(gc, xc, wc, block_size, stride, cu)
    mag_dx, mag_dw = oracle_backward(gc.abs(), xc.abs(), wc.abs(), block_size, stride, cu)
    exact_out = oracle_forward(xc, wc, block_size, stride, cu)
    mag_out = oracle_forward(xc.abs(), wc.abs(), block_size, stride, cu)
    chain_dw = c * x.shape[2]
    for got, ref, exact, mag, chain, what in (
            (out, ref_out, exact_out, mag_out, block_size, "out"),
            (dx, ref_dx, exact_dx, mag_dx, math.ceil(block_size / stride), "dx"),
            (dw, ref_dw, exact_dw, mag_dw, chain_dw, "dweight")):
        # |ours - ref| <= |ours - exact| + |ref - exact| <= 2 bounds
        acc_eps = 2.0 ** -24
        bound = 2 * (ROUNDING[dtype] * exact.abs() + (chain + 1) * acc_eps * mag + SUBNORMAL[dtype])
        err = (got.cpu().to(F64) - ref.cpu().to(F64)).abs()
        assert (err <= bound).all(), f"{what}: kernel and reference differ by {err.max().item():.3g}"


# ---------------------------------------------------------------------------------------
# Tilings: every split of the work must give the same sums


SMALL_BWD = [
    # rows < stride (several row slices), one head and a D slice per program, one stride
    # group per program (many programs per sequence), a tiny reduction tile.
    BackwardConfig(rows=2, block_h=1, block_d=2, groups_per_chunk=1, num_warps=4,
                   reduce_block_p=2, reduce_block_w=4),
    # two groups per program, heads tiled by two, rows cover a whole group
    BackwardConfig(rows=8, block_h=2, block_d=8, groups_per_chunk=2, num_warps=4,
                   reduce_block_p=4, reduce_block_w=8),
    # the run-time loop over covering blocks (what l/s past MAX_UNROLLED_COVER gets) for
    # every l/s, with rows and head dim split
    BackwardConfig(rows=2, block_h=2, block_d=4, groups_per_chunk=3, num_warps=4,
                   reduce_block_p=2, reduce_block_w=8, max_unrolled_cover=0, num_stages=1),
]
SMALL_FWD = [ForwardConfig(block_c=2, block_h=1, block_d=2, num_warps=4),
             ForwardConfig(block_c=4, block_h=2, block_d=4, num_warps=4)]


@pytest.mark.parametrize("tiling", [0, 1, 2])
@pytest.mark.parametrize("block_size,stride", [(6, 4), (3, 5), (4, 2)])
def test_tilings(device, tiling, block_size, stride):
    cu, x, weight = make([0, 2, 15, 7], 3, 5, block_size, torch.float32, device)
    out, dout, dx, dw = run_both(x, weight, block_size, stride, cu,
                                 fwd_cfg=SMALL_FWD[tiling % 2], bwd_cfg=SMALL_BWD[tiling])
    check_forward(out.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)
    check_backward(dx.cpu(), dw.cpu(), dout.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)


def test_many_heads(device):
    """More heads than one tile holds (N = 260 > 256)."""
    block_size, stride = 4, 2
    cu, x, weight = make([3, 9], 260, 2, block_size, torch.float32, device)
    out, dout, dx, dw = run_both(x, weight, block_size, stride, cu)
    check_forward(out.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)
    check_backward(dx.cpu(), dw.cpu(), dout.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)


def test_deterministic(device):
    """Bitwise equal results on repeated runs, with many programs contributing to dweight."""
    block_size, stride = 5, 2
    cu, x, weight = make([0, 17, 4, 23], 2, 6, block_size, torch.float32, device)
    c = num_blocks_of(cu, block_size, stride)
    dout = torch.randn(c, 2, 6, device=device)
    cfg = SMALL_BWD[1]
    first = kernels._backward(dout, x, weight, block_size, stride, cu, c, cfg)
    second = kernels._backward(dout, x, weight, block_size, stride, cu, c, cfg)
    default = [kernels.nsa_compress_grad(dout, x, weight, block_size, stride, cu, c) for _ in range(2)]
    for a, b in (first, second), default:
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    out = [kernels.nsa_compress(x, weight, block_size, stride, cu, c) for _ in range(2)]
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("block_size,stride", [(4, 4), (8, 4), (5, 2), (7, 2), (3, 5)])
def test_unrolled_blocks_match_the_loop(device, block_size, stride):
    """The unrolled (pipelined) covering blocks and the run-time loop over them add the
    same terms in the same order: bitwise equal dx and dweight, with 1 to 4 covering blocks
    and sequences with fewer blocks than that (the missing ones are masked)."""
    cu, x, weight = make([1, 5, 0, 13, 9], 2, 6, block_size, torch.bfloat16, device)
    c = num_blocks_of(cu, block_size, stride)
    dout = torch.randn(c, 2, 6, device=device).to(torch.bfloat16)
    cfg = kernels.nsa_config.backward_config(cu[-1], 2, 6, block_size, stride, device)
    assert kernels.backward_meta(cfg, block_size, stride)["COVER"] == -(-block_size // stride)
    loop = BackwardConfig(**{**cfg.__dict__, "max_unrolled_cover": 0})
    assert kernels.backward_meta(loop, block_size, stride)["COVER"] == 0
    unrolled = kernels._backward(dout, x, weight, block_size, stride, cu, c, cfg)
    looped = kernels._backward(dout, x, weight, block_size, stride, cu, c, loop)
    assert torch.equal(unrolled[0], looped[0]) and torch.equal(unrolled[1], looped[1])
    check_backward(unrolled[0].cpu(), unrolled[1].cpu(), dout.cpu(), x.cpu(), weight.cpu(),
                   block_size, stride, cu)


# ---------------------------------------------------------------------------------------
# Layouts and edge cases


def test_non_contiguous(device):
    """Views with arbitrary strides: heads-major x, a strided head dim, a transposed weight
    and a non-contiguous dout give the same results as their contiguous copies."""
    block_size, stride = 5, 3
    cu = cumulative([0, 12, 7, 16])
    T, N, D = cu[-1], 3, 4
    x = torch.randn(N, T, 2 * D, device=device).transpose(0, 1)[:, :, ::2]  # strides (2D, 2TD, 2)
    weight = torch.randn(N, block_size, device=device).t()
    c = num_blocks_of(cu, block_size, stride)
    dout = torch.randn(D, c, N, device=device).permute(1, 2, 0)
    assert not (x.is_contiguous() or weight.is_contiguous() or dout.is_contiguous())
    out = kernels.nsa_compress(x, weight, block_size, stride, cu, c)
    dx, dw = kernels.nsa_compress_grad(dout, x, weight, block_size, stride, cu, c)
    check_forward(out.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)
    check_backward(dx.cpu(), dw.cpu(), dout.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)
    xc, wc, gc = x.contiguous(), weight.contiguous(), dout.contiguous()
    assert torch.equal(out, kernels.nsa_compress(xc, wc, block_size, stride, cu, c))
    dxc, dwc = kernels.nsa_compress_grad(gc, xc, wc, block_size, stride, cu, c)
    assert torch.equal(dx, dxc) and torch.equal(dw, dwc)


@pytest.mark.parametrize("lengths", [[], [0], [0, 0], [2, 3, 0]], ids=str)
def test_no_blocks(device, lengths):
    """T = 0 or C = 0: empty out, zero dx (written even for tokens no block covers) and
    zero dweight."""
    block_size, stride = 4, 2
    cu, x, weight = make(lengths, 2, 3, block_size, torch.float16, device)
    assert num_blocks_of(cu, block_size, stride) == 0
    out = kernels.nsa_compress(x, weight, block_size, stride, cu, 0)
    assert out.shape == (0, 2, 3) and out.dtype == x.dtype
    dout = torch.empty(0, 2, 3, dtype=x.dtype, device=device)
    dx, dw = kernels.nsa_compress_grad(dout, x, weight, block_size, stride, cu, 0)
    assert dx.shape == x.shape and dw.shape == weight.shape
    assert dx.dtype == dw.dtype == x.dtype
    assert not dx.any() and not dw.any()


def test_uncovered_tokens_are_zero(device):
    """Tail tokens, gaps between windows (stride > block) and short sequences get exactly
    0 even where dx's memory held garbage: the kernel writes every row."""
    block_size, stride = 3, 5
    cu, x, weight = make([2, 14, 0, 9], 2, 3, block_size, torch.float32, device)
    c = num_blocks_of(cu, block_size, stride)
    dout = torch.randn(c, 2, 3, device=device)
    dx, _ = kernels.nsa_compress_grad(dout, x, weight, block_size, stride, cu, c)
    covered = torch.zeros(cu[-1], dtype=torch.bool)
    for b in range(len(cu) - 1):
        for i in range(blocks_in(cu[b + 1] - cu[b], block_size, stride)):
            covered[cu[b] + i * stride: cu[b] + i * stride + block_size] = True
    assert not covered.all()
    assert (dx.cpu()[~covered] == 0).all()
    assert (dx.cpu()[covered] != 0).any()


@pytest.mark.parametrize("tiling", [0, 1, 2])
@pytest.mark.parametrize("block_size,stride", [(6, 4), (3, 5), (4, 1)])
def test_nan_stays_in_its_blocks_with_small_tilings(device, tiling, block_size, stride):
    """NaNs in dOut and x reach exactly the dx and dweight entries the formulas give, with
    tilings that split rows, heads and head dim, unrolled and in a run-time loop ((4, 1) on
    tiling 2 keeps the dweight partial in its own array). One call: every block's dOut gets a NaN in its own
    (head, dim) slot of heads 0-1, so the dx patterns cannot overlap; x gets NaNs in head 2
    at every token no block covers (must reach nothing) and at one covered token."""
    heads, dims = 3, 5
    cu, x, weight = make([2, 9, 0, 6], heads, dims, block_size, torch.float32, device)
    starts = [cu[b] + i * stride for b in range(len(cu) - 1)
              for i in range(blocks_in(cu[b + 1] - cu[b], block_size, stride))]
    c = len(starts)
    assert c <= 2 * dims
    dout = torch.randn(c, heads, dims, device=device)
    want_dx = torch.zeros(x.shape, dtype=torch.bool)
    want_dw = torch.zeros(weight.shape, dtype=torch.bool)
    for i, start in enumerate(starts):
        n, d = i % 2, i // 2
        dout[i, n, d] = float("nan")
        want_dx[start:start + block_size, n, d] = True  # dx[start + j] += w[j] * dout[i]
        want_dw[:, n] = True  # dweight[j, n] sums dout[i, n, d] * x[start + j, n, d]
    covering = {t: [t - s for s in starts if s <= t < s + block_size] for t in range(cu[-1])}
    uncovered = [t for t, js in covering.items() if not js]
    assert uncovered
    for t in uncovered:
        x[t, 2, t % dims] = float("nan")
    t = starts[-1] + block_size - 1  # covered by the last block (and its neighbours when they overlap)
    x[t, 2, 0] = float("nan")
    for j in covering[t]:
        want_dw[j, 2] = True
    dx, dw = kernels._backward(dout, x, weight, block_size, stride, cu, c, SMALL_BWD[tiling])
    assert torch.equal(torch.isnan(dx).cpu(), want_dx), torch.isnan(dx).nonzero().tolist()
    assert torch.equal(torch.isnan(dw).cpu(), want_dw), torch.isnan(dw).nonzero().tolist()
    assert torch.isfinite(dx[~want_dx.to(dx.device)]).all() and torch.isfinite(dw[~want_dw.to(dw.device)]).all()


def test_infinite_input_leaves_dx_finite(device):
    """dx does not depend on x: an infinite x must not poison it."""
    block_size, stride = 4, 2
    cu, x, weight = make([10], 1, 4, block_size, torch.float32, device)
    x[3, 0, 1] = float("inf")
    c = num_blocks_of(cu, block_size, stride)
    dout = torch.randn(c, 1, 4, device=device)
    dx, _ = kernels.nsa_compress_grad(dout, x, weight, block_size, stride, cu, c)
    assert torch.isfinite(dx).all()
    exact_dx, _ = oracle_backward(dout.cpu(), torch.zeros_like(x).cpu(), weight.cpu(), block_size, stride, cu)
    assert torch.allclose(dx.cpu().to(F64), exact_dx, rtol=1e-6, atol=1e-6)


def test_num_blocks_mismatch_is_an_internal_error(device):
    from gradops.errors import ACLNN_ERR_INNER, AclnnError

    cu, x, weight = make([10], 1, 4, 4, torch.float32, device)
    with pytest.raises(AclnnError) as err:
        kernels.nsa_compress(x, weight, 4, 2, cu, 3)
    assert err.value.status == ACLNN_ERR_INNER


def test_public_api_runs_the_kernels(device):
    """backend='triton' through gradops reaches these kernels (per-sequence lengths)."""
    import gradops

    block_size, stride = 5, 3
    lengths = [0, 11, 4, 8]
    cu, x, weight = make(lengths, 2, 6, block_size, torch.bfloat16, device)
    out = gradops.nsa_compress(x, weight, block_size, stride, lengths, seq_lens_type="lengths",
                               backend="triton")
    check_forward(out.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)
    dout = torch.randn(out.shape, device=device).to(out.dtype)
    dx, dw = gradops.nsa_compress_grad(dout, x, weight, block_size, stride, cu[1:], backend="triton")
    check_backward(dx.cpu(), dw.cpu(), dout.cpu(), x.cpu(), weight.cpu(), block_size, stride, cu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with > 20 GB free")
def test_int64_offsets_cuda(device):
    """T*N*D past 2^31 elements: the last sequence's blocks and tokens, checked against the
    oracle on that sequence alone."""
    if device != "cuda" or torch.cuda.mem_get_info()[0] < 20 * 2 ** 30:
        pytest.skip("needs GRADOPS_TEST_DEVICE=cuda and 20 GB free")
    N, D, block_size, stride = 16, 128, 32, 16
    T = 2 ** 31 // (N * D) + 4096
    tail = 200
    cu = [0, T - tail, T]
    x = torch.randn(T, N, D, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(block_size, N, device="cuda", dtype=torch.bfloat16)
    c = num_blocks_of(cu, block_size, stride)
    out = kernels.nsa_compress(x, weight, block_size, stride, cu, c)
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16)
    dx, dw = kernels.nsa_compress_grad(dout, x, weight, block_size, stride, cu, c)
    c_tail = blocks_in(tail, block_size, stride)
    local = [0, tail]
    xs, gs = x[T - tail:].cpu(), dout[c - c_tail:].cpu()
    check_forward(out[c - c_tail:].cpu(), xs, weight.cpu(), block_size, stride, local)
    exact_dx, _ = oracle_backward(gs, xs, weight.cpu(), block_size, stride, local)
    mag_dx, _ = oracle_backward(gs.abs(), xs.abs(), weight.cpu().abs(), block_size, stride, local)
    assert_within(dx[T - tail:].cpu(), exact_dx, mag_dx, 2, "dx tail")


# ---------------------------------------------------------------------------------------
# Compiled code without a GPU: the interpreter never compiles, so type or lowering errors
# would only show on a GPU. Compile for sm_90 with the bundled ptxas, as the JIT would
# specialise a contiguous [T, N, D] bf16 problem (block size, stride and heads multiples of
# 16, as CANN requires), with the launch parameters nsa_config picks for it, and check what
# the configuration is built on: registers within nsa_config's budgets, no local memory
# (spills), and in the backward's pipelined group loop asynchronous copies (cp.async) in
# place of its loads. Under the installed (newest) Triton and under 3.6, the GPU image's.

_COMPILE_SM90 = r"""
import os, re, subprocess, sys, tempfile
import torch
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gradops.kernels import nsa_compress as K, nsa_config as C

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TYPES = {**{n: "*bf16" for n in ("x_ptr", "w_ptr", "out_ptr", "dout_ptr", "dx_ptr")},
         **{n: "*i64" for n in ("cu_seqlens_ptr", "cu_blocks_ptr", "cu_chunks_ptr")},
         "part_ptr": "*fp32"}
UNIT = ("sx_d", "so_d", "sg_d", "sdx_d", "sw_n")
DIV16 = ("sx_t", "sx_n", "so_c", "so_n", "sg_c", "sg_n", "sdx_t", "sdx_n", "head_dim", "sw_j", "width",
         "num_heads", "block_size", "stride")

def usage(name, fn, consts, types=TYPES):
    sig, attrs = {}, {}
    consts = dict(consts, ACC=tl.float32)
    for i, n in enumerate(fn.arg_names):
        if n in UNIT:
            consts[n] = 1
        if n in consts:
            sig[n] = "constexpr"
            continue
        sig[n] = types.get(n, "i32")
        if n in DIV16 or n.endswith("_ptr"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                         capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name],
                          capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ptx = k.asm["ptx"]
    # A pipelined loop carries the tokens of the copies it has in flight.
    pipelined = any("!ttg.async.token" in line for line in k.asm["ttgir"].splitlines() if "scf.for" in line)
    print(name, re.search(r"REG:(\d+)", res).group(1), len(re.findall(r"\b(?:STL|LDL)\b", sass)),
          ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global"),
          ptx.count("ld.global.v"), int(pipelined), flush=True)

def bwd(name, heads, dim, l, s, max_unrolled_cover=C.MAX_UNROLLED_COVER):
    cfg = C.backward_config(131072, heads, dim, l, s, torch.device("cpu"))
    cfg = type(cfg)(**{**cfg.__dict__, "max_unrolled_cover": max_unrolled_cover})
    usage(name, K._nsa_compress_bwd_kernel, K.backward_meta(cfg, l, s))

f = C.forward_config(64, 128, 32, 16)
usage("fwd", K._nsa_compress_fwd_kernel, {"BLOCK_C": f.block_c, "BLOCK_H": f.block_h, "BLOCK_D": f.block_d})
bwd("bwd", 64, 128, 32, 16)        # the training shape: ceil(l/s) = 2, 16 x 1 x 128 tiles
bwd("bwd_d64", 64, 64, 64, 32)     # 16 x 2 x 64 tiles
bwd("bwd_k1", 16, 128, 16, 16)     # l = s: one block per token
bwd("bwd_k4", 16, 128, 64, 16)     # 4 blocks: half tiles
bwd("bwd_loop", 16, 128, 128, 16)  # 8 blocks: run-time loop over them, not pipelined
# ceil(l/s) > BLOCK_D (tiny head dims, stride 1): dweight partial in its own array
usage("bwd_k_array", K._nsa_compress_bwd_kernel, {"ROWS": 1, "BLOCK_H": 16, "BLOCK_D": 16, "K_PAD": 32,
                                                  "COVER": 0, "NUM_STAGES": 1, "DW_IN_TILE": False})
usage("sum", K._sum_rows_kernel, {"BLOCK_P": 128, "BLOCK_W": 64}, {"part_ptr": "*fp32", "out_ptr": "*bf16"})
"""


@pytest.mark.parametrize("triton_version", ["installed", "3.6"])
def test_compiles_for_sm90_within_register_budget(triton_version):
    import os

    import triton

    from gradops.kernels import nsa_config

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's bundled ptxas is not installed")
    stdout = run_sm90_compile(_COMPILE_SM90, timeout=300, triton_version=triton_version)
    usage = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in stdout.splitlines()}
    assert len(usage) == 8, stdout
    for kernel, (regs, local, async_copies, vector_loads, pipelined) in usage.items():
        assert local == 0, f"{kernel} spills ({local} local-memory instructions)"
        if kernel.startswith("bwd") and kernel not in ("bwd_loop", "bwd_k_array"):
            # The group loop's x tiles and dOut rows go through cp.async, 16 bytes a copy.
            assert pipelined and async_copies > 0, f"{kernel}: the group loop is not pipelined"
            assert regs <= nsa_config.BWD_MAX_REGISTERS, (
                f"{kernel} needs {regs} registers; nsa_config assumes <= {nsa_config.BWD_MAX_REGISTERS}")
        else:
            assert vector_loads > 0 or kernel == "bwd_k_array", f"{kernel}: loads are not vectorised"
            assert regs <= 96, f"{kernel} needs {regs} registers"
    assert not usage["bwd_loop"][4] and not usage["bwd_k_array"][4]
