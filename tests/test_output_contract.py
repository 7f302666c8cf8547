"""The output contract of gradops.aclnn and gradops.ascendc (issue 13): a tensor a call
cannot write (an expanded/stride-0 view, a leaf that requires grad, an inference tensor, a
sparse or a meta tensor), and outputs that share memory with each other, are refused before
anything runs, with 161002 naming the tensor, and every output given is left bit for bit as
it was. Outputs may alias inputs (aclnn computes every result before writing any), and
interleaved views of one tensor are separate outputs."""
import itertools

import pytest
import torch

import gradops
from gradops import aclnn as A
from gradops.ascendc import (
    GetLayerNormGradBetaMaxMinTmpSize,
    GetLayerNormGradBetaNDTilingInfo,
    GetLayerNormGradMaxMinTmpSize,
    GetLayerNormGradNDTilingInfo,
    LayerNormGrad,
    LayerNormGradBeta,
)
from gradops.errors import AclnnTypeError

import test_aclnn as T
from conftest import as_default_backend

NULLPTR, INVALID, RUNTIME = 161001, 161002, 361001
SENTINEL = T.SENTINEL

OPS = {
    "LayerNorm": (A.aclnnLayerNormGetWorkspaceSize, A.aclnnLayerNorm, T.ln_args, T.LN_OUTS),
    "LayerNormBackward": (A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, T.lnb_args,
                          T.LNB_OUTS),
    "RmsNorm": (A.aclnnRmsNormGetWorkspaceSize, A.aclnnRmsNorm, T.rms_args, T.RMS_OUTS),
    "RmsNormGrad": (A.aclnnRmsNormGradGetWorkspaceSize, A.aclnnRmsNormGrad, T.rmsg_args, T.RMSG_OUTS),
    "NsaCompress": (A.aclnnNsaCompressGetWorkspaceSize, A.aclnnNsaCompress, T.nsa_args, T.NSA_OUTS),
    "NsaCompressGrad": (A.aclnnNsaCompressGradGetWorkspaceSize, A.aclnnNsaCompressGrad, T.nsag_args,
                        T.NSAG_OUTS),
    "FusedFloydAttention": (A.aclnnFusedFloydAttentionGetWorkspaceSize, A.aclnnFusedFloydAttention, T.fa_args,
                            T.FA_OUTS),
    "FusedFloydAttentionGrad": (A.aclnnFusedFloydAttentionGradGetWorkspaceSize, A.aclnnFusedFloydAttentionGrad,
                                T.fag_args, T.FAG_OUTS),
}
OUTPUTS = [(op, name) for op, (_, _, _, outs) in OPS.items() for name in outs]
PAIRS = [(op, a, b) for op, (_, _, _, outs) in OPS.items() for a, b in itertools.combinations(outs, 2)]
KINDS = ["expanded", "broadcast", "requires_grad", "inference", "sparse", "meta"]


@pytest.fixture
def reference(request):
    """The reference backend only: calls that run Floyd attention are slow through the interpreter."""
    with as_default_backend(request, "reference") as name:
        yield name


def unwritable(kind, like):
    """A tensor of ``like``'s shape and dtype, holding the sentinel, that a call cannot write."""
    shape, dtype, device = tuple(like.shape), like.dtype, like.device
    if kind == "expanded":  # every element in one place
        return torch.full((), SENTINEL, dtype=dtype, device=device).expand(shape)
    if kind == "broadcast":  # stride 0 along the first dim of more than one element
        dim = next(i for i, n in enumerate(shape) if n > 1)
        small = shape[:dim] + (1,) + shape[dim + 1:]
        return torch.full(small, SENTINEL, dtype=dtype, device=device).expand(shape)
    if kind == "requires_grad":
        return torch.full(shape, SENTINEL, dtype=dtype, device=device, requires_grad=True)
    if kind == "inference":
        with torch.inference_mode():
            return torch.full(shape, SENTINEL, dtype=dtype, device=device)
    if kind == "sparse":
        return torch.full(shape, SENTINEL, dtype=dtype, device=device).to_sparse()
    if kind == "meta":
        return torch.full(shape, SENTINEL, dtype=dtype, device="meta")
    raise AssertionError(kind)


def snapshot(tensors):
    """Bit-exact copies of the tensors that hold data (dense, not meta)."""
    return [(t, _bits(t).clone()) for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def _bits(t):
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.reshape(-1).contiguous().view(torch.uint8)


def unchanged(snap):
    return all(torch.equal(_bits(t), before) for t, before in snap)


def refused(call, status, *words):
    with pytest.raises(gradops.AclnnError) as e:
        call()
    msg = str(e.value)
    assert e.value.status == status, msg
    for w in words:
        assert w in msg, msg
    return e.value


def overlapping(like_a, like_b, offset_fraction=0.5):
    """Two tensors shaped and typed like ``like_a`` and ``like_b`` whose bytes overlap: ``b``
    starts ``offset_fraction`` of the way into ``a`` (0: at the same address). Returns
    (a, b, base), ``base`` being the random bytes both view."""
    na, nb = like_a.numel() * like_a.element_size(), like_b.numel() * like_b.element_size()
    offset = int(min(na, nb) * offset_fraction) // 8 * 8
    base = torch.randint(0, 256, (max(na, offset + nb),), dtype=torch.uint8, device=like_a.device)
    a = base[:na].view(like_a.dtype).view(like_a.shape)
    b = base[offset:offset + nb].view(like_b.dtype).view(like_b.shape)
    return a, b, base


# ---------------------------------------------------------------------------------------
# aclnn phase one: unwritable outputs, outputs sharing memory
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op,name", OUTPUTS)
def test_aclnn_refuses_an_unwritable_output(backend, op, name, kind):
    get_ws, _, make, outs = OPS[op]
    a = make()
    a[name] = unwritable(kind, a[name])
    snap = snapshot(a[n] for n in outs)
    refused(lambda: get_ws(**a), INVALID, f"aclnn{op}: {name} ")
    assert unchanged(snap)


@pytest.mark.parametrize("op,first,second", PAIRS)
def test_aclnn_refuses_outputs_sharing_memory(backend, op, first, second):
    get_ws, _, make, outs = OPS[op]
    # overlapping views (the second starts half-way into the first, or where it starts), then,
    # where the two have one shape and dtype, one tensor given twice
    for fraction in (0.5, 0.0, "same"):
        a = make()
        base = None
        if fraction == "same":
            if a[first].shape != a[second].shape or a[first].dtype != a[second].dtype:
                continue
            a[second] = a[first]
        else:
            a[first], a[second], base = overlapping(a[first], a[second], fraction)
        snap = snapshot([a[n] for n in outs] + [base])
        refused(lambda: get_ws(**a), INVALID, f"{first} and {second} share memory")
        assert unchanged(snap)


def test_aclnn_refuses_a_self_overlapping_output(backend):
    a = T.rmsg_args()
    store = torch.full((2 * 3 * 16 + 16,), SENTINEL, dtype=torch.float16)
    a["dxOut"] = store.as_strided((2, 3, 32), (48, 16, 1))  # each row's second half is the next row's first
    snap = snapshot([store, a["dgammaOut"]])
    refused(lambda: A.aclnnRmsNormGradGetWorkspaceSize(**a), INVALID, "dxOut ", "share memory")
    assert unchanged(snap)


def test_meta_outputs_plan_only_a_call_wholly_on_meta(backend):
    a = T.to_meta(T.rms_args())
    size, ex = A.aclnnRmsNormGetWorkspaceSize(**a)  # a dry run: nothing has memory
    assert A.aclnnRmsNorm(None, size, ex, None) == 0
    a["rstdOut"] = torch.empty((), device="meta").expand(2, 3, 1)  # the other rules still hold
    refused(lambda: A.aclnnRmsNormGetWorkspaceSize(**a), INVALID, "rstdOut ")
    a = T.to_meta(T.rms_args())
    a["rstdOut"] = a["yOut"].float()[..., :1]  # another meta tensor: not the same memory
    assert A.aclnnRmsNormGetWorkspaceSize(**a)[0] == 0
    c = T.to_meta(T.lnb_args(mean=torch.zeros(6, dtype=torch.float16), rstd=torch.ones(6, dtype=torch.float16)))
    size, ex = A.aclnnLayerNormBackwardGetWorkspaceSize(**c)  # staged statistics: a meta workspace
    assert size > 0 and A.aclnnLayerNormBackward(torch.empty(size, dtype=torch.uint8, device="meta"), size, ex) == 0
    b = T.to_meta(T.lnb_args())
    b["gradBiasOut"] = b["gradWeightOut"]
    refused(lambda: A.aclnnLayerNormBackwardGetWorkspaceSize(**b), INVALID, "gradWeightOut and gradBiasOut")


def test_masked_out_outputs_are_not_written_so_not_checked(backend):
    a = T.lnb_args(outputMask=[True, True, False])
    a["gradBiasOut"] = a["gradWeightOut"]  # not written: sharing is harmless
    T.run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, a)
    want = gradops.layer_norm_backward(a["gradOut"], a["input"], [16], a["mean"], a["rstd"], a["weightOptional"])
    assert torch.equal(a["gradWeightOut"], want[1])


# ---------------------------------------------------------------------------------------
# aclnn: what is accepted
# ---------------------------------------------------------------------------------------

def test_outputs_may_alias_inputs(backend):
    # LayerNorm: out is input
    a = T.ln_args()
    x0 = a["input"].clone()
    a["out"] = a["input"]
    T.run(A.aclnnLayerNormGetWorkspaceSize, A.aclnnLayerNorm, a)
    y, mean, rstd = gradops.layer_norm(x0, [16], a["weightOptional"], a["biasOptional"], 1e-5)
    assert torch.equal(a["input"], y) and torch.equal(a["meanOutOptional"], mean)
    # RmsNormGrad: dxOut is dy
    b = T.rmsg_args(torch.float32, torch.float32)
    dy0 = b["dy"].clone()
    b["dxOut"] = b["dy"]
    T.run(A.aclnnRmsNormGradGetWorkspaceSize, A.aclnnRmsNormGrad, b)
    dx, dgamma = gradops.rms_norm_grad(dy0, b["x"], b["rstd"], b["gamma"])
    assert torch.equal(b["dy"], dx) and torch.equal(b["dgammaOut"], dgamma)
    # LayerNormBackward with half statistics staged in the workspace: gradInputOut is gradOut
    c = T.lnb_args()
    c["mean"], c["rstd"] = c["mean"].reshape(6).half(), c["rstd"].reshape(6).half()
    g0 = c["gradOut"].clone()
    c["gradInputOut"] = c["gradOut"]
    assert T.run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, c)[0] > 0
    want = gradops.layer_norm_backward(g0, c["input"], [16], c["mean"].float().reshape(2, 3),
                                       c["rstd"].float().reshape(2, 3), c["weightOptional"])
    assert torch.equal(c["gradOut"], want[0]) and torch.equal(c["gradBiasOut"], want[2])
    # NsaCompressGrad: inputGradOut is input
    d = T.nsag_args()
    x0 = d["input"].clone()
    d["inputGradOut"] = d["input"]
    T.run(A.aclnnNsaCompressGradGetWorkspaceSize, A.aclnnNsaCompressGrad, d)
    dx, dw = gradops.nsa_compress_grad(d["outputGrad"], x0, d["weight"], T.BLOCK, T.STRIDE, T.ENDS)
    assert torch.equal(d["input"], dx) and torch.equal(d["weightGradOut"], dw)


def test_floyd_grad_outputs_may_alias_inputs(reference):
    a = T.fag_args()
    for name in ("query", "key1", "value2"):
        a[name] = a[name].clone()  # the builder's inputs are shared by the module: never write them
    before = {n: a[n].clone() for n in ("query", "key1", "value2")}
    a["dqOut"], a["dk1Out"], a["dv2Out"] = a["query"], a["key1"], a["value2"]
    T.run(A.aclnnFusedFloydAttentionGradGetWorkspaceSize, A.aclnnFusedFloydAttentionGrad, a)
    want = gradops.floyd_attention_grad(a["dy"], before["query"], before["key1"], a["value1"], a["key2"],
                                        before["value2"], a["attentionIn"], a["softmaxMax"], a["softmaxSum"],
                                        a["attenMaskOptional"], a["scaleValue"])
    for name, w in zip(T.FAG_OUTS, want):
        assert torch.equal(a[name], w), name


def test_interleaved_views_are_separate_outputs(backend):
    store = T.sentinel(32)
    a = T.lnb_args(gradWeightOut=store[::2], gradBiasOut=store[1::2])
    T.run(A.aclnnLayerNormBackwardGetWorkspaceSize, A.aclnnLayerNormBackward, a)
    want = gradops.layer_norm_backward(a["gradOut"], a["input"], [16], a["mean"], a["rstd"], a["weightOptional"])
    assert torch.equal(store[::2], want[1]) and torch.equal(store[1::2], want[2])
    stats = T.sentinel(2, 2 * 3, 1)  # x[:, ::2] and x[:, 1::2]
    b = T.ln_args(meanOutOptional=stats[:, ::2], rstdOutOptional=stats[:, 1::2])
    T.run(A.aclnnLayerNormGetWorkspaceSize, A.aclnnLayerNorm, b)
    _, mean, rstd = gradops.layer_norm(b["input"], [16], b["weightOptional"], b["biasOptional"], 1e-5)
    assert torch.equal(stats[:, ::2], mean) and torch.equal(stats[:, 1::2], rstd)
    c = T.rms_args(torch.float32, torch.float32)
    pair = T.sentinel(2, 3, 64)
    c["yOut"] = pair[..., ::2]
    c["rstdOut"] = T.sentinel(2, 3, 1)
    T.run(A.aclnnRmsNormGetWorkspaceSize, A.aclnnRmsNorm, c)
    assert torch.all(pair[..., 1::2] == SENTINEL)


def test_floyd_interleaved_statistics(reference):
    store = T.sentinel(T.B, T.H, T.N, T.M, 16)
    a = T.fa_args(softmaxMaxOut=store[..., ::2], softmaxSumOut=store[..., 1::2])
    T.run(A.aclnnFusedFloydAttentionGetWorkspaceSize, A.aclnnFusedFloydAttention, a)
    _, smax, ssum = gradops.floyd_attention(a["query"], a["key1"], a["value1"], a["key2"], a["value2"],
                                            a["attenMaskOptional"], a["scaleValue"])
    assert torch.equal(store[..., 0], smax) and torch.equal(store[..., 1], ssum)


# ---------------------------------------------------------------------------------------
# aclnn phase two: nothing written when it refuses
# ---------------------------------------------------------------------------------------

def test_phase_two_rechecks_outputs_changed_since_phase_one(backend):
    a = T.rms_args()
    size, ex = A.aclnnRmsNormGetWorkspaceSize(**a)
    snap = snapshot([a["yOut"], a["rstdOut"]])
    a["rstdOut"].requires_grad_()
    refused(lambda: A.aclnnRmsNorm(None, size, ex, None), INVALID, "rstdOut ", "requires grad")
    a["rstdOut"].requires_grad_(False)
    assert unchanged(snap)
    a["yOut"].resize_(6, 32)
    refused(lambda: A.aclnnRmsNorm(None, size, ex, None), INVALID, "yOut ", "changed since phase one")
    assert unchanged(snap)
    a["yOut"].resize_(2, 3, 32)
    assert A.aclnnRmsNorm(None, size, ex, None) == 0  # the refused runs did not consume the executor


def test_workspace_sharing_memory_with_a_tensor_is_refused(backend):
    a = T.lnb_args()
    a["mean"], a["rstd"] = a["mean"].reshape(6).half(), a["rstd"].reshape(6).half()  # staged: a workspace
    size, ex = A.aclnnLayerNormBackwardGetWorkspaceSize(**a)
    assert size > 0
    ws = a["gradInputOut"].reshape(-1).view(torch.uint8)[:size]
    snap = snapshot([a[n] for n in T.LNB_OUTS])
    refused(lambda: A.aclnnLayerNormBackward(ws, size, ex, None), INVALID, "workspace shares memory with gradInputOut")
    ws = a["gradOut"].reshape(-1).view(torch.uint8)[:size]
    refused(lambda: A.aclnnLayerNormBackward(ws, size, ex, None), INVALID, "workspace shares memory with gradOut")
    with torch.inference_mode():
        ws = torch.empty(size, dtype=torch.uint8)
    refused(lambda: A.aclnnLayerNormBackward(ws, size, ex, None), INVALID, "workspace is an inference tensor")
    ws = torch.zeros(size, dtype=torch.uint8).to_sparse()
    refused(lambda: A.aclnnLayerNormBackward(ws, size, ex, None), INVALID, "workspace has layout sparse")
    assert unchanged(snap)
    assert A.aclnnLayerNormBackward(torch.empty(size, dtype=torch.uint8), size, ex, None) == 0


# ---------------------------------------------------------------------------------------
# Only AclnnError escapes, None is 161001
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,status,word,type_error", [
    (lambda: A.aclnnRmsNormGetWorkspaceSize(**T.rms_args(x=T.rand(2, 3, 32, dtype=torch.float16).to_sparse())),
     INVALID, "x has layout sparse", False),
    (lambda: A.aclnnRmsNormGetWorkspaceSize(**T.rms_args(yOut=[1.0])), INVALID, "yOut is a list", True),
    (lambda: A.aclnnNsaCompressGetWorkspaceSize(**T.nsa_args(compressBlockSize=1 << 64)), INVALID,
     "compressBlockSize", False),
    (lambda: A.aclnnNsaCompressGetWorkspaceSize(**T.nsa_args(compressStride="16")), INVALID, "compressStride", True),
    (lambda: A.aclnnLayerNormGetWorkspaceSize(**T.ln_args(normalizedShape="16")), INVALID, "normalizedShape", True),
    (lambda: A.aclnnRmsNorm(None, 0, "executor", None), INVALID, "executor", True),
    (lambda: A.aclnnRmsNorm(None, 0.0, A.aclnnRmsNormGetWorkspaceSize(**T.rms_args())[1], None), INVALID,
     "workspaceSize", True),
    (lambda: A.aclnnRmsNorm(None, 0, A.aclnnRmsNormGetWorkspaceSize(**T.rms_args())[1], "stream"), INVALID,
     "stream", True),
])
def test_bad_arguments_raise_aclnn_errors(backend, call, status, word, type_error):
    err = refused(call, status, word)
    assert isinstance(err, AclnnTypeError) == type_error  # a wrong Python type is also a TypeError


# ---------------------------------------------------------------------------------------
# AscendC kernels
# ---------------------------------------------------------------------------------------

def grad_call(reuse=False, **over):
    b, s, h = 2, 4, 8
    _, mn = GetLayerNormGradMaxMinTmpSize([b, s, h, h], 4, reuse)
    tiling = GetLayerNormGradNDTilingInfo([b, s, h, h], mn, 4, reuse)
    x = T.rand(b, s, h)
    args = dict(outputPdX=T.sentinel(b, s, h), resForGamma=T.sentinel(b, s, h), inputDy=T.rand(b, s, h), inputX=x,
                inputVariance=x.var(-1, unbiased=False), inputMean=x.mean(-1), inputGamma=T.rand(h),
                sharedTmpBuffer=torch.zeros(mn, dtype=torch.uint8), epsilon=1e-5, tiling=tiling,
                isReuseSource=reuse)
    args.update(over)
    return args


def beta_call(reuse=False, **over):
    b, s, h = 2, 4, 8
    _, mn = GetLayerNormGradBetaMaxMinTmpSize([b, s, h, h], 4, reuse)
    tiling = GetLayerNormGradBetaNDTilingInfo([b, s, h, h], mn, 4, reuse)
    args = dict(outputPdGamma=T.sentinel(h), outputPdBeta=T.sentinel(h), resForGamma=T.rand(b, s, h),
                inputDy=T.rand(b, s, h), sharedTmpBuffer=torch.zeros(mn, dtype=torch.uint8), tiling=tiling,
                isReuseSource=reuse)
    args.update(over)
    return args


KERNELS = {"LayerNormGrad": (LayerNormGrad, grad_call, ["outputPdX", "resForGamma"]),
           "LayerNormGradBeta": (LayerNormGradBeta, beta_call, ["outputPdGamma", "outputPdBeta"])}
KERNEL_OUTPUTS = [(k, name) for k, (_, _, outs) in KERNELS.items() for name in outs]
ALL_TENSORS = {"LayerNormGrad": ["outputPdX", "resForGamma", "inputDy", "inputX", "inputVariance", "inputMean",
                                 "inputGamma", "sharedTmpBuffer"],
               "LayerNormGradBeta": ["outputPdGamma", "outputPdBeta", "resForGamma", "inputDy", "sharedTmpBuffer"]}


def kernel_snapshot(kernel, args, extra=()):
    return snapshot([args[n] for n in ALL_TENSORS[kernel]] + list(extra))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kernel,name", KERNEL_OUTPUTS)
def test_ascendc_refuses_an_unwritable_output(backend, kernel, name, kind):
    fn, make, _ = KERNELS[kernel]
    a = make()
    a[name] = unwritable(kind, a[name])
    snap = kernel_snapshot(kernel, a)
    refused(lambda: fn(**a), INVALID, f"{kernel}: {name} ")
    assert unchanged(snap)


@pytest.mark.parametrize("mode", ["same", "overlap"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_ascendc_refuses_outputs_sharing_memory(backend, kernel, mode):
    fn, make, (first, second) = KERNELS[kernel]
    a = make()
    base = None
    if mode == "same":
        a[second] = a[first]
    else:
        a[first], a[second], base = overlapping(a[first], a[second])
    snap = kernel_snapshot(kernel, a, [base])
    refused(lambda: fn(**a), INVALID, f"{first} and {second} share memory")
    assert unchanged(snap)


@pytest.mark.parametrize("kind", ["expanded", "inference", "sparse", "meta"])
@pytest.mark.parametrize("kernel,name", [("LayerNormGrad", "inputDy"), ("LayerNormGrad", "inputX"),
                                         ("LayerNormGradBeta", "resForGamma")])
def test_ascendc_refuses_an_unwritable_input_it_would_overwrite(backend, kernel, name, kind):
    fn, make, _ = KERNELS[kernel]
    a = make(reuse=True)
    a[name] = unwritable(kind, a[name])
    snap = kernel_snapshot(kernel, a)
    refused(lambda: fn(**a), INVALID, f"{kernel}: {name} ")
    assert unchanged(snap)
    if kind == "expanded":  # read only, without isReuseSource, an expanded input is fine
        a.update(isReuseSource=False, tiling=make()["tiling"], sharedTmpBuffer=None)
        fn(**a)


def test_ascendc_overwritten_inputs_may_require_grad(backend):
    # the kernel-level API is outside autograd: an input it overwrites may require grad (its
    # version counter moves, so a graph that saved it notices); an output may not
    a = grad_call(reuse=True)
    plain = dict(a, inputDy=a["inputDy"].clone(), inputX=a["inputX"].clone(), outputPdX=T.sentinel(2, 4, 8),
                 resForGamma=T.sentinel(2, 4, 8))
    LayerNormGrad(**plain)
    dy = a["inputDy"].clone().requires_grad_()
    version = dy._version
    a["inputDy"] = dy
    LayerNormGrad(**a)
    assert dy.requires_grad and dy.is_leaf and dy._version > version
    assert torch.equal(dy.detach(), plain["inputDy"])  # dy*gamma, as without requires_grad
    assert torch.equal(a["outputPdX"], plain["outputPdX"]) and not a["outputPdX"].requires_grad


@pytest.mark.parametrize("kernel,first,second", [
    ("LayerNormGrad", "inputDy", "inputX"), ("LayerNormGrad", "outputPdX", "inputDy"),
    ("LayerNormGrad", "resForGamma", "inputX"), ("LayerNormGradBeta", "outputPdGamma", "resForGamma")])
def test_ascendc_refuses_overwritten_inputs_sharing_memory(backend, kernel, first, second):
    fn, make, _ = KERNELS[kernel]
    a = make(reuse=True)
    a[first], a[second], base = overlapping(a[first], a[second], 0.0)
    snap = kernel_snapshot(kernel, a, [base])
    refused(lambda: fn(**a), INVALID, "share memory", first, second)
    assert unchanged(snap)


def test_ascendc_output_in_place_of_an_input_it_reads(backend):
    a = grad_call()
    want = grad_call()
    for n in ("inputDy", "inputX", "inputVariance", "inputMean", "inputGamma"):
        want[n] = a[n].clone()
    LayerNormGrad(**want)
    a["outputPdX"], a["resForGamma"] = a["inputDy"], a["inputX"]  # elementwise in place: accepted
    LayerNormGrad(**a)
    assert torch.equal(a["inputDy"], want["outputPdX"]) and torch.equal(a["inputX"], want["resForGamma"])


@pytest.mark.parametrize("kernel,written,read", [
    ("LayerNormGrad", "outputPdX", "inputX"), ("LayerNormGrad", "resForGamma", "inputDy"),
    ("LayerNormGrad", "outputPdX", "inputVariance"), ("LayerNormGrad", "resForGamma", "inputGamma"),
    ("LayerNormGradBeta", "outputPdGamma", "inputDy")])
def test_ascendc_refuses_an_output_partly_over_an_input_it_reads(backend, kernel, written, read):
    fn, make, _ = KERNELS[kernel]
    a = make()
    src = a[read]
    a[written], a[read], base = overlapping(a[written], src, 0.25)
    a[read].copy_(src)
    snap = kernel_snapshot(kernel, a, [base])
    refused(lambda: fn(**a), INVALID, f"{written} shares memory with {read}")
    assert unchanged(snap)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_ascendc_refuses_a_tmp_buffer_sharing_memory(backend, kernel):
    fn, make, (first, _) = KERNELS[kernel]
    a = make()
    store = torch.zeros(a["sharedTmpBuffer"].numel() + a[first].numel() * 4, dtype=torch.uint8)
    a[first] = store[:a[first].numel() * 4].view(torch.float32).view(a[first].shape).fill_(SENTINEL)
    a["sharedTmpBuffer"] = store
    snap = kernel_snapshot(kernel, a)
    refused(lambda: fn(**a), INVALID, f"sharedTmpBuffer shares memory with {first}")
    assert unchanged(snap)


@pytest.mark.parametrize("change,status,word,type_error", [
    (lambda: dict(epsilon=10 ** 400), INVALID, "epsilon", False),
    (lambda: dict(epsilon="1e-5"), INVALID, "epsilon", True),
    (lambda: dict(isReuseSource=None), NULLPTR, "isReuseSource", False),
    (lambda: dict(isReuseSource="yes"), INVALID, "isReuseSource", True),
    (lambda: dict(isReuseSource=torch.ones(2)), INVALID, "isReuseSource", True),
    (lambda: dict(inputDy=T.rand(2, 4, 8).to_sparse()), INVALID, "inputDy has layout sparse", False),
    (lambda: dict(sharedTmpBuffer=torch.zeros(4096, dtype=torch.uint8).to_sparse()), INVALID, "sharedTmpBuffer",
     False),
    (lambda: dict(inputGamma=[1.0] * 8), INVALID, "inputGamma", True),
])
def test_ascendc_bad_arguments_raise_aclnn_errors(backend, change, status, word, type_error):
    # the table's tensors are made here, on the test device (made at collection, they are on the CPU)
    a = grad_call(**change())
    snap = snapshot([a["outputPdX"], a["resForGamma"], a["inputDy"], a["inputX"]])
    err = refused(lambda: LayerNormGrad(**a), status, word)
    assert isinstance(err, AclnnTypeError) == type_error
    assert unchanged(snap)


def test_ascendc_tiling_none_fields_and_scratch_positions(backend):
    a = grad_call()
    a["tiling"].x3TensorPos = None
    refused(lambda: LayerNormGrad(**a), NULLPTR, "tiling.x3TensorPos")
    a = grad_call(sharedTmpBuffer=None)
    a["tiling"].x3TensorPos = 1 << 40  # past any buffer: our own scratch, sized by the rows, not the position
    LayerNormGrad(**a)
    assert torch.all(a["outputPdX"] != SENTINEL)
    b, s, h = 1, 2, 16
    x = T.rand(b, s, h, dtype=torch.float16)
    tiling = GetLayerNormGradNDTilingInfo([b, s, h, h], 1 << 14, 2, False)
    tiling.tmpTensor1Pos = tiling.tmpTensorPos  # dy and x converted into one region
    out = T.sentinel(b, s, h, dtype=torch.float16)
    refused(lambda: LayerNormGrad(out, out.clone(), x.clone(), x, x.float().var(-1).half(), x.float().mean(-1).half(),
                                  T.rand(h, dtype=torch.float16), None, 1e-5, tiling), INVALID, "tmpTensor1Pos")
    assert torch.all(out == SENTINEL)


def test_outputs_over_one_buffer_through_two_storages_are_refused(backend):
    """Outputs made over one buffer through two storages (``torch.from_dlpack`` of two slices,
    as NumPy views or another framework's tensors would be) share memory: refused as any two
    overlapping views, and nothing written. The buffer is on the test device (NumPy memory
    could only be on the CPU, beside a test-device x)."""
    buf = torch.full((200,), 7.0)
    x = torch.randn(2, 3, 16)
    out = torch.from_dlpack(buf[:96]).view(2, 3, 16)
    mean = torch.from_dlpack(buf[90:96]).view(2, 3, 1)
    assert out.untyped_storage()._cdata != mean.untyped_storage()._cdata  # two storages
    rstd = torch.empty(2, 3, 1)
    before = buf.clone()
    refused(lambda: A.aclnnLayerNormGetWorkspaceSize(x, [16], None, None, 1e-5, out, mean, rstd),
            161002, "out", "meanOutOptional", "share memory")
    assert torch.equal(buf, before)


def test_workspace_size_past_uint64_is_refused(backend):
    x, gamma = torch.randn(2, 8, dtype=torch.float16), torch.randn(8, dtype=torch.float16)
    y, rstd = torch.empty_like(x), torch.empty(2, 1)
    size, ex = A.aclnnRmsNormGetWorkspaceSize(x, gamma, 1e-6, y, rstd)
    refused(lambda: A.aclnnRmsNorm(None, 2 ** 64, ex), 161002, "workspaceSize")
    refused(lambda: A.aclnnRmsNorm(None, 10 ** 5000, ex), 161002, "workspaceSize")
    assert A.aclnnRmsNorm(None, size, ex) == 0
