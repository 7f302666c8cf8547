"""3-Floyd attention (issue 46): the operator (``gradops.floyd3_attention`` /
``floyd3_attention_grad``), the functional (``gradops.nn.functional.floyd3_attention``) and
FloydNet's ``pivotal_attention3`` signature (``gradops.pivotal_attention3``), on every backend,
against independent oracles: float64 autograd through the full quartic scores
(``gradops.oracles.floyd3_attention``), FloydNet's own ``pivotal_attention3`` in float64, and
finite differences (gradcheck)."""
import pytest
import torch

import gradops
from gradops import oracles
from gradops.oracles import TOLERANCE, rel_error

from conftest import TEST_DEVICE
from helpers import autocast, interpreted, raises_status
from test_compile import gradops_ops_in, recording_backend

FLT_MAX = 3.4028234663852886e38
GRADS = ("dq", "dk1", "dv1", "dk2", "dv2", "dk3", "dv3")
# I, J, K, P all different, none a multiple of 16 (every kernel's tails); B, H > 1
SHAPE = (2, 2, 3, 5, 4, 6, 8)  # B, H, I, J, K, P, D
# The Triton interpreter runs each program of each batched GEMM in Python: a second or more a
# launch at SHAPE. Interpreted runs take a smaller problem (B, H > 1 and the kernels' own cases:
# tests/test_kernels_floyd3.py).
INTERPRETED_SHAPE = (1, 1, 3, 2, 4, 5, 4)


@pytest.fixture
def size(backend):
    """The problem (B, H, I, J, K, P, D) of a test on ``backend``."""
    return INTERPRETED_SHAPE if interpreted(backend) else SHAPE


def stat_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_inputs(b, h, i, j, k, p, d, dtype=torch.float32, seed=0):
    """q, k1, v1, k2, v2, k3, v3 drawn in float32 from a CPU generator, rounded to ``dtype``, on
    the test device (the oracle is fed the same rounded values)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, h, i, j, k, d)] + [(b, h, p, j, k, d)] * 2 + [(b, h, i, p, k, d)] * 2 + [(b, h, i, j, p, d)] * 2
    return [torch.randn(s, generator=gen, device="cpu").to(dtype).to(TEST_DEVICE) for s in shapes]


def make_mask(b, i, j, k, p, shape=None, seed=1, fully_masked=True):
    """A boolean mask broadcastable to (B, 1, I, J, K, P), about 30% True, with (when
    ``fully_masked``) every pivot of the rows (0, *, 0) removed."""
    shape = (b, 1, i, 1, k, p) if shape is None else shape
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed), device="cpu") < 0.3
    if fully_masked:
        mask[:, :, 0, ..., 0, :] = True
    return mask.to(TEST_DEVICE)


def run_operator(inputs, mask, scale, dy):
    out, smax, ssum = gradops.floyd3_attention(*inputs, mask, scale)
    return (out, smax, ssum), gradops.floyd3_attention_grad(dy, *inputs, out, smax, ssum, mask, scale)


def check_against_oracle(inputs, mask, scale, dtype, dy):
    q = inputs[0]
    b, h, i, j, k, _ = q.shape
    (out, smax, ssum), grads = run_operator(inputs, mask, scale, dy)
    assert out.dtype == dtype and out.shape == q.shape
    for stat in (smax, ssum):
        assert stat.dtype == stat_dtype(dtype) and stat.shape == (b, h, i, j, k)
    e_out, e_max, e_sum = oracles.floyd3_attention(*inputs, mask=mask, scale=scale)
    assert rel_error(out, e_out) <= TOLERANCE[dtype]
    # the statistics are float32 (float64) from the same rounded inputs
    assert rel_error(smax, e_max) <= TOLERANCE[stat_dtype(dtype)]
    assert rel_error(ssum, e_sum) <= TOLERANCE[stat_dtype(dtype)]
    expected = oracles.floyd3_attention_backward(dy, *inputs, mask=mask, scale=scale)
    for name, g, e, t in zip(GRADS, grads, expected, inputs):
        assert g.dtype == dtype and g.shape == t.shape, name
        assert rel_error(g, e) <= TOLERANCE[dtype], (name, rel_error(g, e))
    return (out, smax, ssum), grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_operator_matches_float64_oracle(backend, size, dtype, masked):
    b, h, i, j, k, p, d = size
    inputs = make_inputs(*size, dtype=dtype)
    mask = make_mask(b, i, j, k, p) if masked else None
    dy = make_inputs(b, h, i, j, k, 1, d, dtype=dtype, seed=2)[0]
    scale = (3 * d) ** -0.5
    if backend == "triton" and dtype == torch.float64:
        # the Triton backend refuses float64 by name; "auto" takes it to the reference
        with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "float64"):
            gradops.floyd3_attention(*inputs, mask, scale)
        out, _, _ = gradops.floyd3_attention(*inputs, mask, scale, backend="auto")
        assert rel_error(out, oracles.floyd3_attention(*inputs, mask=mask, scale=scale)[0]) <= TOLERANCE[dtype]
        return
    check_against_oracle(inputs, mask, scale, dtype, dy)


# A mask's dims by letter: the size of that dim of (B, H, I, J, K, P), "1" a broadcast one
@pytest.mark.parametrize("dims", ["B11J1P", "1IJ1P", "11I11P", "KP", "B1IJKP"])
def test_masks_broadcast_over_any_dim(backend, size, dims):
    b, h, i, j, k, p, d = size
    sizes = dict(zip("BHIJKP", (b, h, i, j, k, p)), **{"1": 1})
    inputs = make_inputs(*size)
    mask = make_mask(b, i, j, k, p, shape=tuple(sizes[c] for c in dims), fully_masked=False)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    check_against_oracle(inputs, mask, 0.3, torch.float32, dy)


def test_uint8_mask_is_a_bool_mask(backend, size):
    b, h, i, j, k, p, d = size
    inputs = make_inputs(*size)
    mask = make_mask(b, i, j, k, p)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    as_bool = run_operator(inputs, mask, 0.3, dy)
    as_uint8 = run_operator(inputs, mask.to(torch.uint8), 0.3, dy)
    for a, e in zip(as_bool[0] + as_bool[1], as_uint8[0] + as_uint8[1]):
        assert torch.equal(a, e)


def test_fully_masked_row_is_uniform_and_gives_q_and_keys_nothing(backend, size):
    """A row whose pivots are all masked has max -FLT_MAX, sum P and a uniform softmax (as the
    2-pivot operator, CANN's convention); its dS is exactly 0, so dq of the row is exactly 0."""
    b, h, i, j, k, p, d = size
    inputs = make_inputs(*size)
    mask = torch.zeros((b, 1, i, j, k, p), dtype=torch.bool, device="cpu")
    mask[:, :, 1, 1, 3] = True
    mask = mask.to(TEST_DEVICE)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    (out, smax, ssum), grads = run_operator(inputs, mask, 0.5, dy)
    assert torch.all(smax[:, :, 1, 1, 3] == -FLT_MAX) and torch.all(ssum[:, :, 1, 1, 3] == p)
    _, k1, v1, k2, v2, k3, v3 = inputs
    mean = (v1[:, :, :, 1, 3] + v2[:, :, 1, :, 3] + v3[:, :, 1, 1, :]).mean(dim=2)
    assert rel_error(out[:, :, 1, 1, 3], mean) <= TOLERANCE[torch.float32]
    assert torch.all(grads[0][:, :, 1, 1, 3] == 0)
    # the oracle agrees everywhere else too
    check_against_oracle(inputs, mask, 0.5, torch.float32, dy)


def test_one_hot_softmax_gives_exactly_zero_dq(backend):
    """A single pivot: P is one-hot, so dS = P (dP - Dr) is exactly 0 (Dr from P and dP, not dY.Y)."""
    inputs = make_inputs(1, 1, 3, 2, 4, 1, 4)
    dy = make_inputs(1, 1, 3, 2, 4, 1, 4, seed=2)[0]
    _, grads = run_operator(inputs, None, 1.0, dy)
    for name in ("dq", "dk1", "dk2", "dk3"):
        assert torch.all(grads[GRADS.index(name)] == 0), name


def test_deterministic(backend, size):
    b, h, i, j, k, p, d = size
    inputs = make_inputs(*size)
    mask = make_mask(b, i, j, k, p)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    first, second = run_operator(inputs, mask, 0.3, dy), run_operator(inputs, mask, 0.3, dy)
    for a, e in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, e)


def test_strided_inputs(backend, size):
    b, h, i, j, k, p, d = size
    inputs = make_inputs(*size)
    # permuted storage: each tensor a non-contiguous view of the same values
    views = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in inputs]
    assert not any(v.is_contiguous() for v in views)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    contiguous, strided = run_operator(inputs, None, 0.3, dy), run_operator(views, None, 0.3, dy)
    for a, e in zip(contiguous[0] + contiguous[1], strided[0] + strided[1]):
        assert rel_error(a, e) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("shape", [(0, 2, 3, 4, 5, 6, 8), (1, 2, 0, 4, 5, 6, 8), (1, 1, 3, 4, 5, 6, 0),
                                   (1, 1, 2, 3, 0, 6, 8)], ids=lambda s: "x".join(map(str, s)))
def test_empty_shapes(backend, shape):
    b, h, i, j, k, p, d = shape
    inputs = make_inputs(*shape)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    (out, smax, ssum), grads = run_operator(inputs, None, 1.0, dy)
    e_out, e_max, e_sum = oracles.floyd3_attention(*inputs)
    assert out.shape == inputs[0].shape and smax.shape == (b, h, i, j, k)
    assert torch.equal(out.double(), e_out) and torch.equal(ssum.double(), e_sum)
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and torch.all(g == 0)


def test_no_pivots_is_refused():
    inputs = make_inputs(1, 1, 2, 3, 4, 0, 8)
    with raises_status(gradops.ACLNN_ERR_INNER_TILING_ERROR, "P = 0 pivots"):
        gradops.floyd3_attention(*inputs)


def test_errors_name_the_parameter_and_the_rule():
    inputs = make_inputs(1, 2, 3, 4, 5, 6, 8)
    q, k1, v1, k2, v2, k3, v3 = inputs
    with raises_status(gradops.ACLNN_ERR_PARAM_NULLPTR, "k2"):
        gradops.floyd3_attention(q, k1, v1, None, v2, k3, v3)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "v3", "float16"):
        gradops.floyd3_attention(q, k1, v1, k2, v2, k3, v3.half())
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "q", "int64"):
        gradops.floyd3_attention(*(t.long() for t in inputs))
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "mask", "float32"):
        gradops.floyd3_attention(*inputs, mask=torch.zeros(1, 1, 3, 4, 5, 6, device=TEST_DEVICE))
    with raises_status(gradops.ACLNN_ERR_INNER_TILING_ERROR, "k3", "P = 7", "P = 6 as in k1, v1, k2, v2"):
        gradops.floyd3_attention(q, k1, v1, k2, v2, make_inputs(1, 2, 3, 4, 5, 7, 8)[5], v3)
    with raises_status(gradops.ACLNN_ERR_INNER_TILING_ERROR, "k1", "6 dims"):
        gradops.floyd3_attention(q, k1[0], v1, k2, v2, k3, v3)
    with raises_status(gradops.ACLNN_ERR_INNER_TILING_ERROR, "mask", "(B, 1, I, J, K, P)"):
        per_head = torch.zeros(1, 2, 3, 4, 5, 6, dtype=torch.bool, device=TEST_DEVICE)
        gradops.floyd3_attention(*inputs, mask=per_head)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "scale"):
        gradops.floyd3_attention(*inputs, scale="0.5")
    out, smax, ssum = gradops.floyd3_attention(*inputs)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "softmax_max", "float32"):
        gradops.floyd3_attention_grad(out, *inputs, out, smax.double(), ssum)
    with raises_status(gradops.ACLNN_ERR_INNER_TILING_ERROR, "softmax_sum", "(B, H, I, J, K)"):
        gradops.floyd3_attention_grad(out, *inputs, out, smax, ssum[..., :2])
    with raises_status(gradops.ACLNN_ERR_INNER_TILING_ERROR, "dy", "q.shape"):
        gradops.floyd3_attention_grad(out[:, :1], *inputs, out, smax, ssum)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "backend"):
        gradops.floyd3_attention(*inputs, backend="cuda")


# ---------------------------------------------------------------------------------------------
# The functional and FloydNet's signature
# ---------------------------------------------------------------------------------------------
def leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def floydnet_order(inputs):
    """gradops' (q, k1, v1, k2, v2, k3, v3) -> FloydNet's (q, k_pjk, k_ipk, k_ijp, v_pjk, v_ipk, v_ijp)."""
    q, k1, v1, k2, v2, k3, v3 = inputs
    return [q, k1, k2, k3, v1, v2, v3]


def value_and_grads(fn, tensors, dy, **kwargs):
    tensors = leaves(tensors)
    y = fn(*tensors, **kwargs)
    return [y] + list(torch.autograd.grad(y, tensors, dy))


def floydnet_float64(tensors, dy, **kwargs):
    floydnet = pytest.importorskip("floydnet")
    kwargs = {key: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for key, v in kwargs.items()}
    return value_and_grads(floydnet.pivotal_attention3, [t.double() for t in tensors], dy.double(), **kwargs)


MASKS = {
    "none": lambda b, h, i, j, k, p: None,
    "bool-fused": lambda b, h, i, j, k, p: make_mask(b, i, j, k, p),
    "bool-per-head": lambda b, h, i, j, k, p: make_mask(b, i, j, k, p, shape=(b, h, i, 1, k, p)),
    "additive": lambda b, h, i, j, k, p: torch.randn((1, h, i, j, 1, p), device="cpu").to(TEST_DEVICE),
}


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("options", [{}, {"softmax_cap": 1.5}, {"scale": 0.7}], ids=["default", "cap", "scale"])
def test_pivotal_attention3_matches_floydnet(backend, size, mask_kind, options):
    b, h, i, j, k, p, d = size
    tensors = floydnet_order(make_inputs(*size))
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    mask = MASKS[mask_kind](b, h, i, j, k, p)
    # a fully masked row of a boolean mask: FloydNet's -1e9 and the operator's exclusion agree
    ours = value_and_grads(gradops.pivotal_attention3, tensors, dy, attn_mask=mask, **options)
    theirs = floydnet_float64(tensors, dy, attn_mask=mask, **options)
    for name, a, e in zip(("y",) + GRADS, ours, theirs):
        assert a.dtype == torch.float32
        assert rel_error(a, e) <= TOLERANCE[torch.float32], (name, rel_error(a, e))


def test_pivotal_attention3_dropout_draws_as_floydnet(backend, size):
    """One tile covers the call, so the chunked path draws its dropout mask over FloydNet's
    whole weight tensor: the same seed gives FloydNet's result."""
    b, h, i, j, k, p, d = size
    tensors = floydnet_order(make_inputs(*size))
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    torch.manual_seed(5)
    ours = value_and_grads(gradops.pivotal_attention3, tensors, dy, dropout=0.25)
    floydnet = pytest.importorskip("floydnet")
    torch.manual_seed(5)
    theirs = value_and_grads(floydnet.pivotal_attention3, tensors, dy, dropout=0.25)
    for name, a, e in zip(("y",) + GRADS, ours, theirs):
        assert rel_error(a, e) <= TOLERANCE[torch.float32], name


def test_pivotal_attention3_tiles_give_one_result(backend, size, monkeypatch):
    """The chunked path in many tiles (each checkpointed) against FloydNet."""
    from gradops.nn import pivotal3

    b, h, i, j, k, p, d = size
    monkeypatch.setattr(pivotal3, "TILE_ELEMENTS", b * h * k * p * 2)  # two (i, j) pairs a tile
    tensors = floydnet_order(make_inputs(*size))
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    mask = MASKS["additive"](b, h, i, j, k, p)
    ours = value_and_grads(gradops.pivotal_attention3, tensors, dy, attn_mask=mask)
    theirs = floydnet_float64(tensors, dy, attn_mask=mask)
    for name, a, e in zip(("y",) + GRADS, ours, theirs):
        assert rel_error(a, e) <= TOLERANCE[torch.float32], name


def test_fused_path_takes_the_operator(backend, size, monkeypatch):
    """No dropout, no cap, a boolean mask constant over heads: one operator call forward and one
    backward, and no chunked tile."""
    from gradops.nn import pivotal3
    from gradops.ops import floyd3_attention as ops

    calls = []
    for name in ("prepare_floyd3_attention", "prepare_floyd3_attention_grad"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(pivotal3, "_tile", lambda *a: pytest.fail("the chunked path ran"))
    b, h, i, j, k, p, d = size
    tensors = floydnet_order(make_inputs(*size))
    y = gradops.pivotal_attention3(*leaves(tensors), attn_mask=make_mask(b, i, j, k, p))
    y.sum().backward()
    assert calls == ["prepare_floyd3_attention", "prepare_floyd3_attention_grad"]


def test_pivotal_attention3_float64_gradcheck():
    """Finite differences (the reference backend, float64), both paths."""
    tensors = leaves(floydnet_order(make_inputs(1, 1, 2, 3, 2, 3, 2, dtype=torch.float64)))
    mask = make_mask(1, 2, 3, 2, 3)
    assert torch.autograd.gradcheck(lambda *t: gradops.pivotal_attention3(*t, attn_mask=mask), tensors)
    assert torch.autograd.gradcheck(lambda *t: gradops.pivotal_attention3(*t, softmax_cap=2.0), tensors)


def test_pivotal_attention3_errors():
    b, h, i, j, k, p, d = SHAPE
    tensors = floydnet_order(make_inputs(*SHAPE))
    with raises_status(gradops.ACLNN_ERR_PARAM_NULLPTR, "k_ijp"):
        gradops.pivotal_attention3(*tensors[:3], None, *tensors[4:])
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "v_ipk", "(B, H, L_i, L_p, L_k, D)"):
        gradops.pivotal_attention3(*tensors[:5], tensors[6], tensors[6])
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "attn_mask", "(B, H, L_i, L_j, L_k, L_p)"):
        gradops.pivotal_attention3(*tensors, attn_mask=torch.zeros(7, dtype=torch.bool, device=TEST_DEVICE))
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "dropout"):
        gradops.pivotal_attention3(*tensors, dropout=1.5)
    with raises_status(gradops.ACLNN_ERR_PARAM_INVALID, "q_ijk", "6 dims"):
        gradops.pivotal_attention3(tensors[0][0], *tensors[1:])


def test_functional_matches_operator_and_refuses_double_backward(backend, size):
    b, h, i, j, k, p, d = size
    inputs = make_inputs(*size)
    mask = make_mask(b, i, j, k, p)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    (out, _, _), grads = run_operator(inputs, mask, 0.3, dy)
    ours = value_and_grads(gradops.nn.functional.floyd3_attention, inputs, dy, mask=mask, scale=0.3)
    for a, e in zip(ours, (out,) + tuple(grads)):
        assert torch.equal(a, e)
    tensors = leaves(inputs)
    y = gradops.nn.functional.floyd3_attention(*tensors, mask=mask, scale=0.3)
    (dq,) = torch.autograd.grad(y, tensors[0], dy, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()


def test_autocast_computes_in_the_autocast_dtype(backend, size):
    b, h, i, j, k, p, d = size
    tensors = floydnet_order(make_inputs(*size))
    for kwargs in ({}, {"softmax_cap": 2.0}):  # the fused path, then the chunked one
        with autocast(torch.bfloat16):
            y = gradops.pivotal_attention3(*tensors, **kwargs)
        assert y.dtype == torch.bfloat16
        expected = gradops.pivotal_attention3(*(t.to(torch.bfloat16) for t in tensors), **kwargs)
        assert torch.equal(y, expected)


def test_compiles_fullgraph_as_the_custom_ops(backend, size):
    b, h, i, j, k, p, d = size
    tensors = floydnet_order(make_inputs(*size))
    mask = make_mask(b, i, j, k, p)
    dy = make_inputs(b, h, i, j, k, 1, d, seed=2)[0]
    graphs = []
    compiled = torch.compile(gradops.pivotal_attention3, fullgraph=True, backend=recording_backend(graphs))
    ours = value_and_grads(compiled, tensors, dy, attn_mask=mask)
    eager = value_and_grads(gradops.pivotal_attention3, tensors, dy, attn_mask=mask)
    for a, e in zip(ours, eager):
        assert torch.equal(a, e)
    forward, backward = graphs
    assert gradops_ops_in(forward) == {"floyd3_attention"}
    assert gradops_ops_in(backward) == {"floyd3_attention_backward"}


def test_a_brec_style_3_floyd_block_matches_floydnet(backend):
    """As FloydNet's BREC model calls it (``example/BREC/model.py``, ``FloydBlock3``): q and the six
    keys and values are chunks of one projection of the triple representation, rearranged
    into heads (non-contiguous views), a scale of ``head_dim**-0.5 * sf``, no mask; run under
    no_grad (BREC's forward) and with the projection's gradient."""
    floydnet = pytest.importorskip("floydnet")
    b, n, heads, head_dim, sf = 1, 5, 2, 8, 4.0
    width = heads * head_dim
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(b, n, n, n, width, generator=gen, device="cpu").to(TEST_DEVICE)
    weight = (torch.randn(7 * width, width, generator=gen, device="cpu") * width ** -0.5).to(TEST_DEVICE)

    def block(attention, x, weight):
        parts = torch.nn.functional.linear(x, weight).chunk(7, dim=-1)
        q, k1, k2, k3, v1, v2, v3 = (t.unflatten(-1, (heads, head_dim)).permute(0, 4, 1, 2, 3, 5) for t in parts)
        y = attention(q, k1, k2, k3, v1, v2, v3, scale=head_dim ** -0.5 * sf)
        return y.permute(0, 2, 3, 4, 1, 5).flatten(-2)

    with torch.no_grad():
        ours = block(gradops.pivotal_attention3, x, weight)
        theirs = block(floydnet.pivotal_attention3, x.double(), weight.double())
    assert rel_error(ours, theirs) <= TOLERANCE[torch.float32]
    w = weight.clone().requires_grad_()
    (dw,) = torch.autograd.grad(block(gradops.pivotal_attention3, x, w).square().sum(), w)
    w64 = weight.double().requires_grad_()
    (dw64,) = torch.autograd.grad(block(floydnet.pivotal_attention3, x.double(), w64).square().sum(), w64)
    assert rel_error(dw, dw64) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("sizes", [(1, 1, 0, 2, 2, 3, 2), (1, 1, 2, 0, 2, 3, 2)], ids=["I=0", "J=0"])
@pytest.mark.parametrize("options", [{}, {"softmax_cap": 1.0}], ids=["fused", "chunked"])
def test_pivotal_attention3_empty_grids(backend, sizes, options):
    tensors = floydnet_order(make_inputs(*sizes))
    y = gradops.pivotal_attention3(*leaves(tensors), **options)
    assert y.shape == tensors[0].shape and y.numel() == 0


def test_infinite_inf_takes_floydnets_nan_rows(backend):
    """inf = float("inf"): FloydNet's fully masked row is a softmax of -inf scores, NaN; the
    operator's would be uniform, so such a call takes the chunked path, FloydNet's formula."""
    b, h, i, j, k, p, d = SHAPE
    tensors = floydnet_order(make_inputs(*SHAPE))
    mask = make_mask(b, i, j, k, p)  # rows (0, *, 0) fully masked
    ours = gradops.pivotal_attention3(*tensors, attn_mask=mask, inf=float("inf"))
    theirs = floydnet_float64(tensors, torch.ones_like(tensors[0]).double(), attn_mask=mask, inf=float("inf"))[0]
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs)) and torch.isnan(ours[:, :, 0, :, 0]).all()
    assert rel_error(ours, theirs) <= TOLERANCE[torch.float32]


def test_torch_func_grad_matches_autograd_and_jvp_is_refused():
    """torch.func.grad runs the operator's backward; forward mode has no rule and says so (the
    bare custom op would give a silent zero tangent)."""
    from torch.func import grad, jvp

    tensors = floydnet_order(make_inputs(1, 1, 2, 3, 2, 3, 4, dtype=torch.float64))
    q = tensors[0].clone().requires_grad_()
    gradops.pivotal_attention3(q, *tensors[1:]).square().sum().backward()
    by_func = grad(lambda x: gradops.pivotal_attention3(x, *tensors[1:]).square().sum())(tensors[0])
    assert torch.equal(by_func, q.grad)
    with pytest.raises(NotImplementedError, match="jvp"):
        jvp(lambda x: gradops.pivotal_attention3(x, *tensors[1:]), (tensors[0],), (torch.ones_like(tensors[0]),))
