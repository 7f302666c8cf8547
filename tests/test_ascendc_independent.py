"""Independent check of gradops.ascendc (issue 3): the four tiling host functions re-derived
from CANN's public host code (asc-devkit impl/adv_api/tiling/normalization/
layernorm_grad_tiling_impl.cpp and layernorm_grad_beta_tiling_impl.cpp, read, not copied) in
CANN's own uint32 arithmetic, compared field by field over a wide sweep; the worked examples
of OPERATORS.md section 2 recomputed through the kernel functions with real tilings that
need several rounds and a tail; the host asserts.

Where CANN's source differs from OPERATORS.md (OPERATORS.md wins):
- GetLayerNormGradMaxMinTmpSize has a second branch for ASCEND910_95/910_55 SoCs
  (``2 * ceil8(H) * 4`` bytes, 0 for float with reuse); OPERATORS.md (and gradops) follow the
  A2/A3 branch, checked here.
- CANN computes in uint32 and wraps past 4 GiB; not reachable with the shapes below.
- For half, CANN's minimum tmp size ``18 * min(B*S*H, H*H)`` bytes is below what its own
  ND tiling needs (``36 * H`` bytes) when B*S == 1 or H == 1: that minimum is refused by the
  tiling (checked below as CANN's behaviour, not a gradops bug).
"""
import dataclasses
import itertools

import numpy as np
import pytest
import torch

import gradops
import gradops.ascendc as asc
from gradops.ascendc import (
    GetLayerNormGradBetaMaxMinTmpSize,
    GetLayerNormGradBetaNDTilingInfo,
    GetLayerNormGradMaxMinTmpSize,
    GetLayerNormGradNDTilingInfo,
    LayerNormGrad,
    LayerNormGradBeta,
)

INVALID, TILING = 161002, 561002
U32 = np.uint32


class _HostAssert(Exception):
    pass


def _u(v):
    return U32(v)


# ---------------------------------------------------------------------------------------
# CANN's host functions, in uint32 as CANN computes them (A2/A3 branch)
# ---------------------------------------------------------------------------------------

def cann_common(shape, type_size):
    if type_size not in (2, 4):
        raise _HostAssert("type size")
    if len(shape) != 4 or int(np.prod(shape)) <= 0 or any(d <= 0 for d in shape):
        raise _HostAssert("shape")


def cann_grad_minmax(shape, type_size, reuse):
    cann_common(shape, type_size)
    b, s, h = (_u(d) for d in shape[:3])
    with np.errstate(over="ignore"):
        inp = b * s * h
        hh = h * h
        mx, mn = max(inp, hh), min(inp, hh)
        n = _u(9) if type_size == 2 else (_u(4) if reuse else _u(6))
        return int(n * mx * _u(type_size)), int(mn * n * _u(type_size))


def cann_grad_tiling(shape, stack, type_size, reuse):
    cann_common(shape, type_size)
    b, s, h, oh = (_u(d) for d in shape)
    with np.errstate(over="ignore"):
        inp = b * s * h
        need = _u(9) if type_size == 2 else (_u(4) if reuse else _u(6))
        one = _u(stack) // _u(4) // need
        one = one // h * h
        if one == 0:
            raise _HostAssert("stackBufferSize is not enough.")
        noh = one // h
        per_block = _u(8) if type_size == 4 else _u(16)
        noh = (noh + per_block - _u(1)) // per_block * per_block
        one = noh * h
    f = {}
    pd_var = one
    pd_mean = pd_var + one
    x1 = x2 = 0
    x3 = pd_mean + one
    if not (reuse and type_size == 4):
        x1 = pd_mean + one
        x2 = x1 + one
        x3 = x2 + one
    t0 = t1 = t2 = 0
    if type_size == 2:
        t0 = x3 + one
        t1 = t0 + one
        t2 = t1 + one
    f.update(stackBufferSize=stack, bLength=b, sLength=s, hLength=h, originalHLength=oh,
             oneCalSize=one, nohCalSize=noh, loopNum=inp // one, tailSize=inp % one,
             nohTailSize=(inp % one) // h,
             tmpTensorBSHPos=0, pdVarTensorPos=pd_var, pdMeanTensorPos=pd_mean, x1TensorPos=x1,
             x2TensorPos=x2, x3TensorPos=x3, tmpTensorPos=t0, tmpTensor1Pos=t1, tmpTensor2Pos=t2,
             lastDimValueBack=np.array(np.float32(1.0) / np.float32(oh), dtype=np.float32).view(np.uint32),
             lastDimValueBackMulTwo=np.array(np.float32(2.0) / np.float32(oh), dtype=np.float32).view(np.uint32))
    for name in ("tmpTensorBSH", "pdVarTensor", "pdMeanTensor", "x1Tensor", "x2Tensor", "x3Tensor",
                 "tmpTensor", "tmpTensor1", "tmpTensor2"):
        f[name + "Size"] = one
    return {k: int(v) for k, v in f.items()}


def cann_beta_minmax(shape, type_size, reuse):
    cann_common(shape, type_size)
    b, s, h = (_u(d) for d in shape[:3])
    k = _u(4) if type_size == 2 else _u(2)
    return int(k * (b * s * h * _u(4))), int(k * (h * _u(4)))


def cann_beta_tiling(shape, stack, type_size, reuse):
    cann_common(shape, type_size)
    b, s, h, oh = (_u(d) for d in shape)
    bsh, bs = b * s * h, b * s
    el = _u(stack) // _u(4)
    if el < h + h:
        raise _HostAssert("stackBufferSize is not enough.")
    one, nbuf = el, 1
    if type_size == 2:
        nbuf = 2
        one = (one - h - h) // _u(2)
    one = one // h * h
    if one == 0:
        raise _HostAssert("stackBufferSize is not enough.")
    if one >= bsh:
        one = bsh
    tail = bsh % one
    f = dict(stackBufferSize=el, bLength=b, sLength=s, hLength=h, originalHLength=oh, bshLength=bsh,
             bsLength=bs, oneCalSize=one, numberOfTmpBuf=nbuf, loopRound=bsh // one, inputTailSize=tail,
             inputTailPos=bsh - tail, bsTailSize=tail // h, bshCurLength=one, bsCurLength=one // h,
             gammaTempTensorPos=0, betaTempTensorPos=0, inputDyTmpTensorPos=0, resForGammaTmpTensorPos=0)
    if type_size == 2:
        f.update(betaTempTensorPos=h, inputDyTmpTensorPos=h + h, resForGammaTmpTensorPos=h + h + one)
    return {k: int(v) for k, v in f.items()}


def as_dict(tiling):
    return {k: int(v) for k, v in vars(tiling).items()}


# ---------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------

BS = [(1, 1), (1, 3), (2, 5), (4, 16), (3, 33)]
HS = [1, 3, 7, 8, 12, 16, 17, 31, 64, 100, 128, 255, 1024]
SHAPES = [[b, s, h, h] for (b, s), h in itertools.product(BS, HS)] + [
    [2, 5, 16, 13], [1, 7, 32, 30], [3, 2, 64, 1], [1, 1, 8, 7]]  # padded storage (originH < H)


def stack_sizes(shape, mn, mx):
    h = shape[2]
    fixed = {0, 1, 4, 8 * h - 1, 8 * h, 16 * h, 24 * h, 36 * h - 1, 36 * h, 36 * h + 4, 100 * h + 12,
             1 << 12, 1 << 16, 1 << 20, (1 << 32) - 1}
    return sorted(fixed | {mn, mn + 1, mn + 31, max(mn - 1, 0), (mn + mx) // 2, mx, 3 * mx})


def _compare(ours_fn, cann_fn, *args):
    try:
        want = cann_fn(*args)
    except _HostAssert:
        with pytest.raises(gradops.AclnnError) as e:
            ours_fn(*args)
        return e.value.status
    got = ours_fn(*args)
    if not isinstance(got, tuple):
        got = as_dict(got)
    assert got == want, (args, got, want)
    return 0


@pytest.mark.parametrize("type_size", [2, 4])
@pytest.mark.parametrize("reuse", [False, True])
def test_tiling_sweep_matches_cann_field_by_field(backend, type_size, reuse):
    statuses = set()
    checked = 0
    for shape in SHAPES:
        assert GetLayerNormGradMaxMinTmpSize(shape, type_size, reuse) == cann_grad_minmax(shape, type_size, reuse)
        assert GetLayerNormGradBetaMaxMinTmpSize(shape, type_size, reuse) == cann_beta_minmax(
            shape, type_size, reuse)
        gmx, gmn = cann_grad_minmax(shape, type_size, reuse)
        bmx, bmn = cann_beta_minmax(shape, type_size, reuse)
        for stack in stack_sizes(shape, gmn, gmx):
            if stack > 0xFFFFFFFF:
                continue
            statuses.add(_compare(GetLayerNormGradNDTilingInfo, cann_grad_tiling, shape, stack, type_size, reuse))
            checked += 1
        for stack in stack_sizes(shape, bmn, bmx):
            if stack > 0xFFFFFFFF:
                continue
            statuses.add(_compare(GetLayerNormGradBetaNDTilingInfo, cann_beta_tiling, shape, stack, type_size,
                                  reuse))
            checked += 1
    assert checked > 1000
    # both accepted tilings and "stackBufferSize is not enough" were exercised; the latter is
    # CANN's tiling error
    assert statuses == {0, TILING}


def test_minimum_tmp_size_is_enough_for_the_tiling_except_cann_half_corner(backend):
    """Float: CANN's minimum always tiles. Half: it does iff B*S >= 2 and H >= 2 (CANN quirk)."""
    for shape in SHAPES:
        for ts, reuse in ((4, False), (4, True), (2, False)):
            _, mn = GetLayerNormGradMaxMinTmpSize(shape, ts, reuse)
            b, s, h, _ = shape
            ok = ts == 4 or min(b * s * h, h * h) >= 2 * h
            if ok:
                GetLayerNormGradNDTilingInfo(shape, mn, ts, reuse)
            else:
                with pytest.raises(gradops.AclnnError) as e:
                    GetLayerNormGradNDTilingInfo(shape, mn, ts, reuse)
                assert e.value.status == TILING
            _, bmn = GetLayerNormGradBetaMaxMinTmpSize(shape, ts, reuse)
            GetLayerNormGradBetaNDTilingInfo(shape, bmn, ts, reuse)  # always enough


def test_last_dim_values_are_float32_bits(backend):
    for oh in (1, 3, 7, 10, 13, 100, 255, 1000, 4095, (1 << 24) + 1, 123457):
        t = GetLayerNormGradNDTilingInfo([1, 1, oh, oh], 1 << 31, 4, False)
        assert t.lastDimValueBack == int(np.array(np.float32(1) / np.float32(oh)).view(np.uint32))
        assert t.lastDimValueBackMulTwo == int(np.array(np.float32(2) / np.float32(oh)).view(np.uint32))


HOST_FUNCS = [
    lambda shape, ts: GetLayerNormGradMaxMinTmpSize(shape, ts, False),
    lambda shape, ts: GetLayerNormGradNDTilingInfo(shape, 1 << 20, ts, False),
    lambda shape, ts: GetLayerNormGradBetaMaxMinTmpSize(shape, ts, False),
    lambda shape, ts: GetLayerNormGradBetaNDTilingInfo(shape, 1 << 20, ts, False),
]


@pytest.mark.parametrize("func", HOST_FUNCS)
@pytest.mark.parametrize("shape,ts", [
    ([2, 3, 8, 8], 3), ([2, 3, 8, 8], 1), ([2, 3, 8, 8], 8), ([2, 3, 8, 8], 0),
    ([2, 3, 8], 4), ([2, 3, 8, 8, 1], 4), ([8], 2), ([], 4),
    ([0, 3, 8, 8], 4), ([2, 0, 8, 8], 4), ([2, 3, 0, 8], 2), ([2, 3, 8, 0], 4),
    ([-2, -3, 8, 8], 4),  # positive product, negative dims
])
def test_host_asserts_raise_aclnn_error(backend, func, shape, ts):
    with pytest.raises(gradops.AclnnError) as e:
        func(shape, ts)
    assert e.value.status == INVALID
    assert not isinstance(e.value, AssertionError)


# ---------------------------------------------------------------------------------------
# Worked examples through the kernel functions, with real tilings
# ---------------------------------------------------------------------------------------

class _Spy:
    """Records the row count of every step the kernel hands to the engine."""

    def __init__(self, engine, steps):
        self._engine, self.steps = engine, steps

    def layer_norm_grad(self, dy, *a):
        self.steps.append(dy.shape[0])
        return self._engine.layer_norm_grad(dy, *a)

    def layer_norm_grad_beta(self, res, *a):
        self.steps.append(res.shape[0])
        return self._engine.layer_norm_grad_beta(res, *a)


@pytest.fixture
def steps(monkeypatch):
    recorded = []
    real = asc.implementation
    monkeypatch.setattr(asc, "implementation", lambda *a, **k: _Spy(real(*a, **k), recorded))
    return recorded


def worked_example_rows(rows, dtype):
    """CANN's LayerNormGrad page extended to ``rows`` rows: x = dy = arange as [1, rows, 8],
    mean 3.5 + 8r, variance 5.25 (exact for 8 consecutive integers), gamma = arange(8)."""
    x = torch.arange(rows * 8, dtype=torch.float64).reshape(1, rows, 8)
    mean = (3.5 + 8 * torch.arange(rows, dtype=torch.float64)).reshape(1, rows)
    var = torch.full((1, rows), 5.25, dtype=torch.float64)
    gamma = torch.arange(8, dtype=torch.float64)
    return [t.to(dtype) for t in (x.clone(), x, var, mean, gamma)]


def literal_formula(dy, x, var, mean, gamma, eps):
    dy, x, var, mean, gamma = (t.double() for t in (dy, x, var, mean, gamma))
    h = x.shape[-1]
    r = (var[..., None] + eps) ** -0.5
    x2, x1 = x - mean[..., None], dy * gamma
    pd_var = (-0.5 * x1 * x2 * r ** 3).sum(-1, keepdim=True)
    pd_mean = (-x1 * r).sum(-1, keepdim=True) + pd_var / h * (-2 * x2).sum(-1, keepdim=True)
    return x1 * r + pd_var * (2 / h) * x2 + pd_mean / h, x2 * r


PAGE_RES = -1.5275106
PAGE_PDX = [3.0548172, 0.4362857, -1.3093826, -2.182187]


@pytest.mark.parametrize("dtype,reuse,rows,want_steps", [
    (torch.float32, False, 20, [8, 8, 4]),   # min buffer: 8 rows a step, two rounds + tail
    (torch.float32, True, 20, [8, 8, 4]),
    (torch.float32, False, 3, [3]),          # rows round up to 8: loopNum 0, all tail
    (torch.float16, False, 20, [16, 4]),     # half rounds rows up to 16
    (torch.float32, False, 8, [8]),          # the page itself: [1, 8, 8]
])
def test_layer_norm_grad_worked_example_tiled(backend, steps, dtype, reuse, rows, want_steps):
    ts = 2 if dtype == torch.float16 else 4
    shape = [1, rows, 8, 8]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, ts, reuse)
    stack = max(mn, 9 * 8 * 4)  # half with B*S small: CANN's min is below the tiling's need
    tiling = GetLayerNormGradNDTilingInfo(shape, stack, ts, reuse)
    assert tiling.loopNum * tiling.oneCalSize + tiling.tailSize == rows * 8
    dy, x, var, mean, gamma = worked_example_rows(rows, dtype)
    dy0, x0 = dy.clone(), x.clone()
    pd_x, res = torch.full_like(x, 1234.0), torch.full_like(x, 1234.0)
    LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, torch.zeros(stack, dtype=torch.uint8), 1e-4, tiling,
                  isReuseSource=reuse)
    assert steps == want_steps
    eps = float(torch.tensor(1e-4, dtype=dtype))  # epsilon has type T
    want_pdx, want_res = literal_formula(dy0, x0, var, mean, gamma, eps)
    if dtype == torch.float32:
        # the page's numbers (NPU float32): pd_x cancels O(10) terms -> a few float32 ulps of them
        assert res[0, 0, 0].item() == pytest.approx(PAGE_RES, abs=2e-6)
        torch.testing.assert_close(pd_x[0, 0, :4], torch.tensor(PAGE_PDX), rtol=0, atol=1e-5)
        torch.testing.assert_close(pd_x.double(), want_pdx, rtol=0, atol=2e-5 * (1 + rows))
        torch.testing.assert_close(res.double(), want_res, rtol=1e-6, atol=1e-6)
    else:
        # half computes in float32 and rounds once: half's ulp (2^-11 relative) dominates
        torch.testing.assert_close(pd_x.double(), want_pdx, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(res.double(), want_res, rtol=1e-3, atol=1e-3)
        assert res[0, 0, 0].item() == pytest.approx(PAGE_RES, rel=1e-3)
        torch.testing.assert_close(pd_x[0, 0, :4].float(), torch.tensor(PAGE_PDX), rtol=1e-3, atol=2e-3)
    if reuse:  # CANN's kernel leaves dy*gamma in inputDy and x-mean in inputX
        torch.testing.assert_close(dy.double(), dy0.double() * gamma.double(), rtol=0, atol=0)
        torch.testing.assert_close(x.double(), x0.double() - mean.double()[..., None], rtol=0, atol=0)
    else:
        assert torch.equal(dy, dy0) and torch.equal(x, x0)


@pytest.mark.parametrize("dtype,stack,want_steps", [
    (torch.float32, 3 * 8 * 4, [3, 3, 2]),         # float: el = 24 -> 3 rows a round, tail 2
    (torch.float32, 2 * 8 * 4, [2, 2, 2, 2]),      # the minimum buffer
    (torch.float32, 1 << 16, [8]),                 # oneCalSize capped at B*S*H: one round
    (torch.float16, (2 * 8 + 2 * 24) * 4, [3, 3, 2]),  # half: (el - 2H) / 2 = 24
    (torch.float16, 4 * 8 * 4, [1] * 8),           # half minimum: one row a round
])
def test_layer_norm_grad_beta_worked_example_tiled(backend, steps, dtype, stack, want_steps):
    ts = 2 if dtype == torch.float16 else 4
    shape = [8, 1, 8, 8]
    tiling = GetLayerNormGradBetaNDTilingInfo(shape, stack, ts, False)
    a = torch.arange(64, dtype=dtype).reshape(8, 1, 8)
    pd_gamma, pd_beta = torch.full((8,), -1.0, dtype=dtype), torch.full((8,), -1.0, dtype=dtype)
    buf = torch.zeros(max(stack, GetLayerNormGradBetaMaxMinTmpSize(shape, ts, False)[1]), dtype=torch.uint8)
    LayerNormGradBeta(pd_gamma, pd_beta, a.clone(), a.clone(), buf, tiling)
    assert steps == want_steps
    assert pd_gamma[0].item() == 8960.0 and pd_beta[0].item() == 224.0  # the page's numbers
    r = torch.arange(8, dtype=torch.float64)[:, None]
    h = torch.arange(8, dtype=torch.float64)[None, :]
    # every value is an integer < 2^24 summed in float32, exact; half holds these exactly too
    # except where rounding to half's 11-bit mantissa applies, so compare after rounding to T
    assert torch.equal(pd_gamma, ((8 * r + h) ** 2).sum(0).to(dtype))
    assert torch.equal(pd_beta, (8 * r + h).sum(0).to(dtype))


def test_kernel_refuses_a_buffer_below_the_minimum_and_writes_nothing(backend):
    shape = [1, 20, 8, 8]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, 4, False)
    tiling = GetLayerNormGradNDTilingInfo(shape, mn, 4, False)
    dy, x, var, mean, gamma = worked_example_rows(20, torch.float32)
    pd_x, res = torch.full_like(x, 1234.0), torch.full_like(x, 1234.0)
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, torch.zeros(mn - 1, dtype=torch.uint8), 1e-4, tiling)
    assert e.value.status == INVALID
    assert bool((pd_x == 1234).all()) and bool((res == 1234).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_grad_beta_takes_a_padded_tiling(backend, dtype):
    """pdGamma/pdBeta are per-column sums over rows: originH (srcShape[3]) plays no part, so a
    tiling of padded rows (storageH 16, originH 13, zero padding) is a call CANN accepts."""
    ts = 2 if dtype == torch.float16 else 4
    shape = [2, 5, 16, 13]
    stack = (2 * 16 + 2 * 48) * 4 if ts == 2 else 48 * 4  # 3 rows of 16 a round either way
    tiling = GetLayerNormGradBetaNDTilingInfo(shape, stack, ts, False)
    assert tiling.originalHLength == 13 and tiling.loopRound == 3 and tiling.bsTailSize == 1
    res = torch.randn(2, 5, 16, dtype=torch.float64)
    dy = torch.randn(2, 5, 16, dtype=torch.float64)
    res[..., 13:] = 0
    dy[..., 13:] = 0
    res, dy = res.to(dtype), dy.to(dtype)
    pd_gamma, pd_beta = torch.full((16,), 99.0, dtype=dtype), torch.full((16,), 99.0, dtype=dtype)
    LayerNormGradBeta(pd_gamma, pd_beta, res, dy, None, tiling)
    want_g = (res.double() * dy.double()).sum((0, 1))
    want_b = dy.double().sum((0, 1))
    # 10 float32 terms per column, then one rounding to T
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pd_gamma.double(), want_g, **tol)
    torch.testing.assert_close(pd_beta.double(), want_b, **tol)
    assert bool((pd_gamma[13:] == 0).all()) and bool((pd_beta[13:] == 0).all())


def _kernel_args():
    """What the refused kernel calls below are made of, made in the test (on its device)."""
    import types
    shape = [2, 5, 8, 8]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, 4, False)
    x, dy = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    var, mean, g = torch.rand(2, 5) + 0.5, torch.randn(2, 5), torch.randn(8)
    return types.SimpleNamespace(
        shape=shape, t=GetLayerNormGradNDTilingInfo(shape, mn, 4, False), x=x, dy=dy, var=var, mean=mean, g=g,
        buf=torch.zeros(mn, dtype=torch.uint8), half_reuse=GetLayerNormGradNDTilingInfo(shape, 4096, 2, True))


def _beta_tiling(a, stack):
    return GetLayerNormGradBetaNDTilingInfo(a.shape, stack, 4)


# (the calls take their tensors from _kernel_args in the test: tensors in a parametrize table
# would be made at collection, on the CPU, and a device error would stand in for the one
# expected)
NULL = 161001
BAD_KERNEL_CALLS = [
    ("gamma None", NULL, lambda p, r, a: LayerNormGrad(p, r, a.dy, a.x, a.var, a.mean, None, a.buf, 1e-5, a.t)),
    ("epsilon None", NULL, lambda p, r, a: LayerNormGrad(p, r, a.dy, a.x, a.var, a.mean, a.g, a.buf, None, a.t)),
    ("tiling None", NULL, lambda p, r, a: LayerNormGrad(p, r, a.dy, a.x, a.var, a.mean, a.g, a.buf, 1e-5, None)),
    ("x half", INVALID, lambda p, r, a: LayerNormGrad(p, r, a.dy, a.x.half(), a.var, a.mean, a.g, a.buf, 1e-5, a.t)),
    ("variance shape", INVALID, lambda p, r, a: LayerNormGrad(p, r, a.dy, a.x, a.var[:, :4], a.mean, a.g, a.buf,
                                                              1e-5, a.t)),
    ("beta tiling", INVALID, lambda p, r, a: LayerNormGrad(
        p, r, a.dy, a.x, a.var, a.mean, a.g, a.buf, 1e-5, GetLayerNormGradBetaNDTilingInfo(a.shape, 1024, 4, False))),
    ("buffer int8", INVALID, lambda p, r, a: LayerNormGrad(p, r, a.dy, a.x, a.var, a.mean, a.g,
                                                           a.buf.to(torch.int8), 1e-5, a.t)),
    ("buffer below min", INVALID, lambda p, r, a: LayerNormGrad(p, r, a.dy, a.x, a.var, a.mean, a.g, a.buf[:-1],
                                                                1e-5, a.t)),
    ("tampered loopNum", INVALID, lambda p, r, a: LayerNormGrad(
        p, r, a.dy, a.x, a.var, a.mean, a.g, a.buf, 1e-5, dataclasses.replace(a.t, loopNum=a.t.loopNum + 1))),
    ("negative position", INVALID, lambda p, r, a: LayerNormGrad(
        p, r, a.dy, a.x, a.var, a.mean, a.g, a.buf, 1e-5, dataclasses.replace(a.t, x3TensorPos=-1))),
    ("reuse with half", INVALID, lambda p, r, a: LayerNormGrad(
        p.half(), r.half(), a.dy.half(), a.x.half(), a.var.half(), a.mean.half(), a.g.half(), None, 1e-5,
        a.half_reuse, isReuseSource=True)),
    ("beta dy None", NULL, lambda p, r, a: LayerNormGradBeta(p[0, 0], r[0, 0], a.x, None, None,
                                                             _beta_tiling(a, 1024))),
    ("beta output shape", INVALID, lambda p, r, a: LayerNormGradBeta(
        p[0, 0, :7], r[0, 0], a.x, a.dy, None, _beta_tiling(a, 1024))),
    ("beta buffer below min", INVALID, lambda p, r, a: LayerNormGradBeta(
        p[0, 0], r[0, 0], a.x, a.dy, torch.zeros(63, dtype=torch.uint8), _beta_tiling(a, 64))),
]


@pytest.mark.parametrize("name,status,call", BAD_KERNEL_CALLS, ids=lambda v: v if isinstance(v, str) else "")
def test_kernel_errors_status_and_nothing_written(backend, name, status, call):
    pd_x, res = torch.full((2, 5, 8), 7.0), torch.full((2, 5, 8), 7.0)
    with pytest.raises(gradops.AclnnError) as e:
        call(pd_x, res, _kernel_args())
    assert e.value.status == status, str(e.value)
    assert bool((pd_x == 7).all()) and bool((res == 7).all())
