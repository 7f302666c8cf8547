"""gradops.pivotal_attention and gradops.nn.FloydAttention against the real FloydNet package
(PyPI ``floydnet`` 1.1.0: ``floydnet.functional.pivotal_attention`` and
``floydnet.transformer.PivotalAttentionBlock``), not a re-derivation of its formula.

FloydNet materialises the whole [B,H,L_i,L_k,L_j] score tensor with einsum and plain
autograd; in float64 that is the oracle for forward values and gradients. Skipped when
floydnet is not installed (it is in the test extras).
"""
import math

import pytest
import torch

floydnet = pytest.importorskip("floydnet")
from floydnet.functional import pivotal_attention as floyd_pivotal  # noqa: E402
from floydnet.transformer import PivotalAttentionBlock  # noqa: E402

import gradops  # noqa: E402
import gradops.nn.pivotal as pivotal_mod  # noqa: E402
from gradops.nn import FloydAttention  # noqa: E402
from conftest import TEST_DEVICE  # noqa: E402
from helpers import autocast  # noqa: E402

f64 = torch.float64
B, H, LI, LK, LJ, D = 2, 3, 4, 5, 6, 4

# float64: both sides are exact up to summation order (scores ~ O(10), a few hundred terms)
F64_TOL = dict(rtol=1e-10, atol=1e-10)


def _leaves(dtype=f64, li=LI, lk=LK, lj=LJ):
    shapes = [(B, H, li, lk, D), (B, H, li, lj, D), (B, H, lj, lk, D), (B, H, li, lj, D), (B, H, lj, lk, D)]
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def _run_both(leaves, **kwargs):
    """Forward and gradients of ours and FloydNet's on the same leaves (same upstream gradient)."""
    results = []
    dy = None
    for fn in (gradops.pivotal_attention, floyd_pivotal):
        for t in leaves:
            t.grad = None
        y = fn(*leaves, **kwargs)
        if dy is None:
            dy = torch.randn_like(y)
        y.backward(dy)
        results.append((y.detach(), [t.grad.clone() for t in leaves]))
    return results


def _assert_same(ours, theirs, **tol):
    (y0, g0), (y1, g1) = ours, theirs
    torch.testing.assert_close(y0, y1, **tol)
    for name, a, b in zip(("q_ik", "k_ij", "k_jk", "v_ij", "v_jk"), g0, g1):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"grad {n}: {m}")


def test_package_is_the_one_we_compare_against(backend):
    assert floydnet.pivotal_attention is floyd_pivotal
    from importlib.metadata import version
    assert version("floydnet") == "1.1.0"


@pytest.mark.floyd_float64
@pytest.mark.parametrize("scale", [None, 0.37])
def test_no_mask_default_and_explicit_scale(backend, scale):
    ours, theirs = _run_both(_leaves(), scale=scale)
    _assert_same(ours, theirs, **F64_TOL)


# Boolean masks of every broadcast form a FloydNet user writes; the first two take the fused
# operator, the rest the chunked path. About a third of the pivots are removed.
BOOL_MASK_SHAPES = [
    (B, 1, LI, 1, LJ),      # per (b, i, j): the fused operator's own mask
    (LJ,),                  # the same pivots removed everywhere
    (B, H, LI, LK, LJ),     # full
    (1, H, 1, 1, LJ),       # per head
    (B, 1, 1, LK, LJ),      # per (b, k, j)
    (LK, LJ),               # 2-D, right-aligned broadcasting
]


@pytest.mark.floyd_float64
@pytest.mark.parametrize("shape", BOOL_MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_boolean_masks(backend, shape, monkeypatch):
    fused_calls = []
    fused = pivotal_mod._fused
    monkeypatch.setattr(pivotal_mod, "_fused", lambda *a, **k: fused_calls.append(1) or fused(*a, **k))
    mask = torch.rand(shape) < 0.35
    ours, theirs = _run_both(_leaves(), attn_mask=mask)
    _assert_same(ours, theirs, **F64_TOL)
    # constant over heads and k: the fused operator ran; otherwise the chunked path
    assert bool(fused_calls) == (shape in BOOL_MASK_SHAPES[:2])


@pytest.mark.floyd_float64
@pytest.mark.parametrize("shape", [(B, 1, LI, 1, LJ), (B, H, LI, LK, LJ)], ids=["fused", "full"])
def test_boolean_mask_with_fully_masked_rows(backend, shape):
    # FloydNet writes -1e9 everywhere in such a row: a uniform softmax over all pivots
    mask = torch.rand(shape) < 0.3
    mask[0, ..., 1, :, :] = True  # every pivot of i == 1 in batch 0
    ours, theirs = _run_both(_leaves(), attn_mask=mask)
    _assert_same(ours, theirs, **F64_TOL)


@pytest.mark.parametrize("shape", [(B, H, LI, LK, LJ), (B, 1, LI, 1, LJ), (1, 1, 1, LK, 1)],
                         ids=["full", "per_bij", "per_k"])
def test_additive_float_masks(backend, shape):
    mask = torch.randn(shape, dtype=f64) * 2
    mask[torch.rand(shape) < 0.2] = -1e4
    ours, theirs = _run_both(_leaves(), attn_mask=mask)
    _assert_same(ours, theirs, **F64_TOL)


@pytest.mark.parametrize("cap", [0.5, 5.0])
def test_softmax_cap(backend, cap):
    # scores up to ~ 3 with scale=1.0: a cap of 0.5 saturates, 5.0 barely bends them
    mask = torch.rand(B, 1, LI, 1, LJ) < 0.3
    ours, theirs = _run_both(_leaves(), attn_mask=mask, softmax_cap=cap, scale=1.0)
    _assert_same(ours, theirs, **F64_TOL)


def test_small_inf_keeps_a_visible_share(backend):
    # with inf=2 a masked pivot keeps weight; FloydNet's literal formula must be reproduced
    mask = torch.rand(B, 1, LI, 1, LJ) < 0.4
    ours, theirs = _run_both(_leaves(), attn_mask=mask, inf=2.0)
    _assert_same(ours, theirs, **F64_TOL)


@pytest.mark.floyd_float64
def test_dropout_zero_keyword_and_positional(backend):
    leaves = _leaves()
    a = gradops.pivotal_attention(*leaves, None, 0.0)
    b = floyd_pivotal(*leaves, attn_mask=None, dropout=0.0)
    torch.testing.assert_close(a, b, **F64_TOL)


@pytest.mark.floyd_float64
def test_permuted_views_as_floydnet_blocks_pass_them(backend):
    # PivotalAttentionBlock.attn: chunk a [B,L,L,5C] projection and permute to [B,H,L,L,d]
    n, c = 5, H * D
    proj = torch.randn(B, n, n, 5 * c, dtype=f64, requires_grad=True)
    mask = torch.rand(B, 1, n, 1, n) < 0.3
    outs, grads = [], []
    for fn in (gradops.pivotal_attention, floyd_pivotal):
        proj.grad = None
        views = [t.view(B, n, n, H, D).permute(0, 3, 1, 2, 4) for t in proj.chunk(5, dim=-1)]
        assert not any(v.is_contiguous() for v in views)
        y = fn(*views, attn_mask=mask, dropout=0.0)
        y.backward(torch.ones_like(y))
        outs.append(y.detach())
        grads.append(proj.grad.clone())
    torch.testing.assert_close(outs[0], outs[1], **F64_TOL)
    torch.testing.assert_close(grads[0], grads[1], **F64_TOL)


@pytest.mark.parametrize("dtype,tol", [
    # our side computes in float32 inside; FloydNet computes in the input dtype, so bf16's
    # error is FloydNet's own rounding (8 mantissa bits over a 6-term softmax and two einsums)
    (torch.float32, dict(rtol=1e-5, atol=1e-5)),
    (torch.bfloat16, dict(rtol=4e-2, atol=4e-2)),
])
@pytest.mark.parametrize("masked", [False, True])
def test_low_precision_forward(floyd_backend, dtype, tol, masked):
    leaves64 = [t.detach() for t in _leaves()]
    leaves = [t.to(dtype) for t in leaves64]
    mask = (torch.rand(B, 1, LI, 1, LJ) < 0.3) if masked else None
    ours = gradops.pivotal_attention(*leaves, attn_mask=mask)
    theirs = floyd_pivotal(*leaves, attn_mask=mask)
    exact = floyd_pivotal(*[t.to(f64) for t in leaves], attn_mask=mask)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, theirs, **tol)
    # and ours is at least as close to the float64 value of the same rounded inputs
    err_ours = (ours.to(f64) - exact).abs().max().item()
    err_theirs = (theirs.to(f64) - exact).abs().max().item()
    assert err_ours <= err_theirs + torch.finfo(dtype).eps


def test_chunked_path_tiles_agree_with_floydnet(backend, monkeypatch):
    # force many tiles on the chunked path (additive mask), both axes split
    monkeypatch.setattr(pivotal_mod, "TILE_ELEMENTS", B * H * LJ * 2)
    mask = torch.randn(B, H, LI, LK, LJ, dtype=f64)
    ours, theirs = _run_both(_leaves(), attn_mask=mask, softmax_cap=3.0)
    _assert_same(ours, theirs, **F64_TOL)


# ------------------------------------------------------------------------------------------
# Modules: gradops.nn.FloydAttention vs FloydNet's PivotalAttentionBlock.attn
# ------------------------------------------------------------------------------------------

def _block_and_layer(c, heads, bias):
    block = PivotalAttentionBlock(c, heads, bias=bias, enable_ffn=False).to(f64).eval()
    # FloydNet zero-initialises c_proj; give it real weights so gradients are not trivially 0
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    layer = FloydAttention(c, heads, bias=bias, dtype=f64).eval()
    keys = {k: v for k, v in block.state_dict().items() if k.startswith(("c_qkv.", "c_proj."))}
    loaded = layer.load_state_dict(keys, strict=True)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    # and back: FloydAttention's state_dict loads into FloydNet's block (non-strict: the block
    # has c_mix and norm1 too)
    result = block.load_state_dict(layer.state_dict(), strict=False)
    assert not result.unexpected_keys
    return block, layer


@pytest.mark.floyd_float64
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_floyd_attention_module_matches_floydnet_attn(backend, bias, masked):
    n, c, heads = 5, 12, 3
    block, layer = _block_and_layer(c, heads, bias)
    x = torch.randn(B, n, n, c, dtype=f64)
    mask = (torch.rand(B, 1, n, 1, n) < 0.3) if masked else None
    outs, grads = [], []
    for fn, params in ((lambda t: layer(t, attn_mask=mask), dict(layer.named_parameters())),
                       (lambda t: block.attn(t, mask), {k: v for k, v in block.named_parameters()
                                                        if k.startswith(("c_qkv.", "c_proj."))})):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(torch.cos(torch.arange(y.numel(), dtype=f64)).view_as(y))
        outs.append(y.detach())
        grads.append({"x": xi.grad, **{k: p.grad.clone() for k, p in params.items()}})
    torch.testing.assert_close(outs[0], outs[1], **F64_TOL)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], **F64_TOL, msg=lambda m, k=k: f"{k}: {m}")


def _block_runs_floydnets_then_ours(block, x, mask, monkeypatch, autocast_dtype=None):
    """(output, x's gradient, parameter gradients) of a FloydNet block on ``x``, first with
    FloydNet's pivotal_attention, then with ours swapped into floydnet.transformer."""
    import floydnet.transformer as floyd_transformer
    runs = []
    for swap in (False, True):
        if swap:
            monkeypatch.setattr(floyd_transformer, "pivotal_attention", gradops.pivotal_attention)
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with autocast(autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            y = block(xi, attn_mask=mask)
        y.pow(2).sum().backward()
        runs.append((y.detach(), xi.grad, {k: p.grad.clone() for k, p in block.named_parameters()}))
    return runs


@pytest.mark.floyd_float64
def test_swapping_our_function_into_floydnets_block(backend, monkeypatch):
    # the whole FloydNet block (symmetric mix, pre-norm, FFN) with its pivotal_attention
    # replaced by ours: same outputs and parameter gradients
    import floydnet.transformer as floyd_transformer
    n, c, heads = 4, 8, 2
    block = PivotalAttentionBlock(c, heads, bias=True).to(f64).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(B, n, n, c, dtype=f64)
    mask = torch.rand(B, 1, n, 1, n) < 0.3
    runs = _block_runs_floydnets_then_ours(block, x, mask, monkeypatch)
    assert floyd_transformer.pivotal_attention is gradops.pivotal_attention
    torch.testing.assert_close(runs[1][0], runs[0][0], **F64_TOL)
    torch.testing.assert_close(runs[1][1], runs[0][1], **F64_TOL)
    for k in runs[0][2]:
        torch.testing.assert_close(runs[1][2][k], runs[0][2][k], **F64_TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_swapped_block_trains_with_dropout(backend):
    # training mode: FloydNet's block passes dropout=p; with ours swapped in the step must run
    # and, for a fixed RNG seed, produce a finite loss with gradients for every parameter
    import floydnet.transformer as floyd_transformer
    original = floyd_transformer.pivotal_attention
    try:
        floyd_transformer.pivotal_attention = gradops.pivotal_attention
        block = PivotalAttentionBlock(8, 2, dropout=0.2, bias=True).train()
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        y = block(torch.randn(2, 4, 4, 8))
        y.pow(2).mean().backward()
        assert torch.isfinite(y).all()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in block.parameters())
    finally:
        floyd_transformer.pivotal_attention = original


def test_dropout_matches_floydnet_under_same_rng(backend):
    # with the same seed FloydNet and the chunked path (one tile) draw the same dropout mask
    leaves = _leaves()
    torch.manual_seed(123)
    a = gradops.pivotal_attention(*leaves, dropout=0.3)
    torch.manual_seed(123)
    b = floyd_pivotal(*leaves, dropout=0.3)
    torch.testing.assert_close(a, b, **F64_TOL)
    assert math.isfinite(a.sum().item())


@pytest.mark.parametrize("shape", [(B, H, LI, LK, LJ), (LK, LJ), (1, H, LI, 1, LJ)], ids=["full", "2d", "per_h_i"])
def test_learnable_additive_mask_gets_floydnets_gradient(backend, shape):
    # a learned attention bias passed as attn_mask: its (broadcast-summed) gradient too
    leaves = _leaves()
    grads = []
    for fn in (gradops.pivotal_attention, floyd_pivotal):
        bias = torch.randn(shape, dtype=f64, generator=torch.Generator().manual_seed(7), device="cpu")
        bias = bias.to(torch.get_default_device()).requires_grad_(True)
        y = fn(*leaves, attn_mask=bias)
        y.backward(torch.ones_like(y))
        grads.append(bias.grad)
    torch.testing.assert_close(grads[0], grads[1], **F64_TOL)


def test_integer_mask_is_additive_as_in_floydnet(backend):
    # FloydNet adds any non-boolean mask, a uint8 one included (0/1 added to the scores)
    leaves = _leaves()
    mask = (torch.rand(B, 1, LI, 1, LJ) < 0.5).to(torch.uint8)
    ours, theirs = gradops.pivotal_attention(*leaves, attn_mask=mask), floyd_pivotal(*leaves, attn_mask=mask)
    torch.testing.assert_close(ours, theirs, **F64_TOL)


def test_floyd_attention_training_with_dropout_matches_floydnet_under_same_rng(backend):
    # train mode, dropout on the attention weights and the output: one tile, so both draw
    # the same random numbers in the same order
    n, c, heads = 4, 8, 2
    block = PivotalAttentionBlock(c, heads, dropout=0.25, bias=True, enable_ffn=False).to(f64).train()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    layer = FloydAttention(c, heads, bias=True, dropout=0.25, dtype=f64).train()
    layer.load_state_dict({k: v for k, v in block.state_dict().items() if k.startswith(("c_qkv.", "c_proj."))})
    x = torch.randn(B, n, n, c, dtype=f64)
    outs = []
    for fn in (layer, lambda t: block.attn(t, None)):
        torch.manual_seed(5)
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.sum().backward()
        outs.append((y.detach(), xi.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], **F64_TOL)
    torch.testing.assert_close(outs[0][1], outs[1][1], **F64_TOL)


@pytest.mark.parametrize("masked", [False, True])
def test_autocast_bf16_matches_floydnet_under_autocast(floyd_backend, masked):
    # under CPU autocast FloydNet's einsums run in bf16; ours casts to bf16 and computes in
    # float32, so ours is the closer one to float64 and both return bf16
    leaves = [t.detach().float() for t in _leaves()]
    mask = (torch.rand(B, 1, LI, 1, LJ) < 0.3) if masked else None
    with autocast():
        ours = gradops.pivotal_attention(*leaves, attn_mask=mask)
        theirs = floyd_pivotal(*leaves, attn_mask=mask)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    exact = floyd_pivotal(*[t.to(torch.bfloat16).to(f64) for t in leaves], attn_mask=mask)
    torch.testing.assert_close(ours.to(f64), exact, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=5e-2, atol=5e-2)


def test_swapped_floydnet_block_compiles_fullgraph(floyd_backend, monkeypatch):
    import floydnet.transformer as floyd_transformer
    torch._dynamo.reset()
    n, c, heads = 4, 8, 2
    block = PivotalAttentionBlock(c, heads, bias=True).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(B, n, n, c)
    mask = torch.rand(B, 1, n, 1, n) < 0.3
    runs = []
    for swap in (False, True):
        if swap:
            monkeypatch.setattr(floyd_transformer, "pivotal_attention", gradops.pivotal_attention)
        fn = torch.compile(block, fullgraph=True, backend="aot_eager") if swap else block
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = fn(xi, attn_mask=mask)
        y.square().sum().backward()
        runs.append((y.detach(), xi.grad, {k: p.grad.clone() for k, p in block.named_parameters()}))
    torch._dynamo.reset()
    # float32, different summation orders (fused operator vs einsum)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runs[1][0], runs[0][0], **tol)
    torch.testing.assert_close(runs[1][1], runs[0][1], **tol)
    for k in runs[0][2]:
        torch.testing.assert_close(runs[1][2][k], runs[0][2][k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("compiled", [False, True])
def test_dropout_gradients_match_floydnet_under_same_rng(backend, compiled, monkeypatch):
    """The chunked path recomputes each tile in backward (checkpoint): the recomputed dropout
    mask must be the forward's, eagerly and under torch.compile, or gradients are silently
    wrong. The values show the dropped weights themselves: v_ij[i, j, :L_j] is the one-hot
    of j and v_jk[..., :L_j] is 0, so y[..., :L_j] = P * keep / (1 - p) exactly, and
    FloydNet's formula with that keep mask (its F.dropout replaced by it) is the oracle of y
    and of every gradient.

    Eagerly that mask is also FloydNet's own under the same seed (one tile: both draw the
    same numbers in the same order), on any device. Compiled, only on a CPU: on CUDA,
    AOTAutograd functionalises the RNG of a checkpointed region with generators of its own
    (``graphsafe_rng_functionalization``), so compiled dropout masks are not eager ones
    there; which numbers torch draws is not gradops' to decide, that its forward and
    backward use the same ones is."""
    torch._dynamo.reset()
    li, lk, lj = 4, 4, 4
    d = lj + 2
    leaves = [torch.randn(s, dtype=f64) for s in [(B, H, li, lk, d), (B, H, li, lj, d), (B, H, lj, lk, d),
                                                   (B, H, li, lj, d), (B, H, lj, lk, d)]]
    leaves[3][..., :lj] = torch.eye(lj, dtype=f64)
    leaves[4][..., :lj] = 0.0
    leaves = [t.requires_grad_() for t in leaves]
    mask = torch.randn(lk, lj, dtype=f64)
    p = 0.3

    def ours_fn(*t):
        return gradops.pivotal_attention(*t, attn_mask=mask, dropout=p)

    def run(f, seed=11):
        for t in leaves:
            t.grad = None
        torch.manual_seed(seed)
        y = f(*leaves)
        y.backward(torch.cos(torch.arange(y.numel(), dtype=f64)).view_as(y))
        return y.detach(), [t.grad.clone() for t in leaves]

    ours = run(torch.compile(ours_fn, fullgraph=True, backend="aot_eager") if compiled else ours_fn)
    torch._dynamo.reset()
    keep = ours[0][..., :lj] != 0  # [B, H, L_i, L_k, L_j]: P > 0 everywhere
    assert 0 < int(keep.sum()) < keep.numel()
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "dropout", lambda attn, p, **_: attn * keep / (1 - p))
        oracle = run(lambda *t: floyd_pivotal(*t, attn_mask=mask, dropout=p))
    _assert_same(ours, oracle, **F64_TOL)
    if not compiled or TEST_DEVICE == "cpu":
        _assert_same(ours, run(lambda *t: floyd_pivotal(*t, attn_mask=mask, dropout=p)), **F64_TOL)


def test_single_pivot_training_matches_floydnet(floyd_backend):
    """A FloydNet block on a 1 x 1 grid: a single pivot, so P = 1 and the exact gradients of
    the queries and keys are zero (FloydNet's autograd returns exact zeros). Any rounding
    noise there is what AdamW normalises into full learning-rate steps (a 1.3e-2 drift of
    c_qkv after 5 steps was observed); with gradops swapped in, 5 AdamW steps must leave
    the same parameters as FloydNet's own, up to float32 rounding."""
    import floydnet.transformer as floyd_transformer
    torch.manual_seed(0)
    c, heads = 8, 2
    reference_block = PivotalAttentionBlock(c, heads, bias=True)
    with torch.no_grad():  # FloydNet zero-initialises c_mix, c_proj, ffn[2]: give them weights
        for p in reference_block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours_block = PivotalAttentionBlock(c, heads, bias=True)
    ours_block.load_state_dict(reference_block.state_dict())
    xs = [torch.randn(3, 1, 1, c) for _ in range(5)]

    def train(block, attention):
        original = floyd_transformer.pivotal_attention
        floyd_transformer.pivotal_attention = attention
        try:
            opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
            for x in xs:
                opt.zero_grad(set_to_none=True)
                block(x).square().mean().backward()
                opt.step()
        finally:
            floyd_transformer.pivotal_attention = original
        return {k: v.detach().clone() for k, v in block.named_parameters()}

    theirs = train(reference_block, floyd_pivotal)
    ours = train(ours_block, gradops.pivotal_attention)
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.floyd_float64
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_float64_block_under_autocast_stays_float64(backend, monkeypatch, mask_kind):
    """torch's autocast never lowers float64, so FloydNet's float64 block runs in float64 under
    bf16 autocast; with ours swapped in it must too (it used to cast to bf16, and the block's
    next Linear then failed on mixed dtypes). Both paths: fused (None/bool mask) and chunked."""
    n, c, heads = 4, 8, 2
    block = PivotalAttentionBlock(c, heads, bias=True).to(f64).eval()
    x = torch.randn(B, n, n, c, dtype=f64)
    mask = {"none": None, "bool": torch.rand(B, 1, n, 1, n) < 0.3,
            "additive": torch.randn(B, 1, n, n, n, dtype=f64)}[mask_kind]
    runs = _block_runs_floydnets_then_ours(block, x, mask, monkeypatch, autocast_dtype=torch.bfloat16)
    assert runs[0][0].dtype == runs[1][0].dtype == f64
    torch.testing.assert_close(runs[1][0], runs[0][0], **F64_TOL)
    torch.testing.assert_close(runs[1][1], runs[0][1], **F64_TOL)
