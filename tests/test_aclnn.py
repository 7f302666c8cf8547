"""gradops.aclnn: CANN's two-phase API. Every documented rule with its status code, nothing
written by a failed call (outputs hold a sentinel that must survive), phase one reading no
data (it accepts meta tensors, which have none), executor and workspace rules, and results
equal to the Python API's."""

import pytest
import torch

import gradops
from gradops import aclnn as A

NULLPTR, INVALID, TILING = 161001, 161002, 561002
SENTINEL = 7.0


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def sentinel(*shape, dtype=torch.float32):
    return torch.full(shape, SENTINEL, dtype=dtype)


def intact(*outs):
    return all(t is None or not isinstance(t, torch.Tensor) or bool(torch.all(t == SENTINEL)) for t in outs)


def run(get_ws, launch, args, stream=None):
    size, ex = get_ws(**args)
    ws = torch.empty(size, dtype=torch.uint8) if size else None
    assert launch(ws, size, ex, stream) == A.ACLNN_SUCCESS == 0
    return size, ex


def expect_error(get_ws, args, status, word, out_names):
    with pytest.raises(gradops.AclnnError) as e:
        get_ws(**args)
    assert e.value.status == status, str(e.value)
    assert word in str(e.value), str(e.value)
    assert intact(*[args.get(n) for n in out_names])


# ---------------------------------------------------------------------------------------
# aclnnLayerNorm / aclnnLayerNormBackward (161001 / 161002 only)
# ---------------------------------------------------------------------------------------

LN_OUTS = ["out", "meanOutOptional", "rstdOutOptional"]
LNB_OUTS = ["gradInputOut", "gradWeightOut", "gradBiasOut"]


def ln_args(dtype=torch.float32, **over):
    a = dict(input=rand(2, 3, 16, dtype=dtype), normalizedShape=[16], weightOptional=rand(16, dtype=dtype),
             biasOptional=rand(16, dtype=dtype), eps=1e-5, out=sentinel(2, 3, 16, dtype=dtype),
             meanOutOptional=sentinel(2, 3, 1), rstdOutOptional=sentinel(2, 3, 1))
    a.update(over)
    return a


def lnb_args(dtype=torch.float32, **over):
    x, dy, w = rand(2, 3, 16, dtype=dtype), rand(2, 3, 16, dtype=dtype), rand(16, dtype=dtype)
    _, mean, rstd = gradops.layer_norm(x, [16], w)
    a = dict(gradOut=dy, input=x, normalizedShape=[16], mean=mean, rstd=rstd, weightOptional=w,
             biasOptional=rand(16, dtype=dtype), outputMask=[True, True, True],
             gradInputOut=sentinel(2, 3, 16, dtype=dtype), gradWeightOut=sentinel(16, dtype=dtype),
             gradBiasOut=sentinel(16, dtype=dtype))
    a.update(over)
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layer_norm_matches_python_api(backend, dtype):
    a = ln_args(dtype)
    size, _ = run(A.aclnnLayerNormGetWorkspaceSize, A.aclnnLayerNorm, a)
    assert size == 0
    y, mean, rstd = gradops.layer_norm(a["input"], [16], a["weightOptional"], a["biasOptional"], 1e-5)
    assert torch.equal(a["out"], y)
    assert torch.equal(a["meanOutOptional"], mean) and torch.equal(a["rstdOutOptional"], rstd)


def test_layer_norm_casts_into_outputs_and_optional_stats(backend):
    a = ln_args(out=sentinel(2, 3, 16, dtype=torch.float16), meanOutOptional=None,
                rstdOutOptional=sentinel(6, dtype=torch.bfloat16)[:6].view(2, 3))
    run(A.aclnnLayerNormGetWorkspaceSize, A.aclnnLayerNorm, a)
    y, _, rstd = gradops.layer_norm(a["input"], [16], a["weightOptional"], a["biasOptional"], 1e-5)
    assert torch.equal(a["out"], y.half())
    assert torch.equal(a["rstdOutOptional"], rstd.reshape(2, 3).bfloat16())


# (each change is made in the test, under the backend fixture: on the test device; a tensor in
# a parametrize table would be made at collection, on the CPU)
@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(input=None), NULLPTR, "input"),
    (lambda: dict(normalizedShape=None), NULLPTR, "normalizedShape"),
    (lambda: dict(eps=None), NULLPTR, "eps"),
    (lambda: dict(out=None), NULLPTR, "out"),
    (lambda: dict(input=rand(2, 3, 16, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(input=torch.ones(2, 3, 16, dtype=torch.int32)), INVALID, "dtype"),
    (lambda: dict(input=rand(*[1] * 8, 16), out=sentinel(*[1] * 8, 16)), INVALID, "input"),
    (lambda: dict(normalizedShape=[]), INVALID, "normalizedShape"),
    (lambda: dict(normalizedShape=[1] * 9), INVALID, "normalizedShape"),
    (lambda: dict(normalizedShape=[8]), INVALID, "normalizedShape"),
    (lambda: dict(normalizedShape=16), INVALID, "normalizedShape"),
    (lambda: dict(weightOptional=rand(8)), INVALID, "weightOptional"),
    (lambda: dict(weightOptional=rand(16, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(biasOptional=rand(3, 16)), INVALID, "biasOptional"),
    (lambda: dict(out=sentinel(2, 3, 8)), INVALID, "out"),
    (lambda: dict(out=sentinel(2, 3, 16, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(meanOutOptional=sentinel(2, 4)), INVALID, "meanOutOptional"),
    (lambda: dict(rstdOutOptional=[1.0]), INVALID, "rstdOutOptional"),
])
def test_layer_norm_errors(backend, change, status, word):
    expect_error(A.aclnnLayerNormGetWorkspaceSize, ln_args(**change()), status, word, LN_OUTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layer_norm_backward_matches_python_api(backend, dtype):
    a = lnb_args(dtype)
    size, _ = run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, a)
    assert size == 0  # float32 keepdim statistics are used as they are
    want = gradops.layer_norm_backward(a["gradOut"], a["input"], [16], a["mean"], a["rstd"], a["weightOptional"])
    for got, w in zip((a["gradInputOut"], a["gradWeightOut"], a["gradBiasOut"]), want):
        assert torch.equal(got, w)


def test_layer_norm_backward_half_flat_statistics_use_the_workspace(backend):
    a = lnb_args()
    a["mean"] = a["mean"].reshape(6).half()
    a["rstd"] = a["rstd"].reshape(6).bfloat16()
    a["gradWeightOut"] = sentinel(16, dtype=torch.float16)  # accumulated in f32, cast to the output
    size, _ = run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, a)
    assert size == 2 * 6 * 4  # float32 mean and rstd
    want = gradops.layer_norm_backward(a["gradOut"], a["input"], [16], a["mean"].float().reshape(2, 3),
                                       a["rstd"].float().reshape(2, 3),
                                       a["weightOptional"])
    assert torch.equal(a["gradInputOut"], want[0])
    assert torch.equal(a["gradWeightOut"], want[1].half())
    assert torch.equal(a["gradBiasOut"], want[2])


def test_layer_norm_backward_output_mask_gates_outputs(backend):
    a = lnb_args(outputMask=[True, False, False], gradWeightOut=None)
    run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, a)
    assert not intact(a["gradInputOut"]) and intact(a["gradBiasOut"])  # masked out: not written


def test_layer_norm_backward_weight_none_and_empty_rows(backend):
    a = lnb_args(weightOptional=None)
    run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, a)
    want = gradops.layer_norm_backward(a["gradOut"], a["input"], [16], a["mean"], a["rstd"])
    assert torch.equal(a["gradWeightOut"], want[1])
    x = rand(0, 16)
    b = dict(gradOut=rand(0, 16), input=x, normalizedShape=[16], mean=torch.empty(0), rstd=torch.empty(0),
             weightOptional=rand(16), biasOptional=None, outputMask=[True, True, True],
             gradInputOut=torch.empty(0, 16), gradWeightOut=sentinel(16), gradBiasOut=sentinel(16))
    run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, b)
    assert torch.equal(b["gradWeightOut"], torch.zeros(16)) and torch.equal(b["gradBiasOut"], torch.zeros(16))


@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(gradOut=None), NULLPTR, "gradOut"),
    (lambda: dict(input=None), NULLPTR, "input"),
    (lambda: dict(normalizedShape=None), NULLPTR, "normalizedShape"),
    (lambda: dict(mean=None), NULLPTR, "mean"),
    (lambda: dict(rstd=None), NULLPTR, "rstd"),
    (lambda: dict(outputMask=None), NULLPTR, "outputMask"),
    (lambda: dict(gradInputOut=None), NULLPTR, "gradInputOut"),
    (lambda: dict(gradBiasOut=None), NULLPTR, "gradBiasOut"),
    (lambda: dict(outputMask=[True, True]), INVALID, "outputMask"),
    (lambda: dict(input=rand(2, 3, 16, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(gradOut=rand(2, 3, 16, dtype=torch.float16)), INVALID, "gradOut"),
    (lambda: dict(mean=torch.zeros(2, 3, 1, dtype=torch.float64)), INVALID, "mean"),
    (lambda: dict(rstd=torch.zeros(2, 3, 1, dtype=torch.int32)), INVALID, "rstd"),
    (lambda: dict(gradOut=rand(2, 4, 16)), INVALID, "gradOut"),
    (lambda: dict(mean=torch.zeros(7)), INVALID, "mean"),
    (lambda: dict(rstd=torch.zeros(6)), INVALID, "rstd"),
    (lambda: dict(normalizedShape=[1] * 9), INVALID, "normalizedShape"),
    (lambda: dict(normalizedShape=[3, 8]), INVALID, "normalizedShape"),
    (lambda: dict(weightOptional=rand(15)), INVALID, "weightOptional"),
    (lambda: dict(biasOptional=rand(16, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(gradInputOut=sentinel(2, 3, 15)), INVALID, "gradInputOut"),
    (lambda: dict(gradWeightOut=sentinel(16, dtype=torch.float64)), INVALID, "gradWeightOut"),
    (lambda: dict(gradBiasOut=sentinel(1, 16)), INVALID, "gradBiasOut"),
])
def test_layer_norm_backward_errors(backend, change, status, word):
    expect_error(A.aclnnLayerNormBackwardGetWorkspaceSize, lnb_args(**change()), status, word, LNB_OUTS)


def test_layer_norm_backward_rank_limits(backend):
    x = rand(*[1] * 8, 16)
    a = lnb_args(gradOut=x.clone(), input=x, mean=torch.zeros([1] * 8), rstd=torch.ones([1] * 8),
                 gradInputOut=sentinel(*[1] * 8, 16))
    expect_error(A.aclnnLayerNormBackwardGetWorkspaceSize, a, INVALID, "input", LNB_OUTS)


# ---------------------------------------------------------------------------------------
# aclnnRmsNorm / aclnnRmsNormGrad (shapes at tiling: 561002)
# ---------------------------------------------------------------------------------------

RMS_TABLE = [  # CANN's dtype table (dy=x, gamma) -> (dx, dgamma f32)
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


def rms_args(xd=torch.float16, gd=torch.float32, **over):
    a = dict(x=rand(2, 3, 32, dtype=xd), gamma=rand(32, dtype=gd), epsilon=1e-6, yOut=sentinel(2, 3, 32, dtype=xd),
             rstdOut=sentinel(2, 3, 1))
    a.update(over)
    return a


def rmsg_args(xd=torch.float16, gd=torch.float32, **over):
    x, g = rand(2, 3, 32, dtype=xd), rand(32, dtype=gd)
    _, rstd = gradops.rms_norm(x, g)
    a = dict(dy=rand(2, 3, 32, dtype=xd), x=x, rstd=rstd, gamma=g, dxOut=sentinel(2, 3, 32, dtype=xd),
             dgammaOut=sentinel(32))
    a.update(over)
    return a


@pytest.mark.parametrize("xd,gd", RMS_TABLE)
def test_rms_norm_table_matches_python_api(backend, xd, gd):
    a = rms_args(xd, gd)
    run(A.aclnnRmsNormGetWorkspaceSize, A.aclnnRmsNorm, a)
    y, rstd = gradops.rms_norm(a["x"], a["gamma"], 1e-6)
    assert torch.equal(a["yOut"], y) and torch.equal(a["rstdOut"], rstd)
    b = rmsg_args(xd, gd)
    size, _ = run(A.aclnnRmsNormGradGetWorkspaceSize, A.aclnnRmsNormGrad, b)
    assert size == 0
    dx, dgamma = gradops.rms_norm_grad(b["dy"], b["x"], b["rstd"], b["gamma"])
    assert torch.equal(b["dxOut"], dx) and torch.equal(b["dgammaOut"], dgamma)


def test_rms_norm_grad_accepts_views_and_flat_rstd(backend):
    base = rand(32, 6, dtype=torch.float32)
    x = base.t().unflatten(0, (2, 3))  # a non-contiguous [2, 3, 32] view
    g = rand(32)
    _, rstd = gradops.rms_norm(x, g)
    dy = rand(32, 6).t().unflatten(0, (2, 3))
    dx_store = sentinel(32, 6)
    dx_out = dx_store.t().unflatten(0, (2, 3))  # a non-contiguous output view
    a = dict(dy=dy, x=x, rstd=rstd.reshape(2, 3), gamma=g, dxOut=dx_out, dgammaOut=sentinel(32))
    run(A.aclnnRmsNormGradGetWorkspaceSize, A.aclnnRmsNormGrad, a)
    dx, dgamma = gradops.rms_norm_grad(dy.contiguous(), x.contiguous(), rstd, g)
    torch.testing.assert_close(dx_out, dx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a["dgammaOut"], dgamma, rtol=1e-6, atol=1e-6)


RMS_OUTS = ["yOut", "rstdOut"]
RMSG_OUTS = ["dxOut", "dgammaOut"]


@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(x=None), NULLPTR, "x"),
    (lambda: dict(gamma=None), NULLPTR, "gamma"),
    (lambda: dict(epsilon=None), NULLPTR, "epsilon"),
    (lambda: dict(yOut=None), NULLPTR, "yOut"),
    (lambda: dict(rstdOut=None), NULLPTR, "rstdOut"),
    (lambda: dict(x=rand(2, 3, 32, dtype=torch.float64), yOut=sentinel(2, 3, 32, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(gamma=rand(32, dtype=torch.bfloat16)), INVALID, "gamma"),  # not in CANN's table beside f16
    (lambda: dict(gamma=rand(16)), TILING, "gamma"),
    (lambda: dict(x=rand(*[1] * 8, 32), yOut=sentinel(*[1] * 8, 32)), TILING, "x"),
    (lambda: dict(x=rand(2, 3, 0), gamma=rand(0), yOut=sentinel(2, 3, 0)), TILING, "last dim"),
    (lambda: dict(yOut=sentinel(2, 3, 32)), INVALID, "yOut"),
    (lambda: dict(yOut=sentinel(2, 3, 31, dtype=torch.float16)), TILING, "yOut"),
    (lambda: dict(rstdOut=sentinel(2, 3, 1, dtype=torch.float16)), INVALID, "rstdOut"),
    (lambda: dict(rstdOut=sentinel(2, 1)), TILING, "rstdOut"),
])
def test_rms_norm_errors(backend, change, status, word):
    expect_error(A.aclnnRmsNormGetWorkspaceSize, rms_args(**change()), status, word, RMS_OUTS)


@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(dy=None), NULLPTR, "dy"),
    (lambda: dict(x=None), NULLPTR, "x"),
    (lambda: dict(rstd=None), NULLPTR, "rstd"),
    (lambda: dict(gamma=None), NULLPTR, "gamma"),
    (lambda: dict(dxOut=None), NULLPTR, "dxOut"),
    (lambda: dict(dgammaOut=None), NULLPTR, "dgammaOut"),
    (lambda: dict(dy=rand(2, 3, 32, dtype=torch.float32)), INVALID, "dy"),
    (lambda: dict(rstd=torch.ones(2, 3, 1, dtype=torch.float16)), INVALID, "rstd"),
    (lambda: dict(x=rand(2, 3, 32, dtype=torch.float64), dy=rand(2, 3, 32, dtype=torch.float64)), INVALID, "dtype"),
    (lambda: dict(gamma=rand(32, dtype=torch.float64)), INVALID, "gamma"),
    (lambda: dict(dy=rand(32, dtype=torch.float16), x=rand(32, dtype=torch.float16), rstd=torch.ones(()),
          dxOut=sentinel(32, dtype=torch.float16)), TILING, "dy"),  # CANN's grad: 2..8 dims
    (lambda: dict(dy=rand(2, 4, 32, dtype=torch.float16)), TILING, "dy"),
    (lambda: dict(rstd=torch.ones(3, 2)), TILING, "rstd"),
    (lambda: dict(gamma=rand(3, 16)), TILING, "gamma"),
    (lambda: dict(dxOut=sentinel(2, 3, 32)), INVALID, "dxOut"),
    (lambda: dict(dgammaOut=sentinel(32, dtype=torch.float16)), INVALID, "dgammaOut"),
    (lambda: dict(dgammaOut=sentinel(1, 32)), TILING, "dgammaOut"),
])
def test_rms_norm_grad_errors(backend, change, status, word):
    expect_error(A.aclnnRmsNormGradGetWorkspaceSize, rmsg_args(**change()), status, word, RMSG_OUTS)


def test_rms_norm_grad_table_rejects_float32_x_with_half_gamma(backend):
    expect_error(A.aclnnRmsNormGradGetWorkspaceSize, rmsg_args(torch.float32, torch.float32,
                 gamma=rand(32, dtype=torch.float16)), INVALID, "gamma", RMSG_OUTS)


# ---------------------------------------------------------------------------------------
# aclnnNsaCompress / aclnnNsaCompressGrad (TND, f16/bf16, actSeqLen type 0)
# ---------------------------------------------------------------------------------------

ENDS = [64, 112]  # two sequences of 64 and 48 tokens
BLOCK, STRIDE = 32, 16
C = (64 - 32) // 16 + 1 + (48 - 32) // 16 + 1  # 3 + 2 compressed blocks
NSA_OUTS = ["output"]
NSAG_OUTS = ["inputGradOut", "weightGradOut"]


def nsa_args(dtype=torch.float16, t=112, n=2, d=16, **over):
    a = dict(input=rand(t, n, d, dtype=dtype), weight=rand(BLOCK, n, dtype=dtype), actSeqLenOptional=list(ENDS),
             layoutOptional="TND", compressBlockSize=BLOCK, compressStride=STRIDE, actSeqLenType=0,
             output=sentinel(C, n, d, dtype=dtype))
    a.update(over)
    return a


def nsag_args(dtype=torch.float16, **over):
    a = dict(outputGrad=rand(C, 2, 16, dtype=dtype), input=rand(112, 2, 16, dtype=dtype),
             weight=rand(BLOCK, 2, dtype=dtype), actSeqLenOptional=list(ENDS), compressBlockSize=BLOCK,
             compressStride=STRIDE, actSeqLenType=0, layoutOptional="TND",
             inputGradOut=sentinel(112, 2, 16, dtype=dtype), weightGradOut=sentinel(BLOCK, 2, dtype=dtype))
    a.update(over)
    return a


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nsa_compress_matches_python_api(backend, dtype):
    a = nsa_args(dtype, actSeqLenOptional=torch.tensor(ENDS, dtype=torch.int64))
    assert run(A.aclnnNsaCompressGetWorkspaceSize, A.aclnnNsaCompress, a)[0] == 0
    assert torch.equal(a["output"], gradops.nsa_compress(a["input"], a["weight"], BLOCK, STRIDE, ENDS))
    b = nsag_args(dtype)
    run(A.aclnnNsaCompressGradGetWorkspaceSize, A.aclnnNsaCompressGrad, b)
    dx, dw = gradops.nsa_compress_grad(b["outputGrad"], b["input"], b["weight"], BLOCK, STRIDE, ENDS)
    assert torch.equal(b["inputGradOut"], dx) and torch.equal(b["weightGradOut"], dw)


# (each change is made in the test, under the backend fixture: on the test device; a tensor in
# a parametrize table would be made at collection, on the CPU)
@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(input=None), NULLPTR, "input"),
    (lambda: dict(weight=None), NULLPTR, "weight"),
    (lambda: dict(output=None), NULLPTR, "output"),
    (lambda: dict(compressBlockSize=None), NULLPTR, "compressBlockSize"),
    (lambda: dict(input=rand(112, 2, 16)), INVALID, "dtype"),
    (lambda: dict(weight=rand(BLOCK, 2, dtype=torch.bfloat16)), INVALID, "weight"),
    (lambda: dict(output=sentinel(C, 2, 16, dtype=torch.float32)), INVALID, "output"),
    (lambda: dict(layoutOptional="BSND"), INVALID, "layoutOptional"),
    (lambda: dict(layoutOptional=None), INVALID, "layoutOptional"),
    (lambda: dict(actSeqLenOptional=None), INVALID, "actSeqLenOptional"),
    (lambda: dict(actSeqLenOptional=[]), INVALID, "actSeqLenOptional"),
    (lambda: dict(actSeqLenOptional=torch.tensor(ENDS, dtype=torch.int32)), INVALID, "int64"),
    (lambda: dict(actSeqLenOptional=[64, 100]), INVALID, "actSeqLenOptional"),
    (lambda: dict(actSeqLenOptional=[64, 48]), INVALID, "actSeqLenOptional"),
    (lambda: dict(actSeqLenType=1), INVALID, "actSeqLenType"),
    (lambda: dict(weight=rand(16, 2, dtype=torch.float16)), INVALID, "weight"),
    (lambda: dict(weight=rand(BLOCK, 3, dtype=torch.float16)), INVALID, "weight"),
    (lambda: dict(input=rand(112, 32, dtype=torch.float16)), INVALID, "input"),
    (lambda: dict(output=sentinel(C + 1, 2, 16, dtype=torch.float16)), INVALID, "output"),
    (lambda: dict(compressBlockSize=24, weight=rand(24, 2, dtype=torch.float16)), TILING, "compressBlockSize"),
    (lambda: dict(compressBlockSize=144, weight=rand(144, 2, dtype=torch.float16), input=rand(288, 2, 16,
          dtype=torch.float16), actSeqLenOptional=[288], output=sentinel(10, 2, 16, dtype=torch.float16)),
     TILING, "compressBlockSize"),
    (lambda: dict(compressStride=8, output=sentinel(10, 2, 16, dtype=torch.float16)), TILING, "compressStride"),
    (lambda: dict(compressStride=48, compressBlockSize=32, output=sentinel(2, 2, 16, dtype=torch.float16)), TILING,
     "compressBlockSize"),
])
def test_nsa_compress_errors(backend, change, status, word):
    expect_error(A.aclnnNsaCompressGetWorkspaceSize, nsa_args(**change()), status, word, NSA_OUTS)


@pytest.mark.parametrize("n,d,word", [(129, 16, "N"), (2, 24, "D"), (2, 272, "D")])
def test_nsa_compress_head_limits(backend, n, d, word):
    a = nsa_args(n=n, d=d)
    expect_error(A.aclnnNsaCompressGetWorkspaceSize, a, TILING, word, NSA_OUTS)


def test_nsa_compress_no_empty_tensors(backend):
    a = nsa_args(actSeqLenOptional=[16, 31], input=rand(31, 2, 16, dtype=torch.float16),
                 output=sentinel(0, 2, 16, dtype=torch.float16))
    expect_error(A.aclnnNsaCompressGetWorkspaceSize, a, INVALID, "empty", NSA_OUTS)


@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(outputGrad=None), NULLPTR, "outputGrad"),
    (lambda: dict(inputGradOut=None), NULLPTR, "inputGradOut"),
    (lambda: dict(weightGradOut=None), NULLPTR, "weightGradOut"),
    (lambda: dict(outputGrad=rand(C, 2, 16, dtype=torch.bfloat16)), INVALID, "outputGrad"),
    (lambda: dict(weightGradOut=sentinel(BLOCK, 2)), INVALID, "weightGradOut"),
    (lambda: dict(layoutOptional="BNSD"), INVALID, "layoutOptional"),
    (lambda: dict(actSeqLenOptional=None), INVALID, "actSeqLenOptional"),
    (lambda: dict(actSeqLenType=1), INVALID, "actSeqLenType"),
    (lambda: dict(outputGrad=rand(C + 1, 2, 16, dtype=torch.float16)), INVALID, "outputGrad"),
    (lambda: dict(compressStride=32, outputGrad=rand(3, 2, 16, dtype=torch.float16)), TILING, "compressStride"),
    (lambda: dict(inputGradOut=sentinel(111, 2, 16, dtype=torch.float16)), INVALID, "inputGradOut"),
    (lambda: dict(weightGradOut=sentinel(BLOCK, 3, dtype=torch.float16)), INVALID, "weightGradOut"),
])
def test_nsa_compress_grad_errors(backend, change, status, word):
    expect_error(A.aclnnNsaCompressGradGetWorkspaceSize, nsag_args(**change()), status, word, NSAG_OUTS)


# ---------------------------------------------------------------------------------------
# aclnnFusedFloydAttention / aclnnFusedFloydAttentionGrad (f16/bf16; shapes 561002)
# ---------------------------------------------------------------------------------------

B, H, N, M, K, D = 1, 1, 16, 128, 128, 32
FA_OUTS = ["softmaxMaxOut", "softmaxSumOut", "attentionOutOut"]
FAG_OUTS = ["dqOut", "dk1Out", "dv1Out", "dk2Out", "dv2Out"]


_QKV = {}


def qkv(dtype, b=B, h=H, n=N, m=M, k=K, d=D, lazy=False):
    """q, k1, v1, k2, v2; ``lazy`` gives data-less expanded tensors for shape-only checks.
    The random ones are made once per dtype (no test writes into inputs)."""
    if lazy:
        make = lambda *s: torch.zeros((), dtype=dtype).expand(*s)  # noqa: E731
        return (make(b, h, n, m, d), make(b, h, n, k, d), make(b, h, n, k, d), make(b, h, k, m, d),
                make(b, h, k, m, d))
    key = (dtype, b, h, n, m, k, d)
    if key not in _QKV:
        _QKV[key] = tuple(rand(*s, dtype=dtype) * 0.3 for s in
                          ((b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d), (b, h, k, m, d), (b, h, k, m, d)))
    return _QKV[key]


def fa_args(dtype=torch.float16, mask=True, **over):
    q, k1, v1, k2, v2 = qkv(dtype)
    atten = None
    if mask:
        atten = (torch.rand(B, 1, N, 1, K) < 0.3).to(torch.uint8)
        atten[0, 0, 3] = 1  # one fully masked row
    a = dict(query=q, key1=k1, value1=v1, key2=k2, value2=v2, attenMaskOptional=atten, scaleValue=D ** -0.5,
             softmaxMaxOut=sentinel(B, H, N, M, 8), softmaxSumOut=sentinel(B, H, N, M, 8),
             attentionOutOut=sentinel(B, H, N, M, D, dtype=dtype))
    a.update(over)
    return a


_FORWARD = {}


def fag_args(dtype=torch.float16, **over):
    if dtype not in _FORWARD:  # one forward per dtype for the whole module: the inputs of the grad
        f = fa_args(dtype)
        _FORWARD[dtype] = f, gradops.floyd_attention(f["query"], f["key1"], f["value1"], f["key2"], f["value2"],
                                                     f["attenMaskOptional"], f["scaleValue"])
    f, (out, smax, ssum) = _FORWARD[dtype]
    a = dict(query=f["query"], key1=f["key1"], value1=f["value1"], key2=f["key2"], value2=f["value2"],
             dy=rand(B, H, N, M, D, dtype=dtype), attenMaskOptional=f["attenMaskOptional"],
             softmaxMax=smax.unsqueeze(-1).expand(B, H, N, M, 8).contiguous(),
             softmaxSum=ssum.unsqueeze(-1).expand(B, H, N, M, 8).contiguous(), attentionIn=out,
             scaleValue=f["scaleValue"])
    for name, t in zip(FAG_OUTS, (f["query"], f["key1"], f["value1"], f["key2"], f["value2"])):
        a[name] = sentinel(*t.shape, dtype=dtype)
    a.update(over)
    return a


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_floyd_attention_matches_python_api(floyd_backend, dtype):
    a = fa_args(dtype)
    assert run(A.aclnnFusedFloydAttentionGetWorkspaceSize, A.aclnnFusedFloydAttention, a)[0] == 0
    out, smax, ssum = gradops.floyd_attention(a["query"], a["key1"], a["value1"], a["key2"], a["value2"],
                                              a["attenMaskOptional"], a["scaleValue"])
    assert torch.equal(a["attentionOutOut"], out)
    for r in range(8):  # CANN's [B,H,N,M,8]: every replica holds the statistic
        assert torch.equal(a["softmaxMaxOut"][..., r], smax) and torch.equal(a["softmaxSumOut"][..., r], ssum)
    assert torch.all(a["softmaxMaxOut"][0, 0, 3] == -3.4028234663852886e38)  # fully masked row
    assert torch.all(a["softmaxSumOut"][0, 0, 3] == K)


def test_floyd_attention_grad_matches_python_api(floyd_backend):
    a = fag_args()
    size, _ = run(A.aclnnFusedFloydAttentionGradGetWorkspaceSize, A.aclnnFusedFloydAttentionGrad, a)
    assert size == 2 * B * H * N * M * 4  # compact float32 statistics
    want = gradops.floyd_attention_grad(a["dy"], a["query"], a["key1"], a["value1"], a["key2"], a["value2"],
                                        a["attentionIn"], a["softmaxMax"], a["softmaxSum"],
                                        a["attenMaskOptional"], a["scaleValue"])
    for name, w in zip(FAG_OUTS, want):
        assert torch.equal(a[name], w), name


@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(query=None), NULLPTR, "query"),
    (lambda: dict(value2=None), NULLPTR, "value2"),
    (lambda: dict(scaleValue=None), NULLPTR, "scaleValue"),
    (lambda: dict(softmaxMaxOut=None), NULLPTR, "softmaxMaxOut"),
    (lambda: dict(attentionOutOut=None), NULLPTR, "attentionOutOut"),
    (lambda: dict(query=rand(B, H, N, M, D)), INVALID, "dtype"),
    (lambda: dict(key1=rand(B, H, N, K, D, dtype=torch.bfloat16)), INVALID, "key1"),
    (lambda: dict(attenMaskOptional=torch.zeros(B, 1, N, 1, K, dtype=torch.float16)), INVALID, "attenMaskOptional"),
    (lambda: dict(softmaxSumOut=sentinel(B, H, N, M, 8, dtype=torch.float16)), INVALID, "softmaxSumOut"),
    (lambda: dict(attentionOutOut=sentinel(B, H, N, M, D)), INVALID, "attentionOutOut"),
    (lambda: dict(attenMaskOptional=torch.zeros(B, 1, N, 1, K // 2, dtype=torch.bool)), TILING, "attenMaskOptional"),
    (lambda: dict(attenMaskOptional=torch.zeros(B, N, K, dtype=torch.bool)), TILING, "attenMaskOptional"),
    (lambda: dict(key1=rand(B, H, N, K, 64, dtype=torch.float16)), TILING, "key1"),
    (lambda: dict(value2=rand(B, H, K, M - 1, D, dtype=torch.float16)), TILING, "value2"),
    (lambda: dict(softmaxMaxOut=sentinel(B, H, N, M)), TILING, "softmaxMaxOut"),
    (lambda: dict(softmaxSumOut=sentinel(B, H, N, M, 4)), TILING, "softmaxSumOut"),
    (lambda: dict(attentionOutOut=sentinel(B, H, N, M, 64, dtype=torch.float16)), TILING, "attentionOutOut"),
])
def test_floyd_attention_errors(backend, change, status, word):
    expect_error(A.aclnnFusedFloydAttentionGetWorkspaceSize, fa_args(**change()), status, word, FA_OUTS)


@pytest.mark.parametrize("dims,word", [
    (dict(b=2049), "B"), (dict(h=257), "H"), (dict(n=8), "N"), (dict(n=24), "N"), (dict(m=64), "M"),
    (dict(m=192), "M"), (dict(k=64), "K"), (dict(k=136), "K"), (dict(d=16), "D"), (dict(d=48), "D"),
])
def test_floyd_attention_shape_limits(backend, dims, word):
    q, k1, v1, k2, v2 = qkv(torch.float16, lazy=True, **dims)  # shape-only: phase one reads no data
    b, h, n, m, d = q.shape
    a = dict(query=q, key1=k1, value1=v1, key2=k2, value2=v2, attenMaskOptional=None, scaleValue=1.0,
             softmaxMaxOut=torch.zeros(()).expand(b, h, n, m, 8), softmaxSumOut=torch.zeros(()).expand(b, h, n, m, 8),
             attentionOutOut=torch.zeros((), dtype=torch.float16).expand(b, h, n, m, d))
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnFusedFloydAttentionGetWorkspaceSize(**a)
    assert e.value.status == TILING and word in str(e.value)


@pytest.mark.parametrize("change,status,word", [
    (lambda: dict(dy=None), NULLPTR, "dy"),
    (lambda: dict(softmaxMax=None), NULLPTR, "softmaxMax"),
    (lambda: dict(attentionIn=None), NULLPTR, "attentionIn"),
    (lambda: dict(dv2Out=None), NULLPTR, "dv2Out"),
    (lambda: dict(dy=rand(B, H, N, M, D, dtype=torch.bfloat16)), INVALID, "dy"),
    (lambda: dict(softmaxSum=torch.ones(B, H, N, M, 8, dtype=torch.float16)), INVALID, "softmaxSum"),
    (lambda: dict(dqOut=sentinel(B, H, N, M, D)), INVALID, "dqOut"),
    (lambda: dict(softmaxMax=torch.zeros(B, H, N, M)), TILING, "softmaxMax"),
    (lambda: dict(softmaxSum=torch.ones(B, H, N, M, 4)), TILING, "softmaxSum"),
    (lambda: dict(attentionIn=rand(B, H, N, M - 1, D, dtype=torch.float16)), TILING, "attentionIn"),
    (lambda: dict(dk2Out=sentinel(B, H, K, M, 64, dtype=torch.float16)), TILING, "dk2Out"),
])
def test_floyd_attention_grad_errors(backend, change, status, word):
    expect_error(A.aclnnFusedFloydAttentionGradGetWorkspaceSize, fag_args(**change()), status, word, FAG_OUTS)


def test_dtype_rule_wins_over_a_tiling_shape_rule(backend):
    # CANN checks dtypes in its op API before shapes at tiling: both broken -> 161002
    a = rmsg_args(dxOut=sentinel(2, 3, 32), dy=rand(2, 4, 32, dtype=torch.float16))
    expect_error(A.aclnnRmsNormGradGetWorkspaceSize, a, INVALID, "dxOut", RMSG_OUTS)
    q, k1, v1, k2, v2 = qkv(torch.float16, n=8, lazy=True)
    a = fa_args(query=q, key1=k1, value1=v1, key2=k2, value2=v2, attenMaskOptional=None,
                attentionOutOut=sentinel(B, H, 8, M, D))
    expect_error(A.aclnnFusedFloydAttentionGetWorkspaceSize, a, INVALID, "attentionOutOut", FA_OUTS)


def test_messages_name_cann_parameters(backend):
    cases = [
        (A.aclnnNsaCompressGetWorkspaceSize, nsa_args(actSeqLenOptional=[64, 100]),
         ["actSeqLenOptional", "input.shape[0]"], ["seq_lens", "x.shape"]),
        (A.aclnnNsaCompressGetWorkspaceSize, nsa_args(weight=rand(16, 2, dtype=torch.float16)),
         ["weight", "compressBlockSize", "input.shape[1]"], ["block_size", "x.shape"]),
        (A.aclnnLayerNormGetWorkspaceSize, ln_args(weightOptional=rand(8)),
         ["weightOptional", "normalizedShape"], ["normalized_shape", " weight "]),
        (A.aclnnLayerNormBackwardGetWorkspaceSize, lnb_args(gradOut=rand(2, 4, 16)),
         ["gradOut", "input.shape"], ["dy ", "x.shape"]),
        (A.aclnnFusedFloydAttentionGetWorkspaceSize, fa_args(key1=rand(B, H, N, K, 64, dtype=torch.float16)),
         ["key1", "as in query"], ["k1 ", " q,", " q "]),
        (A.aclnnFusedFloydAttentionGradGetWorkspaceSize,
         fag_args(attentionIn=rand(B, H, N, M - 1, D, dtype=torch.float16)), ["attentionIn", "query"], ["out "]),
    ]
    for get_ws, args, present, absent in cases:
        with pytest.raises(gradops.AclnnError) as e:
            get_ws(**args)
        msg = str(e.value)
        for w in present:
            assert w in msg, msg
        for w in absent:
            assert w not in msg, msg


# ---------------------------------------------------------------------------------------
# Phase one reads and writes nothing
# ---------------------------------------------------------------------------------------

def to_meta(a):
    return {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in a.items()}


@pytest.mark.parametrize("get_ws,make,out_names", [
    (A.aclnnLayerNormGetWorkspaceSize, ln_args, LN_OUTS),
    (A.aclnnLayerNormBackwardGetWorkspaceSize, lnb_args, LNB_OUTS),
    (A.aclnnRmsNormGetWorkspaceSize, rms_args, RMS_OUTS),
    (A.aclnnRmsNormGradGetWorkspaceSize, rmsg_args, RMSG_OUTS),
    (A.aclnnNsaCompressGetWorkspaceSize, nsa_args, NSA_OUTS),
    (A.aclnnNsaCompressGradGetWorkspaceSize, nsag_args, NSAG_OUTS),
    (A.aclnnFusedFloydAttentionGetWorkspaceSize, fa_args, FA_OUTS),
    (A.aclnnFusedFloydAttentionGradGetWorkspaceSize, fag_args, FAG_OUTS),
])
def test_phase_one_reads_no_data_and_writes_nothing(backend, get_ws, make, out_names):
    a = make()
    size, ex = get_ws(**to_meta(a))  # meta tensors have no data: any read would fail
    assert size >= 0 and isinstance(ex, A.AclOpExecutor)
    size2, _ = get_ws(**a)
    assert size2 == size  # the workspace depends on shapes, dtypes and device only
    assert intact(*[a[n] for n in out_names])


def test_half_statistics_staging_also_plans_on_meta(backend):
    a = lnb_args(mean=torch.zeros(6, dtype=torch.float16), rstd=torch.ones(6, dtype=torch.float16))
    assert A.aclnnLayerNormBackwardGetWorkspaceSize(**to_meta(a))[0] == 48


# ---------------------------------------------------------------------------------------
# Executors, workspaces, streams
# ---------------------------------------------------------------------------------------

def test_executor_runs_once_unless_repeatable(backend):
    a = rms_args()
    size, ex = A.aclnnRmsNormGetWorkspaceSize(**a)
    assert A.aclnnRmsNorm(None, size, ex, None) == 0
    a["yOut"].fill_(SENTINEL)
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnRmsNorm(None, size, ex, None)
    assert e.value.status == INVALID and "already ran" in str(e.value)
    assert intact(a["yOut"])
    with pytest.raises(gradops.AclnnError) as e:
        A.aclSetAclOpExecutorRepeatable(ex)  # too late: it already ran once
    assert e.value.status == INVALID


def test_repeatable_executor_reads_current_data_each_run(backend):
    a = rms_args(torch.float32, torch.float32)
    size, ex = A.aclnnRmsNormGetWorkspaceSize(**a)
    assert A.aclSetAclOpExecutorRepeatable(ex) == 0
    for _ in range(3):
        a["x"].copy_(rand(2, 3, 32))
        assert A.aclnnRmsNorm(None, size, ex, None) == 0
        y, rstd = gradops.rms_norm(a["x"], a["gamma"])
        assert torch.equal(a["yOut"], y) and torch.equal(a["rstdOut"], rstd)
    assert A.aclDestroyAclOpExecutor(ex) == 0
    a["yOut"].fill_(SENTINEL)
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnRmsNorm(None, size, ex, None)
    assert e.value.status == INVALID and "destroyed" in str(e.value)
    assert intact(a["yOut"])
    with pytest.raises(gradops.AclnnError):
        A.aclDestroyAclOpExecutor(ex)


def test_executor_argument_rules(backend):
    a = rms_args()
    size, ex = A.aclnnRmsNormGetWorkspaceSize(**a)
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnRmsNorm(None, size, None, None)
    assert e.value.status == NULLPTR
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnRmsNormGrad(None, size, ex, None)  # planned by another operator
    assert e.value.status == INVALID and "aclnnRmsNorm" in str(e.value)
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnRmsNorm(None, size, object(), None)
    assert e.value.status == INVALID
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnRmsNorm(None, size, ex, "stream0")
    assert e.value.status == INVALID and "stream" in str(e.value)
    assert intact(a["yOut"], a["rstdOut"])
    assert A.aclnnRmsNorm(None, size, ex, None) == 0  # the refused calls did not consume it


@pytest.mark.parametrize("bad,status,word", [
    ("none", NULLPTR, "workspace"),
    ("small", INVALID, "bytes"),
    ("float", INVALID, "uint8"),
    ("meta", INVALID, "device"),
    ("size_arg", INVALID, "workspaceSize"),
    ("strided", INVALID, "contiguous"),
])
def test_workspace_checks(backend, bad, status, word):
    a = fag_args()
    size, ex = A.aclnnFusedFloydAttentionGradGetWorkspaceSize(**a)
    assert size > 0
    ws, ws_size = torch.empty(size, dtype=torch.uint8), size
    if bad == "none":
        ws = None
    elif bad == "small":
        ws = torch.empty(size - 1, dtype=torch.uint8)
    elif bad == "float":
        ws = torch.empty(size // 4, dtype=torch.float32)
    elif bad == "meta":
        ws = torch.empty(size, dtype=torch.uint8, device="meta")
    elif bad == "size_arg":
        ws_size = size - 4
    elif bad == "strided":
        ws = torch.empty(2 * size, dtype=torch.uint8)[::2]
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnFusedFloydAttentionGrad(ws, ws_size, ex, None)
    assert e.value.status == status and word in str(e.value), str(e.value)
    assert intact(*[a[n] for n in FAG_OUTS])
    if bad == "small":  # a larger workspace is fine, and the refused call did not consume the executor
        assert A.aclnnFusedFloydAttentionGrad(torch.empty(size + 100, dtype=torch.uint8), size + 100, ex, None) == 0
        assert not intact(a["dqOut"])


def test_zero_workspace_accepts_none_or_an_empty_tensor(backend):
    a = nsa_args()
    size, ex = A.aclnnNsaCompressGetWorkspaceSize(**a)
    assert size == 0
    assert A.aclnnNsaCompress(torch.empty(0, dtype=torch.uint8), 0, ex, None) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_the_given_cuda_stream(backend):
    a = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in rms_args(torch.float32, torch.float32).items()}
    size, ex = A.aclnnRmsNormGetWorkspaceSize(**a)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    assert A.aclnnRmsNorm(None, size, ex, s) == 0
    s.synchronize()
    y, _ = gradops.rms_norm(a["x"], a["gamma"])
    torch.testing.assert_close(a["yOut"], y)


def test_views_are_accepted_everywhere(backend):
    # LayerNormBackward on transposed views, results into a strided output
    x = rand(16, 6).t().unflatten(0, (2, 3))
    dy = rand(16, 6).t().unflatten(0, (2, 3))
    w = rand(32)[::2]
    _, mean, rstd = gradops.layer_norm(x, [16], w)
    gi_store = sentinel(2, 3, 32)
    a = dict(gradOut=dy, input=x, normalizedShape=[16], mean=mean, rstd=rstd, weightOptional=w, biasOptional=None,
             outputMask=[True, True, True], gradInputOut=gi_store[..., ::2], gradWeightOut=sentinel(16),
             gradBiasOut=sentinel(16))
    run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, a)
    want = gradops.layer_norm_backward(dy.contiguous(), x.contiguous(), [16], mean, rstd, w.contiguous())
    torch.testing.assert_close(a["gradInputOut"], want[0], rtol=1e-6, atol=1e-6)
    assert torch.all(gi_store[..., 1::2] == SENTINEL)  # the other half of the storage is untouched
    torch.testing.assert_close(a["gradWeightOut"], want[1], rtol=1e-6, atol=1e-6)
    # NSA on a view of a wider [T, N, 2D] tensor
    wide = rand(112, 2, 32, dtype=torch.float16)
    b = nsa_args(input=wide[..., 16:])
    run(A.aclnnNsaCompressGetWorkspaceSize, A.aclnnNsaCompress, b)
    assert torch.equal(b["output"], gradops.nsa_compress(wide[..., 16:].contiguous(), b["weight"], BLOCK, STRIDE, ENDS))
