"""The norm variants real models use: RMSNorm's ``offset`` (Gemma's ``1 + w``) and casting
modes (Llama rounds x-hat to the input dtype before the weight; Gemma computes everything in
float32), the norms without an affine weight, and the fused residual add of pre-norm blocks
(``h = x + residual; y = norm(h)``, returning y and h).

At the level users call them (``gradops.nn.functional`` and the modules), on both backends,
against three independent oracles: float64 gradcheck; float64 formulas written here with
each variant's rounding points; and the models' own modules from transformers
(LlamaRMSNorm, Gemma3RMSNorm), whose outputs the variants must reproduce bit for bit where
the arithmetic is the same.
"""
import pytest
import torch

import gradops
from gradops import nn as gnn
from gradops.kernels import norm_config
from gradops.nn import functional as GF

from conftest import as_default_backend
from helpers import assert_close, interpreted, raises_status, rand

HALF = (torch.bfloat16, torch.float16)
EPS = 1e-6
# Rows of 130: a tail in every tile, and, on the split path, three column blocks of the
# interpreter's 64 (so the wide kernels' loops, h stored in pass 1 and recomputed in pass 2,
# run more than once).
WIDTH = 130


def hf_norm(name):
    """transformers' own norm class (a test dependency: ``pip install -e '.[test]'``; a GPU
    machine gets it from benchmarks/gpu_wheels.sh)."""
    pytest.importorskip("transformers")
    if name == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        return LlamaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    return Gemma3RMSNorm


@pytest.fixture(params=["reference", "triton", "triton-split"])
def row_path(request):
    """Each backend as gradops' default (as the ``backend`` fixture does), and the kernels'
    second row regime: rows split over column blocks, forced here at small widths."""
    name = request.param.split("-")[0]
    old = norm_config.MAX_FUSED_N_OVERRIDE
    if request.param.endswith("split"):
        norm_config.MAX_FUSED_N_OVERRIDE = 8
    try:
        with as_default_backend(request, name):
            yield request.param
    finally:
        norm_config.MAX_FUSED_N_OVERRIDE = old


# ------------------------------------------------------------------ float64 formulas
def ste_round(t, dtype):
    """``t`` rounded to ``dtype`` and back, with the gradient of the identity (as autograd
    passes gradients through ``.to``)."""
    return t + (t.to(dtype).to(t.dtype) - t).detach()


def rms_formula(x, residual, w, eps, offset, mode, dtype):
    """HF's RMSNorm formulas in float64, rounding where the models round: h = x + residual
    in the input dtype, and (Llama) x-hat in the input dtype before the weight."""
    h = ste_round(x + residual, dtype) if residual is not None else x
    xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "llama":
        xhat = ste_round(xhat, dtype)
    return (xhat * (w + offset) if w is not None else xhat), h


def ln_formula(x, residual, w, b, eps, dtype):
    h = ste_round(x + residual, dtype) if residual is not None else x
    y = torch.nn.functional.layer_norm(h, h.shape[-1:], w, b, eps)
    return y, h


def float64_grads(formula, inputs, dy, dh, *args):
    """The formula's outputs and the gradients of (y, h) . (dy, dh) for each input, float64."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    y, h = formula(*leaves, *args)
    outs = [y] + ([h] if dh is not None else [])
    grads = [dy.double()] + ([dh.double()] if dh is not None else [])
    wanted = [t for t in leaves if t is not None]
    got = torch.autograd.grad(outs, wanted, grads)
    it = iter(got)
    return y.detach(), h.detach(), [None if t is None else next(it) for t in leaves]


def leaves(*ts):
    return [None if t is None else t.clone().requires_grad_() for t in ts]


# ------------------------------------------------------------------ RMSNorm variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["gemma", "llama"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_variants_match_float64_formula(row_path, dtype, mode, offset, with_residual):
    m, n = 5, WIDTH
    x, dy = rand((m, n), dtype, scale=2.0), rand((m, n), dtype)
    residual = rand((m, n), dtype) if with_residual else None
    dh = rand((m, n), dtype) if with_residual else None
    w = rand((n,), dtype, scale=0.5) + (0.0 if offset else 1.0)
    want_y, want_h, (gx, gr, gw) = float64_grads(rms_formula, (x, residual, w), dy, dh, EPS, offset, mode, dtype)

    x_, r_, w_ = leaves(x, residual, w)
    if with_residual:
        y, h = GF.fused_add_rms_norm(x_, r_, n, w_, EPS, offset=offset, casting_mode=mode)
        torch.autograd.backward([y, h], [dy, dh])
        assert h.dtype == dtype
        # h is x + residual exactly as torch adds them, not merely close
        assert torch.equal(h, x + residual)
        assert torch.equal(r_.grad, x_.grad)
    else:
        y = GF.rms_norm(x_, n, w_, EPS, offset=offset, casting_mode=mode)
        y.backward(dy)
    assert y.dtype == dtype and x_.grad.dtype == dtype and w_.grad.dtype == dtype
    assert_close(y, want_y, dtype, what="y")
    assert_close(x_.grad, gx, dtype, what="dx")
    assert_close(w_.grad, gw, dtype, what="dweight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_without_weight(row_path, dtype, with_residual):
    m, n = 4, WIDTH
    x, dy = rand((m, n), dtype), rand((m, n), dtype)
    residual = rand((m, n), dtype) if with_residual else None
    dh = rand((m, n), dtype) if with_residual else None
    want_y, _, (gx, _, _) = float64_grads(rms_formula, (x, residual, None), dy, dh, EPS, 0.0, "llama", dtype)
    x_, r_ = leaves(x, residual)
    if with_residual:
        y, h = GF.fused_add_rms_norm(x_, r_, n, None, EPS, casting_mode="llama")
        torch.autograd.backward([y, h], [dy, dh])
    else:
        y = GF.rms_norm(x_, n, None, EPS, casting_mode="llama")
        y.backward(dy)
    assert_close(y, want_y, dtype, what="y")
    assert_close(x_.grad, gx, dtype, what="dx")


@pytest.mark.usefixtures("statistics")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_fused_add_layer_norm_matches_float64_formula(row_path, dtype, affine):
    m, n = 5, WIDTH
    x, residual, dy, dh = (rand((m, n), dtype) for _ in range(4))
    w = rand((n,), dtype, scale=0.5) + 1.0 if affine else None
    b = rand((n,), dtype) if affine else None
    want_y, _, (gx, gr, gw, gb) = float64_grads(ln_formula, (x, residual, w, b), dy, dh, 1e-5, dtype)
    x_, r_, w_, b_ = leaves(x, residual, w, b)
    y, h = GF.fused_add_layer_norm(x_, r_, n, w_, b_, 1e-5)
    torch.autograd.backward([y, h], [dy, dh])
    assert torch.equal(h, x + residual)
    assert_close(y, want_y, dtype, what="y")
    assert_close(x_.grad, gx, dtype, what="dx")
    assert torch.equal(r_.grad, x_.grad)
    if affine:
        assert_close(w_.grad, gw, dtype, what="dweight")
        assert_close(b_.grad, gb, dtype, what="dbias")


def test_unused_h_and_unused_y(backend):
    """Only y used (h gets no gradient), or only h used (y gets none): the gradients are
    those of what was used."""
    x, r, w = rand((3, 8)), rand((3, 8)), rand((8,)) + 1
    x_, r_, w_ = leaves(x, r, w)
    y, _ = GF.fused_add_rms_norm(x_, r_, 8, w_, EPS)
    y.sum().backward()
    xe, re_, we = leaves(x, r, w)
    GF.rms_norm(xe + re_, 8, we, EPS).sum().backward()
    assert_close(x_.grad, xe.grad, torch.float32, what="dx, h unused")
    assert_close(w_.grad, we.grad, torch.float32, what="dweight, h unused")
    x_, r_, w_ = leaves(x, r, w)
    _, h = GF.fused_add_layer_norm(x_, r_, 8, w_, None)
    (2 * h).sum().backward()
    assert torch.equal(x_.grad, torch.full_like(x, 2.0)) and torch.equal(r_.grad, x_.grad)
    assert w_.grad is None or not w_.grad.any()


# ------------------------------------------------------------------ float64 gradcheck
VARIANTS = {
    "rms offset llama residual": lambda x, r, w, b: GF.fused_add_rms_norm(x, r, 6, w, EPS, offset=1.0,
                                                                          casting_mode="llama"),
    "rms offset gemma": lambda x, r, w, b: GF.rms_norm(x + r, 6, w, EPS, offset=0.5),
    "rms no weight residual": lambda x, r, w, b: GF.fused_add_rms_norm(x, r, 6, None, EPS),
    "layer_norm residual": lambda x, r, w, b: GF.fused_add_layer_norm(x, r, 6, w, b),
    "layer_norm no affine residual": lambda x, r, w, b: GF.fused_add_layer_norm(x, r, 6),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradcheck_float64(backend, variant):
    inputs = [rand(s, torch.float64).requires_grad_() for s in ((3, 6), (3, 6), (6,), (6,))]
    assert torch.autograd.gradcheck(VARIANTS[variant], inputs, fast_mode=interpreted(backend))


# ------------------------------------------------------------------ the models' own modules
def _hf_pair(cls, n, dtype, mode, offset, weight):
    hf = cls(n, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
    ours = gnn.RMSNorm(n, eps=EPS, dtype=dtype, offset=offset, casting_mode=mode)
    with torch.no_grad():
        ours.weight.copy_(weight)
    return hf, ours


MODELS = {  # casting mode, offset, weight around: what each model's weight holds
    "llama": ("llama", 0.0, 1.0),
    "gemma3": ("gemma", 1.0, 0.0),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_matches_the_models_own_module(backend, model, dtype, with_residual):
    """The module configured as the model's norm against the model's own, alone and as the
    decoder layer uses it after the residual add (``norm(residual + hidden)``, fused)."""
    cls = hf_norm(model)
    mode, offset, centre = MODELS[model]
    m, n = 16, 64
    x, dy = rand((m, n), dtype, scale=3.0), rand((m, n), dtype)
    r = rand((m, n), dtype, scale=2.0) if with_residual else torch.zeros_like(x)
    weight = rand((n,), dtype, scale=0.3) + centre
    hf, ours = _hf_pair(cls, n, dtype, mode, offset, weight)
    xh, xo = leaves(x, x)
    yh = hf(xh + r)
    yo = ours(xo, r)[0] if with_residual else ours(xo)
    yh.backward(dy)
    yo.backward(dy)
    x = x + r  # what was normalised
    assert yo.dtype == yh.dtype == dtype
    if dtype == torch.float32:
        for a, e, what in ((yo, yh, "y"), (xo.grad, xh.grad, "dx"), (ours.weight.grad, hf.weight.grad, "dweight")):
            assert_close(a, e, torch.float32, what=what)
        return
    # Same rounding points: the outputs agree bit for bit except where the float32 rstd
    # (a differently ordered sum) puts x-hat across a rounding boundary: rare, one ulp.
    differ = yo != yh
    assert differ.float().mean().item() <= 0.02, f"{differ.float().mean().item():.3f} of y differs"
    ulp = torch.finfo(dtype).eps * yh.float().abs()[differ]
    assert ((yo.float() - yh.float()).abs()[differ] <= ulp * 1.01).all()
    # The gradients: at least as accurate as the model's own half-precision autograd
    # (CANN's double-benchmark rule), both measured against the float64 formula.
    _, _, (gx, gw) = float64_grads(lambda a, b: rms_formula(a, None, b, EPS, offset, mode, dtype),
                                   (x, weight), dy, None)
    for ours_g, theirs_g, exact, what in ((xo.grad, xh.grad, gx, "dx"), (ours.weight.grad, hf.weight.grad, gw,
                                                                         "dweight")):
        err_ours = (ours_g.double() - exact).abs().max().item()
        err_theirs = (theirs_g.double() - exact).abs().max().item()
        assert err_ours <= max(err_theirs, torch.finfo(dtype).eps * exact.abs().max().item()), \
            f"{what}: error {err_ours:.3e}, the model's own {err_theirs:.3e}"


def test_llama_mode_is_what_llama_computes(backend):
    """The casting mode matters: in bf16, Gemma's rounding (the default) does not reproduce
    LlamaRMSNorm where Llama's does, so the test above distinguishes them."""
    n = 256
    x = rand((32, n), torch.bfloat16, scale=3.0)
    weight = rand((n,), torch.bfloat16, scale=0.3) + 1.0
    hf = hf_norm("llama")(n, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(weight)
        want = hf(x)
        llama = GF.rms_norm(x, n, weight, EPS, casting_mode="llama")
        gemma = GF.rms_norm(x, n, weight, EPS, casting_mode="gemma")
    assert (llama != want).float().mean().item() <= 0.02
    assert (gemma != want).float().mean().item() >= 0.05


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_llama_mode_with_float32_master_weight(backend, dtype):
    """A float32 weight beside half input: Llama's ``weight * hidden.to(input_dtype)``
    returns float32, and so does the llama mode."""
    n = 32
    x, dy = rand((6, n), dtype, scale=2.0), rand((6, n), torch.float32)
    weight = rand((n,), torch.float32, scale=0.3) + 1.0
    hf = hf_norm("llama")(n, eps=EPS)
    with torch.no_grad():
        hf.weight.copy_(weight)
    w_ = weight.clone().requires_grad_()
    xh, xo = leaves(x, x)
    yh = hf(xh)
    yo = GF.rms_norm(xo, n, w_, EPS, casting_mode="llama")
    assert yo.dtype == yh.dtype == torch.float32
    assert (yo != yh).float().mean().item() <= 0.02
    yh.backward(dy)
    yo.backward(dy)
    assert_close(w_.grad, hf.weight.grad, torch.float32, what="dweight")
    assert_close(xo.grad, xh.grad, dtype, what="dx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_no_affine_matches_torch_modules(backend, dtype, with_residual):
    """elementwise_affine=False against torch's own modules (GPT-2/BERT-style LayerNorm,
    torch.nn.RMSNorm), alone and after a residual add."""
    n = 48
    x, dy = rand((8, n), dtype, scale=2.0), rand((8, n), dtype)
    r = rand((8, n), dtype) if with_residual else torch.zeros_like(x)
    for theirs, ours in ((torch.nn.LayerNorm(n, elementwise_affine=False), gnn.LayerNorm(n, elementwise_affine=False)),
                         (torch.nn.RMSNorm(n, eps=EPS, elementwise_affine=False),
                          gnn.RMSNorm(n, eps=EPS, elementwise_affine=False))):
        xt, xo = leaves(x, x)
        yt = theirs(xt + r)
        yo = ours(xo, r)[0] if with_residual else ours(xo)
        yt.backward(dy)
        yo.backward(dy)
        assert_close(yo, yt, dtype, what=f"{type(ours).__name__} y")
        assert_close(xo.grad, xt.grad, dtype, what=f"{type(ours).__name__} dx")


@pytest.mark.parametrize("mode", ["gemma", "llama"])
def test_the_other_half_type_as_weight(backend, mode):
    """fp16 input beside a bf16 weight (and the reverse): outside CANN's dtype table, but
    the models run it, so the variants compute what those models compute: Llama's promoted
    float32 product, Gemma's float32 arithmetic rounded to the input's dtype."""
    n = 32
    for dtype, wdtype in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        x, weight = rand((6, n), dtype, scale=2.0), rand((n,), wdtype, scale=0.3)
        cls, offset = (hf_norm("llama"), 0.0) if mode == "llama" else (hf_norm("gemma3"), 1.0)
        hf = cls(n, eps=EPS).to(wdtype)
        with torch.no_grad():
            hf.weight.copy_(weight)
        w_ = weight.clone().requires_grad_()
        xh, xo = leaves(x, x)
        yh = hf(xh)
        yo = GF.rms_norm(xo, n, w_, EPS, offset=offset, casting_mode=mode)
        assert yo.dtype == yh.dtype
        assert (yo != yh).float().mean().item() <= 0.02
        dy = rand(yh.shape, yh.dtype)
        yh.backward(dy)
        yo.backward(dy)
        assert w_.grad.dtype == wdtype
        assert_close(w_.grad, hf.weight.grad, wdtype, what="dweight")
        assert_close(xo.grad, xh.grad, dtype, what="dx")


# ------------------------------------------------------------------ modules
def test_rms_norm_module_variants(backend):
    m = gnn.RMSNorm(8, eps=EPS, offset=1.0, casting_mode="llama")
    assert torch.equal(m.weight, torch.zeros(8))  # offset + weight starts at 1, as Gemma's does
    assert list(m.state_dict()) == list(torch.nn.RMSNorm(8).state_dict()) == ["weight"]
    assert "offset=1.0" in repr(m) and "casting_mode='llama'" in repr(m)
    assert "offset" not in repr(gnn.RMSNorm(8))
    x, r = rand((3, 8)), rand((3, 8))
    assert torch.equal(m(x), GF.rms_norm(x, 8, m.weight, EPS, offset=1.0, casting_mode="llama"))
    y, h = m(x, r)
    assert torch.equal(h, x + r) and torch.equal(y, m(x + r))
    ln = gnn.LayerNorm(8)
    y, h = ln(x, r)
    assert torch.equal(h, x + r) and torch.equal(y, ln(x + r))


def test_pre_norm_block_compiles_to_one_graph(backend):
    """A pre-norm block written with the fused residual add traces whole with
    torch.compile(fullgraph=True), and its gradients are the eager ones."""
    norm1 = gnn.RMSNorm(8, eps=EPS, offset=1.0, casting_mode="llama")
    norm2 = gnn.LayerNorm(8)
    lin = torch.nn.Linear(8, 8)

    def block(x, residual):
        y, h = norm1(x, residual)
        y, h = norm2(lin(y), h)
        return y + h

    x, r = rand((4, 8)), rand((4, 8))
    params = [norm1.weight, norm2.weight, norm2.bias, lin.weight, lin.bias]
    grads = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        x_, r_ = leaves(x, r)
        out = fn(x_, r_)
        grads.append([out.detach()] + list(torch.autograd.grad(out.square().sum(), [x_, r_] + params)))
    for a, e in zip(*grads):
        assert_close(a, e, torch.float32)


# ------------------------------------------------------------------ bad input
def test_bad_variant_arguments_raise_aclnn_errors(backend):
    x, r, w = rand((3, 8)), rand((3, 8)), rand((8,))
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "casting_mode", "'none'", "'gemma'", "'llama'"):
        GF.rms_norm(x, 8, w, casting_mode="none")
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "casting_mode"):
        gnn.RMSNorm(8, casting_mode="float16")
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "offset", "weight is None"):
        GF.rms_norm(x, 8, None, offset=1.0)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "offset", "'1'"):
        GF.rms_norm(x, 8, w, offset="1")
    with raises_status(gradops.ACLNN_ERR_INNER_TILING_ERROR, "residual", "(3, 4)"):
        GF.fused_add_rms_norm(x, r[:, :4], 8, w)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "residual", "bfloat16"):
        GF.fused_add_rms_norm(x, r.bfloat16(), 8, w)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "residual", "(2, 8)"):
        GF.fused_add_layer_norm(x, r[:2], 8, w)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "fused_add_layer_norm", "residual", "float64"):
        GF.fused_add_layer_norm(x, r.double(), 8, w)
    # wrong Python types get AclnnError naming the parameter, not the dispatcher's RuntimeError
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "fused_add_rms_norm", "residual", "float"):
        GF.fused_add_rms_norm(x, 3.0, 8, w)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "fused_add_layer_norm", "residual", "float"):
        GF.fused_add_layer_norm(x, 3.0, 8)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "residual"):
        gnn.RMSNorm(8)(x, 2.0)
    with raises_status(gradops.ACLNN_ERR_PARAM_NULLPTR, "casting_mode", "None"):  # None is 161001 everywhere
        GF.rms_norm(x, 8, w, casting_mode=None)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "weight", "list"):
        GF.rms_norm(x, 8, [1.0] * 8)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "offset", "elementwise_affine=False"):
        gnn.RMSNorm(8, elementwise_affine=False, offset=1.0)
