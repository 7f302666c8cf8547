"""The Python API's contract on hostile and edge-case arguments (issue 13), on both backends:
every bad argument is an AclnnError naming the parameter (a wrong Python type also a
TypeError), nothing is written by a call that fails, empty dims compute what torch does,
a constant LayerNorm row is centred exactly, and layer_norm_backward takes the statistics
torch.native_layer_norm returns. Oracles are torch itself or float64 formulas written here,
never gradops' own output."""
import pytest
import torch

import gradops
from gradops.errors import (
    ACLNN_ERR_INNER_TILING_ERROR as TILING,
    ACLNN_ERR_PARAM_INVALID as INVALID,
    ACLNN_ERR_PARAM_NULLPTR as NULLPTR,
    AclnnTypeError,
)
from gradops.kernels import norm_config

from helpers import DTYPES, assert_close, rand, raises_status

FLT_MAX = 3.4028234663852886e38


# ------------------------------------------------------------------------------- valid calls
def _ln_stats(x, n):
    """mean/rstd of x over its last n dims in float64 (keepdim), from the definition."""
    xf = x.double().flatten(x.dim() - n)
    mean = xf.mean(-1)
    var = (xf - mean[..., None]).square().mean(-1)
    shape = tuple(x.shape[: x.dim() - n]) + (1,) * n
    return mean.reshape(shape), (var + 1e-5).rsqrt().reshape(shape)


def valid_calls():
    """op -> (function, kwargs) of a call that succeeds (small float32 tensors)."""
    x, dy, w, b = rand((2, 3, 8)), rand((2, 3, 8)), rand((8,)), rand((8,))
    mean, rstd = (t.float() for t in _ln_stats(x, 1))
    var, mu = x.double().var(-1, unbiased=False).float(), x.mean(-1)
    rms_rstd = (x.double().square().mean(-1, keepdim=True) + 1e-6).rsqrt().float()
    nx, nw = rand((10, 2, 4)), rand((4, 2))
    q, k1, v1 = rand((1, 1, 2, 3, 4)), rand((1, 1, 2, 5, 4)), rand((1, 1, 2, 5, 4))
    k2, v2 = rand((1, 1, 5, 3, 4)), rand((1, 1, 5, 3, 4))
    mask = torch.zeros((1, 1, 2, 1, 5), dtype=torch.bool)
    stats = torch.zeros((1, 1, 2, 3)), torch.ones((1, 1, 2, 3))
    return {
        "layer_norm": (gradops.layer_norm, dict(x=x, normalized_shape=(8,), weight=w, bias=b, eps=1e-5)),
        "layer_norm_backward": (gradops.layer_norm_backward,
                                dict(dy=dy, x=x, normalized_shape=(8,), mean=mean, rstd=rstd, weight=w, bias=b,
                                     output_mask=(True, True, True), in_place=False)),
        "layer_norm_grad": (gradops.layer_norm_grad,
                            dict(dy=dy, x=x.clone(), variance=var, mean=mu, gamma=w, eps=1e-5, reuse_source=False)),
        "layer_norm_grad_beta": (gradops.layer_norm_grad_beta,
                                 dict(res_for_gamma=x.clone(), dy=dy, reuse_source=False)),
        "rms_norm": (gradops.rms_norm, dict(x=x, gamma=w, eps=1e-6)),
        "rms_norm_grad": (gradops.rms_norm_grad, dict(dy=dy, x=x, rstd=rms_rstd, gamma=w, in_place=False)),
        "nsa_compress": (gradops.nsa_compress,
                         dict(x=nx, weight=nw, block_size=4, stride=2, seq_lens=[4, 10], seq_lens_type="cumsum")),
        "nsa_compress_grad": (gradops.nsa_compress_grad,
                              dict(dout=rand((3, 2, 4)), x=nx, weight=nw, block_size=4, stride=2, seq_lens=[4, 10],
                                   seq_lens_type="cumsum")),
        "floyd_attention": (gradops.floyd_attention,
                            dict(q=q, k1=k1, v1=v1, k2=k2, v2=v2, mask=mask, scale=0.5)),
        "floyd_attention_grad": (gradops.floyd_attention_grad,
                                 dict(dy=rand(q.shape), q=q, k1=k1, v1=v1, k2=k2, v2=v2, out=rand(q.shape),
                                      softmax_max=stats[0], softmax_sum=stats[1], mask=mask, scale=0.5)),
    }


OPTIONAL = {"weight", "bias", "mask"}  # None is a valid value of these


def _snapshot(kwargs):
    return {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.layout == torch.strided
            and v.device.type != "meta"}


def _assert_unchanged(kwargs, before):
    for k, v in before.items():
        assert torch.equal(kwargs[k], v), f"{k} was written by a call that failed"


def _call_fails(op, param, value, status, type_error, backend):
    fn, kwargs = valid_calls()[op]
    fn(**kwargs)  # the valid call works
    kwargs = dict(kwargs, **{param: value})
    before = _snapshot(kwargs)
    with raises_status(status, param) as info:
        fn(**kwargs)
    assert isinstance(info.value, TypeError) == type_error, f"{op}({param}={value!r}): {info.value!r}"
    _assert_unchanged(kwargs, before)


def test_valid_calls_run(backend):
    for op, (fn, kwargs) in valid_calls().items():
        fn(**kwargs)


# ----------------------------------------------------------------------- None is 161001
def _none_cases():
    for op, (_, kwargs) in valid_calls().items():
        for param in kwargs:
            if param not in OPTIONAL:
                yield op, param


@pytest.mark.parametrize("op,param", list(_none_cases()))
def test_none_is_nullptr_everywhere(backend, op, param):
    _call_fails(op, param, None, NULLPTR, False, backend)


# ------------------------------------------------------- hostile values of every argument
def _tensor_hostiles(t):
    """(label, value, status or None for any AclnnError status, is a TypeError)."""
    out = [("list", t.tolist(), INVALID, True), ("string", "tensor", INVALID, True),
           ("numpy", t.cpu().numpy(), INVALID, True), ("bool", True, INVALID, True),
           ("complex", t.to(torch.complex64), INVALID, False)]
    if t.dim() >= 1 and t.numel() > 1:
        out.append(("sparse", t.to_sparse(), INVALID, False))
        out.append(("zero_dim", t.reshape(-1)[0].clone(), None, False))
    if t.dtype.is_floating_point:
        out.append(("int", t.to(torch.int32), INVALID, False))
    return out


def hostile_attrs():
    """attribute -> [(label, value, status or None, is a TypeError)]; made when called (in the
    test: its tensors on the test device; a tensor made at collection is on the CPU)."""
    return {
        "normalized_shape": [("meta tensor", torch.tensor([8], device="meta"), INVALID, False),
                             ("sparse tensor", torch.tensor([8, 0]).to_sparse(), INVALID, False),
                             ("float tensor", torch.tensor([8.0]), INVALID, False),
                             ("string", "8", INVALID, True), ("float", 8.0, INVALID, True),
                             ("floats", [8.0], INVALID, True), ("bools", [True], INVALID, True),
                             ("huge", [2**70], INVALID, False), ("negative", [-8], INVALID, False),
                             ("dict", {8: 8}, INVALID, True)],
        "seq_lens": [("meta tensor", torch.tensor([4, 10], device="meta"), INVALID, False),
                     ("sparse tensor", torch.tensor([4, 10]).to_sparse(), INVALID, False),
                     ("float tensor", torch.tensor([4.0, 10.0]), INVALID, False),
                     ("string", "4,10", INVALID, True), ("int", 10, INVALID, True),
                     ("floats", [4.0, 10.0], INVALID, True), ("huge", [4, 2**70], INVALID, False),
                     ("negative", [-4, 10], INVALID, False), ("nested", [[4, 10]], INVALID, True)],
        "seq_lens_type": [("list", [0], INVALID, True), ("dict", {}, INVALID, True), ("bool", True, INVALID, True),
                          ("float", 0.0, INVALID, True), ("other int", 2, INVALID, False),
                          ("other string", "lens", INVALID, False)],
        "block_size": [("meta tensor", torch.tensor(4, device="meta"), INVALID, True),
                       ("sparse tensor", torch.tensor([4]).to_sparse(), INVALID, True),
                       ("float tensor", torch.tensor(4.0), INVALID, True),
                       ("huge", 10**30, INVALID, False), ("zero", 0, INVALID, False), ("negative", -4, INVALID, False),
                       ("bool", True, INVALID, True), ("float", 4.0, INVALID, True), ("string", "4", INVALID, True)],
        "stride": [("huge", 10**30, INVALID, False), ("int64 max + 1", 2**63, INVALID, False),
                   ("meta tensor", torch.tensor(2, device="meta"), INVALID, True), ("zero", 0, INVALID, False),
                   ("string", "2", INVALID, True), ("list", [2], INVALID, True)],
        "eps": [("huge", 10**400, INVALID, False), ("string", "1e-5", INVALID, True), ("bool", True, INVALID, True),
                ("list", [1e-5], INVALID, True), ("tensor", torch.tensor(1e-5), INVALID, True)],
        "scale": [("huge", -(10**400), INVALID, False), ("string", "0.5", INVALID, True),
                  ("complex", 0.5j, INVALID, True)],
        "in_place": [("string", "yes", INVALID, True), ("int", 1, INVALID, True)],
        "reuse_source": [("string", "yes", INVALID, True), ("int", 1, INVALID, True)],
        "output_mask": [("string", "abc", INVALID, True), ("int", 7, INVALID, True), ("short", (True,), INVALID, False),
                        ("strings", ("a", "b", "c"), INVALID, True), ("tensor", torch.ones(3, dtype=torch.bool),
                                                                      INVALID, True)],
    }


def _hostiles(param, value):
    return _tensor_hostiles(value) if isinstance(value, torch.Tensor) else hostile_attrs()[param]


def _hostile_cases():
    for op, (_, kwargs) in valid_calls().items():
        for param, value in kwargs.items():
            for label, *_ in _hostiles(param, value):
                yield pytest.param(op, param, label, id=f"{op}-{param}-{label}")


@pytest.mark.parametrize("op,param,label", list(_hostile_cases()))
def test_hostile_arguments_are_aclnn_errors_naming_the_parameter(backend, op, param, label):
    fn, kwargs = valid_calls()[op]
    value, status, type_error = next(case[1:] for case in _hostiles(param, kwargs[param]) if case[0] == label)
    kwargs = dict(kwargs, **{param: value})
    before = _snapshot(kwargs)
    with pytest.raises(gradops.AclnnError) as info:
        fn(**kwargs)
    err = info.value
    assert param in str(err), f"{param} not named: {err}"
    if status is not None:
        assert err.status == status, f"status {err.status} != {status}: {err}"
    else:
        assert err.status in (INVALID, TILING), str(err)
    assert isinstance(err, TypeError) == type_error, repr(err)
    _assert_unchanged(kwargs, before)


def test_huge_numbers_are_named_briefly(backend):
    with raises_status(INVALID, "eps", "float64's range") as info:
        gradops.layer_norm(rand((2, 8)), (8,), eps=10**400)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "nsa_compress", "floyd_attention"])
def test_meta_tensors_beside_cpu_tensors_are_refused(backend, op):
    fn, kwargs = valid_calls()[op]
    first = next(iter(kwargs))
    second = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)][1]
    with raises_status(INVALID, second) as info:
        fn(**dict(kwargs, **{second: kwargs[second].to("meta")}))
    assert "meta" in str(info.value) and first in str(info.value)


# ------------------------------------------------------ tensors a call overwrites
def _expanded(rows, cols):
    base = rand((1, cols))
    return base, base.expand(rows, cols)  # stride 0 along the rows


def _overwrite_cases():
    rows, cols = 3, 8
    x, w = rand((rows, cols)), rand((cols,))
    mean, rstd = torch.zeros(rows, 1), torch.ones(rows, 1)
    var, mu = torch.ones(rows), torch.zeros(rows)

    def ln_backward(dy):
        return gradops.layer_norm_backward, dict(dy=dy, x=x, normalized_shape=(cols,), mean=mean, rstd=rstd,
                                                 weight=w, in_place=True)

    def rms_grad(dy):
        return gradops.rms_norm_grad, dict(dy=dy, x=x, rstd=rstd, gamma=w, in_place=True)

    def ln_grad_dy(dy):
        return gradops.layer_norm_grad, dict(dy=dy, x=x.clone(), variance=var, mean=mu, gamma=w, eps=1e-5,
                                             reuse_source=True)

    def ln_grad_x(x_):
        return gradops.layer_norm_grad, dict(dy=rand((rows, cols)), x=x_, variance=var, mean=mu, gamma=w, eps=1e-5,
                                             reuse_source=True)

    def ln_grad_beta(res):
        return gradops.layer_norm_grad_beta, dict(res_for_gamma=res, dy=rand((rows, cols)), reuse_source=True)

    return [("layer_norm_backward", "dy", ln_backward), ("rms_norm_grad", "dy", rms_grad),
            ("layer_norm_grad", "dy", ln_grad_dy), ("layer_norm_grad", "x", ln_grad_x),
            ("layer_norm_grad_beta", "res_for_gamma", ln_grad_beta)]


@pytest.mark.parametrize("case", range(5))
def test_an_overwritten_stride0_view_is_refused_before_anything_is_written(backend, case):
    op, param, build = _overwrite_cases()[case]
    base, view = _expanded(3, 8)
    fn, kwargs = build(view)
    before = _snapshot(kwargs)
    base_before = base.clone()
    with raises_status(INVALID, param, "share memory"):
        fn(**kwargs)
    _assert_unchanged(kwargs, before)
    assert torch.equal(base, base_before)
    # the same call with a tensor of its own runs
    fn(**dict(kwargs, **{param: view.clone()}))


@pytest.mark.parametrize("case", range(5))
def test_an_overwritten_tensor_may_not_alias_another_input(backend, case):
    op, param, build = _overwrite_cases()[case]
    fn, kwargs = build(rand((3, 8)))
    other = "dy" if param in ("x", "res_for_gamma") else "x"
    alias = kwargs[other]
    kwargs = dict(kwargs, **{param: alias})  # the same memory as the input it would overwrite
    before = _snapshot(kwargs)
    with raises_status(INVALID, param, other, "share"):
        fn(**kwargs)
    _assert_unchanged(kwargs, before)


def test_in_place_into_a_tensor_that_requires_grad_is_allowed(backend):
    x, dy = rand((3, 8)), rand((3, 8)).requires_grad_()
    mean, rstd = (t.float() for t in _ln_stats(x, 1))
    expected = torch.ops.aten.native_layer_norm_backward(dy.detach(), x, (8,), mean, rstd, None, None,
                                                         (True, False, False))[0]
    dx, _, _ = gradops.layer_norm_backward(dy, x, (8,), mean, rstd, in_place=True)
    assert dx is dy
    assert_close(dx.detach(), expected, torch.float32)


# ---------------------------------------------------------------------------- empty dims
def test_layer_norm_with_empty_rows_computes_what_torch_does(backend):
    for w in (None, torch.ones(0)):
        x = rand((3, 0))
        y, mean, rstd = gradops.layer_norm(x, (0,), w, w)
        ty, tmean, trstd = torch.native_layer_norm(x, (0,), w, w, 1e-5)
        assert y.shape == ty.shape == (3, 0)
        torch.testing.assert_close(mean, tmean, equal_nan=True)  # 0, not nan
        assert torch.equal(mean, torch.zeros(3, 1))
        torch.testing.assert_close(rstd, trstd, equal_nan=True)
    dy = rand((3, 0))
    dx, dw, db = gradops.layer_norm_backward(dy, x, (0,), mean, rstd, torch.ones(0), None)
    tdx, tdw, tdb = torch.ops.aten.native_layer_norm_backward(dy, x, (0,), tmean, trstd, torch.ones(0), torch.ones(0),
                                                              (True, True, True))
    for a, e in ((dx, tdx), (dw, tdw), (db, tdb)):
        assert a.shape == e.shape
    # empty leading dims: dw and db are zeros over the normalised width
    x = rand((0, 5))
    _, dw, db = gradops.layer_norm_backward(x, x, (5,), torch.zeros(0, 1), torch.ones(0, 1), torch.ones(5))
    assert torch.equal(dw, torch.zeros(5)) and torch.equal(db, torch.zeros(5))


def test_layer_norm_grad_with_h_0_is_empty_not_a_division_by_zero(backend):
    for shape in ((3, 0), (2, 4, 0)):
        lead = shape[:-1]
        x, dy = rand(shape), rand(shape)
        pd_x, res = gradops.layer_norm_grad(dy, x, torch.ones(lead), torch.zeros(lead), torch.ones(0), 1e-5)
        assert pd_x.shape == res.shape == shape
        pd_gamma, pd_beta = gradops.layer_norm_grad_beta(res, dy)
        assert pd_gamma.shape == pd_beta.shape == (0,)
    # empty leading dims, H > 0: zero sums
    dy = rand((0, 6))
    pd_gamma, pd_beta = gradops.layer_norm_grad_beta(dy, dy)
    assert torch.equal(pd_gamma, torch.zeros(6)) and torch.equal(pd_beta, torch.zeros(6))


def test_rms_norm_with_empty_rows_computes_what_torch_does(backend):
    x = rand((3, 0))
    y, rstd = gradops.rms_norm(x, torch.ones(0))
    assert torch.equal(y, torch.nn.functional.rms_norm(x, (0,), torch.ones(0), 1e-6))
    assert rstd.shape == (3, 1)
    dx, dgamma = gradops.rms_norm_grad(rand((3, 0)), x, torch.ones(3, 1), torch.ones(0))
    assert dx.shape == (3, 0) and dgamma.shape == (0,)


def _floyd_float64(q, k1, v1, k2, v2, mask, scale):
    """Floyd attention from its definition, in float64: (out, max, sum)."""
    q, k1, v1, k2, v2 = (t.double() for t in (q, k1, v1, k2, v2))
    s = scale * (torch.einsum("bhnmd,bhnkd->bhnmk", q, k1) + torch.einsum("bhnmd,bhkmd->bhnmk", q, k2))
    if mask is not None:
        s = s.masked_fill(mask.bool().reshape(mask.shape[0], 1, mask.shape[2], 1, mask.shape[4]), -FLT_MAX)
    mx = s.amax(-1)
    p = torch.exp(s - mx[..., None])
    l = p.sum(-1)
    p = p / l[..., None]
    out = torch.einsum("bhnmk,bhnkd->bhnmd", p, v1) + torch.einsum("bhnmk,bhkmd->bhnmd", p, v2)
    return out, mx, l


@pytest.mark.parametrize("with_mask", [False, True])
def test_floyd_attention_with_head_dim_0(backend, with_mask):
    b, h, n, m, k = 1, 2, 3, 4, 5
    q, k1, v1 = rand((b, h, n, m, 0)), rand((b, h, n, k, 0)), rand((b, h, n, k, 0))
    k2, v2 = rand((b, h, k, m, 0)), rand((b, h, k, m, 0))
    mask = None
    if with_mask:
        mask = torch.zeros((b, 1, n, 1, k), dtype=torch.bool)
        mask[0, 0, 0, 0, :2] = True  # two pivots removed in row 0
        mask[0, 0, 1] = True  # row 1 fully masked
    out, smax, ssum = gradops.floyd_attention(q, k1, v1, k2, v2, mask, scale=0.7)
    eout, emax, esum = _floyd_float64(q, k1, v1, k2, v2, mask, 0.7)
    assert out.shape == eout.shape == (b, h, n, m, 0)
    # every score is 0 (masked ones -FLT_MAX): max 0, sum = live pivots (K in a fully masked row)
    assert torch.equal(smax.double(), emax) and torch.equal(ssum.double(), esum)
    assert not smax.isnan().any() and not ssum.isnan().any()
    grads = gradops.floyd_attention_grad(rand(q.shape), q, k1, v1, k2, v2, out, smax, ssum, mask, scale=0.7)
    for g, t in zip(grads, (q, k1, v1, k2, v2)):
        assert g.shape == t.shape and g.dtype == t.dtype


# ---------------------------------------------------------------- a constant LayerNorm row
def test_the_issue_example_centres_to_zero(backend):
    x = torch.full((2, 768), 0.1)
    y, mean, rstd = gradops.layer_norm(x, (768,), eps=1e-12)
    ty, tmean, trstd = torch.native_layer_norm(x, (768,), None, None, 1e-12)
    assert torch.equal(y, torch.zeros(2, 768)) and torch.equal(y, ty)
    assert torch.equal(mean, torch.full((2, 1), 0.1))
    assert torch.equal(rstd, trstd)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows_give_zero_variance_on_both_paths(backend, dtype, split, monkeypatch):
    if split:  # rows wider than the fused kernel takes: the split-row kernels
        monkeypatch.setattr(norm_config, "MAX_FUSED_N_OVERRIDE", 64)
    n = 300 if split else 200
    values = torch.tensor([0.1, -3.7, 1234.5678, 1e-3, 7.0, -0.3], dtype=torch.float64).to(dtype)
    x = values[:, None].expand(6, n).contiguous()
    w, b = rand((n,), dtype), rand((n,), dtype)
    for eps in (1e-12, 1e-5):
        y, mean, rstd = gradops.layer_norm(x, (n,), w, b, eps=eps)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        assert torch.equal(mean.reshape(-1), values.to(acc)), "a constant row's mean is its value"
        # variance 0: rstd = 1/sqrt(eps), the exact value (torch's CUDA kernel gives these rows
        # a variance: it cannot be the oracle on a GPU)
        assert_close(rstd, torch.full(rstd.shape, eps ** -0.5, dtype=torch.float64), acc, what="rstd")
        # y = 0 * w + b: the bias exactly
        assert torch.equal(y, b.expand(6, n)), (y - b).abs().max()
        # as torch's CPU kernel (its half kernels miss some rows; its CUDA kernel misses these)
        if x.device.type == "cpu" and dtype in (torch.float32, torch.float64):
            ty, _, _ = torch.native_layer_norm(x, (n,), w, b, eps)
            assert torch.equal(y, ty)


@pytest.mark.parametrize("split", [False, True])
def test_layer_norm_keeps_its_precision_on_rows_with_a_large_mean(backend, split, monkeypatch):
    if split:
        monkeypatch.setattr(norm_config, "MAX_FUSED_N_OVERRIDE", 64)
    n = 200
    x64 = 300.0 + torch.randn(5, n, dtype=torch.float64)
    x64[1] = 0.5  # a constant row among them
    x64[2, ::2] += 1e-3  # nearly constant
    x = x64.float()
    y, mean, rstd = gradops.layer_norm(x, (n,))
    emean, erstd = _ln_stats(x, 1)  # float64, of the float32 inputs
    ey = (x.double() - emean) * erstd
    ty, tmean, trstd = torch.native_layer_norm(x, (n,), None, None, 1e-5)  # torch in float32

    def errors(y_, mean_, rstd_):
        return ((y_.double() - ey).abs().max(), (mean_.double() - emean).abs().max(),
                ((rstd_.double() - erstd) / erstd).abs().max())

    for what, ours, torchs in zip(("y", "mean", "rstd"), errors(y, mean, rstd), errors(ty, tmean, trstd)):
        assert ours <= max(2 * torchs, 1e-6), f"{what}: error {ours:.3e}, torch's {torchs:.3e}"
    assert torch.equal(y[1], torch.zeros(n))


# ------------------------------------------------- statistics layer_norm_backward takes
def _ln_backward_float64(dy, x, mean, rstd, w):
    """dx, dw, db from the formula, in float64, from the given statistics."""
    dyf, xf = dy.double(), x.double()
    mean, rstd = mean.double().reshape(-1, 1), rstd.double().reshape(-1, 1)
    xhat = (xf - mean) * rstd
    g = dyf * w.double()
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, (dyf * xhat).sum(0), dyf.sum(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_backward_takes_what_torch_native_layer_norm_returns(backend, dtype):
    x, dy, w = rand((6, 40), dtype), rand((6, 40), dtype), rand((40,), dtype)
    _, mean, rstd = torch.native_layer_norm(x, (40,), w, None, 1e-5)
    dx, dw, db = gradops.layer_norm_backward(dy, x, (40,), mean, rstd, w, None)
    edx, edw, edb = _ln_backward_float64(dy, x, mean, rstd, w)
    assert dx.dtype == dtype and dw.dtype == dtype and db.dtype == dtype
    assert_close(dx, edx, dtype, what="dx")
    assert_close(dw, edw, dtype, what="dw")
    assert_close(db, edb, dtype, what="db")


@pytest.mark.parametrize("x_dtype,stat_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.float64, torch.float32), (torch.float64, torch.float64)])
def test_statistics_in_float32_or_x_dtype_are_accepted(backend, x_dtype, stat_dtype):
    x, dy, w = rand((4, 24), x_dtype), rand((4, 24), x_dtype), rand((24,), x_dtype)
    mean, rstd = (t.to(stat_dtype) for t in _ln_stats(x, 1))
    dx, dw, db = gradops.layer_norm_backward(dy, x, (24,), mean, rstd, w, None)
    edx, edw, edb = _ln_backward_float64(dy, x, mean, rstd, w)
    for name, a, e in (("dx", dx, edx), ("dw", dw, edw), ("db", db, edb)):
        assert_close(a, e, x_dtype, what=name)


@pytest.mark.parametrize("x_dtype,stat_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                                (torch.float32, torch.float64), (torch.bfloat16, torch.float16),
                                                (torch.float16, torch.float64), (torch.float64, torch.float16)])
def test_other_statistics_dtypes_are_refused(backend, x_dtype, stat_dtype):
    x = rand((4, 24), x_dtype)
    mean, rstd = (t.to(torch.float32) for t in _ln_stats(x, 1))
    for name in ("mean", "rstd"):
        stats = dict(mean=mean, rstd=rstd)
        stats[name] = stats[name].to(stat_dtype)
        with raises_status(INVALID, name, "dtype"):
            gradops.layer_norm_backward(x, x, (24,), stats["mean"], stats["rstd"])


# ----------------------------------------------------------------------------- messages
@pytest.mark.parametrize("name,pivot_dim", [("k1", 3), ("v1", 3), ("k2", 2), ("v2", 2)])
def test_a_wrong_pivot_count_is_blamed_on_its_tensor(backend, name, pivot_dim):
    fn, kwargs = valid_calls()["floyd_attention"]
    t = kwargs[name]
    kwargs = dict(kwargs, **{name: t.narrow(pivot_dim, 0, 4)})  # K = 4 where the others have 5
    with raises_status(TILING, f"{name} has shape", "K = 4", "expected K = 5 as in") as info:
        fn(**kwargs)
    others = [o for o in ("k1", "v1", "k2", "v2") if o != name]
    assert all(o in str(info.value).split("expected")[1] for o in others)


@pytest.mark.parametrize("name,dim,letter", [("k1", 4, "D"), ("v1", 2, "N"), ("k2", 3, "M"), ("v2", 0, "B"),
                                             ("k1", 1, "H")])
def test_a_wrong_dim_of_q_names_the_tensor_and_the_dim(backend, name, dim, letter):
    for op in ("floyd_attention", "floyd_attention_grad"):
        fn, kwargs = valid_calls()[op]
        t = kwargs[name]
        bad = torch.cat([t, t], dim=dim)
        with raises_status(TILING, f"{name} has shape", f"{letter} = {t.shape[dim] * 2}",
                           f"expected {letter} = {t.shape[dim]} as in q"):
            fn(**dict(kwargs, **{name: bad}))


def test_a_wrong_dim_of_q_itself_is_blamed_on_q(backend):
    """When q alone differs from the four tensors beside it, q is named, not k1."""
    fn, kwargs = valid_calls()["floyd_attention"]
    q = kwargs["q"]
    with raises_status(TILING, "q has shape", f"D = {q.shape[4] + 1}",
                       f"expected D = {q.shape[4]} as in k1, v1, k2, v2"):
        fn(**dict(kwargs, q=torch.cat([q, q[..., :1]], dim=4)))


# ------------------------------------------------------------------ Floyd masks, float64
@pytest.mark.floyd_float64
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
def test_float64_floyd_with_a_bool_mask_matches_the_formula(backend, mask_dtype):
    b, h, n, m, k, d = 1, 2, 3, 4, 5, 8
    q, k1, v1 = (rand(s, torch.float64) for s in ((b, h, n, m, d), (b, h, n, k, d), (b, h, n, k, d)))
    k2, v2 = rand((b, h, k, m, d), torch.float64), rand((b, h, k, m, d), torch.float64)
    mask = torch.zeros((b, 1, n, 1, k), dtype=mask_dtype)
    mask[0, 0, 0, 0, 1] = 1
    mask[0, 0, 2] = 1  # a fully masked row: uniform
    out, smax, ssum = gradops.floyd_attention(q, k1, v1, k2, v2, mask, scale=0.3)
    eout, emax, esum = _floyd_float64(q, k1, v1, k2, v2, mask, 0.3)
    assert smax.dtype == ssum.dtype == torch.float64
    assert_close(out, eout, torch.float64, what="out")
    assert_close(smax, emax, torch.float64, what="softmax_max")
    assert_close(ssum, esum, torch.float64, what="softmax_sum")
    assert torch.equal(smax[0, :, 2], torch.full((h, m), -FLT_MAX, dtype=torch.float64))
    # the gradient, against autograd through the float64 formula (a masked score gets no
    # gradient there either: masked_fill's)
    leaves = [t.clone().requires_grad_() for t in (q, k1, v1, k2, v2)]
    dy = rand(q.shape, torch.float64)
    _floyd_float64(*leaves, mask, 0.3)[0].backward(dy)
    grads = gradops.floyd_attention_grad(dy, q, k1, v1, k2, v2, out, smax, ssum, mask, scale=0.3)
    for name, g, leaf in zip(("dq", "dk1", "dv1", "dk2", "dv2"), grads, leaves):
        assert g.dtype == torch.float64
        assert_close(g, leaf.grad, torch.float64, what=name)


@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.float32, torch.int64, torch.complex64])
def test_an_additive_or_integer_mask_is_refused_naming_mask(backend, mask_dtype):
    for op in ("floyd_attention", "floyd_attention_grad"):
        fn, kwargs = valid_calls()[op]
        mask = torch.zeros((1, 1, 2, 1, 5), dtype=mask_dtype)
        with raises_status(INVALID, "mask", "dtype"):
            fn(**dict(kwargs, mask=mask))


# ------------------------------------------------- found by review: huge ints, order, blame
HUGE = 10 ** 5000  # past Python's 4300-digit str() limit: a message must not print it


@pytest.mark.parametrize("op,name,value", [
    ("nsa_compress", "block_size", HUGE), ("nsa_compress", "seq_lens", [HUGE]), ("layer_norm", "eps", HUGE),
    ("layer_norm", "normalized_shape", [HUGE]), ("layer_norm", "normalized_shape", HUGE),
    ("floyd_attention", "scale", HUGE), ("nsa_compress", "seq_lens", [2 ** 63]),
], ids=["block_size", "seq_lens", "eps", "shape_list", "shape_int", "scale", "seq_lens_2**63"])
def test_integers_past_any_limit_are_refused_by_name(backend, op, name, value):
    fn, kwargs = valid_calls()[op]
    with raises_status(INVALID, name):
        fn(**dict(kwargs, **{name: value}))


@pytest.mark.parametrize("value", [{8}, (v for v in (8,)), frozenset({8})])
def test_unordered_shapes_are_a_type_error(backend, value):
    fn, kwargs = valid_calls()["layer_norm"]
    with pytest.raises(AclnnTypeError, match="normalized_shape"):
        fn(**dict(kwargs, normalized_shape=value))


def test_numpy_scalars_are_accepted_as_torch_accepts_them(backend):
    np = pytest.importorskip("numpy")
    fn, kwargs = valid_calls()["layer_norm"]
    y_np = fn(**dict(kwargs, eps=np.float32(1e-5), normalized_shape=[np.int64(8)]))[0]
    y = fn(**kwargs)[0]
    expected = torch.nn.functional.layer_norm(kwargs["x"].double(), (8,), kwargs["weight"].double(),
                                              kwargs["bias"].double(), float(np.float32(1e-5)))
    assert_close(y_np, expected, torch.float32, what="y with numpy scalars")
    assert_close(y, expected, torch.float32, what="y")


def test_the_tensor_moved_to_another_device_is_the_one_named(backend):
    fn, kwargs = valid_calls()["layer_norm"]
    device = kwargs["x"].device  # the test device (cuda:0 on a GPU)
    with raises_status(INVALID, "x is on meta", f"weight, bias ({device})"):
        fn(**dict(kwargs, x=kwargs["x"].to("meta")))
    with raises_status(INVALID, "bias is on meta", f"x, weight ({device})"):
        fn(**dict(kwargs, bias=kwargs["bias"].to("meta")))


def test_overwritten_input_overlapping_another_through_a_second_storage(backend):
    """Two storages over one buffer (``torch.from_dlpack`` of two slices, as NumPy views would
    be on the CPU) share memory as much as two views do; the buffer is on the test device."""
    buf = torch.randn(64)
    x = torch.from_dlpack(buf[:24]).view(3, 8)
    dy = torch.from_dlpack(buf[16:40]).view(3, 8)  # its first row is x's last
    assert x.untyped_storage()._cdata != dy.untyped_storage()._cdata  # two storages
    rstd = (x.double().square().mean(-1, keepdim=True) + 1e-6).rsqrt().float()
    before = buf.clone()
    with raises_status(INVALID, "dy shares memory with x"):
        gradops.rms_norm_grad(dy, x, rstd, torch.ones(8), in_place=True)
    assert torch.equal(buf, before)
