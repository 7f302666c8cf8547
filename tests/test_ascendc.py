"""gradops.ascendc: the tiling host functions against CANN's formulas (written out again here,
independently of the implementation), the worked examples of CANN's LayerNormGrad and
LayerNormGradBeta pages, and the tiled kernel functions against a float64 oracle."""
import dataclasses
import importlib
import math
import struct

import pytest
import torch

import gradops
from gradops.ascendc import (
    GetLayerNormGradBetaMaxMinTmpSize,
    GetLayerNormGradBetaNDTilingInfo,
    GetLayerNormGradMaxMinTmpSize,
    GetLayerNormGradNDTilingInfo,
    LayerNormGrad,
    LayerNormGradBeta,
    LayerNormGradBetaTiling,
    LayerNormGradTiling,
)

from conftest import TEST_DEVICE  # noqa: E402

INVALID, NULLPTR, TILING = 161002, 161001, 561002

# ---------------------------------------------------------------------------------------
# Independent restatement of OPERATORS.md section 2 (CANN's host functions).
# ---------------------------------------------------------------------------------------


def expected_grad_minmax(shape, type_size, reuse):
    b, s, h, _ = shape
    n = 9 if type_size == 2 else (4 if reuse else 6)
    bsh, hh = b * s * h, h * h
    return n * max(bsh, hh) * type_size, n * min(bsh, hh) * type_size


def expected_grad_tiling(shape, stack, type_size, reuse):
    b, s, h, oh = shape
    need = 9 if type_size == 2 else (4 if reuse else 6)
    one = (stack // 4 // need // h) * h
    assert one > 0
    block = 8 if type_size == 4 else 16
    noh = math.ceil((one // h) / block) * block
    one = noh * h
    bsh = b * s * h
    e = dict(stackBufferSize=stack, bLength=b, sLength=s, hLength=h, originalHLength=oh,
             oneCalSize=one, nohCalSize=noh, loopNum=bsh // one, tailSize=bsh % one,
             nohTailSize=(bsh % one) // h, tmpTensorBSHPos=0, pdVarTensorPos=one, pdMeanTensorPos=2 * one)
    if reuse and type_size == 4:
        e.update(x1TensorPos=0, x2TensorPos=0, x3TensorPos=3 * one)
    else:
        e.update(x1TensorPos=3 * one, x2TensorPos=4 * one, x3TensorPos=5 * one)
    if type_size == 2:
        e.update(tmpTensorPos=e["x3TensorPos"] + one, tmpTensor1Pos=e["x3TensorPos"] + 2 * one,
                 tmpTensor2Pos=e["x3TensorPos"] + 3 * one)
    else:
        e.update(tmpTensorPos=0, tmpTensor1Pos=0, tmpTensor2Pos=0)
    for name in ("tmpTensorBSH", "pdVarTensor", "pdMeanTensor", "x1Tensor", "x2Tensor", "x3Tensor",
                 "tmpTensor", "tmpTensor1", "tmpTensor2"):
        e[name + "Size"] = one
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]  # noqa: E731
    e["lastDimValueBack"] = struct.unpack("<I", struct.pack("<f", f32(1.0 / oh)))[0]
    e["lastDimValueBackMulTwo"] = struct.unpack("<I", struct.pack("<f", f32(2.0 / oh)))[0]
    return e


def expected_beta_minmax(shape, type_size):
    b, s, h, _ = shape
    k = 4 if type_size == 2 else 2
    return k * b * s * h * 4, k * h * 4


def expected_beta_tiling(shape, stack, type_size):
    b, s, h, oh = shape
    el = stack // 4
    assert el >= 2 * h
    one, nbuf = el, 1
    if type_size == 2:
        nbuf, one = 2, (el - 2 * h) // 2
    one = (one // h) * h
    assert one > 0
    bsh = b * s * h
    one = min(one, bsh)
    tail = bsh % one
    e = dict(stackBufferSize=el, bLength=b, sLength=s, hLength=h, originalHLength=oh, bshLength=bsh,
             bsLength=b * s, oneCalSize=one, numberOfTmpBuf=nbuf, loopRound=bsh // one, inputTailSize=tail,
             inputTailPos=bsh - tail, bsTailSize=tail // h, bshCurLength=one, bsCurLength=one // h)
    if type_size == 2:
        e.update(gammaTempTensorPos=0, betaTempTensorPos=h, inputDyTmpTensorPos=2 * h,
                 resForGammaTmpTensorPos=2 * h + one)
    else:
        e.update(gammaTempTensorPos=0, betaTempTensorPos=0, inputDyTmpTensorPos=0, resForGammaTmpTensorPos=0)
    return e


def as_dict(t):
    return {k: getattr(t, k) for k in t.__dataclass_fields__}


SHAPES = [[1, 8, 8, 8], [2, 16, 64, 64], [4, 3, 32, 32], [1, 1, 128, 128], [3, 5, 7, 7], [8, 1, 8, 8],
          [2, 37, 16, 16], [1, 2, 4096, 4096]]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("type_size", [2, 4])
@pytest.mark.parametrize("reuse", [False, True])
def test_layer_norm_grad_host_functions(backend, shape, type_size, reuse):
    assert GetLayerNormGradMaxMinTmpSize(shape, type_size, reuse) == expected_grad_minmax(shape, type_size, reuse)
    mx, mn = expected_grad_minmax(shape, type_size, reuse)
    h = shape[2]
    need = 9 if type_size == 2 else (4 if reuse else 6)
    stacks = {mn, mx, need * h * 4, need * h * 4 * 3 + 7, 16 * 1024, 192 * 1024}
    for stack in sorted(stacks):
        if stack // 4 // need // h == 0:
            with pytest.raises(gradops.AclnnError) as e:
                GetLayerNormGradNDTilingInfo(shape, stack, type_size, reuse)
            assert e.value.status == TILING and "stackBufferSize" in str(e.value)
            continue
        got = GetLayerNormGradNDTilingInfo(shape, stack, type_size, reuse)
        assert isinstance(got, LayerNormGradTiling)
        assert as_dict(got) == expected_grad_tiling(shape, stack, type_size, reuse), (shape, stack)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("type_size", [2, 4])
@pytest.mark.parametrize("reuse", [False, True])
def test_layer_norm_grad_beta_host_functions(backend, shape, type_size, reuse):
    # isReuseSource is ignored by CANN's beta host functions
    assert GetLayerNormGradBetaMaxMinTmpSize(shape, type_size, reuse) == expected_beta_minmax(shape, type_size)
    mx, mn = expected_beta_minmax(shape, type_size)
    h = shape[2]
    for stack in sorted({mn, mx, mn + 4, 2 * h * 4 + 3 * h * 4, 3 * h * 4 - 1, 16 * 1024, 192 * 1024}):
        el = stack // 4
        ok = el >= 2 * h and ((el if type_size == 4 else (el - 2 * h) // 2) // h) > 0
        if not ok:
            with pytest.raises(gradops.AclnnError) as e:
                GetLayerNormGradBetaNDTilingInfo(shape, stack, type_size, reuse)
            assert e.value.status == TILING and "stackBufferSize" in str(e.value)
            continue
        got = GetLayerNormGradBetaNDTilingInfo(shape, stack, type_size, reuse)
        assert isinstance(got, LayerNormGradBetaTiling)
        assert as_dict(got) == expected_beta_tiling(shape, stack, type_size), (shape, stack)


def test_tiling_struct_fields_are_cann_names_in_cann_order(backend):
    assert list(LayerNormGradTiling.__dataclass_fields__) == [
        "stackBufferSize", "bLength", "sLength", "hLength", "originalHLength", "oneCalSize", "nohCalSize",
        "loopNum", "tailSize", "nohTailSize", "tmpTensorBSHPos", "tmpTensorBSHSize", "pdVarTensorPos",
        "pdVarTensorSize", "pdMeanTensorPos", "pdMeanTensorSize", "x1TensorPos", "x1TensorSize", "x2TensorPos",
        "x2TensorSize", "x3TensorPos", "x3TensorSize", "tmpTensorPos", "tmpTensorSize", "tmpTensor1Pos",
        "tmpTensor1Size", "tmpTensor2Pos", "tmpTensor2Size", "lastDimValueBack", "lastDimValueBackMulTwo"]
    assert list(LayerNormGradBetaTiling.__dataclass_fields__) == [
        "stackBufferSize", "bLength", "sLength", "hLength", "originalHLength", "bshLength", "bsLength",
        "oneCalSize", "numberOfTmpBuf", "loopRound", "inputTailSize", "inputTailPos", "bsTailSize",
        "bshCurLength", "bsCurLength", "gammaTempTensorPos", "betaTempTensorPos", "inputDyTmpTensorPos",
        "resForGammaTmpTensorPos"]


def test_known_tiling_numbers(backend):
    # hand-computed: float, [2,16,64,64], 16 KiB: 16384/4/6 = 682 -> 640 (10 rows) -> 16 rows -> 1024
    t = GetLayerNormGradNDTilingInfo([2, 16, 64, 64], 16384, 4, False)
    assert (t.oneCalSize, t.nohCalSize, t.loopNum, t.tailSize, t.nohTailSize) == (1024, 16, 2, 0, 0)
    assert (t.x1TensorPos, t.x2TensorPos, t.x3TensorPos, t.tmpTensorPos) == (3072, 4096, 5120, 0)
    assert t.lastDimValueBack == 0x3C800000 and t.lastDimValueBackMulTwo == 0x3D000000  # 1/64, 2/64
    # half, same shape: 16384/4/9 = 455 -> 448 (7 rows) -> 16 rows -> 1024; loop 2
    t = GetLayerNormGradNDTilingInfo([2, 16, 64, 64], 16384, 2, False)
    assert (t.oneCalSize, t.loopNum, t.tmpTensorPos, t.tmpTensor1Pos, t.tmpTensor2Pos) == (1024, 2, 6144, 7168, 8192)
    # beta half [2,16,64,64], 4 KiB: 1024 el, (1024-128)//2 = 448 -> 448 (7 rows); 2048 = 4*448 + 256
    t = GetLayerNormGradBetaNDTilingInfo([2, 16, 64, 64], 4096, 2, False)
    assert (t.oneCalSize, t.loopRound, t.inputTailSize, t.inputTailPos, t.bsTailSize) == (448, 4, 256, 1792, 4)
    assert (t.betaTempTensorPos, t.inputDyTmpTensorPos, t.resForGammaTmpTensorPos) == (64, 128, 576)


def test_loop_count_zero_tiling(backend):
    # the rows-per-step round-up makes one step larger than the whole input: loopNum 0, all tail
    t = GetLayerNormGradNDTilingInfo([1, 3, 16, 16], 6 * 16 * 4, 4, False)
    assert t.oneCalSize == 8 * 16 and t.loopNum == 0 and t.tailSize == 48 and t.nohTailSize == 3


@pytest.mark.parametrize("func,args", [
    (GetLayerNormGradMaxMinTmpSize, ([1, 8, 8, 8], 3, False)),
    (GetLayerNormGradMaxMinTmpSize, ([1, 8, 8, 8], 8, False)),
    (GetLayerNormGradMaxMinTmpSize, ([8, 8, 8], 4, False)),
    (GetLayerNormGradMaxMinTmpSize, ([1, 1, 8, 8, 8], 4, False)),
    (GetLayerNormGradMaxMinTmpSize, ([1, 0, 8, 8], 4, False)),
    (GetLayerNormGradNDTilingInfo, ([1, 8, 8, 8], 4096, 1, False)),
    (GetLayerNormGradNDTilingInfo, ([1, 8, 8], 4096, 4, False)),
    (GetLayerNormGradNDTilingInfo, ([1, 8, -8, 8], 4096, 4, False)),
    (GetLayerNormGradBetaMaxMinTmpSize, ([1, 8, 8, 8], 0, False)),
    (GetLayerNormGradBetaMaxMinTmpSize, ([1, 8, 8], 2, False)),
    (GetLayerNormGradBetaNDTilingInfo, ([1, 8, 8, 8], 4096, 6, False)),
    (GetLayerNormGradBetaNDTilingInfo, ([8, 8, 8, 8, 8], 4096, 4, False)),
])
def test_host_asserts_are_aclnn_errors(backend, func, args):
    with pytest.raises(gradops.AclnnError) as e:
        func(*args)
    assert e.value.status == INVALID
    assert ("typeSize" in str(e.value)) or ("srcShape" in str(e.value))


def test_stack_buffer_too_small(backend):
    with pytest.raises(gradops.AclnnError) as e:
        GetLayerNormGradNDTilingInfo([1, 8, 64, 64], 6 * 64 * 4 - 1, 4, False)
    assert e.value.status == TILING
    with pytest.raises(gradops.AclnnError) as e:
        GetLayerNormGradBetaNDTilingInfo([1, 8, 64, 64], 2 * 64 * 4 - 4, 4, False)
    assert e.value.status == TILING
    # half beta: 2H accumulators fit but no row of two converted buffers does
    with pytest.raises(gradops.AclnnError) as e:
        GetLayerNormGradBetaNDTilingInfo([1, 8, 64, 64], 3 * 64 * 4, 2, False)
    assert e.value.status == TILING


# ---------------------------------------------------------------------------------------
# Worked examples of CANN's pages (OPERATORS.md section 2)
# ---------------------------------------------------------------------------------------

def test_layer_norm_grad_worked_example(backend):
    x = torch.arange(64, dtype=torch.float32).reshape(1, 8, 8)
    dy = x.clone()
    mean = (3.5 + 8 * torch.arange(8, dtype=torch.float32)).reshape(1, 8)
    var = torch.full((1, 8), 5.25)
    gamma = torch.arange(8, dtype=torch.float32)
    shape = [1, 8, 8, 8]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, 4, False)
    tiling = GetLayerNormGradNDTilingInfo(shape, mn, 4, False)
    pd_x, res = torch.empty_like(x), torch.empty_like(x)
    LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, torch.zeros(mn, dtype=torch.uint8), 1e-4, tiling)
    # the page's numbers come from an NPU's float32 arithmetic; pd_x cancels terms of size ~10,
    # so allow a few float32 ulps of those terms
    assert res[0, 0, 0].item() == pytest.approx(-1.5275106, abs=2e-6)
    torch.testing.assert_close(pd_x[0, 0, :4], torch.tensor([3.0548172, 0.4362857, -1.3093826, -2.182187]),
                               rtol=0, atol=1e-5)


def test_layer_norm_grad_beta_worked_example(backend):
    a = torch.arange(64, dtype=torch.float32).reshape(8, 1, 8)
    shape = [8, 1, 8, 8]
    _, mn = GetLayerNormGradBetaMaxMinTmpSize(shape, 4, False)
    tiling = GetLayerNormGradBetaNDTilingInfo(shape, mn, 4, False)
    assert tiling.loopRound == 4  # the minimum buffer walks the 8 rows two at a time
    pd_gamma, pd_beta = torch.empty(8), torch.empty(8)
    LayerNormGradBeta(pd_gamma, pd_beta, a.clone(), a.clone(), torch.zeros(mn, dtype=torch.uint8), tiling)
    assert pd_gamma[0].item() == 8960.0 and pd_beta[0].item() == 224.0
    # every column, exactly: sum_r (8r+h)^2 and sum_r (8r+h)
    r = torch.arange(8, dtype=torch.float64)[:, None]
    h = torch.arange(8, dtype=torch.float64)[None, :]
    assert torch.equal(pd_gamma.double(), ((8 * r + h) ** 2).sum(0))
    assert torch.equal(pd_beta.double(), (8 * r + h).sum(0))


# ---------------------------------------------------------------------------------------
# Kernel functions against a float64 oracle of the AscendC formulas
# ---------------------------------------------------------------------------------------

def oracle_grad(dy, x, var, mean, gamma, eps):
    """OPERATORS.md section 2, literally, in float64."""
    dy, x, var, mean, gamma = (t.double() for t in (dy, x, var, mean, gamma))
    h = x.shape[-1]
    r = (var[..., None] + eps) ** -0.5
    x2 = x - mean[..., None]
    x1 = dy * gamma
    pd_var = (-0.5 * x1 * x2 * r ** 3).sum(-1, keepdim=True)
    pd_mean = (-x1 * r).sum(-1, keepdim=True) + pd_var * (1 / h) * (-2 * x2).sum(-1, keepdim=True)
    return x1 * r + pd_var * (2 / h) * x2 + pd_mean / h, x2 * r


def make_inputs(b, s, h, dtype):
    x = torch.randn(b, s, h).to(dtype)
    dy = torch.randn(b, s, h).to(dtype)
    mean = x.float().mean(-1).to(dtype)
    var = x.float().var(-1, unbiased=False).to(dtype)
    gamma = torch.randn(h).to(dtype)
    return dy, x, var, mean, gamma


def half_rounding_of(a, v, slack):
    """Whether each float16 in ``a`` is a rounding to float16 of a value within ``slack`` of the
    float32 ``v``: |a - v| <= slack + half a float16 ulp at |v| + slack (float64 arithmetic)."""
    v64 = v.double().abs() + slack
    ulp = torch.exp2(torch.floor(torch.log2(v64.clamp_min(2.0 ** -14))) - 10)
    return bool(((a.double() - v.double()).abs() <= slack + ulp / 2).all())


def pd_x_sum_order_bound(dy, x, var, mean, gamma, eps):
    """How far apart two float32 evaluations of LayerNormGrad's pd_x can be when they differ
    only in the order of their row sums (float64, per element). The operands of the sums and
    the factors that take none (x1 = dy*gamma, x2 = x - mean, r) have the same bits in both; a
    path from those to pd_x passes at most k = H + 8 roundings (the H - 1 of a sum, the
    formula's own), so each evaluation is within gamma_k = k*u / (1 - k*u) times the formula
    evaluated on the terms' magnitudes of the exact value (Higham, Accuracy and Stability of
    Numerical Algorithms, ch. 3), and the two within twice that. Under cancellation this
    exceeds a float16 ulp of the result; elsewhere it is a few float32 ulps of it."""
    x1 = (dy.float() * gamma.float()).double().abs()
    x2 = (x.float() - mean.float()[..., None]).double().abs()
    r = torch.rsqrt(var.float() + eps).double()[..., None]
    h = x.shape[-1]
    pd_var = 0.5 * r ** 3 * (x1 * x2).sum(-1, keepdim=True)
    pd_mean = r * x1.sum(-1, keepdim=True) + pd_var * (2.0 / h) * x2.sum(-1, keepdim=True)
    ku = (h + 8) * 2.0 ** -24
    return 2 * ku / (1 - ku) * (x1 * r + pd_var * (2.0 / h) * x2 + pd_mean / h)


def tol(dtype):
    # float32 inputs: a few float32 ulps of O(10) terms; half: one rounding of the result
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,s,h,stack", [
    (2, 9, 16, None),        # minimum buffer
    (2, 9, 16, 1 << 20),     # one step covers everything: loopNum 0 (rows round up), all tail
    (3, 40, 8, 6 * 8 * 4 * 3),  # several full steps and a tail
])
def test_layer_norm_grad_kernel(backend, dtype, b, s, h, stack):
    ts = 2 if dtype == torch.float16 else 4
    shape = [b, s, h, h]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, ts, False)
    stack = mn if stack is None else max(stack, 9 * h * 4)
    tiling = GetLayerNormGradNDTilingInfo(shape, stack, ts, False)
    dy, x, var, mean, gamma = make_inputs(b, s, h, dtype)
    originals = [t.clone() for t in (dy, x, var, mean, gamma)]
    eps = 1e-3
    pd_x, res = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
    buf = torch.zeros(max(mn, stack), dtype=torch.uint8)
    LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, buf, eps, tiling)
    eps_t = float(torch.tensor(eps, dtype=dtype))
    want_pdx, want_res = oracle_grad(dy, x, var, mean, gamma, eps_t)
    torch.testing.assert_close(pd_x.double(), want_pdx, **tol(dtype))
    torch.testing.assert_close(res.double(), want_res, **tol(dtype))
    for before, after in zip(originals, (dy, x, var, mean, gamma)):
        assert torch.equal(before, after)  # without isReuseSource no input changes
    # The Python API's numbers: the kernel runs the same engine step by step, on fewer rows at
    # a time, and a row's results do not depend on the rows computed with it (the Triton
    # kernel's tile follows the width only, test_kernels_norm's
    # test_ascendc_kernel_tiles_do_not_depend_on_the_row_count; the reference reduces each row
    # of these widths on its own), so float32 is bitwise the API's, on every device.
    api_pdx, api_res = gradops.layer_norm_grad(dy, x, var, mean, gamma, eps)
    if dtype == torch.float32:
        torch.testing.assert_close(pd_x, api_pdx, rtol=0, atol=0)
        torch.testing.assert_close(res, api_res, rtol=0, atol=0)
        return
    # Half rows reach the engine as the float32 copies CANN's kernel makes, so the kernel's
    # results are the API's float32 results on those copies, each rounded once, on every device.
    f32_pdx, f32_res = gradops.layer_norm_grad(*(t.float() for t in (dy, x, var, mean, gamma)), eps_t)
    torch.testing.assert_close(pd_x, f32_pdx.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(res, f32_res.to(dtype), rtol=0, atol=0)
    if TEST_DEVICE == "cpu":  # the interpreter and torch's CPU sums add in one order, whatever dtype was read
        torch.testing.assert_close(api_pdx, pd_x, rtol=0, atol=0)
        torch.testing.assert_close(api_res, res, rtol=0, atol=0)
        return
    # On a GPU the API's half call is another compiled kernel (it loads 16 bytes of half
    # wide), whose row sums may add in another order: its pd_x is a rounding of a float32 value
    # that only that order moves from the float32 call's. x-hat takes no sum: bitwise.
    torch.testing.assert_close(api_res, res, rtol=0, atol=0)
    slack = pd_x_sum_order_bound(dy, x, var, mean, gamma, eps_t)
    assert half_rounding_of(api_pdx, f32_pdx, slack)


def test_layer_norm_grad_kernel_walks_the_tiling(backend, monkeypatch):
    """The engine is called once per step with the tiling's row counts, loop then tail."""
    b, s, h = 3, 40, 8
    shape = [b, s, h, h]
    tiling = GetLayerNormGradNDTilingInfo(shape, 6 * 8 * 4 * 3, 4, False)
    assert tiling.loopNum == 15 and tiling.nohCalSize == 8 and tiling.nohTailSize == 0
    tiling = GetLayerNormGradNDTilingInfo([b, 37, h, h], 6 * 8 * 4 * 3, 4, False)
    assert (tiling.loopNum, tiling.nohTailSize) == (13, 7)
    engine = importlib.import_module(f"gradops.{'kernels' if backend == 'triton' else 'reference'}.layer_norm")
    calls = []
    real = engine.layer_norm_grad

    def spy(dy, *a):
        calls.append(dy.shape[0])
        return real(dy, *a)

    monkeypatch.setattr(engine, "layer_norm_grad", spy)
    dy, x, var, mean, gamma = make_inputs(b, 37, h, torch.float32)
    LayerNormGrad(torch.empty_like(x), torch.empty_like(x), dy, x, var, mean, gamma, None, 1e-5, tiling)
    assert calls == [8] * 13 + [7]
    calls.clear()
    t0 = GetLayerNormGradNDTilingInfo([1, 3, h, h], 6 * h * 4, 4, False)  # loopNum 0
    dy, x, var, mean, gamma = make_inputs(1, 3, h, torch.float32)
    LayerNormGrad(torch.empty_like(x), torch.empty_like(x), dy, x, var, mean, gamma, None, 1e-5, t0)
    assert t0.loopNum == 0 and calls == [3]


def test_layer_norm_grad_kernel_uses_the_buffer(backend):
    """The float32 working set lands in sharedTmpBuffer at the tiling's positions."""
    b, s, h = 1, 8, 8
    shape = [b, s, h, h]
    tiling = GetLayerNormGradNDTilingInfo(shape, 4096, 4, False)
    # rows round up, so the positions reach past stackBufferSize: give the buffer that much
    buf = torch.zeros((tiling.x3TensorPos + tiling.oneCalSize) * 4, dtype=torch.uint8)
    dy, x, var, mean, gamma = make_inputs(b, s, h, torch.float32)
    pd_x, res = torch.empty_like(x), torch.empty_like(x)
    LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, buf, 1e-5, tiling)
    f = buf.view(torch.float32)
    n = s * h  # a single step
    assert torch.equal(f[tiling.x3TensorPos:tiling.x3TensorPos + n], pd_x.reshape(-1))
    assert torch.equal(f[tiling.tmpTensorBSHPos:tiling.tmpTensorBSHPos + n], res.reshape(-1))


def test_positions_past_a_buffer_of_at_least_the_minimum_use_own_scratch(backend):
    b, s, h = 1, 8, 8
    shape = [b, s, h, h]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, 4, False)
    tiling = GetLayerNormGradNDTilingInfo(shape, 4096, 4, False)
    assert 4096 >= mn and (tiling.x3TensorPos + tiling.oneCalSize) * 4 > 4096
    buf = torch.zeros(4096, dtype=torch.uint8)
    dy, x, var, mean, gamma = make_inputs(b, s, h, torch.float32)
    pd_x, res = torch.empty_like(x), torch.empty_like(x)
    LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, buf, 1e-5, tiling)
    want_pdx, want_res = oracle_grad(dy, x, var, mean, gamma, 1e-5)
    torch.testing.assert_close(pd_x.double(), want_pdx, **tol(torch.float32))
    torch.testing.assert_close(res.double(), want_res, **tol(torch.float32))


def test_layer_norm_grad_reuse_source_overwrites_like_cann(backend):
    b, s, h = 2, 11, 16
    shape = [b, s, h, h]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, 4, True)
    tiling = GetLayerNormGradNDTilingInfo(shape, 4 * h * 4 * 8, 4, True)
    assert tiling.x1TensorPos == 0 and tiling.x3TensorPos == 3 * tiling.oneCalSize
    dy, x, var, mean, gamma = make_inputs(b, s, h, torch.float32)
    dy0, x0 = dy.clone(), x.clone()
    pd_x, res = torch.empty_like(x), torch.empty_like(x)
    LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, torch.zeros(max(mn, 4 * h * 4 * 8), dtype=torch.uint8),
                  1e-5, tiling, isReuseSource=True)
    want_pdx, want_res = oracle_grad(dy0, x0, var, mean, gamma, 1e-5)
    torch.testing.assert_close(pd_x.double(), want_pdx, **tol(torch.float32))
    torch.testing.assert_close(res.double(), want_res, **tol(torch.float32))
    torch.testing.assert_close(dy, dy0 * gamma)             # inputDy <- dy*gamma
    torch.testing.assert_close(x, x0 - mean[..., None])     # inputX <- x-mean


def test_layer_norm_grad_reuse_non_contiguous_inputs_are_overwritten_too(backend):
    b, s, h = 3, 4, 8
    shape = [b, s, h, h]
    tiling = GetLayerNormGradNDTilingInfo(shape, 4 * h * 4 * 8, 4, True)
    dy_store = torch.randn(s, b, h)
    dy = dy_store.transpose(0, 1)  # [b, s, h] whose b and s cannot merge
    _, x, var, mean, gamma = make_inputs(b, s, h, torch.float32)
    dy0 = dy.clone()
    pd_x, res = torch.empty_like(x), torch.empty_like(x)
    LayerNormGrad(pd_x, res, dy, x, var, mean, gamma, None, 1e-5, tiling, isReuseSource=True)
    torch.testing.assert_close(dy, dy0 * gamma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,s,h,stack", [(2, 9, 16, None), (3, 7, 8, 1 << 16), (5, 3, 8, 4 * 8 * 4 + 7 * 4 * 8)])
def test_layer_norm_grad_beta_kernel(backend, dtype, b, s, h, stack):
    ts = 2 if dtype == torch.float16 else 4
    shape = [b, s, h, h]
    _, mn = GetLayerNormGradBetaMaxMinTmpSize(shape, ts, False)
    stack = mn if stack is None else stack
    tiling = GetLayerNormGradBetaNDTilingInfo(shape, stack, ts, False)
    res, dy = torch.randn(b, s, h).to(dtype), torch.randn(b, s, h).to(dtype)
    res0, dy0 = res.clone(), dy.clone()
    pg, pb = torch.full((h,), 7.0, dtype=dtype), torch.full((h,), 7.0, dtype=dtype)
    LayerNormGradBeta(pg, pb, res, dy, torch.zeros(max(mn, stack), dtype=torch.uint8), tiling)
    want_g = (res.double() * dy.double()).sum((0, 1))
    want_b = dy.double().sum((0, 1))
    torch.testing.assert_close(pg.double(), want_g, **tol(dtype))
    torch.testing.assert_close(pb.double(), want_b, **tol(dtype))
    assert torch.equal(res, res0) and torch.equal(dy, dy0)


def test_layer_norm_grad_beta_half_accumulates_in_float32(backend):
    # 4096 rows of 0.1: per-step half partial sums would drift; one float32 sum rounds once
    b, s, h = 64, 64, 8
    dy = torch.full((b, s, h), 0.1, dtype=torch.float16)
    res = torch.ones((b, s, h), dtype=torch.float16)
    shape = [b, s, h, h]
    _, mn = GetLayerNormGradBetaMaxMinTmpSize(shape, 2, False)
    tiling = GetLayerNormGradBetaNDTilingInfo(shape, mn + 64 * 4 * 8, 2, False)
    assert tiling.loopRound > 1
    pg, pb = torch.empty(h, dtype=torch.float16), torch.empty(h, dtype=torch.float16)
    LayerNormGradBeta(pg, pb, res, dy, None, tiling)
    want = torch.tensor(float(torch.tensor(0.1, dtype=torch.float16)) * b * s).to(torch.float16)
    assert torch.equal(pb, want.expand(h)) and torch.equal(pg, want.expand(h))


def test_layer_norm_grad_beta_reuse_overwrites_res_for_gamma(backend):
    b, s, h = 2, 5, 8
    shape = [b, s, h, h]
    tiling = GetLayerNormGradBetaNDTilingInfo(shape, 4 * h * 4, 4, True)
    res, dy = torch.randn(b, s, h), torch.randn(b, s, h)
    res0, dy0 = res.clone(), dy.clone()
    pg, pb = torch.empty(h), torch.empty(h)
    LayerNormGradBeta(pg, pb, res, dy, None, tiling, isReuseSource=True)
    torch.testing.assert_close(pg, (res0 * dy0).sum((0, 1)))
    torch.testing.assert_close(res, res0 * dy0)
    assert torch.equal(dy, dy0)


def grad_call(**over):
    b, s, h = 2, 4, 8
    shape = [b, s, h, h]
    _, mn = GetLayerNormGradMaxMinTmpSize(shape, 4, False)
    tiling = GetLayerNormGradNDTilingInfo(shape, mn, 4, False)
    dy, x, var, mean, gamma = make_inputs(b, s, h, torch.float32)
    args = dict(outputPdX=torch.full_like(x, 3.0), resForGamma=torch.full_like(x, 3.0), inputDy=dy, inputX=x,
                inputVariance=var, inputMean=mean, inputGamma=gamma,
                sharedTmpBuffer=torch.zeros(mn, dtype=torch.uint8), epsilon=1e-5, tiling=tiling)
    args.update(over)
    return args


# (the changes are made in the test, on the test device: a tensor in a parametrize table would
# be made at collection, on the CPU)
@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(inputDy=None), NULLPTR, "inputDy"),
    (lambda: dict(outputPdX=None), NULLPTR, "outputPdX"),
    (lambda: dict(tiling=None), NULLPTR, "tiling"),
    (lambda: dict(epsilon=None), NULLPTR, "epsilon"),
    (lambda: dict(inputX=torch.zeros(2, 4, 8, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(inputGamma=torch.zeros(8, dtype=torch.float16)), INVALID, "dtype"),
    (lambda: dict(inputGamma=torch.zeros(9)), INVALID, "inputGamma"),
    (lambda: dict(inputMean=torch.zeros(2, 5)), INVALID, "inputMean"),
    (lambda: dict(sharedTmpBuffer=torch.zeros(10, dtype=torch.uint8)), INVALID, "sharedTmpBuffer"),
    (lambda: dict(sharedTmpBuffer=torch.zeros(4096, dtype=torch.float32)), INVALID, "sharedTmpBuffer"),
    (lambda: dict(tiling=LayerNormGradBetaTiling()), INVALID, "tiling"),
    (lambda: dict(tiling=dataclasses.replace(GetLayerNormGradNDTilingInfo([2, 4, 8, 8], 4096, 4, False),
                                             originalHLength=9)), INVALID, "originalHLength"),
    (lambda: dict(tiling=GetLayerNormGradNDTilingInfo([2, 5, 8, 8], 4096, 4, False)), INVALID, "tiling"),
])
def test_layer_norm_grad_kernel_errors_write_nothing(backend, change, status, word):
    args = grad_call(**change())
    outs = [t for t in (args["outputPdX"], args["resForGamma"]) if t is not None]
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGrad(**args)
    assert e.value.status == status and word in str(e.value)
    assert all(torch.all(t == 3.0) for t in outs)


def test_reuse_source_with_half_is_161002(backend):
    b, s, h = 1, 2, 16
    dy, x, var, mean, gamma = make_inputs(b, s, h, torch.float16)
    t = GetLayerNormGradNDTilingInfo([b, s, h, h], 1 << 14, 2, True)
    out = torch.full_like(x, 3.0)
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGrad(out, out.clone(), dy, x, var, mean, gamma, None, 1e-5, t, isReuseSource=True)
    assert e.value.status == INVALID and "isReuseSource" in str(e.value)
    assert torch.all(out == 3.0)
    tb = GetLayerNormGradBetaNDTilingInfo([b, s, h, h], 1 << 14, 2, True)
    pg = torch.full((h,), 3.0, dtype=torch.float16)
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGradBeta(pg, pg.clone(), x, dy, None, tb, isReuseSource=True)
    assert e.value.status == INVALID and torch.all(pg == 3.0)


def test_layer_norm_grad_beta_refuses_small_buffer_and_bad_tiling(backend):
    b, s, h = 2, 3, 8
    tiling = GetLayerNormGradBetaNDTilingInfo([b, s, h, h], 1024, 4, False)
    res, dy = torch.randn(b, s, h), torch.randn(b, s, h)
    pg = torch.full((h,), 3.0)
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGradBeta(pg, pg.clone(), res, dy, torch.zeros(2 * h * 4 - 1, dtype=torch.uint8), tiling)
    assert e.value.status == INVALID and "sharedTmpBuffer" in str(e.value)
    bad = GetLayerNormGradBetaNDTilingInfo([b, s, h, h], 1024, 4, False)
    bad.loopRound += 1
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGradBeta(pg, pg.clone(), res, dy, None, bad)
    assert e.value.status == INVALID and "loopRound" in str(e.value)
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGradBeta(pg, None, res, dy, None, tiling)
    assert e.value.status == NULLPTR and "outputPdBeta" in str(e.value)
    assert torch.all(pg == 3.0)


def test_empty_tiling_is_refused_before_anything_runs(backend):
    t = LayerNormGradBetaTiling()  # all zeros: describes nothing
    empty = torch.empty(0, 0, 0)
    pg = torch.full((0,), 3.0)
    with pytest.raises(gradops.AclnnError) as e:
        LayerNormGradBeta(pg, pg.clone(), empty, empty.clone(), None, t)
    assert e.value.status == INVALID and "tiling.bLength" in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_grad_padded_rows_follow_cann(backend, dtype):
    """Rows stored 16 wide holding 13 values and zero padding (srcShape [B, S, 16, 13]): sums
    run over the stored width, the factors 1/H and 2/H use originH (OPERATORS.md section 2).
    Expected values from that formula, written out here in float64."""
    b, s, h, oh = 4, 10, 16, 13
    g = torch.Generator().manual_seed(7)
    x = torch.zeros(b, s, h, dtype=torch.float64)
    dy = torch.zeros(b, s, h, dtype=torch.float64)
    x[..., :oh] = torch.randn(b, s, oh, generator=g, dtype=torch.float64, device="cpu")
    dy[..., :oh] = torch.randn(b, s, oh, generator=g, dtype=torch.float64, device="cpu")
    gamma = torch.zeros(h, dtype=torch.float64)
    gamma[:oh] = torch.randn(oh, generator=g, dtype=torch.float64, device="cpu")
    x, dy, gamma = x.to(dtype), dy.to(dtype), gamma.to(dtype)  # the values the kernel sees
    mean = x.double()[..., :oh].mean(-1).to(dtype)
    var = x.double()[..., :oh].var(-1, unbiased=False).to(dtype)
    eps = float(torch.tensor(1e-5, dtype=dtype))

    xd, dyd, gd = x.double(), dy.double(), gamma.double()
    r = (var.double()[..., None] + eps) ** -0.5
    x2 = xd - mean.double()[..., None]  # the padding's x - mean is -mean: CANN sums it too
    x1 = dyd * gd
    pd_var = (-0.5 * x1 * x2 * r ** 3).sum(-1, keepdim=True)
    pd_mean = (-x1 * r).sum(-1, keepdim=True) + pd_var * (1 / oh) * (-2 * x2).sum(-1, keepdim=True)
    want_pdx = x1 * r + pd_var * (2 / oh) * x2 + pd_mean / oh
    want_res = x2 * r

    type_size = 2 if dtype == torch.float16 else 4
    mn = GetLayerNormGradMaxMinTmpSize([b, s, h, oh], type_size, False)[1]
    tiling = GetLayerNormGradNDTilingInfo([b, s, h, oh], mn, type_size, False)
    assert tiling.originalHLength == oh and tiling.loopNum >= 1
    pdx = torch.full((b, s, h), 7.0, dtype=dtype)
    res = torch.full((b, s, h), 7.0, dtype=dtype)
    buf = torch.zeros(mn, dtype=torch.uint8)
    if backend == "triton":  # padded rows are the reference engine's alone (docs/operators.md)
        with pytest.raises(gradops.AclnnError, match="padded rows"):
            LayerNormGrad(pdx, res, dy, x, var, mean, gamma, buf, eps, tiling)
        assert (pdx == 7).all() and (res == 7).all()  # refused before anything is written
        return
    LayerNormGrad(pdx, res, dy, x, var, mean, gamma, buf, eps, tiling)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    assert (pdx.double() - want_pdx).abs().max() <= tol * want_pdx.abs().max()
    assert (res.double() - want_res).abs().max() <= tol * want_res.abs().max()
    # the padding matters: unpadded rows of 13 give a pd_x outside the tolerance of this one
    unpadded, _ = gradops.layer_norm_grad(dy[..., :oh], x[..., :oh], var, mean, gamma[:oh], eps)
    assert (pdx[..., :oh].double() - unpadded.double()).abs().max() > 3 * tol * want_pdx.abs().max()
