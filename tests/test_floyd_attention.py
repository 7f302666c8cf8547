"""Floyd (pivotal) attention (``gradops.floyd_attention`` / ``floyd_attention_grad``) on the
reference backend, through the public API, against the independent float64 oracles of
``gradops.oracles`` (the full ``[B,H,N,M,K]`` score tensor, autograd for the backward)."""
import functools
import re

import pytest
import torch

import gradops
import gradops.reference.floyd_attention as reference_floyd
from gradops import oracles
from gradops.oracles import TOLERANCE, rel_error

from conftest import FLOYD_BACKENDS, TEST_DEVICE
from helpers import skip_if_floyd_float64_refused

BACKEND = "reference"
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FLT_MAX = 3.4028234663852886e38  # float32's largest finite value, exactly


def attention(q, k1, v1, k2, v2, mask=None, scale=1.0):
    return gradops.floyd_attention(q, k1, v1, k2, v2, mask, scale, backend=BACKEND)


def attention_grad(dy, q, k1, v1, k2, v2, out, smax, ssum, mask=None, scale=1.0):
    return gradops.floyd_attention_grad(dy, q, k1, v1, k2, v2, out, smax, ssum, mask, scale, backend=BACKEND)


def make_inputs(b, h, n, m, k, d, dtype=torch.float32, device="cpu"):
    """q, k1, v1, k2, v2 generated in float32 and rounded to ``dtype`` (the oracle is fed the
    same rounded values)."""
    shapes = [(b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)]
    return [torch.randn(s, device=device).to(dtype) for s in shapes]


def random_mask(b, n, k, dtype=torch.bool, device="cpu", p=0.3):
    return (torch.rand(b, 1, n, 1, k, device=device) < p).to(dtype)


def stat_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_against_oracle(inputs, mask, scale, dtype, dy=None):
    """Forward and backward within the dtype's tolerance of the float64 oracles; returns the
    library's results."""
    q = inputs[0]
    b, h, n, m, _ = q.shape
    out, smax, ssum = attention(*inputs, mask=mask, scale=scale)
    assert out.dtype == dtype and out.shape == q.shape
    for stat in (smax, ssum):
        assert stat.dtype == stat_dtype(dtype) and stat.shape == (b, h, n, m)
    out_ref, smax_ref, ssum_ref = oracles.floyd_attention(*inputs, mask=mask, scale=scale)
    tol = TOLERANCE[dtype]
    assert rel_error(out, out_ref) <= tol
    # The statistics are computed and kept in float32 (float64) from the same rounded inputs.
    assert rel_error(smax, smax_ref) <= TOLERANCE[stat_dtype(dtype)]
    assert rel_error(ssum, ssum_ref) <= TOLERANCE[stat_dtype(dtype)]

    if dy is None:
        dy = torch.randn(q.shape, device=q.device).to(dtype)
    grads = attention_grad(dy, *inputs, out, smax, ssum, mask=mask, scale=scale)
    grads_ref = oracles.floyd_attention_backward(dy, *inputs, mask=mask, scale=scale)
    for name, g, g_ref, t in zip(("dq", "dk1", "dv1", "dk2", "dv2"), grads, grads_ref, inputs):
        assert g.dtype == dtype and g.shape == t.shape, name
        assert rel_error(g, g_ref) <= tol, (name, rel_error(g, g_ref))
    return (out, smax, ssum), grads


SHAPES = [(2, 3, 5, 4, 6, 8), (1, 2, 3, 7, 5, 3), (2, 1, 4, 4, 9, 16)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_oracle(shape, masked, dtype, device):
    b, h, n, m, k, d = shape
    inputs = make_inputs(*shape, dtype=dtype, device=device)
    mask = random_mask(b, n, k, device=device) if masked else None
    check_against_oracle(inputs, mask, 0.3, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_output_dtypes(dtype, device):
    inputs = make_inputs(1, 2, 3, 4, 5, 3, dtype, device)
    out, smax, ssum = attention(*inputs, mask=random_mask(1, 3, 5, device=device))
    assert smax.dtype == ssum.dtype == stat_dtype(dtype)
    assert out.dtype == dtype


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_float64_float32(seed, device):
    gen = torch.Generator().manual_seed(seed)
    shape = [int(v) for v in torch.randint(1, 7, (6,), generator=gen, device="cpu")]
    scale = float(torch.rand((), generator=gen, device="cpu")) * 2 - 0.5
    for dtype in (torch.float64, torch.float32):
        inputs = make_inputs(*shape, dtype=dtype, device=device)
        mask = random_mask(shape[0], shape[2], shape[4], torch.uint8, device) if seed % 2 else None
        check_against_oracle(inputs, mask, scale, dtype)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8], ids=str)
def test_uint8_and_bool_masks_agree(mask_dtype, device):
    inputs = make_inputs(2, 2, 4, 3, 6, 4, torch.float64, device)
    mask = random_mask(2, 4, 6, mask_dtype, device)
    (out, smax, ssum), grads = check_against_oracle(inputs, mask, 0.5, torch.float64)
    out_b, smax_b, ssum_b = attention(*inputs, mask=mask.bool(), scale=0.5)
    assert torch.equal(out, out_b) and torch.equal(smax, smax_b) and torch.equal(ssum, ssum_b)
    # uint8 values other than 1 also mean "masked out"
    if mask_dtype == torch.uint8:
        out_7, _, _ = attention(*inputs, mask=mask * 7, scale=0.5)
        assert torch.equal(out, out_7)


class _Floyd(torch.autograd.Function):
    """Forward through gradops.floyd_attention, backward through gradops.floyd_attention_grad,
    so that gradcheck compares the library's backward with finite differences of its forward."""

    @staticmethod
    def forward(ctx, q, k1, v1, k2, v2, mask, scale):
        out, smax, ssum = attention(q, k1, v1, k2, v2, mask=mask, scale=scale)
        ctx.save_for_backward(q, k1, v1, k2, v2, out, smax, ssum)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, dy):
        grads = attention_grad(dy, *ctx.saved_tensors, mask=ctx.mask, scale=ctx.scale)
        return grads + (None, None)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask-with-full-row"])
def test_gradcheck_finite_differences(masked, device):
    b, h, n, m, k, d = 1, 2, 3, 2, 4, 3
    inputs = [t.requires_grad_() for t in make_inputs(b, h, n, m, k, d, torch.float64, device)]
    mask = None
    if masked:
        mask = torch.zeros(b, 1, n, 1, k, dtype=torch.bool, device=device)
        mask[0, 0, 0, 0, 1] = mask[0, 0, 2, 0, 3] = True
        mask[0, 0, 1] = True  # row n = 1: every pivot removed
    assert torch.autograd.gradcheck(lambda *t: _Floyd.apply(*t, mask, 0.7), tuple(inputs))


def test_fully_masked_rows(device):
    b, h, n, m, k, d = 2, 2, 4, 3, 5, 4
    inputs = make_inputs(b, h, n, m, k, d, torch.float64, device)
    q, k1, v1, k2, v2 = inputs
    mask = random_mask(b, n, k, device=device, p=0.2)
    mask[0, 0, 1] = True
    mask[1, 0, 3] = True
    mask[0, 0, 2] = False
    full = [(0, 1), (1, 3)]
    dy = torch.randn(q.shape, dtype=torch.float64, device=device)
    (out, smax, ssum), (dq, dk1, dv1, dk2, dv2) = check_against_oracle(inputs, mask, 0.5, torch.float64, dy)

    for bi, ni in full:
        # uniform softmax: the statistics CANN defines, and the plain mean over the pivots
        assert torch.all(smax[bi, :, ni] == -FLT_MAX)
        assert torch.all(ssum[bi, :, ni] == k)
        mean = (v1[bi, :, ni, :, None, :] + v2[bi]).mean(dim=1)  # [H, M, D]
        assert rel_error(out[bi, :, ni], mean) <= 1e-12
        # the scores of that row are constants: no gradient to q or k1 from it
        assert torch.all(dq[bi, :, ni] == 0)
        assert torch.all(dk1[bi, :, ni] == 0)
        # ... but the values still receive P * dy with P = 1/K
        expected_dv1 = dy[bi, :, ni].sum(dim=1)[:, None, :].expand(h, k, d) / k
        assert rel_error(dv1[bi, :, ni], expected_dv1) <= 1e-12

    # dk2/dv2 sum over n: the fully masked rows add nothing to dk2 and exactly P*dy = dy/K to dv2.
    keep = [i for i in range(n) if (0, i) not in full]
    sub = [q[:1, :, keep], k1[:1, :, keep], v1[:1, :, keep], k2[:1], v2[:1]]
    sub_out, sub_smax, sub_ssum = attention(*sub, mask=mask[:1, :, keep], scale=0.5)
    _, _, _, sub_dk2, sub_dv2 = attention_grad(dy[:1, :, keep], *sub, sub_out, sub_smax, sub_ssum,
                                               mask=mask[:1, :, keep], scale=0.5)
    assert rel_error(dk2[:1], sub_dk2) <= 1e-12
    assert rel_error(dv2[0] - sub_dv2[0], (dy[0, :, 1] / k)[:, None].expand(h, k, m, d)) <= 1e-12


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_fully_masked_statistics_in_every_dtype(dtype, device):
    inputs = make_inputs(1, 1, 2, 3, 4, 2, dtype, device)
    mask = torch.ones(1, 1, 2, 1, 4, dtype=torch.uint8, device=device)
    out, smax, ssum = attention(*inputs, mask=mask)
    # -3.4028235e38 itself, not -inf, in float64 as well
    assert smax.dtype == stat_dtype(dtype)
    assert torch.all(smax == -FLT_MAX) and torch.all(ssum == 4)
    _, _, v1, _, v2 = inputs
    v1_nk = v1[0, 0].to(torch.float64)[:, None]  # [N, 1, K, D]
    v2_mk = v2[0, 0].to(torch.float64).transpose(0, 1)[None]  # [1, M, K, D]
    mean = (v1_nk + v2_mk).mean(dim=2)
    assert rel_error(out[0, 0], mean) <= TOLERANCE[dtype]


def test_statistics_compact_or_cann_layout(device):
    inputs = make_inputs(2, 2, 3, 4, 5, 3, torch.float32, device)
    mask = random_mask(2, 3, 5, device=device)
    out, smax, ssum = attention(*inputs, mask=mask)
    dy = torch.randn_like(out)
    compact = attention_grad(dy, *inputs, out, smax, ssum, mask=mask)
    smax8, ssum8 = smax[..., None].expand(*smax.shape, 8), ssum[..., None].expand(*ssum.shape, 8)
    for pair in ((smax8, ssum8), (smax8.contiguous(), ssum8.contiguous()), (smax, ssum8), (smax8, ssum)):
        replicated = attention_grad(dy, *inputs, out, *pair, mask=mask)
        for a, b in zip(compact, replicated):
            assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 1), (1, 2, 1, 3, 4, 2), (2, 1, 3, 1, 2, 3),
                                   (1, 2, 3, 4, 1, 5), (2, 2, 3, 2, 4, 1)],
                         ids=["all1", "N1", "M1", "K1", "D1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_unit_sizes(shape, dtype, device):
    b, h, n, m, k, d = shape
    check_against_oracle(make_inputs(*shape, dtype=dtype, device=device), random_mask(b, n, k, device=device),
                         1.0, dtype)


def test_single_pivot_is_plain_sum(device):
    # K = 1: P == 1, so out = V1 + V2 and the score gradients vanish
    q, k1, v1, k2, v2 = make_inputs(2, 2, 3, 4, 1, 5, torch.float64, device)
    out, smax, ssum = attention(q, k1, v1, k2, v2, scale=0.9)
    assert rel_error(out, v1.expand(-1, -1, -1, 4, -1) + v2.expand(-1, -1, 3, -1, -1)) <= 1e-12
    assert torch.all(ssum == 1)
    dq, dk1, _, dk2, _ = attention_grad(torch.randn_like(out), q, k1, v1, k2, v2, out, smax, ssum, scale=0.9)
    for g in (dq, dk1, dk2):
        assert g.abs().max() <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_non_contiguous_views(dtype, device):
    b, h, n, m, k, d = 2, 3, 4, 5, 3, 4
    q = torch.randn(m, b, n, h, 2 * d, device=device).to(dtype).permute(1, 3, 2, 0, 4)[..., ::2]
    k1 = torch.randn(b, h, n, k + 2, d, device=device).to(dtype)[:, :, :, 1:-1]
    v1 = torch.randn(d, b, h, n, k, device=device).to(dtype).permute(1, 2, 3, 4, 0)
    k2 = torch.randn(b, h, m, k, d, device=device).to(dtype).transpose(2, 3)
    v2 = torch.randn(b, 2 * h, k, m, d, device=device).to(dtype)[:, 1::2]
    mask = (torch.rand(b, k, n, device=device) < 0.3).transpose(1, 2)[:, None, :, None, :]
    dy = torch.randn(b, h, n, m, d + 1, device=device).to(dtype)[..., 1:]
    inputs = [q, k1, v1, k2, v2]
    for t in inputs + [mask, dy]:
        assert not t.is_contiguous()
    for t, shape in zip(inputs, [(b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)]):
        assert t.shape == shape
    (out, smax, ssum), grads = check_against_oracle(inputs, mask, 0.4, dtype, dy)
    # non-contiguous output and statistics given back to the backward
    out_nc = out.transpose(0, 3).contiguous().transpose(0, 3)
    smax_nc = smax.transpose(1, 2).contiguous().transpose(1, 2)
    assert not out_nc.is_contiguous() and not smax_nc.is_contiguous()
    again = attention_grad(dy, *inputs, out_nc, smax_nc, ssum, mask=mask, scale=0.4)
    for a, g in zip(again, grads):
        assert rel_error(a, g) <= TOLERANCE[dtype]


@pytest.mark.parametrize("scale", [0.0, 0.125, -1.5, 3.0, 1])
def test_scale_values(scale, device):
    inputs = make_inputs(1, 2, 3, 4, 5, 3, torch.float64, device)
    mask = random_mask(1, 3, 5, device=device)
    mask[0, 0, 0] = False
    (out, smax, ssum), _ = check_against_oracle(inputs, mask, scale, torch.float64)
    if scale == 0.0:
        # every live pivot scores 0: max 0 and a uniform softmax over the unmasked pivots
        live = (~mask).sum(dim=-1).expand(smax.shape)  # [B, 1, N, 1] -> [B, H, N, M]
        rows = live > 0
        assert torch.all(smax[rows] == 0)
        assert torch.equal(ssum[rows], live[rows].to(ssum.dtype))


def test_default_scale_is_one(device):
    inputs = make_inputs(1, 1, 2, 3, 4, 2, torch.float64, device)
    out_default = gradops.floyd_attention(*inputs, backend=BACKEND)
    out_one = attention(*inputs, scale=1.0)
    for a, b in zip(out_default, out_one):
        assert torch.equal(a, b)


def test_nan_propagation_forward(device):
    b, h, n, m, k, d = 1, 2, 3, 4, 5, 2
    q, k1, v1, k2, v2 = make_inputs(b, h, n, m, k, d, torch.float32, device)
    mask = torch.zeros(b, 1, n, 1, k, dtype=torch.bool, device=device)
    mask[0, 0, 2, 0, 4] = True

    def nan_rows(out):
        return torch.isnan(out).any(dim=-1)[0]  # [H, N, M]

    q_nan = q.clone()
    q_nan[0, 1, 0, 2, 1] = float("nan")  # one query: one output row
    out = attention(q_nan, k1, v1, k2, v2, mask=mask)[0]
    expected = torch.zeros(h, n, m, dtype=torch.bool, device="cpu")
    expected[1, 0, 2] = True
    assert torch.equal(nan_rows(out).cpu(), expected)
    assert torch.isnan(out[0, 1, 0, 2]).all()

    k1_nan = k1.clone()
    k1_nan[0, 0, 1, 3, 0] = float("nan")  # pivot 3 of row n=1: every m of that n
    out = attention(q, k1_nan, v1, k2, v2, mask=mask)[0]
    expected = torch.zeros(h, n, m, dtype=torch.bool, device="cpu")
    expected[0, 1, :] = True
    assert torch.equal(nan_rows(out).cpu(), expected)

    k2_nan = k2.clone()
    k2_nan[0, 1, 2, 3, 1] = float("nan")  # pivot 2 of column m=3: every n of that m
    out = attention(q, k1, v1, k2_nan, v2, mask=mask)[0]
    expected = torch.zeros(h, n, m, dtype=torch.bool, device="cpu")
    expected[1, :, 3] = True
    assert torch.equal(nan_rows(out).cpu(), expected)

    k1_masked_nan = k1.clone()
    k1_masked_nan[0, 0, 2, 4, 0] = float("nan")  # a masked pivot's score is replaced, NaN included
    out, smax, ssum = attention(q, k1_masked_nan, v1, k2, v2, mask=mask)
    assert not torch.isnan(out).any() and not torch.isnan(smax).any() and not torch.isnan(ssum).any()
    assert rel_error(out, oracles.floyd_attention(q, k1_masked_nan, v1, k2, v2, mask)[0]) <= 2e-5


def test_nan_propagation_backward(device):
    b, h, n, m, k, d = 1, 2, 3, 4, 5, 2
    inputs = make_inputs(b, h, n, m, k, d, torch.float64, device)
    out, smax, ssum = attention(*inputs)
    dy = torch.randn_like(out)
    dy[0, 1, 2, 0, 1] = float("nan")
    dq, dk1, dv1, dk2, dv2 = attention_grad(dy, *inputs, out, smax, ssum)
    grads_ref = oracles.floyd_attention_backward(dy, *inputs)
    # rel_error is inf unless the NaN positions match the oracle's exactly
    for g, g_ref in zip((dq, dk1, dv1, dk2, dv2), grads_ref):
        assert rel_error(g, g_ref) <= 1e-10
    assert torch.isnan(dq[0, 1, 2, 0]).all() and torch.isnan(dq).sum() == d
    assert torch.isnan(dk1[0, 1, 2]).all() and torch.isnan(dk1).sum() == k * d
    assert torch.isnan(dk2[0, 1, :, 0]).all() and torch.isnan(dk2).sum() == k * d
    # the values' gradients are sums of P * dy: only the NaN's own feature d
    assert torch.isnan(dv1[0, 1, 2, :, 1]).all() and torch.isnan(dv1).sum() == k
    assert torch.isnan(dv2[0, 1, :, 0, 1]).all() and torch.isnan(dv2).sum() == k


@pytest.mark.parametrize("shape", [(0, 2, 3, 4, 5, 2), (1, 0, 3, 4, 5, 2), (1, 2, 3, 4, 5, 0)],
                         ids=["B0", "H0", "D0"])
def test_empty_tensors(shape, device):
    _check_empty(shape, device)


@pytest.mark.parametrize("shape", [(1, 2, 0, 4, 5, 2), (1, 2, 3, 0, 5, 2), (1, 2, 0, 0, 5, 2), (0, 2, 3, 4, 0, 2)],
                         ids=["N0", "M0", "N0M0", "B0K0"])
def test_empty_problems(shape, device):
    _check_empty(shape, device)


def _check_empty(shape, device):
    b, h, n, m, k, d = shape
    inputs = make_inputs(*shape, dtype=torch.float32, device=device)
    mask = torch.zeros(b, 1, n, 1, k, dtype=torch.bool, device=device)
    out, smax, ssum = attention(*inputs, mask=mask)
    assert out.shape == (b, h, n, m, d) and smax.shape == ssum.shape == (b, h, n, m)
    if b * h * n * m:  # D = 0: every score is 0, so the softmax is uniform
        assert torch.all(ssum == k) and torch.all(smax == 0)
    grads = attention_grad(torch.randn_like(out), *inputs, out, smax, ssum, mask=mask)
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and g.dtype == t.dtype
        if g.numel():
            assert torch.all(g == 0)


def test_float64_statistics_for_float64_input(device):
    inputs = make_inputs(1, 2, 3, 4, 5, 3, torch.float64, device)
    out, smax, ssum = attention(*inputs)
    assert out.dtype == smax.dtype == ssum.dtype == torch.float64
    # float32 statistics are refused for float64 inputs: the backward would lose precision
    with pytest.raises(gradops.AclnnError):
        attention_grad(torch.randn_like(out), *inputs, out, smax.float(), ssum)


def test_inputs_are_not_modified(device):
    inputs = make_inputs(1, 2, 3, 4, 5, 3, torch.float32, device)
    mask = random_mask(1, 3, 5, torch.uint8, device)
    out, smax, ssum = attention(*inputs, mask=mask)
    dy = torch.randn_like(out)
    given = inputs + [mask, out, smax, ssum, dy]
    before = [t.clone() for t in given]
    attention(*inputs, mask=mask)
    attention_grad(dy, *inputs, out, smax, ssum, mask=mask)
    attention_grad(dy, *inputs, out, smax[..., None].expand(1, 2, 3, 4, 8), ssum, mask=mask)
    for old, new in zip(before, given):
        assert torch.equal(old, new)


# ---------------------------------------------------------------------------------------------
# Chunking: the reference walks (n, m) tiles whose score block stays under CHUNK_ELEMENTS.

def _record_tiles(monkeypatch, budget=None):
    """Wrap the reference's tile generator (optionally with an explicit budget) and record the
    tiles it yields."""
    seen = []
    original = reference_floyd.tiles

    def recording(*args, **kwargs):
        if budget is not None:
            kwargs["budget"] = budget
        for m0, m1, n_tiles in original(*args, **kwargs):
            seen.extend((n0, n1, m0, m1) for n0, n1 in n_tiles)
            yield m0, m1, n_tiles

    monkeypatch.setattr(reference_floyd, "tiles", recording)
    return seen


def _assert_splits_n_and_m(seen, n, m):
    assert any(n1 - n0 < n for n0, n1, _, _ in seen), seen
    assert any(m1 - m0 < m for _, _, m0, m1 in seen), seen


def _chunked_equals_unchunked(monkeypatch, configure, device):
    b, h, n, m, k, d = 2, 2, 5, 7, 6, 3
    inputs = make_inputs(b, h, n, m, k, d, torch.float64, device)
    mask = random_mask(b, n, k, device=device)
    mask[1, 0, 2] = True  # a fully masked row inside a tile
    dy = torch.randn(b, h, n, m, d, dtype=torch.float64, device=device)
    fwd = attention(*inputs, mask=mask, scale=0.6)
    grads = attention_grad(dy, *inputs, *fwd, mask=mask, scale=0.6)
    for budget in (1, b * h * k * 3, b * h * k * m + 1):
        seen = configure(budget)
        fwd_c = attention(*inputs, mask=mask, scale=0.6)
        grads_c = attention_grad(dy, *inputs, *fwd_c, mask=mask, scale=0.6)
        _assert_splits_n_and_m(seen, n, m) if budget < b * h * k * m else None
        assert len(seen) > 2
        for a, c in zip(fwd + grads, fwd_c + grads_c):
            assert rel_error(c, a) <= 1e-13
        monkeypatch.undo()


def test_chunked_tiles_equal_unchunked(monkeypatch, device):
    _chunked_equals_unchunked(monkeypatch, lambda budget: _record_tiles(monkeypatch, budget), device)


def test_chunk_elements_setting_takes_effect(monkeypatch, device):
    def configure(budget):
        monkeypatch.setattr(reference_floyd, "CHUNK_ELEMENTS", budget)
        return _record_tiles(monkeypatch)
    _chunked_equals_unchunked(monkeypatch, configure, device)


def test_tiles_cover_every_pair_once():
    for b, h, n, m, k, budget in [(1, 1, 7, 9, 3, 1), (2, 3, 5, 8, 4, 50), (1, 2, 6, 4, 5, 10 ** 6),
                                  (1, 1, 13, 3, 2, 7)]:
        count = torch.zeros(n, m, dtype=torch.int64, device="cpu")
        for m0, m1, n_tiles in reference_floyd.tiles(b, h, n, m, k, budget=budget):
            for n0, n1 in n_tiles:
                assert (n1 - n0) * (m1 - m0) * b * h * k <= max(budget, b * h * k)
                count[n0:n1, m0:m1] += 1
        assert torch.all(count == 1)


# ---------------------------------------------------------------------------------------------
# Errors: every rule carries CANN's status and names the parameter.

NULLPTR = gradops.ACLNN_ERR_PARAM_NULLPTR
INVALID = gradops.ACLNN_ERR_PARAM_INVALID
TILING = gradops.ACLNN_ERR_INNER_TILING_ERROR


def check_error(call, status, name, *words):
    with pytest.raises(gradops.AclnnError) as info:
        call()
    message = str(info.value)
    assert info.value.status == status, message
    assert re.match(rf"^\w+: {re.escape(name)}\b", message), (name, message)
    for word in words:
        assert word in message, (word, message)


B, H, N, M, K, D = 2, 2, 3, 4, 5, 3
NAMES = ("q", "k1", "v1", "k2", "v2")


@pytest.fixture
def good(device):
    q, k1, v1, k2, v2 = make_inputs(B, H, N, M, K, D, torch.float32, device)
    out, smax, ssum = attention(q, k1, v1, k2, v2)
    return dict(dy=torch.randn_like(out), q=q, k1=k1, v1=v1, k2=k2, v2=v2, out=out, softmax_max=smax,
                softmax_sum=ssum, mask=random_mask(B, N, K, device=device), scale=1.0)


FWD_ARGS = ("q", "k1", "v1", "k2", "v2", "mask", "scale")


def fwd(args):
    return functools.partial(gradops.floyd_attention, **{a: args[a] for a in FWD_ARGS}, backend=BACKEND)


def bwd(args):
    return functools.partial(gradops.floyd_attention_grad, **args, backend=BACKEND)


@pytest.mark.parametrize("name", NAMES + ("scale",))
def test_none_is_nullptr_both(good, name):
    args = dict(good, **{name: None})
    check_error(fwd(args), NULLPTR, name, "None")
    check_error(bwd(args), NULLPTR, name, "None")


@pytest.mark.parametrize("name", ["dy", "out", "softmax_max", "softmax_sum"])
def test_none_is_nullptr_backward(good, name):
    check_error(bwd(dict(good, **{name: None})), NULLPTR, name, "None")


def test_mask_none_is_allowed(good):
    out = fwd(dict(good, mask=None))()[0]
    assert torch.equal(out, good["out"])


@pytest.mark.parametrize("name,dtype", [("q", torch.int64), ("q", torch.complex64), ("k1", torch.float64),
                                        ("v1", torch.float16), ("k2", torch.bfloat16), ("v2", torch.float64)])
def test_input_dtype_errors(good, name, dtype):
    args = dict(good, **{name: good[name].to(dtype)})
    for call in (fwd(args), bwd(args)):
        check_error(call, INVALID, name, "dtype")


@pytest.mark.parametrize("name,dtype", [("dy", torch.float16), ("out", torch.float64),
                                        ("softmax_max", torch.float16), ("softmax_max", torch.float64),
                                        ("softmax_sum", torch.bfloat16)])
def test_backward_dtype_errors(good, name, dtype):
    check_error(bwd(dict(good, **{name: good[name].to(dtype)})), INVALID, name, "dtype")


def test_half_inputs_take_float32_statistics(good):
    half = {n: good[n].half() for n in NAMES + ("dy", "out")}
    args = dict(good, **half)
    grads = bwd(args)()  # float32 statistics: accepted
    assert all(g.dtype == torch.float16 for g in grads)
    check_error(bwd(dict(args, softmax_max=good["softmax_max"].half())), INVALID, "softmax_max", "dtype")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.float16])
def test_mask_dtype_error(good, dtype):
    args = dict(good, mask=good["mask"].to(dtype))
    for call in (fwd(args), bwd(args)):
        check_error(call, INVALID, "mask", "dtype")


@pytest.mark.parametrize("name,shape", [
    ("q", (B, H, N, M)), ("q", (B, H, N, M, D, 1)),
    ("k1", (B, H, N, K)), ("k1", (B + 1, H, N, K, D)), ("k1", (B, H + 1, N, K, D)), ("k1", (B, H, N + 1, K, D)),
    ("k1", (B, H, N, K, D + 1)),
    ("v1", (B, H, N, K + 1, D)), ("v1", (B, H, N, K, D + 1)),
    ("k2", (B, H, K + 1, M, D)), ("k2", (B, H, K, M + 1, D)), ("k2", (B, H, K, M, D + 1)), ("k2", (B, 1, K, M, D)),
    ("v2", (B, H, K, M, D + 1)), ("v2", (B, H, K + 1, M, D)),
    ("mask", (B, H, N, 1, K)), ("mask", (B, 1, N, M, K)), ("mask", (B, 1, N, K)), ("mask", (B, 1, N, 1, K + 1)),
    ("mask", (1, 1, N, 1, K)), ("mask", (B, 1, 1, 1, K)),
])
def test_shape_errors_are_tiling(good, name, shape, device):
    dtype = torch.bool if name == "mask" else torch.float32
    args = dict(good, **{name: torch.zeros(shape, dtype=dtype, device=device)})
    for call in (fwd(args), bwd(args)):
        check_error(call, TILING, name)


@pytest.mark.parametrize("name,shape", [
    ("dy", (B, H, N, M, D + 1)), ("dy", (B, H, N, M)), ("out", (B, H, N, M + 1, D)),
    ("softmax_max", (B, H, N, M, 4)), ("softmax_max", (B, H, N, M, 1)), ("softmax_max", (B, H, N, M + 1)),
    ("softmax_max", (B, H, N)), ("softmax_sum", (B, H, N, M, 16)), ("softmax_sum", (B, H, M, N)),
])
def test_backward_shape_errors_are_tiling(good, name, shape, device):
    check_error(bwd(dict(good, **{name: torch.zeros(shape, device=device)})), TILING, name)


def test_zero_pivots_is_a_tiling_error(good, device):
    k1 = torch.zeros(B, H, N, 0, D, device=device)
    k2 = torch.zeros(B, H, 0, M, D, device=device)
    args = dict(good, k1=k1, v1=k1, k2=k2, v2=k2, mask=None)
    for call in (fwd(args), bwd(args)):
        check_error(call, TILING, "k1", "K")


@pytest.mark.parametrize("scale", ["1.0", [1.0], True, "tensor"], ids=["str", "list", "bool", "tensor"])
def test_scale_type_error(good, scale, device):
    if scale == "tensor":  # made here, on the test device: a tensor made at collection is a CPU one
        scale = torch.tensor(1.0, device=device)
    args = dict(good, scale=scale)
    for call in (fwd(args), bwd(args)):
        check_error(call, INVALID, "scale")


@pytest.mark.parametrize("name", NAMES)
def test_non_tensor_input(good, name):
    args = dict(good, **{name: good[name].tolist()})
    check_error(fwd(args), INVALID, name)


def test_dtype_rules_come_before_tiling_shape_rules(device):
    """CANN reports a dtype error (161002) even when a shape is also wrong (561002)."""
    q, k1, v1, k2, v2 = make_inputs(1, 1, 2, 3, 4, 5, torch.float32, device)
    out, smax, ssum = gradops.floyd_attention(q, k1, v1, k2, v2, backend=BACKEND)
    bad_shape = smax[..., :2]
    check_error(lambda: gradops.floyd_attention_grad(out, q, k1, v1, k2, v2, out, bad_shape.half(), ssum),
                INVALID, "softmax_max", "dtype")
    float_mask = torch.ones(1, 1, 2, 1, 4, device=device)
    check_error(lambda: gradops.floyd_attention(q, k1[..., :2, :], v1, k2, v2, float_mask), INVALID, "mask", "dtype")


# ---------------------------------------------------------------------------------------------
# Both backends, the Triton one with each strategy (the floyd_backend fixture): Dr from P and
# dP (exact zeros for a single pivot; its precision on CANN's stress inputs is
# tests/test_precision.py's) and NaN locality. The "triton" runs go through the interpreter on
# CPU: small shapes.

F64 = torch.float64


def _backend_or_skip(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    return backend


def _skip_float64_chunked(backend, dtype):
    """float64 calls run the fused kernels whatever the strategy: the fused run covers them."""
    if backend == "triton" and dtype == torch.float64:
        from gradops.kernels import floyd_config

        if floyd_config.STRATEGY not in (None, "fused"):
            pytest.skip("float64 always runs the fused kernels (floyd_config.strategy)")


def _run(backend, inputs, dy, mask, scale):
    out, smax, ssum = gradops.floyd_attention(*inputs, mask, scale, backend=backend)
    grads = gradops.floyd_attention_grad(dy, *inputs, out, smax, ssum, mask, scale, backend=backend)
    return (out, smax, ssum), grads


def _winner(i, k):
    """The pivot that dominates row n = i in ``_one_hot_inputs``: spread over the k-tiles."""
    return (16 * i + 3) % k


def _one_hot_inputs(b, h, n, m, k, d, dtype, device, gen):
    """Inputs whose softmax is exactly one-hot in the accumulation dtype: pivot _winner(n)
    of every row n scores > 10^3 above the others (exp of the gap underflows to 0 in float32
    and float64), so the exact dS rounds to zero everywhere."""
    q = torch.rand(b, h, n, m, d, generator=gen, dtype=F64, device="cpu") + 0.5  # positive
    k1 = torch.randn(b, h, n, k, d, generator=gen, dtype=F64, device="cpu")
    k2 = torch.randn(b, h, k, m, d, generator=gen, dtype=F64, device="cpu")
    for i in range(n):
        k1[:, :, i, _winner(i, k)] = 500.0
    v1 = torch.randn(b, h, n, k, d, generator=gen, dtype=F64, device="cpu")
    v2 = torch.randn(b, h, k, m, d, generator=gen, dtype=F64, device="cpu")
    return [t.to(dtype).to(device) for t in (q, k1, v1, k2, v2)]


def _per_backend(cases, hybrid_cases):
    """Parameters ``(floyd_backend, *case)``: every case for each backend, but on CPU only
    ``hybrid_cases`` (a few of them) for the hybrid strategy, whose interpreted runs cost twice
    the fused kernels' and whose exactness over many chunks test_floyd_memory_strategies.py tests."""
    few = TEST_DEVICE == "cpu"
    return [pytest.param(backend, *case, id="-".join(map(_case_id, (backend, *case))))
            for backend in FLOYD_BACKENDS
            for case in (hybrid_cases if few and backend == "triton-hybrid" else cases)]


def _case_id(value) -> str:
    return str(value).replace("torch.", "")


SINGLE_PIVOT_DTYPES = (torch.float32, torch.float16, torch.float64, torch.bfloat16)
SINGLE_PIVOT_CASES = _per_backend(
    [(dtype, masked, kind) for dtype in SINGLE_PIVOT_DTYPES for masked in ("nomask", "mask") for kind in ("K1", "one_hot")],
    [(torch.float32, "mask", "K1"), (torch.bfloat16, "nomask", "K1"), (torch.float16, "mask", "one_hot"),
     (torch.bfloat16, "mask", "one_hot")])


@pytest.mark.parametrize("floyd_backend,dtype,masked,kind", SINGLE_PIVOT_CASES, indirect=["floyd_backend"])
def test_one_hot_softmax_gives_exactly_zero_score_gradients(floyd_backend, dtype, masked, kind, device):
    """With a single pivot (K = 1) P = 1 exactly, and dQ, dK1, dK2 are exactly zero (not
    rounding noise, which Adam would turn into full learning-rate steps); likewise when the
    softmax is one-hot to the last bit (K = 37: three k-tiles of the fused kernels, so the
    dK/dV kernels must reproduce the dQ pass's zeros; the chunked backward must recompute
    the forward's scores bitwise). dV1, dV2 are still the float64 oracle's."""
    backend = _backend_or_skip(floyd_backend)
    _skip_float64_chunked(backend, dtype)
    skip_if_floyd_float64_refused(backend, device, dtype)
    gen = torch.Generator().manual_seed(3)
    b, h, n, m, d = 2, 2, 5, 19, 6
    k = 1 if kind == "K1" else 37
    if kind == "K1":
        inputs = [torch.randn(s, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
                  for s in [(b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)]]
    else:
        inputs = _one_hot_inputs(b, h, n, m, k, d, dtype, device, gen)
    mask = None
    if masked == "mask":
        if kind == "K1":  # a row is either fully masked or not
            mask = torch.rand(b, 1, n, 1, k, generator=gen, device="cpu") < 0.4
        else:  # some of the losers
            mask = torch.rand(b, 1, n, 1, k, generator=gen, device="cpu") < 0.4
            for i in range(n):
                mask[:, :, i, :, _winner(i, k)] = False
        mask[0, 0, n - 1] = True  # a fully masked row: uniform P, dS zero by the mask
        mask = mask.to(device)
    dy = torch.randn(b, h, n, m, d, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
    (out, smax, ssum), (dq, dk1, dv1, dk2, dv2) = _run(backend, inputs, dy, mask, 0.8)
    for name, g in (("dq", dq), ("dk1", dk1), ("dk2", dk2)):
        assert torch.equal(g, torch.zeros_like(g)), (name, g.abs().max().item())
    _, _, dv1_ref, _, dv2_ref = oracles.floyd_attention_backward(dy, *inputs, mask=mask, scale=0.8)
    assert rel_error(dv1, dv1_ref) <= TOLERANCE[dtype]
    assert rel_error(dv2, dv2_ref) <= TOLERANCE[dtype]


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's nanmax
@pytest.mark.parametrize("floyd_backend,dtype,mask_kind", _per_backend(
    [(dtype, mask_kind) for dtype in (torch.float32, torch.float16) for mask_kind in (None, "some", "full_row")],
    [(torch.float16, "some"), (torch.float32, "full_row")]), indirect=["floyd_backend"])
def test_nan_in_q_stays_in_its_row(floyd_backend, dtype, mask_kind, device):
    """A NaN in q[b,h,n,m] makes every score of that row NaN: its softmax max and sum (a
    NaN max, as torch.amax: tl.max alone would skip it) and its output are NaN, nothing else
    is; the gradients are NaN exactly where the float64 autograd oracle has NaN: dQ in that
    row, dK1/dV1 in row n, dK2/dV2 in column m (where dS is zero, masked pivots, only the
    NaN's own feature: 0 * NaN in sum dS Q). Under a fully masked row the NaN score is
    replaced by -FLT_MAX: the forward row stays finite."""
    backend = _backend_or_skip(floyd_backend)
    gen = torch.Generator().manual_seed(5)
    b, h, n, m, k, d = 2, 2, 5, 19, 20, 6  # tails past a 16-wide tile on m and on k
    inputs = [torch.randn(s, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
              for s in [(b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)]]
    where = (1, 0, 3, 17)
    inputs[0][where + (2,)] = float("nan")
    mask = None
    if mask_kind is not None:
        mask = torch.rand(b, 1, n, 1, k, generator=gen, device="cpu") < 0.3
        mask[where[0], 0, where[2]] = mask_kind == "full_row"
        if mask_kind == "some":
            mask[where[0], 0, where[2], 0, :5] = True
        mask = mask.to(device)
    dy = torch.randn(b, h, n, m, d, generator=gen, dtype=F64, device="cpu").to(dtype).to(device)
    (out, smax, ssum), grads = _run(backend, inputs, dy, mask, 0.6)
    out_ref, smax_ref, ssum_ref = oracles.floyd_attention(*inputs, mask=mask, scale=0.6)
    grads_ref = oracles.floyd_attention_backward(dy, *inputs, mask=mask, scale=0.6)
    if backend != "reference":  # and the reference backend's NaN pattern, directly
        ref_fwd, ref_grads = _run("reference", inputs, dy, mask, 0.6)
        for a, r in zip((out, smax, ssum, *grads), (*ref_fwd, *ref_grads)):
            assert torch.equal(torch.isnan(a), torch.isnan(r))

    row = torch.zeros(b, h, n, m, dtype=torch.bool, device="cpu")  # compared with the results moved to the CPU
    row[where] = mask_kind != "full_row"
    for name, t, t_ref in (("out", out, out_ref), ("softmax_max", smax, smax_ref), ("softmax_sum", ssum, ssum_ref)):
        nan = torch.isnan(t).cpu()
        assert torch.equal(nan, torch.isnan(t_ref).cpu()), name
        assert torch.equal(nan if nan.dim() == 4 else nan.any(dim=-1), row), name
    assert rel_error(out, out_ref) <= TOLERANCE[dtype]  # (NaN positions must match)
    for name, g, g_ref in zip(("dq", "dk1", "dv1", "dk2", "dv2"), grads, grads_ref):
        assert torch.equal(torch.isnan(g).cpu(), torch.isnan(g_ref).cpu()), name
        assert rel_error(g, g_ref) <= TOLERANCE[dtype], name
    # locality: dQ only in the NaN's row, dK1/dV1 only in row n, dK2/dV2 only in column m
    bi, hi, ni, mi = where
    dq_nan, dk1_nan, dv1_nan, dk2_nan, dv2_nan = (torch.isnan(g).cpu() for g in grads)
    assert torch.equal(dq_nan.any(dim=-1), row)
    for g in (dk1_nan, dv1_nan):
        assert g.sum() == g[bi, hi, ni].sum()
    for g in (dk2_nan, dv2_nan):
        assert g.sum() == g[bi, hi, :, mi].sum()
    if mask_kind is None:  # every pivot of the row: all of it
        assert dk1_nan[bi, hi, ni].all() and dv1_nan[bi, hi, ni].all()
        assert dk2_nan[bi, hi, :, mi].all() and dv2_nan[bi, hi, :, mi].all()
