"""Independent check of gradops.aclnn (issue 3): calls CANN rejects are rejected with CANN's
status (OPERATORS.md "Status codes" and sections 1-6, per operator), calls CANN accepts at the
documented boundaries give the Python API's numbers, a failed call leaves every output
bitwise intact, phase one touches no tensor data, and the executor/workspace rules hold.

Written from OPERATORS.md and the CANN pages in shared/seeds, not from tests/test_aclnn.py.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradops
from gradops import aclnn as A

from conftest import TEST_DEVICE

NULLPTR, INVALID, TILING = 161001, 161002, 561002
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
SENT = -12345.0  # exactly representable in every float dtype used here


def rnd(*shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, dtype=F64) * scale).to(dtype)


def sent(*shape, dtype=F32):
    return torch.full(shape, SENT, dtype=dtype)


# ---------------------------------------------------------------------------------------
# One valid call per operator: (GetWorkspaceSize, launch, args, names of the outputs)
# ---------------------------------------------------------------------------------------

def ln(dtype=F32):
    return dict(input=rnd(3, 4, 32, dtype=dtype), normalizedShape=[32], weightOptional=rnd(32, dtype=dtype),
                biasOptional=rnd(32, dtype=dtype), eps=1e-5, out=sent(3, 4, 32, dtype=dtype),
                meanOutOptional=sent(3, 4, 1), rstdOutOptional=sent(3, 4, 1))


def lnb(dtype=F32):
    x, dy, w = rnd(3, 4, 32, dtype=dtype), rnd(3, 4, 32, dtype=dtype), rnd(32, dtype=dtype)
    xd = x.double()
    mean = xd.mean(-1, keepdim=True).float()
    rstd = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float()
    return dict(gradOut=dy, input=x, normalizedShape=[32], mean=mean, rstd=rstd, weightOptional=w,
                biasOptional=rnd(32, dtype=dtype), outputMask=[True, True, True],
                gradInputOut=sent(3, 4, 32, dtype=dtype), gradWeightOut=sent(32, dtype=dtype),
                gradBiasOut=sent(32, dtype=dtype))


def rms(dtype=F32, gdtype=None):
    return dict(x=rnd(3, 4, 32, dtype=dtype), gamma=rnd(32, dtype=gdtype or dtype), epsilon=1e-6,
                yOut=sent(3, 4, 32, dtype=dtype), rstdOut=sent(3, 4, 1))


def rmsg(dtype=F32, gdtype=None):
    x = rnd(3, 4, 32, dtype=dtype)
    rstd = (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt().float()
    return dict(dy=rnd(3, 4, 32, dtype=dtype), x=x, rstd=rstd, gamma=rnd(32, dtype=gdtype or dtype),
                dxOut=sent(3, 4, 32, dtype=dtype), dgammaOut=sent(32))


NSA_ENDS = [48, 80]  # sequences of 48 and 32 tokens; block 32, stride 16 -> 2 + 1 blocks


def nsa(dtype=F16, t=80, n=2, d=16, block=32, stride=16, ends=None, c=3):
    return dict(input=rnd(t, n, d, dtype=dtype), weight=rnd(block, n, dtype=dtype),
                actSeqLenOptional=list(ends or NSA_ENDS), layoutOptional="TND", compressBlockSize=block,
                compressStride=stride, actSeqLenType=0, output=sent(c, n, d, dtype=dtype))


def nsag(dtype=F16, t=80, n=2, d=16, block=32, stride=16, ends=None, c=3):
    return dict(outputGrad=rnd(c, n, d, dtype=dtype), input=rnd(t, n, d, dtype=dtype),
                weight=rnd(block, n, dtype=dtype), actSeqLenOptional=list(ends or NSA_ENDS),
                compressBlockSize=block, compressStride=stride, actSeqLenType=0, layoutOptional="TND",
                inputGradOut=sent(t, n, d, dtype=dtype), weightGradOut=sent(block, n, dtype=dtype))


FB, FH, FN, FM, FK, FD = 1, 1, 16, 128, 128, 32


def fa(dtype=F16, b=FB, h=FH, n=FN, m=FM, k=FK, d=FD, lazy=False):
    make = (lambda *s: torch.zeros((), dtype=dtype).expand(*s)) if lazy else \
        (lambda *s: rnd(*s, dtype=dtype, scale=0.3))
    mask = torch.zeros(b, 1, n, 1, k, dtype=torch.bool)
    mask[..., ::3] = True
    return dict(query=make(b, h, n, m, d), key1=make(b, h, n, k, d), value1=make(b, h, n, k, d),
                key2=make(b, h, k, m, d), value2=make(b, h, k, m, d), attenMaskOptional=mask,
                scaleValue=d ** -0.5, softmaxMaxOut=sent(b, h, n, m, 8), softmaxSumOut=sent(b, h, n, m, 8),
                attentionOutOut=sent(b, h, n, m, d, dtype=dtype))


_FWD = {}


def fag(dtype=F16):
    if dtype not in _FWD:
        f = fa(dtype)
        _FWD[dtype] = f, gradops.floyd_attention(f["query"], f["key1"], f["value1"], f["key2"], f["value2"],
                                                 f["attenMaskOptional"], f["scaleValue"])
    f, (out, smax, ssum) = _FWD[dtype]
    rep = lambda s: s.unsqueeze(-1).expand(*s.shape, 8).contiguous()  # noqa: E731
    a = dict(query=f["query"], key1=f["key1"], value1=f["value1"], key2=f["key2"], value2=f["value2"],
             dy=rnd(FB, FH, FN, FM, FD, dtype=dtype), attenMaskOptional=f["attenMaskOptional"],
             softmaxMax=rep(smax), softmaxSum=rep(ssum), attentionIn=out, scaleValue=f["scaleValue"])
    for o, src in zip(FAG_OUTS, ("query", "key1", "value1", "key2", "value2")):
        a[o] = sent(*f[src].shape, dtype=dtype)
    return a


LN_OUTS = ["out", "meanOutOptional", "rstdOutOptional"]
LNB_OUTS = ["gradInputOut", "gradWeightOut", "gradBiasOut"]
RMS_OUTS, RMSG_OUTS = ["yOut", "rstdOut"], ["dxOut", "dgammaOut"]
NSA_OUTS, NSAG_OUTS = ["output"], ["inputGradOut", "weightGradOut"]
FA_OUTS = ["softmaxMaxOut", "softmaxSumOut", "attentionOutOut"]
FAG_OUTS = ["dqOut", "dk1Out", "dv1Out", "dk2Out", "dv2Out"]

OPS = {
    "ln": (A.aclnnLayerNormGetWorkspaceSize, A.aclnnLayerNorm, ln, LN_OUTS),
    "lnb": (A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, lnb, LNB_OUTS),
    "rms": (A.aclnnRmsNormGetWorkspaceSize, A.aclnnRmsNorm, rms, RMS_OUTS),
    "rmsg": (A.aclnnRmsNormGradGetWorkspaceSize, A.aclnnRmsNormGrad, rmsg, RMSG_OUTS),
    "nsa": (A.aclnnNsaCompressGetWorkspaceSize, A.aclnnNsaCompress, nsa, NSA_OUTS),
    "nsag": (A.aclnnNsaCompressGradGetWorkspaceSize, A.aclnnNsaCompressGrad, nsag, NSAG_OUTS),
    "fa": (A.aclnnFusedFloydAttentionGetWorkspaceSize, A.aclnnFusedFloydAttention, fa, FA_OUTS),
    "fag": (A.aclnnFusedFloydAttentionGradGetWorkspaceSize, A.aclnnFusedFloydAttentionGrad, fag, FAG_OUTS),
}


def snapshot(args, outs):
    return {o: args[o].clone() for o in outs if isinstance(args.get(o), torch.Tensor)}


def bitwise_intact(args, snap):
    for name, before in snap.items():
        now = args[name]
        if now.shape != before.shape or not torch.equal(now.view(torch.uint8) if now.dtype == torch.bool
                                                        else now, before):
            return False
        # bitwise: compare raw bytes too (== would equate -0.0 and 0.0)
        if not torch.equal(now.contiguous().view(torch.uint8), before.contiguous().view(torch.uint8)):
            return False
    return True


def reject(op, args, status):
    get_ws, _, _, outs = OPS[op]
    snap = snapshot(args, outs)
    with pytest.raises(gradops.AclnnError) as e:
        get_ws(**args)
    assert e.value.status == status, f"{op}: got {e.value.status}, want {status}: {e.value}"
    assert bitwise_intact(args, snap), f"{op}: a failed call wrote into an output"
    return str(e.value)


def accept(op, args):
    get_ws, launch, _, outs = OPS[op]
    size, ex = get_ws(**args)
    ws = torch.empty(size, dtype=torch.uint8) if size else None
    assert launch(ws, size, ex, None) == 0
    return size, ex


# ---------------------------------------------------------------------------------------
# None: required -> 161001; optional -> accepted
# ---------------------------------------------------------------------------------------

REQUIRED = {
    "ln": ["input", "normalizedShape", "eps", "out"],
    "lnb": ["gradOut", "input", "normalizedShape", "mean", "rstd", "outputMask",
            "gradInputOut", "gradWeightOut", "gradBiasOut"],
    "rms": ["x", "gamma", "epsilon", "yOut", "rstdOut"],
    "rmsg": ["dy", "x", "rstd", "gamma", "dxOut", "dgammaOut"],
    "nsa": ["input", "weight", "compressBlockSize", "compressStride", "actSeqLenType", "output"],
    "nsag": ["outputGrad", "input", "weight", "compressBlockSize", "compressStride", "actSeqLenType",
             "inputGradOut", "weightGradOut"],
    "fa": ["query", "key1", "value1", "key2", "value2", "scaleValue", "softmaxMaxOut", "softmaxSumOut",
           "attentionOutOut"],
    "fag": ["query", "key1", "value1", "key2", "value2", "dy", "softmaxMax", "softmaxSum", "attentionIn",
            "scaleValue"] + FAG_OUTS,
}
OPTIONAL = {"ln": ["weightOptional", "biasOptional", "meanOutOptional", "rstdOutOptional"],
            "lnb": ["weightOptional", "biasOptional"], "fa": ["attenMaskOptional"], "fag": ["attenMaskOptional"]}


@pytest.mark.parametrize("op,name", [(op, n) for op, names in REQUIRED.items() for n in names])
def test_none_required_is_161001(backend, op, name):
    args = OPS[op][2]()
    args[name] = None
    msg = reject(op, args, NULLPTR)
    assert name in msg


@pytest.mark.parametrize("op", list(REQUIRED))
def test_none_wins_over_every_other_rule(backend, op):
    """A None and a dtype violation together: CANN's null check comes first."""
    args = OPS[op][2]()
    first_tensor = next(k for k, v in args.items() if isinstance(v, torch.Tensor))
    args[first_tensor] = args[first_tensor].to(F64)
    args[REQUIRED[op][-1]] = None
    reject(op, args, NULLPTR)


@pytest.mark.parametrize("op,name", [(op, n) for op, names in OPTIONAL.items() for n in names])
def test_none_optional_is_accepted(backend, op, name):
    args = OPS[op][2]()
    args[name] = None
    accept(op, args)


def test_nsa_act_seq_len_is_required_by_cann_161002(backend):
    for op in ("nsa", "nsag"):
        args = OPS[op][2]()
        args["actSeqLenOptional"] = None
        reject(op, args, INVALID)


@pytest.mark.parametrize("mask", [[False, True, True], [True, False, True], [True, True, False],
                                  [False, False, False]])
def test_layer_norm_backward_masked_out_output_may_be_none(backend, mask):
    args = lnb()
    args["outputMask"] = mask
    for wanted, name in zip(mask, LNB_OUTS):
        if not wanted:
            args[name] = None
    accept("lnb", args)
    for wanted, name in zip(mask, LNB_OUTS):
        if wanted:
            assert not bool((args[name] == SENT).any())


# ---------------------------------------------------------------------------------------
# dtype tables -> 161002
# ---------------------------------------------------------------------------------------

ALL = [F16, BF16, F32, F64, torch.int32, torch.int64, torch.bool]


def _set(args, names, dtype):
    for n in names:
        args[n] = args[n].to(dtype)


@pytest.mark.parametrize("dtype", ALL)
def test_layer_norm_input_dtype_table(backend, dtype):
    for op, names in (("ln", ["input", "weightOptional", "biasOptional", "out"]),
                      ("lnb", ["gradOut", "input", "weightOptional", "biasOptional"] + LNB_OUTS)):
        args = OPS[op][2]()
        _set(args, names, dtype)
        if dtype in (F16, BF16, F32):
            accept(op, args)
        else:
            reject(op, args, INVALID)


def test_layer_norm_backward_mixed_dtypes(backend):
    args = lnb(F16)
    args["gradOut"] = args["gradOut"].to(BF16)  # gradOut dtype == input dtype
    reject("lnb", args, INVALID)
    args = lnb(F16)
    args["weightOptional"] = args["weightOptional"].to(F32)  # weight f32 with half input: accepted
    accept("lnb", args)
    args = lnb(F16)
    args["weightOptional"] = args["weightOptional"].to(BF16)  # weight neither input's dtype nor f32
    reject("lnb", args, INVALID)
    for stat_dtype in (F16, BF16):  # statistics f16/bf16 accepted (computed in f32)
        args = lnb(F32)
        _set(args, ["mean", "rstd"], stat_dtype)
        accept("lnb", args)
    for stat_dtype in (F64, torch.int32):
        args = lnb(F32)
        _set(args, ["mean", "rstd"], stat_dtype)
        reject("lnb", args, INVALID)


RMSG_TABLE = {(F16, F32, F32), (BF16, F32, F32), (F16, F32, F16), (F32, F32, F32), (BF16, F32, BF16)}


@pytest.mark.parametrize("xd", [F16, BF16, F32, F64])
@pytest.mark.parametrize("rd", [F16, F32, F64])
@pytest.mark.parametrize("gd", [F16, BF16, F32, F64])
def test_rms_norm_grad_dtype_table(backend, xd, rd, gd):
    args = rmsg(xd, gd)
    args["rstd"] = args["rstd"].to(rd)
    if (xd, rd, gd) in RMSG_TABLE:
        _, ex = accept("rmsg", args)
        want_dx, want_dg = gradops.rms_norm_grad(args["dy"], args["x"], args["rstd"], args["gamma"])
        assert torch.equal(args["dxOut"], want_dx.to(xd)) and torch.equal(args["dgammaOut"], want_dg.float())
    else:
        reject("rmsg", args, INVALID)


def test_rms_norm_grad_mixed_dy_x_and_output_dtypes(backend):
    args = rmsg(F16, F32)
    args["dy"] = args["dy"].to(BF16)
    reject("rmsg", args, INVALID)
    args = rmsg(F16, F32)
    args["dxOut"] = args["dxOut"].to(F32)  # dx has dy's dtype
    reject("rmsg", args, INVALID)
    args = rmsg(F16, F32)
    args["dgammaOut"] = args["dgammaOut"].to(F16)  # dgamma is float32
    reject("rmsg", args, INVALID)


@pytest.mark.parametrize("dtype", ALL)
def test_nsa_dtype_table(backend, dtype):
    for op in ("nsa", "nsag"):
        args = OPS[op][2]()
        for n, v in list(args.items()):
            if isinstance(v, torch.Tensor):
                args[n] = v.to(dtype)
        if dtype in (F16, BF16):
            accept(op, args)
        else:
            reject(op, args, INVALID)


@pytest.mark.parametrize("op,name", [("nsa", "weight"), ("nsa", "output"), ("nsag", "weight"),
                                     ("nsag", "outputGrad"), ("nsag", "inputGradOut"),
                                     ("nsag", "weightGradOut")])
def test_nsa_mixed_dtypes_161002(backend, op, name):
    args = OPS[op][2]()
    args[name] = args[name].to(BF16)
    reject(op, args, INVALID)


@pytest.mark.parametrize("dtype", [F32, F64, torch.int32])
def test_floyd_dtype_table(backend, dtype):
    args = fa(dtype if dtype.is_floating_point else F16, lazy=True)
    for n in ("query", "key1", "value1", "key2", "value2", "attentionOutOut"):
        args[n] = torch.zeros((), dtype=dtype).expand(*args[n].shape) if n != "attentionOutOut" else \
            sent(*args[n].shape, dtype=dtype)
    reject("fa", args, INVALID)
    args = fag(F16)
    for n in ("query", "key1", "value1", "key2", "value2", "dy", "attentionIn") + tuple(FAG_OUTS):
        args[n] = args[n].to(dtype)
    reject("fag", args, INVALID)


@pytest.mark.parametrize("name", ["key1", "value1", "key2", "value2", "attentionOutOut"])
def test_floyd_forward_mixed_dtypes_161002(backend, name):
    args = fa(F16)
    args[name] = args[name].to(BF16)
    reject("fa", args, INVALID)


@pytest.mark.parametrize("name", ["key1", "value1", "key2", "value2", "dy", "attentionIn"] + FAG_OUTS)
def test_floyd_grad_mixed_dtypes_161002(backend, name):
    args = fag(F16)
    args[name] = args[name].to(BF16)
    reject("fag", args, INVALID)


@pytest.mark.parametrize("op,name,dtype", [
    ("fa", "softmaxMaxOut", F16), ("fa", "softmaxSumOut", BF16), ("fa", "softmaxMaxOut", F64),
    ("fag", "softmaxMax", F16), ("fag", "softmaxSum", BF16), ("fag", "softmaxMax", F64),
    ("fa", "attenMaskOptional", F16), ("fa", "attenMaskOptional", torch.int32),
    ("fag", "attenMaskOptional", torch.int64),
])
def test_floyd_statistics_and_mask_dtypes_161002(backend, op, name, dtype):
    args = OPS[op][2]()
    args[name] = args[name].to(dtype)
    reject(op, args, INVALID)


def test_floyd_uint8_mask_accepted_same_numbers_as_bool(backend):
    a, b = fa(F16), fa(F16)
    for k in ("query", "key1", "value1", "key2", "value2"):
        b[k] = a[k]
    b["attenMaskOptional"] = a["attenMaskOptional"].to(torch.uint8)
    accept("fa", a)
    accept("fa", b)
    for o in FA_OUTS:
        assert torch.equal(a[o], b[o])


def test_dtype_rule_comes_before_tiling_shape_rule(backend):
    """A dtype violation (161002) and a tiling-checked shape (561002) together -> 161002."""
    args = fa(F16, n=8, lazy=True)  # N = 8 breaks N % 16 (561002)
    args["attenMaskOptional"] = None
    args["softmaxMaxOut"] = args["softmaxMaxOut"].to(F16)  # and the statistics must be f32
    reject("fa", args, INVALID)
    args = nsa(d=24)  # D % 16 (tiling) and an f32 weight (dtype)
    args["weight"] = args["weight"].float()
    reject("nsa", args, INVALID)
    args = rmsg(F32)
    args["gamma"] = rnd(31)  # shape (561002) ...
    args["rstd"] = args["rstd"].half()  # ... with a dtype outside the table (161002)
    reject("rmsg", args, INVALID)
    args = rmsg(F16, F32)
    args["x"] = args["x"].to(BF16)  # dy/x dtypes differ (161002) ...
    args["gamma"] = rnd(31)  # ... and gamma's shape (561002)
    reject("rmsg", args, INVALID)
    args = fag(F16)
    args["softmaxMax"] = args["softmaxMax"].half()  # statistics must be f32 (161002) ...
    args["dy"] = rnd(FB, FH, FN, FM, 64, dtype=F16)  # ... and dy's shape (561002)
    reject("fag", args, INVALID)
    args = fag(F16)
    args["softmaxSum"] = args["softmaxSum"].to(BF16)
    args["softmaxMax"] = args["softmaxMax"][..., :1]  # [B,H,N,M,1] (561002)
    reject("fag", args, INVALID)


# ---------------------------------------------------------------------------------------
# LayerNorm shapes (161002 only)
# ---------------------------------------------------------------------------------------

def test_layer_norm_backward_shape_rules_161002(backend):
    cases = []
    a = lnb(); a["normalizedShape"] = [];  cases.append(a)  # noqa: E702
    a = lnb(); a["normalizedShape"] = [4, 32] * 4 + [1]; cases.append(a)  # noqa: E702 length 9
    a = lnb(); a["normalizedShape"] = [31]; cases.append(a)  # noqa: E702 trailing dims
    a = lnb(); a["gradOut"] = rnd(3, 4, 31); cases.append(a)  # noqa: E702
    a = lnb(); a["outputMask"] = [True, True]; cases.append(a)  # noqa: E702
    a = lnb(); a["outputMask"] = [True] * 4; cases.append(a)  # noqa: E702
    a = lnb(); a["mean"] = a["mean"][:2]; cases.append(a)  # noqa: E702
    a = lnb(); a["rstd"] = a["rstd"].reshape(12); cases.append(a)  # noqa: E702 mean/rstd shapes differ
    a = lnb(); a["weightOptional"] = rnd(31); cases.append(a)  # noqa: E702
    a = lnb(); a["biasOptional"] = rnd(31); cases.append(a)  # noqa: E702 bias: checked though unused
    a = lnb(); a["gradInputOut"] = sent(3, 4, 31); cases.append(a)  # noqa: E702
    a = lnb(); a["gradWeightOut"] = sent(31); cases.append(a)  # noqa: E702
    x9 = rnd(*([1] * 8 + [32]))
    a = lnb(); a.update(gradOut=x9, input=x9, mean=torch.zeros(1), rstd=torch.ones(1)); cases.append(a)  # noqa
    for args in cases:
        reject("lnb", args, INVALID)


def test_layer_norm_backward_accepted_boundaries_match_python_api(backend):
    # rank 8, normalizedShape of length 8 (rank == len: one row), flat statistics
    x = rnd(*([2] * 8))
    dy = rnd(*([2] * 8))
    w = rnd(*([2] * 8))
    _, mean, rstd = gradops.layer_norm(x, [2] * 8, w)
    args = dict(gradOut=dy, input=x, normalizedShape=[2] * 8, mean=mean.reshape(1), rstd=rstd.reshape(1),
                weightOptional=w, biasOptional=None, outputMask=[True, True, True],
                gradInputOut=sent(*x.shape), gradWeightOut=sent(*w.shape), gradBiasOut=sent(*w.shape))
    accept("lnb", args)
    want = gradops.layer_norm_backward(dy, x, [2] * 8, mean, rstd, w)
    for got, exp in zip([args[o] for o in LNB_OUTS], want):
        assert torch.equal(got, exp)


# ---------------------------------------------------------------------------------------
# RMSNorm shapes (561002: checked at tiling)
# ---------------------------------------------------------------------------------------

def test_rms_norm_grad_shapes_561002(backend):
    cases = []
    a = rmsg(); a["gamma"] = rnd(31); cases.append(a)  # noqa: E702
    a = rmsg(); a["dy"] = rnd(3, 4, 31); cases.append(a)  # noqa: E702
    a = rmsg(); a["rstd"] = torch.ones(3, 5, 1); cases.append(a)  # noqa: E702
    a = rmsg(); a["dxOut"] = sent(3, 4, 31); cases.append(a)  # noqa: E702
    a = rmsg(); a["dgammaOut"] = sent(31); cases.append(a)  # noqa: E702
    a = rmsg(); a.update(dy=rnd(32), x=rnd(32), rstd=torch.ones(1), dxOut=sent(32)); cases.append(a)  # noqa: rank 1
    x9 = rnd(*([1] * 8 + [32]))
    a = rmsg(); a.update(dy=x9, x=x9, rstd=torch.ones([1] * 9), dxOut=sent(*x9.shape)); cases.append(a)  # noqa
    z = rnd(3, 0)
    a = rmsg(); a.update(dy=z, x=z, gamma=rnd(0), rstd=torch.ones(3, 1), dxOut=sent(3, 0), dgammaOut=sent(0))  # noqa
    cases.append(a)
    for args in cases:
        reject("rmsg", args, TILING)


def test_rms_norm_grad_empty_leading_dims_accepted(backend):
    x = rnd(0, 32)
    args = dict(dy=rnd(0, 32), x=x, rstd=torch.ones(0, 1), gamma=rnd(32), dxOut=sent(0, 32), dgammaOut=sent(32))
    accept("rmsg", args)
    assert torch.equal(args["dgammaOut"], torch.zeros(32))


# ---------------------------------------------------------------------------------------
# NSA constraints
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["nsa", "nsag"])
def test_nsa_tiling_limits(backend, op):
    mk = OPS[op][2]
    reject(op, mk(n=129), TILING)                       # N <= 128
    reject(op, mk(d=24), TILING)                        # D % 16
    reject(op, mk(d=272), TILING)                       # D <= 256
    # block % 16 and <= 128; stride % 16 (161002 or 561002 allowed by OPERATORS.md)
    for kw in (dict(block=40, stride=16, ends=[40, 80], c=2), dict(block=144, stride=16, ends=[144], t=144, c=1),
               dict(block=32, stride=8, ends=[48, 80], c=5)):
        get_ws = OPS[op][0]
        with pytest.raises(gradops.AclnnError) as e:
            get_ws(**mk(**kw))
        assert e.value.status in (INVALID, TILING)


def test_nsa_block_vs_stride_forward_ge_grad_gt(backend):
    # forward: block == stride accepted (non-overlapping blocks)
    a = nsa(block=16, stride=16, ends=[48, 80], c=3 + 2)
    accept("nsa", a)
    want = gradops.nsa_compress(a["input"], a["weight"], 16, 16, [48, 80])
    assert torch.equal(a["output"], want)
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnNsaCompressGetWorkspaceSize(**nsa(block=16, stride=32, ends=[48, 80], c=3 + 2))
    assert e.value.status in (INVALID, TILING)
    # grad: block == stride rejected
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnNsaCompressGradGetWorkspaceSize(**nsag(block=16, stride=16, ends=[48, 80], c=5))
    assert e.value.status in (INVALID, TILING)


@pytest.mark.parametrize("op", ["nsa", "nsag"])
def test_nsa_host_argument_rules_161002(backend, op):
    mk = OPS[op][2]
    for over in (dict(actSeqLenType=1), dict(actSeqLenType=2), dict(layoutOptional="BSND"),
                 dict(layoutOptional="tnd"), dict(actSeqLenOptional=[48, 79]),  # T != actSeqLen[-1]
                 dict(actSeqLenOptional=[48, 81]), dict(actSeqLenOptional=[]),
                 dict(actSeqLenOptional=torch.tensor(NSA_ENDS, dtype=torch.int32)),
                 dict(weight=rnd(32, 3, dtype=F16)), dict(weight=rnd(16, 2, dtype=F16))):
        args = mk()
        args.update(over)
        reject(op, args, INVALID)


@pytest.mark.parametrize("op", ["nsa", "nsag"])
def test_nsa_empty_tensors_rejected(backend, op):
    mk = OPS[op][2]
    args = mk(d=16)
    args["input"] = rnd(80, 2, 0, dtype=F16)
    with pytest.raises(gradops.AclnnError):
        OPS[op][0](**args)


def test_nsa_boundaries_accepted_same_numbers(backend):
    # N = 128, D = 256, block = 128, stride = 16; actSeqLen as an int64 tensor with an empty sequence
    for t, n, d in ((144, 128, 16), (144, 1, 256)):
        ends = [0, t]
        c = (t - 128) // 16 + 1
        a = nsa(t=t, n=n, d=d, block=128, stride=16, ends=ends, c=c)
        a["actSeqLenOptional"] = torch.tensor(ends, dtype=torch.int64)
        accept("nsa", a)
        assert torch.equal(a["output"], gradops.nsa_compress(a["input"], a["weight"], 128, 16, ends))
        g = nsag(t=t, n=n, d=d, block=128, stride=16, ends=ends, c=c)
        accept("nsag", g)
        want = gradops.nsa_compress_grad(g["outputGrad"], g["input"], g["weight"], 128, 16, ends)
        assert torch.equal(g["inputGradOut"], want[0]) and torch.equal(g["weightGradOut"], want[1])


# ---------------------------------------------------------------------------------------
# Floyd constraints (561002 for shapes)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [
    dict(b=2049), dict(h=257), dict(n=8), dict(n=24), dict(m=64), dict(m=192), dict(k=64), dict(k=192),
    dict(d=16), dict(d=48), dict(d=256)])
def test_floyd_shape_limits_561002(backend, dims):
    args = fa_lazy(**dims)
    args["attenMaskOptional"] = None
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnFusedFloydAttentionGetWorkspaceSize(**args)
    assert e.value.status == TILING


def test_floyd_inconsistent_shapes_561002(backend):
    base = fa(F16, lazy=True)
    b, h, n, m, d = base["query"].shape
    k = base["key1"].shape[3]
    z = lambda *s: torch.zeros((), dtype=F16).expand(*s)  # noqa: E731
    for name, shape in (("key1", (b, h, n, k, 64)), ("value1", (b, h, n, 256, d)), ("key2", (b, h, 256, m, d)),
                        ("value2", (b, h, k, m, 64)), ("key1", (b, 2, n, k, d))):
        args = fa(F16, lazy=True)
        args[name] = z(*shape)
        reject("fa", args, TILING)
    for shape in ((b, 1, n, 1, 256), (b, 1, n, k), (b, 1, 32, 1, k), (b, h, n, m, k), (b, 2, n, 1, k)):
        args = fa(F16, lazy=True)
        args["attenMaskOptional"] = torch.zeros(shape, dtype=torch.bool)
        reject("fa", args, TILING)
    for name, shape in (("softmaxMaxOut", (b, h, n, m)), ("softmaxSumOut", (b, h, n, m, 1)),
                        ("attentionOutOut", (b, h, n, m, 64))):
        args = fa(F16, lazy=True)
        args[name] = sent(*shape, dtype=args[name].dtype)
        reject("fa", args, TILING)


def test_floyd_grad_statistics_must_be_bhnm8_561002(backend):
    a = fag(F16)
    b, h, n, m, _ = a["query"].shape
    for shape in ((b, h, n, m), (b, h, n, m, 1), (b, h, n, m, 16)):
        args = fag(F16)
        args["softmaxMax"] = torch.zeros(shape)
        reject("fag", args, TILING)
    for name in ("dy", "attentionIn", "dqOut", "dk2Out"):
        args = fag(F16)
        shape = list(args[name].shape)
        shape[-1] = 64
        args[name] = sent(*shape, dtype=F16) if name.endswith("Out") else rnd(*shape, dtype=F16)
        reject("fag", args, TILING)


def test_floyd_boundaries_accepted_same_numbers(backend):
    # D = 128, N = 16, M = K = 128 (the minimum sizes), bf16, no mask, scale 1.0 (CANN's default)
    a = fa(BF16, d=128)
    a["attenMaskOptional"] = None
    a["scaleValue"] = 1.0
    accept("fa", a)
    out, smax, ssum = gradops.floyd_attention(a["query"], a["key1"], a["value1"], a["key2"], a["value2"],
                                              None, 1.0)
    assert torch.equal(a["attentionOutOut"], out)
    assert torch.equal(a["softmaxMaxOut"], smax.unsqueeze(-1).expand(*smax.shape, 8))
    assert torch.equal(a["softmaxSumOut"], ssum.unsqueeze(-1).expand(*ssum.shape, 8))


def test_floyd_grad_same_numbers_as_python_api(backend):
    a = fag(F16)
    accept("fag", a)
    want = gradops.floyd_attention_grad(a["dy"], a["query"], a["key1"], a["value1"], a["key2"], a["value2"],
                                        a["attentionIn"], a["softmaxMax"][..., 0], a["softmaxSum"][..., 0],
                                        a["attenMaskOptional"], a["scaleValue"])
    for o, w in zip(FAG_OUTS, want):
        assert torch.equal(a[o], w), o


# ---------------------------------------------------------------------------------------
# Phase one: no tensor data read, nothing written
# ---------------------------------------------------------------------------------------

class _DataOps(TorchDispatchMode):
    """Records every aten op that reads or writes tensor data (anything but metadata ops)."""
    META = {"aten.empty", "aten.empty_strided", "aten.expand", "aten.view", "aten.reshape", "aten._unsafe_view",
            "aten.as_strided", "aten.slice", "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.permute",
            "aten.t", "aten.transpose", "aten.alias", "aten.detach", "aten.lift_fresh", "aten.sym_size",
            "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten.is_contiguous", "aten.size",
            "aten.stride", "aten.dim", "aten.numel", "aten.split", "aten.unbind", "aten.flatten"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "aten." + name.split(".")[-1] not in self.META and name not in self.META:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", list(OPS))
def test_phase_one_runs_no_data_op_and_writes_nothing(backend, op):
    get_ws, launch, mk, outs = OPS[op]
    args = mk()
    if op in ("nsa", "nsag"):
        args["actSeqLenOptional"] = list(args["actSeqLenOptional"])  # host metadata, never a device read
    snap = snapshot(args, outs)
    inputs = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and k not in outs}
    mode = _DataOps()
    with mode:
        size, ex = get_ws(**args)
    assert mode.ops == [], f"{op}: phase one ran data ops {mode.ops}"
    assert bitwise_intact(args, snap)
    # and the launch then fills every output
    ws = torch.empty(size, dtype=torch.uint8) if size else None
    launch(ws, size, ex, None)
    for o in outs:
        if isinstance(args.get(o), torch.Tensor) and args[o].numel():
            assert not bool((args[o] == SENT).all()), o
    for k, v in inputs.items():  # inputs untouched by the run
        assert torch.equal(args[k], v), k


def test_phase_one_on_meta_tensors(backend):
    for op, (get_ws, _, mk, _) in OPS.items():
        args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in mk().items()}
        size, ex = get_ws(**args)
        assert isinstance(size, int) and size >= 0


def test_workspace_depends_on_shapes_dtypes_only(backend):
    a, b = lnb(F16), lnb(F16)
    for args in (a, b):
        _set(args, ["mean", "rstd"], F16)
    b["gradOut"] = b["gradOut"] * 100
    assert A.aclnnLayerNormBackwardGetWorkspaceSize(**a)[0] == A.aclnnLayerNormBackwardGetWorkspaceSize(**b)[0] > 0
    s1 = A.aclnnFusedFloydAttentionGradGetWorkspaceSize(**fag(F16))[0]
    s2 = A.aclnnFusedFloydAttentionGradGetWorkspaceSize(**fag(F16))[0]
    assert s1 == s2 > 0


# ---------------------------------------------------------------------------------------
# Executor and workspace rules
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(OPS))
def test_executor_runs_once_unless_repeatable_and_not_after_destroy(backend, op):
    get_ws, launch, mk, outs = OPS[op]
    args = mk()
    size, ex = get_ws(**args)
    ws = torch.empty(size, dtype=torch.uint8) if size else None
    assert launch(ws, size, ex, None) == 0
    first = snapshot(args, outs)
    for o in first:
        args[o].fill_(SENT)
    snap = snapshot(args, outs)
    with pytest.raises(gradops.AclnnError) as e:
        launch(ws, size, ex, None)
    assert e.value.status in (INVALID, NULLPTR)
    assert bitwise_intact(args, snap)  # the refused second run wrote nothing

    size, ex = get_ws(**args)
    assert A.aclSetAclOpExecutorRepeatable(ex) == 0
    for _ in range(3):
        assert launch(ws, size, ex, None) == 0
    assert bitwise_intact(args, first)  # same numbers each run
    assert A.aclDestroyAclOpExecutor(ex) == 0
    for o in first:
        args[o].fill_(SENT)
    with pytest.raises(gradops.AclnnError):
        launch(ws, size, ex, None)
    assert bitwise_intact(args, snap)


@pytest.mark.parametrize("op", ["lnb", "fag"])
def test_workspace_rules(backend, op):
    get_ws, launch, mk, outs = OPS[op]
    args = mk(F16)
    if op == "lnb":
        _set(args, ["mean", "rstd"], F16)  # statistics converted in the workspace
    size, ex = get_ws(**args)
    assert size > 0
    snap = snapshot(args, outs)
    bad = [
        (None, size),                                            # None while size > 0
        (torch.empty(size - 1, dtype=torch.uint8), size),        # too small
        (torch.empty(size, dtype=torch.uint8), size - 1),        # size below phase one's
        (torch.empty(size // 4, dtype=torch.float32), size),     # not uint8
        (torch.empty(size, dtype=torch.uint8, device="meta"), size),  # another device
    ]
    for ws, ws_size in bad:
        with pytest.raises(gradops.AclnnError):
            launch(ws, ws_size, ex, None)
        assert bitwise_intact(args, snap)
        assert ex.runs == 0 or True
    # still runnable after the refusals, with a larger workspace than needed
    assert launch(torch.empty(size + 64, dtype=torch.uint8), size + 64, ex, None) == 0


def test_zero_workspace_operators_take_none(backend):
    for op in ("ln", "rms", "rmsg", "nsa", "nsag", "fa"):
        get_ws, launch, mk, _ = OPS[op]
        size, ex = get_ws(**mk())
        assert size == 0
        assert launch(None, 0, ex, None) == 0


def test_failed_run_does_not_consume_the_executor(backend):
    get_ws, launch, mk, outs = OPS["fag"]
    args = mk(F16)
    size, ex = get_ws(**args)
    with pytest.raises(gradops.AclnnError):
        launch(None, size, ex, None)
    assert launch(torch.empty(size, dtype=torch.uint8), size, ex, None) == 0


# ---------------------------------------------------------------------------------------
# Results cast once into the outputs' dtypes
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F16, BF16])
def test_layer_norm_backward_weight_grads_are_float32_sums_cast_once(backend, dtype):
    """OPERATORS.md 1: gradWeight/gradBias accumulate in f32 and are cast to the output
    tensor's dtype. With a half weight and float32 outputs, the outputs hold the float32
    sums, not the sums rounded to half first."""
    args = lnb(dtype)
    args["gradWeightOut"], args["gradBiasOut"] = sent(32), sent(32)
    accept("lnb", args)
    dy, x = args["gradOut"].double(), args["input"].double()
    xhat = (x - args["mean"].double()) * args["rstd"].double()
    dw, db = (dy * xhat).sum((0, 1)), dy.sum((0, 1))
    # 12 float32 products/sums of O(1) terms: float32 rounding, far below half's 2^-8 / 2^-11
    torch.testing.assert_close(args["gradWeightOut"].double(), dw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["gradBiasOut"].double(), db, rtol=1e-5, atol=1e-5)
    # and a half output gets the float32 sum rounded once; dx is unchanged
    args2 = lnb(dtype)
    for k in ("gradOut", "input", "mean", "rstd", "weightOptional", "biasOptional"):
        args2[k] = args[k]
    accept("lnb", args2)
    assert torch.equal(args2["gradWeightOut"], args["gradWeightOut"].to(dtype))
    assert torch.equal(args2["gradBiasOut"], args["gradBiasOut"].to(dtype))
    assert torch.equal(args2["gradInputOut"], args["gradInputOut"])


def test_cpu_operators_take_a_cpu_torch_stream(backend):
    """OPERATORS.md 6: aclrtStream -> None or a torch stream; on the CPU that is torch.cpu.Stream
    or a generic torch.Stream of the CPU. Anything else is refused before anything is written."""
    if TEST_DEVICE != "cpu":  # its operators run on the test device and take its streams
        pytest.skip("CPU streams go with CPU tensors; on a GPU test_aclnn.py::test_runs_on_the_given_cuda_stream "
                    "checks the CUDA stream")
    streams = [s for s in (getattr(torch.cpu, "Stream", lambda: None)(), torch.Stream(device="cpu")) if s is not None]
    for stream in streams:
        args = rms()
        size, ex = A.aclnnRmsNormGetWorkspaceSize(**args)
        assert A.aclnnRmsNorm(None, size, ex, stream) == 0
        y, rstd = gradops.rms_norm(args["x"], args["gamma"], 1e-6)
        assert torch.equal(args["yOut"], y) and torch.equal(args["rstdOut"], rstd)
    args = rms()
    snap = snapshot(args, RMS_OUTS)
    size, ex = A.aclnnRmsNormGetWorkspaceSize(**args)
    with pytest.raises(gradops.AclnnError) as e:
        A.aclnnRmsNorm(None, size, ex, 7)
    assert e.value.status == INVALID and bitwise_intact(args, snap)


# ---------------------------------------------------------------------------------------
# Floyd limits at their edges (phase one only: data-less meta tensors)
# ---------------------------------------------------------------------------------------

def _lazy(dtype, *shape):
    return torch.empty(shape, dtype=dtype, device="meta")


def fa_lazy(**dims):
    """A forward call of data-less meta tensors, outputs included (phase one only: outputs
    must be writable, so not the stride-0 views that would otherwise stand in for them)."""
    s = dict(b=FB, h=FH, n=FN, m=FM, k=FK, d=FD)
    s.update(dims)
    b, h, n, m, k, d = (s[c] for c in "bhnmkd")
    return dict(query=_lazy(F16, b, h, n, m, d), key1=_lazy(F16, b, h, n, k, d), value1=_lazy(F16, b, h, n, k, d),
                key2=_lazy(F16, b, h, k, m, d), value2=_lazy(F16, b, h, k, m, d),
                attenMaskOptional=_lazy(torch.bool, b, 1, n, 1, k), scaleValue=1.0,
                softmaxMaxOut=_lazy(F32, b, h, n, m, 8), softmaxSumOut=_lazy(F32, b, h, n, m, 8),
                attentionOutOut=_lazy(F16, b, h, n, m, d))


@pytest.mark.parametrize("dims,ok", [
    (dict(b=2048), True), (dict(h=256), True), (dict(n=1 << 20), True), (dict(m=1 << 20), True),
    (dict(k=1 << 20), True), (dict(d=64), True), (dict(d=128), True), (dict(b=1, h=1, n=16), True),
    (dict(n=(1 << 20) + 16), False), (dict(m=(1 << 20) + 128), False), (dict(k=(1 << 20) + 128), False),
    (dict(b=0), False), (dict(h=0), False), (dict(n=0), False),
])
def test_floyd_limits_at_the_edges(backend, dims, ok):
    args = fa_lazy(**dims)
    if ok:
        size, _ = A.aclnnFusedFloydAttentionGetWorkspaceSize(**args)
        assert size == 0
    else:
        with pytest.raises(gradops.AclnnError) as e:
            A.aclnnFusedFloydAttentionGetWorkspaceSize(**args)
        assert e.value.status == TILING


# ---------------------------------------------------------------------------------------
# Views and non-contiguous tensors, inputs and outputs
# ---------------------------------------------------------------------------------------

def test_non_contiguous_inputs_and_outputs_same_numbers(backend):
    a = rmsg(F16, F32)
    a["x"] = rnd(4, 3, 32, dtype=F16).transpose(0, 1)
    a["dy"] = rnd(32, 4, 3, dtype=F16).permute(2, 1, 0)
    a["dxOut"] = sent(32, 3, 4, dtype=F16).permute(1, 2, 0)
    accept("rmsg", a)
    want = gradops.rms_norm_grad(a["dy"], a["x"], a["rstd"], a["gamma"])
    assert torch.equal(a["dxOut"], want[0]) and torch.equal(a["dgammaOut"], want[1])

    g = nsag()
    g["input"] = rnd(16, 2, 80, dtype=F16).permute(2, 1, 0)
    g["inputGradOut"] = sent(2, 80, 16, dtype=F16).transpose(0, 1)
    accept("nsag", g)
    want = gradops.nsa_compress_grad(g["outputGrad"], g["input"], g["weight"], 32, 16, NSA_ENDS)
    assert torch.equal(g["inputGradOut"], want[0]) and torch.equal(g["weightGradOut"], want[1])

    f = fag(F16)
    f["softmaxMax"] = f["softmaxMax"][..., :1].expand(*f["softmaxMax"].shape)  # stride-0 replicas
    f["dqOut"] = sent(FB, FH, FN, FD, FM, dtype=F16).transpose(-1, -2)
    accept("fag", f)
    want = gradops.floyd_attention_grad(f["dy"], f["query"], f["key1"], f["value1"], f["key2"], f["value2"],
                                        f["attentionIn"], f["softmaxMax"][..., 0], f["softmaxSum"][..., 0],
                                        f["attenMaskOptional"], f["scaleValue"])
    for o, w in zip(FAG_OUTS, want):
        assert torch.equal(f[o], w), o


# ---------------------------------------------------------------------------------------
# torch_npu names give the aclnn numbers
# ---------------------------------------------------------------------------------------

def test_torch_npu_matches_aclnn(backend):
    from gradops import torch_npu as npu
    a = fa(F16)
    accept("fa", a)
    smax, ssum, out = npu.npu_fused_floyd_attention(a["query"], a["key1"], a["value1"], a["key2"], a["value2"],
                                                    atten_mask=a["attenMaskOptional"], scale_value=a["scaleValue"])
    assert smax.shape == ssum.shape == (FB, FH, FN, FM, 8)
    assert torch.equal(smax, a["softmaxMaxOut"]) and torch.equal(ssum, a["softmaxSumOut"])
    assert torch.equal(out, a["attentionOutOut"])
    g = rmsg(BF16, BF16)
    accept("rmsg", g)
    dx, dgamma = npu.npu_rms_norm_backward(g["dy"], g["x"], g["gamma"], g["rstd"])  # gamma before rstd
    assert torch.equal(dx, g["dxOut"]) and torch.equal(dgamma, g["dgammaOut"])
    n = nsa()
    accept("nsa", n)
    assert torch.equal(npu.npu_nsa_compress(n["input"], n["weight"], 32, 16, actual_seq_len=NSA_ENDS), n["output"])
    with pytest.raises(gradops.AclnnError) as e:  # a CANN-rejected dtype is still an AclnnError here
        npu.npu_rms_norm_backward(g["dy"], g["x"], g["gamma"], g["rstd"].half())
    assert e.value.status == INVALID


def test_layer_norm_forward_bias_has_the_weights_dtype(backend):
    """CANN's aclnnLayerNorm page: weight is input's dtype or float32, and bias, when both are
    given, has weight's dtype (161002 otherwise)."""
    args = ln(F16)
    args["weightOptional"] = args["weightOptional"].float()
    reject("ln", args, INVALID)
    args["biasOptional"] = args["biasOptional"].float()
    accept("ln", args)
    args = ln(F16)
    args["biasOptional"] = None
    args["weightOptional"] = args["weightOptional"].float()
    accept("ln", args)
