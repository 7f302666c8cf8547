"""The LayerNorm / RMSNorm Triton kernels (gradops.kernels.layer_norm, .rms_norm) against the
reference backend and independent float64 oracles (gradops.oracles: ATen and autograd).

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), at small shapes; GRADOPS_TEST_DEVICE=cuda runs the same tests compiled
on a GPU, where the widths reach past the GPU's fused-row limit.

Tolerances (gradops.oracles.TOLERANCE, relative to the largest expected magnitude): both
sides compute in float32 (float64 for float64) and differ only in summation order, then
round once to the output dtype, so an output of dtype T agrees to about one or two ulps of
T: 2e-5 for float32, 2e-3 for float16, 1.6e-2 for bfloat16. dweight/dbias/dgamma are float32 sums of exactly
the same products on both sides, so they are held to float32's tolerance even for half
inputs.
"""
import inspect
import os

import pytest
import torch

triton = pytest.importorskip("triton")

import gradops  # noqa: E402
from gradops import oracles  # noqa: E402
from gradops.kernels import _norm_common  # noqa: E402
from gradops.kernels import layer_norm as KLN  # noqa: E402
from gradops.kernels import norm_config  # noqa: E402
from gradops.kernels import rms_norm as KRN  # noqa: E402
from gradops.reference import layer_norm as RLN  # noqa: E402
from gradops.reference import rms_norm as RRN  # noqa: E402

from helpers import assert_close, rand, record_launches, run_sm90_compile  # noqa: E402

if os.environ.get("GRADOPS_TEST_DEVICE", "cpu") == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 before triton is imported",
                allow_module_level=True)

F32 = torch.float32
HALF_AND_FLOAT = [torch.float32, torch.float16, torch.bfloat16]
ALL_DTYPES = [torch.float64] + HALF_AND_FLOAT


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def wide_n(device):
    """A width past the fused-row limit, so the column-split kernels run (not a multiple of
    their column block, so the last block is partial)."""
    return norm_config.max_fused_n(torch.device(device)) + 37


@pytest.fixture
def force_split():
    """Make every width above 64 take the split-row path, so it is exercised at small widths."""
    old = norm_config.MAX_FUSED_N_OVERRIDE
    norm_config.MAX_FUSED_N_OVERRIDE = 64
    yield
    norm_config.MAX_FUSED_N_OVERRIDE = old


def assert_close_to_scale(actual, expected, dtype, scale, what):
    """|actual - expected| within the dtype's tolerance of ``scale``: for results that are a
    difference of terms of size ``scale`` (RMSNorm's dx at width 1 is rstd*g*(1 - rstd^2 x^2),
    rounding noise next to its terms), where a tolerance relative to the result is meaningless."""
    err = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    assert err <= oracles.TOLERANCE[dtype] * scale, f"{what}: error {err:.3e} vs scale {scale:.3e}"


def ln_inputs(m, n, dtype, device, weight=True, bias=True, wdtype=None):
    x = rand((m, n), dtype, device, scale=2.0) + 0.5
    dy = rand((m, n), dtype, device)
    w = rand((n,), wdtype or dtype, device) if weight else None
    b = rand((n,), wdtype or dtype, device) if bias else None
    return x, dy, w, b


def check_layer_norm(m, n, dtype, device, weight=True, bias=True, wdtype=None, eps=1e-5):
    x, dy, w, b = ln_inputs(m, n, dtype, device, weight, bias, wdtype)
    # forward: kernel vs reference vs ATen float64
    y, mean, rstd = KLN.layer_norm(x, w, b, eps)
    y_r, mean_r, rstd_r = RLN.layer_norm(x, w, b, eps)
    y_o, mean_o, rstd_o = oracles.layer_norm(x, (n,), w, b, eps)
    assert y.dtype == dtype and mean.dtype == acc_of(dtype) and rstd.dtype == acc_of(dtype)
    assert_close(y, y_r, dtype, what="y vs reference")
    assert_close(y, y_o, dtype, what="y vs ATen f64")
    assert_close(mean, mean_o.reshape(m), acc_of(dtype), what="mean vs ATen f64")
    assert_close(rstd, rstd_o.reshape(m), acc_of(dtype), what="rstd vs ATen f64")
    # backward with the kernel's own statistics
    dx, dw, db = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
    dx_r, dw_r, db_r = RLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
    dx_o, dw_o, db_o = oracles.layer_norm_backward(dy, x, (n,), w, eps)
    assert dx.dtype == dtype and dw.dtype == acc_of(dtype) and db.dtype == acc_of(dtype)
    if n == 1:
        # dx is analytically 0 at width 1: every side's result is rounding noise of terms of
        # size |dy * w * rstd|, so it is held to that scale, not to its own size
        terms = (dy.double() * (w.double() if w is not None else 1.0) * rstd.double()[:, None]).abs().max().item()
        assert_close_to_scale(dx, dx_r, dtype, terms, what="dx vs reference")
        assert_close_to_scale(dx, dx_o, dtype, terms, what="dx vs ATen f64")
    else:
        assert_close(dx, dx_r, dtype, what="dx vs reference")
        assert_close(dx, dx_o, dtype, what="dx vs ATen f64")
    assert_close(dw, dw_r, acc_of(dtype), what="dw vs reference")
    assert_close(db, db_r, acc_of(dtype), what="db vs reference")
    if m:
        # the oracle recomputes statistics in float64; ours come from float32: a half-dtype-
        # sized difference in dw for half inputs is statistics, not summation
        # (at width 1 dw is analytically 0 and ATen's is rounding noise: scale by |db|, the
        # size dw has when |xhat| ~ 1)
        scale = max(dw_o.abs().max().item(), db_o.abs().max().item())
        err = (dw.double() - dw_o).abs().max().item() / scale
        assert err <= oracles.TOLERANCE[dtype], f"dw vs ATen f64: relative error {err:.3e}"
        assert_close(db, db_o, acc_of(dtype), what="db vs ATen f64")
    return x, dy, w, mean, rstd, (dx, dw, db)


def check_rms_norm(m, n, dtype, device, wdtype=None, eps=1e-6):
    x = rand((m, n), dtype, device, scale=2.0)
    dy = rand((m, n), dtype, device)
    g = rand((n,), wdtype or dtype, device)
    y, rstd = KRN.rms_norm(x, g, eps)
    y_r, rstd_r = RRN.rms_norm(x, g, eps)
    y_o, rstd_o = oracles.rms_norm(x, g, eps)
    assert y.dtype == dtype and rstd.dtype == acc_of(dtype)
    assert_close(y, y_r, dtype, what="y vs reference")
    assert_close(y, y_o, dtype, what="y vs f64")
    assert_close(rstd, rstd_o.reshape(m), acc_of(dtype), what="rstd vs f64")
    dx, dg = KRN.rms_norm_grad(dy, x, rstd, g)
    dx_r, dg_r = RRN.rms_norm_grad(dy, x, rstd, g)
    dx_o, dg_o = oracles.rms_norm_backward(dy, x, g, eps)
    assert dx.dtype == dtype and dg.dtype == acc_of(dtype)
    terms = (dy.double() * g.double() * rstd_o.reshape(m, 1)).abs().max().item() if m else 0.0
    scale = max(dx_o.abs().max().item() if m else 0.0, terms)
    assert_close_to_scale(dx, dx_r, dtype, scale, what="dx vs reference")
    assert_close_to_scale(dx, dx_o, dtype, scale, what="dx vs autograd f64")
    assert_close(dg, dg_r, acc_of(dtype), what="dgamma vs reference")
    if m:
        assert_close(dg, dg_o, dtype, what="dgamma vs autograd f64")
    return x, dy, g, rstd, (dx, dg)


SHAPES = [(5, 1), (7, 3), (9, 127), (4, 1000)]


# ------------------------------------------------------------------ widths and dtypes
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("m,n", SHAPES)
def test_layer_norm_widths_and_dtypes(m, n, dtype, device):
    check_layer_norm(m, n, dtype, device)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("m,n", SHAPES)
def test_rms_norm_widths_and_dtypes(m, n, dtype, device):
    check_rms_norm(m, n, dtype, device)


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=str)
def test_wide_rows_past_the_fused_limit(dtype, device):
    n = wide_n(device)
    assert not norm_config.is_fused(n, torch.device(device))
    check_layer_norm(3, n, dtype, device)
    check_rms_norm(3, n, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", [(7, 65), (5, 127), (3, 1000)])
def test_split_row_path_at_small_widths(m, n, dtype, device, force_split):
    assert not norm_config.is_fused(n, torch.device(device))
    check_layer_norm(m, n, dtype, device)
    check_rms_norm(m, n, dtype, device)


def test_wide_layer_norm_forward_keeps_variance_accurate_with_a_large_mean(device, force_split):
    # Per-block mean/M2 merging: a constant offset of 1e3 must not cost float32 precision
    # the way sum(x^2) - n*mean^2 would.
    x = rand((4, 1000), F32, device) + 1000.0
    _, mean, rstd = KLN.layer_norm(x, None, None, 1e-5)
    _, mean_o, rstd_o = oracles.layer_norm(x, (1000,), None, None, 1e-5)
    assert_close(rstd, rstd_o.reshape(4), F32, what="rstd")


@pytest.fixture
def fresh_configs():
    """Configurations are cached per signature: a test that changes norm_config's constants
    starts and leaves without any decided under other constants (request it before
    monkeypatch, so that the constants are back before the caches are cleared)."""
    _norm_common.clear_caches()
    yield
    _norm_common.clear_caches()


def test_wide_layer_norm_forward_mean_is_as_accurate_as_torch(fresh_configs, device, force_split, monkeypatch):
    # 70000 columns in blocks of 2048 (the GPU's): the mean is the first block's mean plus
    # the sum of deviations from it, not 35 rounded running-mean updates, so an offset of
    # 1e3 costs about one rounding of the mean (torch's float32 mean: 3.3e-5 here; the
    # running merge gave 6.6e-4)
    monkeypatch.setattr(norm_config, "CPU_SPLIT_BLOCK_N", 2048)
    n = 70000
    x = (torch.randn((2, n), dtype=torch.float64, generator=torch.Generator().manual_seed(0), device="cpu")
         + 1000.0).to(F32)
    x = x.to(device)
    _, mean, rstd = KLN.layer_norm(x, None, None, 1e-5)
    want = x.double().mean(dim=1)
    err = (mean.double() - want).abs().max().item()
    torch_err = (x.mean(dim=1).double() - want).abs().max().item()
    assert err <= max(2 * torch_err, 6.2e-5), (err, torch_err)  # 6.1e-5: one ulp of 1000
    assert_close(rstd, 1 / (x.double().var(dim=1, unbiased=False) + 1e-5).sqrt(), F32, what="rstd")


@pytest.mark.parametrize("split", [False, True])
def test_constant_rows_of_any_magnitude_have_zero_variance(split, device, monkeypatch):
    # a constant row's mean is its value and its variance 0 (docs/operators.md), whatever its
    # size: the wide kernel's merge once squared the first block's mean (inf past 1.8e19 in
    # float32) and multiplied it by 0
    if split:
        monkeypatch.setattr(norm_config, "MAX_FUSED_N_OVERRIDE", 64)
    for dtype, big in ((F32, 3e19), (torch.float64, 1e200)):
        values = torch.tensor([big, -big, 1.0], dtype=dtype, device=device)
        x = values[:, None].expand(3, 130).contiguous()
        b = rand((130,), dtype, device)
        y, mean, rstd = KLN.layer_norm(x, None, b, 1e-5)
        assert torch.equal(mean, values)
        assert_close(rstd, torch.full((3,), 1e-5 ** -0.5, dtype=torch.float64, device=device), dtype, what="rstd")
        assert torch.equal(y, b.expand(3, 130))


# ------------------------------------------------------------------ rows and programs
@pytest.mark.parametrize("split", [False, True])
def test_one_row(split, device, request):
    if split:
        request.getfixturevalue("force_split")
    check_layer_norm(1, 300, F32, device)
    check_rms_norm(1, 300, F32, device)


@pytest.mark.parametrize("split", [False, True])
def test_zero_rows(split, device, request):
    if split:
        request.getfixturevalue("force_split")
    x = torch.empty((0, 300), device=device)
    w = rand((300,), F32, device)
    y, mean, rstd = KLN.layer_norm(x, w, w, 1e-5)
    assert y.shape == (0, 300) and mean.shape == (0,) and rstd.shape == (0,)
    dx, dw, db = KLN.layer_norm_backward(x, x, mean, rstd, w, (True, True, True))
    assert dx.shape == (0, 300)
    assert torch.equal(dw, torch.zeros(300, device=device)) and torch.equal(db, torch.zeros(300, device=device))
    y, rstd = KRN.rms_norm(x, w, 1e-6)
    assert y.shape == (0, 300) and rstd.shape == (0,)
    dx, dg = KRN.rms_norm_grad(x, x, rstd, w)
    assert dx.shape == (0, 300) and torch.equal(dg, torch.zeros(300, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_tiles_per_persistent_program_with_a_tail(dtype, device):
    # 16 columns: many rows per tile, more tiles than programs, and a partial last tile. The
    # device's programs (its SM count on a GPU) and tile rows, from the config of a call too
    # large for one wave, give the rows that make three waves and a bit.
    dev, n = torch.device(device), 16
    full = norm_config.fused_config(1 << 30, n, dev, persistent=True)
    m = 3 * full.grid * full.block_m + 7
    cfg = norm_config.fused_config(m, n, dev, persistent=True)
    assert cfg.num_tiles > 2 * cfg.grid and m % cfg.block_m
    check_layer_norm(m, n, dtype, device)
    check_rms_norm(m, n, dtype, device)


# The split path's tests ask for a shape of the device's configuration (its tile and column
# block follow its SM count): the first row count here that gives it
SPLIT_ROWS = (37, 75, 301, 1003, 3001)


def several_row_tiles_and_a_tail(m, cfg):
    # each column program walks several row tiles, the last one partial, over several column blocks
    return cfg.row_groups == 1 and cfg.row_tiles > 1 and cfg.col_blocks > 1 and m % cfg.block_m


def many_rows_and_segments(m, cfg):
    # more rows than a column program's tile, each row summed over several column segments
    return cfg.row_tiles > 2 and m % cfg.block_m and cfg.row_segments > 1


def split_rows(n, dev, wanted, config=norm_config.split_config):
    for m in SPLIT_ROWS:
        if wanted(m, config(m, n, dev, whole_columns=True)):
            return m
    raise AssertionError(f"no row count in {SPLIT_ROWS} gives {wanted.__name__} at N = {n} on {dev}")


SPLIT_WIDTHS = {"cpu": (200, 300), "cuda": (4200, 70000)}  # > 1 column block of the device's width


@pytest.mark.parametrize("sms", [108, 114, 132, 144, 170])
def test_the_split_tests_find_their_shape_at_each_sm_count(sms, monkeypatch):
    # (their first GPU run, 2026-11-28, took shapes that gave an H200 one row tile and one segment)
    monkeypatch.setattr(norm_config, "_sm_count", lambda index: sms)
    config = norm_config.split_config.__wrapped__  # not the cache: the SM count is patched
    first, second = SPLIT_WIDTHS["cuda"]
    split_rows(first, torch.device("cuda", 0), several_row_tiles_and_a_tail, config)
    split_rows(second, torch.device("cuda", 0), many_rows_and_segments, config)


def test_split_path_with_several_row_tiles_and_a_tail(device, force_split):
    dev = torch.device(device)
    n = SPLIT_WIDTHS[dev.type][0]
    m = split_rows(n, dev, several_row_tiles_and_a_tail)
    check_layer_norm(m, n, F32, device)
    check_rms_norm(m, n, F32, device)


def test_split_backward_over_many_rows_and_segments(device, force_split):
    # every output combination; the segments' sums added in a fixed order by the column-tiled kernel
    dev = torch.device(device)
    n = SPLIT_WIDTHS[dev.type][1]
    m = split_rows(n, dev, many_rows_and_segments)
    check_layer_norm(m, n, torch.bfloat16, device)
    check_rms_norm(m, n, torch.bfloat16, device)
    x, dy, w, _ = ln_inputs(m, n, F32, device)
    _, mean, rstd = KLN.layer_norm(x, w, None, 1e-5)
    for mask in ((False, True, True), (False, True, False), (True, False, True)):
        got = KLN.layer_norm_backward(dy, x, mean, rstd, w, mask)
        want = RLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
        for g, e, on in zip(got, want, mask):
            assert (g is None) != on
            if on:
                assert_close(g, e, F32, what=str(mask))


@pytest.mark.parametrize("split", [False, True])
def test_layer_norm_backward_writes_dw_db_in_the_grad_dtype(split, device, request):
    # the reduction rounds into the weight's dtype as it writes: no conversion pass after it
    if split:
        request.getfixturevalue("force_split")
    x, dy, w, _ = ln_inputs(9, 130, torch.bfloat16, device)
    _, mean, rstd = KLN.layer_norm(x, w, None, 1e-5)
    f32 = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
    got = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True), grad_dtype=torch.bfloat16)
    assert torch.equal(got[0], f32[0])
    for g, e in zip(got[1:], f32[1:]):
        assert g.dtype == torch.bfloat16 and torch.equal(g, e.to(torch.bfloat16))
    dw = KLN.layer_norm_backward(dy, x, mean, rstd, w, (False, True, False), grad_dtype=torch.bfloat16)[1]
    assert dw.dtype == torch.bfloat16 and torch.equal(dw, f32[1].to(torch.bfloat16))


# ------------------------------------------------------------------ exact arithmetic
def test_float64_calls_give_the_kernels_every_float_in_float64(device, monkeypatch):
    # Triton types a Python float kernel argument fp32 (mangle_type(1e-5) == "fp32"), so a
    # float64 call would run with eps (RMSNorm's offset) rounded to float32 on a GPU: rstd
    # 1.3e-8 off at eps = 1e-5, past float64's tolerance. The interpreter keeps the Python
    # float, so on the CPU the numbers cannot show it; the arguments can: no scalar argument of
    # any norm kernel launched by a float64 call may be one Triton types as a float.
    from triton.runtime.jit import mangle_type

    from gradops.kernels import _norm_common as NC

    recorded = record_launches(monkeypatch)
    f64 = torch.float64
    for override in (None, 64):  # whole rows; the split-row kernels (n = 130 > 64)
        monkeypatch.setattr(norm_config, "MAX_FUSED_N_OVERRIDE", override)
        x, dy, w, b = ln_inputs(5, 130, f64, device)
        res = rand((5, 130), f64, device)
        _, mean, rstd = KLN.layer_norm(x, w, b, 1e-5)
        KLN.layer_norm(x, w, b, 1e-5, residual=res, h_out=torch.empty_like(x))
        KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True), dres=res)
        var = x.var(dim=1, unbiased=False)
        KLN.layer_norm_grad(dy, x, var, x.mean(dim=1), w, 1e-5, False)
        KLN.layer_norm_grad_beta(x, dy, False)
        _, rstd = KRN.rms_norm(x, w, 1e-6, offset=1 / 3, residual=res, h_out=torch.empty_like(x))
        KRN.rms_norm_grad(dy, x, rstd, w, offset=1 / 3, dres=res)
    launches = [(fn.__name__, {name: value for name, value in bound.items()
                               if "constexpr" not in str(inspect.signature(fn).parameters[name].annotation)})
                for fn, bound, _ in recorded]
    every = {name for module in (KLN, KRN, NC) for name in dir(module) if name.endswith("_kernel")}
    assert {name for name, _ in launches} == every  # the calls above reached every norm kernel
    floats = [(name, arg, value) for name, args in launches for arg, value in args.items()
              if not hasattr(value, "data_ptr") and mangle_type(value).startswith(("fp", "bf"))]
    assert not floats, floats


@pytest.mark.parametrize("split", [False, True])
def test_width_one_gives_exact_zeros(split, device, monkeypatch):
    # At width 1 x-hat is 0: LayerNorm's dx = rstd * (g - mean(g)) and AscendC's
    # pd_x = x1*r + pd_mean/H (pd_mean = -x1*r) cancel to exactly 0 when every product is
    # rounded as written and the mean divides exactly (norm_config.fp_fusion; on a GPU the
    # sm_90 compile test below checks the code, here the results), on both kernel paths.
    if split:
        monkeypatch.setattr(norm_config, "MAX_FUSED_N_OVERRIDE", 0)
    for dtype in (torch.float32, torch.bfloat16):
        x, dy, w, b = ln_inputs(7, 1, dtype, device)
        for eps in (1e-5, 1e-12):  # the error of a contracted product grows with rstd
            y, mean, rstd = KLN.layer_norm(x, w, b, eps)
            assert torch.equal(y, b.expand(7, 1))
            dx, dw, db = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
            assert torch.equal(dx, torch.zeros_like(dx)) and torch.equal(dw, torch.zeros_like(dw))
            pd_x, res = KLN.layer_norm_grad(dy, x, torch.zeros(7, dtype=dtype, device=device), x[:, 0], w, eps,
                                            False)
            assert torch.equal(pd_x, torch.zeros_like(pd_x)) and torch.equal(res, torch.zeros_like(res))


def test_ascendc_kernel_tiles_do_not_depend_on_the_row_count():
    # The AscendC kernel API (gradops.ascendc) runs LayerNormGrad once per tiling step, on
    # fewer rows than the whole-tensor call; a row's results may not depend on the rows it
    # runs with, so the reductions' layout (tile and warps) of the one-tile-per-program kernel
    # follows the width only. (The split path's row sums run one row per program.) Configs
    # only: an H100's is computed here too, with no GPU needed.
    for dev in (torch.device("cpu"), torch.device("cuda")):
        for h in (1, 16, 100, 1000, 4096):
            layouts = {(c.block_m, c.block_n, c.num_warps)
                       for c in (norm_config.fused_config(m, h, dev, persistent=False) for m in (1, 2, 9, 18, 127, 5000))}
            assert len(layouts) == 1, (dev, h, layouts)


# ------------------------------------------------------------------ weights
def test_layer_norm_without_weight_or_bias(device):
    check_layer_norm(6, 130, F32, device, weight=False, bias=False)
    check_layer_norm(6, 130, torch.bfloat16, device, weight=False, bias=True)


def test_layer_norm_without_weight_split(device, force_split):
    check_layer_norm(6, 130, F32, device, weight=False, bias=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_weight_with_half_activations(dtype, device):
    check_layer_norm(6, 130, dtype, device, wdtype=F32)
    check_rms_norm(6, 130, dtype, device, wdtype=F32)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, True), (False, False, True),
                                  (True, True, False), (False, False, False)])
@pytest.mark.parametrize("split", [False, True])
def test_layer_norm_output_mask(mask, split, device, request):
    if split:
        request.getfixturevalue("force_split")
    x, dy, w, _ = ln_inputs(5, 100, F32, device)
    _, mean, rstd = RLN.layer_norm(x, w, None, 1e-5)
    got = KLN.layer_norm_backward(dy, x, mean, rstd, w, mask)
    want = RLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
    for g, e, on, name in zip(got, want, mask, ("dx", "dw", "db")):
        if on:
            assert_close(g, e, F32, what=name)
        else:
            assert g is None, name


# ------------------------------------------------------------------ layouts and in place
@pytest.mark.parametrize("split", [False, True])
def test_row_strided_views_are_used_in_place(split, device, request):
    # Last dim contiguous, rows 40 elements apart: the kernels read them where they are,
    # and dx_out (in_place) is written through the same strides, leaving the gaps alone.
    if split:
        request.getfixturevalue("force_split")
    big_x, big_dy = rand((6, 200), F32, device), rand((6, 200), F32, device)
    x, dy = big_x[:, 10:140], big_dy[:, 10:140]
    w = rand((130,), F32, device)
    y, mean, rstd = KLN.layer_norm(x, w, w, 1e-5)
    y_r, mean_r, rstd_r = RLN.layer_norm(x.contiguous(), w, w, 1e-5)
    assert_close(y, y_r, F32, what="y")
    want = RLN.layer_norm_backward(dy.contiguous(), x.contiguous(), mean_r, rstd_r, w, (True, True, True))
    before = big_dy.clone()
    dx, dw, db = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True), dx_out=dy)
    assert dx.data_ptr() == dy.data_ptr()
    assert_close(dy, want[0], F32, what="dx in dy")
    assert_close(dw, want[1], F32, what="dw")
    assert_close(db, want[2], F32, what="db")
    assert torch.equal(big_dy[:, :10], before[:, :10]) and torch.equal(big_dy[:, 140:], before[:, 140:])

    big_dy.copy_(before)
    y, rstd = KRN.rms_norm(x, w, 1e-6)
    want = RRN.rms_norm_grad(dy.contiguous(), x.contiguous(), rstd, w)
    dx, dg = KRN.rms_norm_grad(dy, x, rstd, w, dx_out=dy)
    assert dx.data_ptr() == dy.data_ptr()
    assert_close(dy, want[0], F32, what="rms dx in dy")
    assert_close(dg, want[1], F32, what="dgamma")
    assert torch.equal(big_dy[:, :10], before[:, :10]) and torch.equal(big_dy[:, 140:], before[:, 140:])


def test_transposed_inputs_are_copied_and_dx_out_is_filled(device):
    # Last dim not contiguous: inputs are copied; dx_out (in_place) still receives dx.
    xt, dyt = rand((130, 6), F32, device), rand((130, 6), F32, device)
    x, dy = xt.t(), dyt.t()
    w = rand((130,), F32, device)
    _, mean, rstd = RLN.layer_norm(x, w, None, 1e-5)
    want = RLN.layer_norm_backward(dy.contiguous(), x.contiguous(), mean, rstd, w, (True, True, True))
    dx, dw, db = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True), dx_out=dy)
    assert dx is dy
    assert_close(dy, want[0], F32, what="dx in dy")
    assert_close(dw, want[1], F32, what="dw")
    _, rstd = RRN.rms_norm(x, w, 1e-6)
    dyt2 = rand((130, 6), F32, device)
    want = RRN.rms_norm_grad(dyt2.t().contiguous(), x.contiguous(), rstd, w)
    dx, dg = KRN.rms_norm_grad(dyt2.t(), x, rstd, w)
    assert_close(dx, want[0], F32, what="rms dx")
    assert_close(dg, want[1], F32, what="dgamma")


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=str)
@pytest.mark.parametrize("split", [False, True])
def test_in_place_dx_into_dy_equals_out_of_place(dtype, split, device, request):
    if split:
        request.getfixturevalue("force_split")
    x, dy, w, _ = ln_inputs(9, 127, dtype, device)
    _, mean, rstd = KLN.layer_norm(x, w, None, 1e-5)
    out_of_place = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
    dy2 = dy.clone()
    in_place = KLN.layer_norm_backward(dy2, x, mean, rstd, w, (True, True, True), dx_out=dy2)
    assert in_place[0].data_ptr() == dy2.data_ptr()
    for a, b in zip(in_place, out_of_place):
        assert torch.equal(a, b)
    _, rstd = KRN.rms_norm(x, w, 1e-6)
    out_of_place = KRN.rms_norm_grad(dy, x, rstd, w)
    dy2 = dy.clone()
    in_place = KRN.rms_norm_grad(dy2, x, rstd, w, dx_out=dy2)
    assert in_place[0].data_ptr() == dy2.data_ptr()
    for a, b in zip(in_place, out_of_place):
        assert torch.equal(a, b)


def test_public_api_with_triton_backend(device):
    # Through gradops' validation and dispatch: leading dims, keepdim statistics, in_place.
    x = rand((2, 3, 40), torch.bfloat16, device)
    dy = rand((2, 3, 40), torch.bfloat16, device)
    w = rand((40,), F32, device)
    y, mean, rstd = gradops.layer_norm(x, (40,), w, w, backend="triton")
    y_r, mean_r, rstd_r = gradops.layer_norm(x, (40,), w, w, backend="reference")
    assert_close(y, y_r, torch.bfloat16, what="y")
    assert mean.shape == mean_r.shape == (2, 3, 1)
    got = gradops.layer_norm_backward(dy.clone(), x, (40,), mean, rstd, w, w, in_place=True, backend="triton")
    want = gradops.layer_norm_backward(dy, x, (40,), mean_r, rstd_r, w, w, backend="reference")
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close(g, e, e.dtype, what="layer_norm_backward")
    y, rstd = gradops.rms_norm(x, w, backend="triton")
    dx, dg = gradops.rms_norm_grad(dy, x, rstd, w, backend="triton")
    dx_r, dg_r = gradops.rms_norm_grad(dy, x, rstd, w, backend="reference")
    assert_close(dx, dx_r, torch.bfloat16, what="rms dx")
    assert_close(dg, dg_r, F32, what="rms dgamma")


# ------------------------------------------------------------------ determinism
@pytest.mark.parametrize("split", [False, True])
def test_backward_is_bitwise_deterministic(split, device, request):
    if split:
        request.getfixturevalue("force_split")
    dev = torch.device(device)
    m, n = (40, 100) if dev.type == "cpu" else (20_000, 3000)
    x, dy, w, _ = ln_inputs(m, n, torch.bfloat16, device)
    _, mean, rstd = KLN.layer_norm(x, w, None, 1e-5)
    first = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
    second = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    _, rstd = KRN.rms_norm(x, w, 1e-6)
    first = KRN.rms_norm_grad(dy, x, rstd, w)
    second = KRN.rms_norm_grad(dy, x, rstd, w)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    first = KLN.layer_norm_grad_beta(x, dy, False)
    second = KLN.layer_norm_grad_beta(x, dy, False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ AscendC semantics
def test_layer_norm_grad_worked_example_from_cann_docs(device):
    x = torch.arange(64, dtype=F32, device=device).reshape(8, 8)
    mean = 3.5 + 8 * torch.arange(8, dtype=F32, device=device)
    var = torch.full((8,), 5.25, device=device)
    gamma = torch.arange(8, dtype=F32, device=device)
    pd_x, res = KLN.layer_norm_grad(x.clone(), x.clone(), var, mean, gamma, 1e-4, False)
    assert abs(res[0, 0].item() - -1.5275106) < 1e-6
    expected = torch.tensor([3.0548172, 0.4362857, -1.3093826, -2.182187])
    assert torch.allclose(pd_x[0, :4].cpu(), expected, rtol=1e-5, atol=1e-5)


def test_layer_norm_grad_beta_worked_example_from_cann_docs(device):
    a = torch.arange(64, dtype=F32, device=device).reshape(8, 8)
    pd_gamma, pd_beta = KLN.layer_norm_grad_beta(a.clone(), a.clone(), False)
    assert pd_gamma[0].item() == 8960 and pd_beta[0].item() == 224


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("h", [1, 127, 1000])
@pytest.mark.parametrize("split", [False, True])
def test_layer_norm_grad_matches_reference_and_autograd(h, dtype, split, device, request):
    if split:
        request.getfixturevalue("force_split")
    r, eps = 5, 1e-4
    x = rand((r, h), dtype, device, scale=2.0)
    dy = rand((r, h), dtype, device)
    gamma = rand((h,), dtype, device)
    xd = x.double()
    var, mean = xd.var(dim=1, unbiased=False).to(dtype), xd.mean(dim=1).to(dtype)
    pd_x, res = KLN.layer_norm_grad(dy, x, var, mean, gamma, eps, False)
    pd_x_r, res_r = RLN.layer_norm_grad(dy, x, var, mean, gamma, eps, False)
    assert pd_x.dtype == res.dtype == dtype
    assert_close(pd_x, pd_x_r, dtype, what="pd_x vs reference")
    assert_close(res, res_r, dtype, what="res_for_gamma vs reference")
    # With the true statistics pd_x is LayerNorm's dx (the literal pd_mean term vanishes).
    if dtype == torch.float32:
        x_stats = x.double()
        dx_o, _ = oracles.layer_norm_autograd(dy, x_stats, 1, gamma, eps)
        assert_close(pd_x, dx_o, dtype, what="pd_x vs autograd f64")
    pd_g, pd_b = KLN.layer_norm_grad_beta(res, dy, False)
    pd_g_r, pd_b_r = RLN.layer_norm_grad_beta(res, dy, False)
    assert pd_g.dtype == pd_b.dtype == dtype
    assert_close(pd_g, pd_g_r, dtype, what="pd_gamma")
    assert_close(pd_b, pd_b_r, dtype, what="pd_beta")


@pytest.mark.parametrize("split", [False, True])
def test_reuse_source_overwrites_like_the_reference(split, device, request):
    if split:
        request.getfixturevalue("force_split")
    r, h = 4, 150
    x, dy, gamma = rand((r, h), F32, device), rand((r, h), F32, device), rand((h,), F32, device)
    var, mean = x.var(dim=1, unbiased=False), x.mean(dim=1)
    x_k, dy_k, x_r, dy_r = x.clone(), dy.clone(), x.clone(), dy.clone()
    pd_x, res = KLN.layer_norm_grad(dy_k, x_k, var, mean, gamma, 1e-5, True)
    pd_x_r, res_r = RLN.layer_norm_grad(dy_r, x_r, var, mean, gamma, 1e-5, True)
    assert_close(pd_x, pd_x_r, F32, what="pd_x")
    assert_close(dy_k, dy_r, F32, what="dy overwritten with dy*gamma")
    assert_close(x_k, x_r, F32, what="x overwritten with x-mean")
    assert_close(dy_k, dy * gamma, F32, what="dy*gamma")
    res_k, res_r2 = res.clone(), res_r.clone()
    got = KLN.layer_norm_grad_beta(res_k, dy, True)
    want = RLN.layer_norm_grad_beta(res_r2, dy, True)
    for g, e in zip(got, want):
        assert_close(g, e, F32, what="pd_gamma/pd_beta")
    assert_close(res_k, res_r2, F32, what="res_for_gamma overwritten with dy*res")
    # without reuse_source nothing is written
    x_k, dy_k = x.clone(), dy.clone()
    KLN.layer_norm_grad(dy_k, x_k, var, mean, gamma, 1e-5, False)
    assert torch.equal(x_k, x) and torch.equal(dy_k, dy)


def test_reuse_source_on_transposed_inputs_writes_back(device):
    r, h = 4, 150
    xt, dyt = rand((h, r), F32, device), rand((h, r), F32, device)
    x, dy, gamma = xt.t(), dyt.t(), rand((h,), F32, device)
    var, mean = x.var(dim=1, unbiased=False), x.mean(dim=1)
    want_dy = dy * gamma
    want_x = x - mean[:, None]
    KLN.layer_norm_grad(dy, x, var, mean, gamma, 1e-5, True)
    assert_close(dy, want_dy, F32, what="dy")
    assert_close(x, want_x, F32, what="x")


# ------------------------------------------------------------------ int64 offsets
@pytest.mark.skipif(os.environ.get("GRADOPS_TEST_DEVICE", "cpu") != "cuda", reason="needs 4 GB of GPU memory")
def test_offsets_past_two_to_the_31(device):
    # Row 1 starts 2**31 elements after row 0: an int32 offset would wrap.
    n = 1000
    base = torch.zeros(2**31 + n, dtype=torch.bfloat16, device=device)
    x = base.as_strided((2, n), (2**31, 1))
    x.copy_(rand((2, n), torch.bfloat16, device))
    w = rand((n,), F32, device)
    xc = x.contiguous()
    y, rstd = KRN.rms_norm(x, w, 1e-6)
    y_r, rstd_r = RRN.rms_norm(xc, w, 1e-6)
    assert_close(y, y_r, torch.bfloat16, what="rms y")
    dx, dg = KRN.rms_norm_grad(x, x, rstd, w)
    dx_r, dg_r = RRN.rms_norm_grad(xc, xc, rstd, w)
    assert_close(dx, dx_r, torch.bfloat16, what="rms dx")
    assert_close(dg, dg_r, F32, what="rms dgamma")
    y, mean, rstd = KLN.layer_norm(x, w, w, 1e-5)
    assert_close(y, RLN.layer_norm(xc, w, w, 1e-5)[0], torch.bfloat16, what="ln y")
    got = KLN.layer_norm_backward(x, x, mean, rstd, w, (True, True, True), dx_out=x)
    want = RLN.layer_norm_backward(xc, xc, mean, rstd, w, (True, True, True))
    for g, e in zip(got, want):
        assert_close(g, e, e.dtype, what="ln backward")
    assert torch.count_nonzero(base[n:2**31]) == 0  # nothing written between the rows
    del base


# ------------------------------------------------------------------ GPU width sweep
@pytest.mark.skipif(os.environ.get("GRADOPS_TEST_DEVICE", "cpu") != "cuda", reason="GPU sizes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144])
def test_gpu_width_sweep(n, dtype, device):
    # issue 4's widths, compiled: both paths at their real tile sizes, with a tail tile
    check_layer_norm(5, n, dtype, device)
    check_rms_norm(5, n, dtype, device)
    check_rms_norm(max(3, 2**22 // n) + 1, n, dtype, device)


# ------------------------------------------------------------------ sm_90 code generation
# Run in a child process: the interpreter (TRITON_INTERPRET=1, set for this process) cannot
# also compile. Triton cross-compiles for sm_90 on any machine and its wheel ships ptxas.
# Each kernel is compiled as the JIT would specialise a launch at the goal's shapes (16-byte
# aligned pointers, widths and strides divisible by 16: what lets loads vectorise and the
# pipeliner turn them into cp.async), with the launch parameters and options norm_config gives
# at M = 32768 on an H100 (its launch dicts themselves, so the check compiles what the
# launchers launch); a few odd widths (scalar loads) are checked for spills only. Float
# scalars (eps, offset) are typed as the launchers pass them (_scalar_args).
_SM90_CHECK = r"""
import json, os, re, subprocess, sys, tempfile
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from gradops.kernels import layer_norm as KLN, rms_norm as KRN, norm_config as C, _norm_common as NC
from gradops.kernels._scalar_args import float64_bits
ptxas = sys.argv[1]
C._sm_count = lambda index: 132  # an H100 SXM
dev = torch.device("cuda", 0)
M = 32768
INT_RH = {"_sum_rows_kernel"}  # R is a row count there, H the AscendC row width
INT_H = {"_ln_grad_fused_kernel", "_ln_grad_row_sums_kernel", "_ln_grad_cols_kernel"}
STATS = {"Mean", "Rstd", "C1", "C2", "C", "DW_P", "DB_P", "P", "OUT_A", "OUT_B", "S", "PG_P", "PB_P"}
SCALAR = mangle_type(float64_bits(1e-5)[0])  # each word of eps and offset (eps_high, eps_low, ...)
cases = []  # (label, fn, constexprs, launch options, programs per SM, dtype, aligned)
LN_BWD = dict(HAS_W=True, WANT_DX=True, WANT_DW=True, WANT_DB=True)
for dt, eb, widths in (("bf16", 2, (1024, 4096, 8192)), ("fp32", 4, (8192,))):
    for n in widths:
        for extra in (False, True):  # plain; the fused residual's gradient (and Llama's rounding)
            f = C.fused_config(M, n, dev, elem_bytes=eb, streams=3 if extra else 2)
            b = dict(BLOCK_M=f.block_m, BLOCK_N=f.block_n, NUM_STAGES=f.num_stages)
            per_sm = f.grid // 132
            cases.append((f"bwd {dt} {n}", KLN._ln_bwd_fused_kernel, dict(LN_BWD, HAS_DRES=extra, **b),
                          f.launch(), per_sm, dt, True))
            cases.append((f"bwd {dt} {n}", KRN._rms_bwd_fused_kernel,
                          dict(HAS_W=True, HAS_DRES=extra, ROUND_XHAT=extra, **b), f.launch(), per_sm, dt, True))
for n in (1024, 8192, 16384):
    for res in (False, True):
        f = C.fused_config(M, n, dev, kind="fwd", streams=2 if res else 1)
        b = dict(BLOCK_M=f.block_m, BLOCK_N=f.block_n, NUM_STAGES=f.num_stages)
        per_sm = f.grid // 132
        cases.append((f"fwd {n}", KLN._ln_fwd_fused_kernel, dict(HAS_W=True, HAS_B=True, HAS_RES=res, **b),
                      f.launch(), per_sm, "bf16", True))
        cases.append((f"fwd {n}", KRN._rms_fwd_fused_kernel, dict(HAS_W=True, HAS_RES=res, ROUND_XHAT=res, **b),
                      f.launch(), per_sm, "bf16", True))
# the split backward's column programs at their narrowest, a middle and their widest column
# block (64, 256 and 1024 columns: N = 16K, 64K and 256K at the goal's M = 128M / N)
for n in (16384, 65536, 262144):
    s = C.split_config(2**27 // n, n, dev, whole_columns=True)
    b = dict(BLOCK_M=s.block_m, BLOCK_N=s.block_n, NUM_STAGES=s.num_stages)
    per_sm = C.REGS_PER_SM // (C.GPU_BWD_MAX_REGS * 32 * s.num_warps)
    for dres in (False, True):
        cases.append((f"split bwd {n}", KLN._ln_bwd_cols_kernel,
                      dict(LN_BWD, HAS_DRES=dres, SEGMENTS=C.next_pow2(s.row_segments), **b),
                      s.launch(), per_sm, "bf16", True))
        cases.append((f"split bwd {n}", KRN._rms_bwd_cols_kernel,
                      dict(HAS_W=True, HAS_DRES=dres, ROUND_XHAT=dres, SEGMENTS=C.next_pow2(s.row_segments), **b),
                      s.launch(), per_sm, "bf16", True))
s = C.split_config(M, 65536, dev, whole_columns=True)
rs = dict(HAS_W=True, BLOCK_N=s.row_block_n, NUM_STAGES=s.num_stages)
cases.append(("split bwd 65536", KLN._ln_bwd_row_sums_kernel, rs, s.row_launch(), 1, "bf16", True))
cases.append(("split bwd 65536", KRN._rms_bwd_row_sums_kernel, rs, s.row_launch(), 1, "bf16", True))
for res in (False, True):
    w = C.split_config(M, 65536, dev, streams=2 if res else 1, kind="fwd")
    wb = dict(BLOCK_N=w.row_block_n, NUM_STAGES=w.num_stages)
    cases.append(("wide fwd 65536", KLN._ln_fwd_wide_kernel, dict(HAS_W=True, HAS_B=True, HAS_RES=res, **wb),
                  w.row_launch(), 1, "bf16", True))
    cases.append(("wide fwd 65536", KRN._rms_fwd_wide_kernel, dict(HAS_W=True, HAS_RES=res, ROUND_XHAT=res, **wb),
                  w.row_launch(), 1, "bf16", True))
# odd widths: scalar loads, nothing to pipeline; spills only
f = C.fused_config(M, 1000, dev, streams=3)
b = dict(BLOCK_M=f.block_m, BLOCK_N=f.block_n, NUM_STAGES=f.num_stages)
cases.append(("bwd 1000", KLN._ln_bwd_fused_kernel, dict(LN_BWD, HAS_DRES=True, **b), f.launch(),
              f.grid // 132, "bf16", False))
cases.append(("bwd 1000", KRN._rms_bwd_fused_kernel, dict(HAS_W=True, HAS_DRES=True, ROUND_XHAT=True, **b),
              f.launch(), f.grid // 132, "bf16", False))
w = C.split_config(M, 65537, dev, streams=2, kind="fwd")
cases.append(("wide fwd 65537", KLN._ln_fwd_wide_kernel,
              dict(HAS_W=True, HAS_B=True, HAS_RES=True, BLOCK_N=w.row_block_n, NUM_STAGES=w.num_stages),
              w.row_launch(), 1, "bf16", False))
r = C.reduce_config(264, 2 * 8192, dev)
cases.append(("reduce", NC._sum_rows_kernel, dict(BLOCK_R=r.block_r, BLOCK_N=r.block_n), r.launch(), 1,
              "fp32", True))
# AscendC LayerNormGrad (one tile per program) and LayerNormGradBeta, float32 (T = float)
f = C.fused_config(M, 4096, dev, persistent=False)
cases.append(("ascendc 4096", KLN._ln_grad_fused_kernel, dict(REUSE=True, BLOCK_M=f.block_m, BLOCK_N=f.block_n),
              f.launch(), 1, "fp32", True))
s = C.split_config(M, 65536, dev)
cases.append(("ascendc 65536", KLN._ln_grad_row_sums_kernel, dict(BLOCK_N=s.row_block_n, NUM_STAGES=s.num_stages),
              s.row_launch(), 1, "fp32", True))
cases.append(("ascendc 65536", KLN._ln_grad_cols_kernel, dict(REUSE=True, BLOCK_M=s.block_m, BLOCK_N=s.block_n),
              s.launch(), 1, "fp32", True))
s = C.split_config(M, 4096, dev, elem_bytes=4)
cases.append(("ascendc beta 4096", KLN._ln_grad_beta_kernel,
              dict(REUSE=True, BLOCK_M=s.block_m, BLOCK_N=s.block_n, NUM_STAGES=s.num_stages), s.launch(), 1,
              "fp32", True))
for label, fn, consts, opts, per_sm, dt, aligned in cases:
    if "ACC" in fn.arg_names:
        consts = dict(consts, ACC=tl.float32)
    sig = {a: "constexpr" if a in consts else SCALAR if a.endswith(("_high", "_low"))
           else "i32" if a in ("M", "N", "N_A") or a[0].islower() or (a == "R" and fn.__name__ in INT_RH)
           or (a == "H" and fn.__name__ in INT_H)
           else "*fp32" if a in STATS else f"*{dt}" for a in fn.arg_names}
    div = [i for i, a in enumerate(fn.arg_names) if sig[a].startswith("*") or a.startswith("stride")
           or (aligned and (a in ("M", "N", "N_A") or (a == "H" and fn.__name__ in INT_H)))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(opts))
    ptx = c.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", os.path.join(tmp, "k.ptx"),
                              "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    rec = dict(label=label, kernel=fn.__name__, warps=opts["num_warps"], maxnreg=opts.get("maxnreg"),
               fp_fusion=opts["enable_fp_fusion"], per_sm=per_sm, stages=consts.get("NUM_STAGES", 1), aligned=aligned,
               flags={k: v for k, v in consts.items() if k.startswith(("HAS_", "ROUND"))},
               regs=int(regs.group(1)) if regs else None,
               spill=sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", out.stderr)),
               smem=c.metadata.shared, cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
               fma_f32=len(re.findall(r"\bfma\.[a-z.]*f32\b", ptx)),
               div_approx_f32=len(re.findall(r"\bdiv\.(?:full|approx)[a-z.]*f32\b", ptx)),
               ptxas_error=None if regs else out.stderr[-300:])
    print("K", json.dumps(rec), flush=True)
"""


def _ptxas(triton_root=None):
    root = triton_root or os.path.dirname(triton.__file__)
    path = os.path.join(root, "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX version Triton writes
        if os.path.exists(os.path.join(path, name)):
            return os.path.join(path, name)
    return None


SM90_SMEM_PER_BLOCK = 227 * 1024
SM90_SMEM_PER_SM = 228 * 1024
SM90_REGS_PER_SM = 65536


@pytest.mark.slow
@pytest.mark.parametrize("triton_version", ["installed", "3.6"])
def test_kernels_compile_for_sm90_within_their_budgets(triton_version):
    """The norm kernels, with their launch parameters from norm_config, compile for H100:
    without fused multiply-adds, LayerNorm's dx without approximate divisions, no register spills, registers within the cap norm_config launches with (so its programs
    per SM fit in the register file), shared memory within sm_90's limits for that many
    programs per SM, and the pipelined loops (stages >= 2) really issue cp.async."""
    import json

    from helpers import triton_3_6_path

    ptxas = _ptxas() if triton_version == "installed" else _ptxas(os.path.join(triton_3_6_path(), "triton"))
    if ptxas is None:
        ptxas = _ptxas()  # the newest wheel's ptxas assembles either version's PTX
    if ptxas is None:
        pytest.skip("no ptxas in the triton wheel")
    stdout = run_sm90_compile(_SM90_CHECK, ptxas, triton_version=triton_version)
    recs = [json.loads(ln[2:]) for ln in stdout.splitlines() if ln.startswith("K ")]
    assert len(recs) == 54, stdout
    for r in recs:
        what = f"{r['label']} {r['kernel']} {r['flags']}: {r}"
        if r["regs"] is None:
            pytest.skip(f"ptxas could not assemble Triton's PTX: {what}")
        # LayerNorm's dx at width 1 is exactly 0 only if g = w * dy is rounded before c2 (the
        # row mean of the rounded g, by an IEEE division: g itself) is subtracted: no fused
        # multiply-add and no approximate division in the kernels that compute dx (AscendC's
        # pd_x at H = 1 alike); and no FMA wherever the launch options say no contraction.
        if r["kernel"] in ("_ln_bwd_fused_kernel", "_ln_bwd_cols_kernel"):
            assert r["fma_f32"] == 0 and r["div_approx_f32"] == 0, what
        if r["kernel"] in ("_ln_grad_fused_kernel", "_ln_grad_cols_kernel") or not r["fp_fusion"]:
            assert r["fma_f32"] == 0, what
        assert r["spill"] == 0, what
        if r["maxnreg"]:
            assert r["regs"] <= r["maxnreg"], what
        assert r["regs"] * 32 * r["warps"] * r["per_sm"] <= SM90_REGS_PER_SM, what
        assert r["smem"] <= SM90_SMEM_PER_BLOCK and r["smem"] * r["per_sm"] <= SM90_SMEM_PER_SM, what
        if r["stages"] >= 2 and r["aligned"]:
            assert r["cp_async"] > 0, what


# ------------------------------------------------------------------ the benchmark
def test_bench_norm_runs_and_writes_json(tmp_path):
    import json

    from gradops.bench import norm as bench_norm

    rc = bench_norm.main(["--quick", "--device", "cpu", "--ops", "rms_bwd", "ln_bwd", "--dtypes", "fp32",
                          "--widths", "64", "--numel", "4096", "--peers", "autograd", "aten",
                          "--reps", "2", "--warmup", "1", "--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "t.json").read_text())
    impls = {(r["op"], r["impl"]) for r in data["records"] if not r["error"]}
    assert {("rms_bwd", "gradops"), ("rms_bwd", "torch autograd"), ("ln_bwd", "gradops"),
            ("ln_bwd", "aten bwd")} <= impls
    ours = next(r for r in data["records"] if r["op"] == "ln_bwd" and r["impl"] == "gradops")
    assert ours["bytes"] == 3 * 64 * 64 * 4 + 2 * 64 * 4  # docs/benchmarks.md: 3*M*N*e + 2*N*w_e


def test_bench_norm_times_the_fused_residual_add(tmp_path):
    import json

    from gradops.bench import norm as bench_norm

    rc = bench_norm.main(["--quick", "--device", "cpu", "--ops", "add_rms_bwd", "add_rms_fwd", "--dtypes", "bf16",
                          "--widths", "64", "--numel", "4096", "--peers", "autograd", "--check",
                          "--reps", "2", "--warmup", "1", "--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert rc == 0
    records = json.loads((tmp_path / "t.json").read_text())["records"]
    assert not [r for r in records if r["error"]]
    impls = {(r["op"], r["impl"]) for r in records}
    assert {("add_rms_bwd", "gradops"), ("add_rms_bwd", "torch autograd"), ("add_rms_fwd", "gradops"),
            ("add_rms_fwd", "torch eager")} <= impls
    bwd = next(r for r in records if r["op"] == "add_rms_bwd" and r["impl"] == "gradops")
    assert bwd["bytes"] == 4 * 64 * 64 * 2 + 2 * 64 * 2  # dy, h, dh in and dx out; dgamma
    assert bwd["extra"]["rel_error_vs_reference"] <= 1.6e-2


def test_bench_norm_records_a_failing_peer_as_the_peers_error(device):
    # Liger's forward raised at N = 262144 on the H100 while its backward case was being built,
    # and `bench norm` recorded it as gradops' error: ours was never measured there
    from gradops.bench import harness
    from gradops.bench import norm as bench_norm

    x, dy = rand((4, 64), F32, device), rand((4, 64), F32, device)

    def peer_forward(a):
        raise RuntimeError("the peer cannot take this width")

    run = harness.Run("t", device)
    fn = bench_norm._autograd_backward(peer_forward, [x], dy)  # building it does not raise
    rec = run.time("rms_bwd", {"N": 64}, "liger", fn, reps=1, warmup=1)
    assert rec.error == "RuntimeError: the peer cannot take this width"
    run.time("rms_bwd", {"N": 64}, harness.OURS, lambda: KRN.rms_norm_grad(dy, x, torch.ones(4, device=device),
                                                                            None), reps=1, warmup=1)
    assert not run.failures() and run.records[-1].times_ms


def test_bench_rates_divide_by_the_kernel_time_where_it_was_measured():
    # a host-bound call's eager time is not its kernels' speed (the H100 run reported 150-300
    # GB/s for backwards whose kernels ran at 1.9 TB/s): GB/s comes from the CUDA-graph time
    from gradops.bench import harness

    eager = harness.Record("rms_bwd", {}, harness.OURS, [2.0, 2.0, 2.0], bytes=1e9)
    assert eager.gbps == pytest.approx(500.0)
    split = harness.Record("rms_bwd", {}, harness.OURS, [2.0, 2.0, 2.0], bytes=1e9,
                           extra={"kernel_ms": 0.5, "eager_ms": 2.0})
    assert split.gbps == pytest.approx(2000.0)
    run = harness.Run("t", "cpu")
    run.add(split)
    run.add(harness.Record("rms_bwd", {}, "aten", [1.0, 1.0], bytes=1e9, extra={"kernel_ms": 1.0}))
    peer = run.ratios()[1]
    assert peer["speedup_of_ours"] == pytest.approx(0.5) and peer["kernel_speedup_of_ours"] == pytest.approx(2.0)


def test_split_backward_with_a_gpu_configuration(fresh_configs, monkeypatch, device):
    # On the CPU the split backward's column block equals the row kernels' and rows have two
    # segments; on a GPU the column block narrows or widens with N and the segments tile is
    # padded to a power of two. A GPU's configuration (4 SMs, to keep it small), run on the
    # test device (on a CPU through the interpreter): results as the reference's.
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(norm_config, "MAX_FUSED_N_OVERRIDE", 64)
    monkeypatch.setattr(norm_config, "_sm_count", lambda index: 4)
    whole = norm_config.split_config
    monkeypatch.setattr(norm_config, "split_config", lambda m, n, device, **kw: whole(m, n, gpu, **kw))
    gen = torch.Generator().manual_seed(0)
    for m, n in ((3, 2048 * 5 + 7), (40, 2048 * 2 + 5)):
        cfg = whole(m, n, gpu, whole_columns=True)
        assert cfg.block_n != cfg.row_block_n or cfg.row_segments not in (1, 2, 4, 8)
        x, dy, w, dres = (torch.randn(*shape, generator=gen, dtype=torch.float64, device="cpu").float().to(device)
                          for shape in ((m, n), (m, n), (n,), (m, n)))
        mean, rstd = x.mean(1), (x.var(1, unbiased=False) + 1e-5).rsqrt()
        got = KLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True), None, dres)
        want = RLN.layer_norm_backward(dy, x, mean, rstd, w, (True, True, True), None, dres)
        for g, e, what in zip(got, want, ("dx", "dw", "db")):
            assert_close(g, e, F32, what=f"{what} {m}x{n}")
        rs = (x.pow(2).mean(1) + 1e-6).rsqrt()
        got = KRN.rms_norm_grad(dy, x, rs, w, None, 0.0, False, dres)
        want = RRN.rms_norm_grad(dy, x, rs, w, None, 0.0, False, dres)
        for g, e, what in zip(got, want, ("dx", "dgamma")):
            assert_close(g, e, F32, what=f"rms {what} {m}x{n}")
