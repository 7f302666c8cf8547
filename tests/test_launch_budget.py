"""Kernel launches per call (issue 24): a norm forward is one launch and a backward at most two
(the dweight/dbias partial rows and their reduction), at every width up to 256K, with more
rows than any column program's tile; NSA launches a fixed number whatever its size. Counted
through the user's entry points on the Triton backend, Triton launches and every ATen op that
would launch a kernel on a GPU alike (``gradops.bench.overhead.kernels_launched``); the
launches are recorded, not run, so the widest rows cost nothing here."""
import pytest
import torch

import gradops
import gradops.nn.functional as GF
from gradops.bench.floyd_accuracy import pair_mask
from gradops.bench.overhead import kernels_launched, stubbed_launches
from gradops.kernels import floyd_config, norm_config
from helpers import nsa_problem, rand

pytestmark = pytest.mark.usefixtures("triton_backend")

FORWARD_BUDGET = 1
BACKWARD_BUDGET = 2


@pytest.fixture
def triton_backend():
    with gradops.use_backend("triton"):
        yield


def widths(device):
    """Narrow (many rows per register tile), the widest and twice the widest whole rows of
    this device's backward, and 256K."""
    widest = norm_config.max_fused_n(torch.device(device))
    return [64, widest, 2 * widest, 262144]


def rows_for(n, device):
    # more rows than a column program's tile, than any tile of whole rows, and than the row
    # chunks the split backward once launched one by one (32 on the CPU, 72 at 64K on an H100)
    dev = torch.device(device)
    tiles = (norm_config.split_config(1 << 20, n, dev, whole_columns=True).block_m,
             norm_config.fused_config(1 << 20, min(n, 1024), dev).block_m)
    return max(4 * max(tiles), 128) + 3


def norm_calls(kind, x, w, b, res):
    n = x.shape[-1]
    if kind == "rms":
        return lambda: GF.rms_norm(x, (n,), w, 1e-6)
    if kind == "ln":
        return lambda: GF.layer_norm(x, (n,), w, b, 1e-5)
    if kind == "add_rms":
        return lambda: torch.add(*GF.fused_add_rms_norm(x, res, (n,), w, 1e-6, casting_mode="llama"))
    return lambda: torch.add(*GF.fused_add_layer_norm(x, res, (n,), w, b, 1e-5))


@pytest.mark.parametrize("kind", ["rms", "ln", "add_rms", "add_ln"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nn_functional_norm_launches(kind, dtype, device):
    for n in widths(device):
        m = rows_for(n, device)
        x = rand((m, n), dtype, device).requires_grad_()
        res = rand((m, n), dtype, device).requires_grad_()
        w = rand((n,), dtype, device).requires_grad_()
        b = rand((n,), dtype, device).requires_grad_()
        call = norm_calls(kind, x, w, b, res)
        fused_add = kind.startswith("add")
        forward = kernels_launched(call)
        # the fused forward's only other op is the test's own add of y and h
        assert len(forward) == FORWARD_BUDGET + fused_add, (n, forward)
        with stubbed_launches():  # the graph to differentiate, without running the kernels
            out = call()
        inputs = [t for t in (x, w, b if "ln" in kind else None, res if fused_add else None) if t is not None]
        dy = rand(out.shape, dtype, device)
        backward = kernels_launched(lambda: torch.autograd.grad(out, inputs, dy))
        # the add's backward hands its gradient on without a kernel
        assert len(backward) <= BACKWARD_BUDGET, (n, backward)
        assert all(not k.startswith("aten::") for k in backward), (n, backward)


def test_modules_launch_like_the_functions(device):
    n = 2 * norm_config.max_fused_n(torch.device(device))
    x = rand((rows_for(n, device), n), torch.bfloat16, device).requires_grad_()
    for module in (gradops.nn.RMSNorm(n, dtype=torch.bfloat16), gradops.nn.LayerNorm(n, dtype=torch.bfloat16)):
        module = module.to(device)
        assert len(kernels_launched(lambda: module(x))) == FORWARD_BUDGET
        with stubbed_launches():
            y = module(x)
        dy = torch.ones_like(y)
        assert len(kernels_launched(lambda: torch.autograd.grad(y, [x, *module.parameters()], dy))) <= BACKWARD_BUDGET


def test_api_norm_launches(device):
    for n in widths(device):
        m = rows_for(n, device)
        x, dy = rand((m, n), torch.bfloat16, device), rand((m, n), torch.bfloat16, device)
        w, b = rand((n,), torch.bfloat16, device), rand((n,), torch.bfloat16, device)
        with stubbed_launches():  # statistics of the right shapes and dtypes; their values do not matter here
            _, mean, rstd = gradops.layer_norm(x, (n,), w, b, 1e-5)
            _, rrstd = gradops.rms_norm(x, w, 1e-6)
        variance, mu = x.float().var(dim=-1, unbiased=False).to(x.dtype), x.mean(dim=-1)
        calls = {
            "layer_norm": (lambda: gradops.layer_norm(x, (n,), w, b, 1e-5), FORWARD_BUDGET),
            "rms_norm": (lambda: gradops.rms_norm(x, w, 1e-6), FORWARD_BUDGET),
            "layer_norm_backward": (lambda: gradops.layer_norm_backward(
                dy, x, (n,), mean, rstd, w, b, output_mask=(True, True, True)), BACKWARD_BUDGET),
            "rms_norm_grad": (lambda: gradops.rms_norm_grad(dy, x, rrstd, w), BACKWARD_BUDGET),
            "layer_norm_grad": (lambda: gradops.layer_norm_grad(dy, x, variance, mu, w, 1e-5), BACKWARD_BUDGET),
            "layer_norm_grad_beta": (lambda: gradops.layer_norm_grad_beta(x, dy), BACKWARD_BUDGET),
        }
        for name, (call, budget) in calls.items():
            launched = kernels_launched(call)
            assert 1 <= len(launched) <= budget, (name, n, launched)


def test_nsa_launches_a_fixed_number_of_kernels(device):
    counts = set()
    for lengths, heads, dims in (([40, 70], 2, 16), ([300, 17, 900], 4, 32)):
        ends, x, weight, dout = nsa_problem(lengths, heads, dims, 32, 16, torch.float32, device="cpu")
        x, weight, dout = (t.to(device).requires_grad_() for t in (x, weight, dout))
        forward = kernels_launched(lambda: GF.nsa_compress(x, weight, 32, 16, ends))
        out = GF.nsa_compress(x, weight, 32, 16, ends)
        backward = kernels_launched(lambda: torch.autograd.grad(out, (x, weight), dout))
        counts.add((len(forward), len(backward)))
    assert len(counts) == 1, counts


def test_bench_overhead_times_each_entry_point_beside_torch_and_the_floor(tmp_path, capsys, device):
    # On the test device: on a CPU with the Triton launches stubbed (what it times is gradops'
    # Python), on a GPU the real calls. The figures themselves are for the benchmark
    # (docs/benchmarks.md); here, that every entry point is timed with its launches counted,
    # beside torch's call and the bare autograd.Function floor.
    import json

    from gradops.bench import overhead

    rc = overhead.main(["--device", device, "--quick", "--reps", "2", "--warmup", "1", "--no-plot",
                        "--out", str(tmp_path), "--tag", "t"])
    out = capsys.readouterr().out
    assert rc == 0, out
    records = json.loads((tmp_path / "t.json").read_text())["records"]
    by = {(r["op"], r["impl"]): r for r in records}
    for op in ("F.rms_norm fwd+bwd", "F.layer_norm fwd+bwd", "nn.RMSNorm fwd+bwd", "nn.LayerNorm fwd+bwd"):
        for impl in ("gradops", "torch", "floor"):
            assert not by[(op, impl)]["error"] and min(by[(op, impl)]["times_ms"]) > 0, (op, impl)
        assert 2 <= len(by[(op, "gradops")]["extra"]["launches"]) <= FORWARD_BUDGET + BACKWARD_BUDGET
        assert len(by[(op, "floor")]["extra"]["launches"]) == 3
    assert by[("gradops.rms_norm", "gradops")]["extra"]["launches"] == ["_rms_fwd_fused_kernel"]
    assert "launches per call, F.rms_norm fwd+bwd:" in out


def test_the_floors_launch_their_kernels_with_every_argument(device):
    # bench overhead stubs the launches on a CPU, so a floor whose arguments no longer fit its
    # kernel would fail only on a GPU (the RMSNorm floor's backward did, after the scalars
    # became two words): here they run for real (on a CPU through the interpreter), against torch
    from gradops.bench import overhead

    m, n = overhead.SHAPE
    fwd, bwd, red = overhead._configs(m, n, torch.device(device), torch.float32)
    x, dy = rand((m, n), torch.float32, device), rand((m, n), torch.float32, device)
    w, b = rand((n,), torch.float32, device), rand((n,), torch.float32, device)
    for floor, want in ((lambda x, w, b: overhead._FloorRmsNorm.apply(x, w, fwd, bwd, red),
                         lambda x, w, b: torch.nn.functional.rms_norm(x, (n,), w, 1e-6)),
                        (lambda x, w, b: overhead._FloorLayerNorm.apply(x, w, b, fwd, bwd, red),
                         lambda x, w, b: torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5))):
        results = []
        for fn in (floor, want):
            leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
            y = fn(*leaves)
            grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
            results.append([y] + [g for g in grads if g is not None])
        for got, exp in zip(*results):
            torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)


def test_bench_overhead_lists_every_entry_point_it_times(device):
    from gradops.bench import overhead

    with stubbed_launches():
        timed = overhead.entry_points(device, torch.float32)
    assert tuple(timed) == overhead.ENTRY_POINTS


def test_a_call_signature_seen_before_still_follows_the_default_backend_and_rejects_bad_input(device):
    # checks and plans are remembered per call signature (gradops.ops._plans): a call seen
    # before must still take the backend the default now names, and a bad call must still fail
    from gradops.errors import AclnnError

    x, w = rand((4, 64), torch.float32, device), rand((64,), torch.float32, device)
    with gradops.use_backend("reference"):
        assert gradops.rms_norm(x, w, 1e-6)[0].shape == (4, 64)
        with stubbed_launches() as launched:
            GF.rms_norm(x, (64,), w, 1e-6)
        assert launched == []  # the reference runs no Triton kernel
    with stubbed_launches() as launched:  # the module fixture's default: triton
        GF.rms_norm(x, (64,), w, 1e-6)
        gradops.rms_norm(x, w, 1e-6)
    assert launched == ["_rms_fwd_fused_kernel"] * 2
    for _ in range(2):
        with pytest.raises(AclnnError, match="eps"):
            GF.rms_norm(x, (64,), w, "1e-6")
        with pytest.raises(AclnnError, match="weight"):
            GF.rms_norm(x, (64,), w[:32], 1e-6)


def test_remembered_backward_calls_still_reject_bad_input_and_in_place_overlaps(device):
    # the backward APIs remember a signature's checks too; an in-place call's overlap rules read
    # data pointers, so such calls are checked every time
    from gradops.errors import AclnnError

    x, dy = rand((4, 64), torch.float32, device), rand((4, 64), torch.float32, device)
    w = rand((64,), torch.float32, device)
    mean, rstd = x.mean(1), x.var(1, unbiased=False).add(1e-5).rsqrt()
    for _ in range(2):
        assert gradops.layer_norm_backward(dy, x, (64,), mean, rstd, w)[0].shape == (4, 64)
        assert gradops.rms_norm_grad(dy, x, rstd, w)[0].shape == (4, 64)
        with pytest.raises(AclnnError, match="output_mask"):
            gradops.layer_norm_backward(dy, x, (64,), mean, rstd, w, output_mask=(True, True))
        with pytest.raises(AclnnError, match="rstd"):
            gradops.rms_norm_grad(dy, x, rstd[:2], w)
    for _ in range(2):  # dx written into dy, which x's memory is: refused every time
        with pytest.raises(AclnnError, match="dy"):
            gradops.layer_norm_backward(x, x, (64,), mean, rstd, w, in_place=True)
        with pytest.raises(AclnnError, match="dy"):
            gradops.rms_norm_grad(x, x, rstd, w, in_place=True)


def test_a_remembered_signature_keys_its_attributes_by_type_and_value(device):
    # 64.0 == 64 and True == 1 in Python, not to the checks; a tensor-valued attribute may
    # change after the call (and a key would keep it alive): it is never remembered
    from gradops.errors import AclnnError
    from gradops.kernels._scalar_args import float64_bits
    from gradops.ops import _plans

    x, w, b = (rand(shape, torch.float32, device) for shape in ((4, 64), (64,), (64,)))
    gradops.layer_norm(x, (64,), w, b, 1e-5)
    GF.layer_norm(x, (64,), w, b, 1e-5)
    for bad in ((64.0,), [64.0]):
        with pytest.raises(AclnnError, match="normalized_shape"):
            gradops.layer_norm(x, bad, w, b, 1e-5)
        with pytest.raises(AclnnError, match="normalized_shape"):
            GF.layer_norm(x, bad, w, b, 1e-5)
    shape = torch.tensor([64])
    gradops.layer_norm(x, shape, w, b, 1e-5)
    shape[0] = 32
    with pytest.raises(AclnnError, match="normalized_shape"):
        gradops.layer_norm(x, shape, w, b, 1e-5)
    assert not any(isinstance(part, torch.Tensor) for key in _plans._plans for part in key)
    # -0.0 == 0.0, but an offset of -0.0 leaves -0.0 weights' zeros negative
    assert _plans.signature("op", None, (), (0.0,)) != _plans.signature("op", None, (), (-0.0,))
    assert float64_bits(0.0) == (0, 0) and float64_bits(-0.0) == (-(2 ** 31), 0)
    unhashable = _plans.signature("op", None, (), ({"a": 1},))  # found under no key, kept under none
    assert _plans.remember(unhashable, "plan") == "plan" and _plans.lookup(unhashable) is None


# ---------------------------------------------------------------------------------------------
# Floyd attention at FloydNet's shapes (issue 44): small grids in few launches
# ---------------------------------------------------------------------------------------------
SMALL_GRID_LAUNCHES = 7  # one chunk of the hybrid strategy (3 forward, 4 backward); the fused kernels launch 4


def floyd_step(b, h, grid, d, masked, device, broadcast=False):
    """``gradops.pivotal_attention`` forward and backward at FloydNet's shapes under bf16
    autocast (B, H heads of D, an L x L grid, its padding pair mask [B,1,L,1,L]): (the
    forward, the backward given the forward's output). ``broadcast``: zero-stride inputs (a
    large B*H with nothing allocated; the launches are recorded, not run)."""
    gen = torch.Generator().manual_seed(0)
    if broadcast:
        inputs = [torch.randn(1, 1, 1, 1, d, generator=gen).to(device=device, dtype=torch.bfloat16)
                  .expand(b, h, grid, grid, d).requires_grad_() for _ in range(5)]
    else:
        inputs = [torch.randn(b, h, grid, grid, d, generator=gen).to(device=device, dtype=torch.bfloat16)
                  .requires_grad_() for _ in range(5)]
    mask = pair_mask(b, grid, grid).to(device) if masked else None

    def forward():
        return gradops.pivotal_attention(*inputs, attn_mask=mask)

    def backward(out):
        dy = torch.ones(out.shape, dtype=out.dtype, device=out.device)
        return lambda: torch.autograd.grad(out, inputs, dy)

    return forward, backward


def floyd_launches(forward, backward):
    """(the forward's launches, the backward's), as kernels_launched counts them."""
    fwd = kernels_launched(forward)
    with stubbed_launches():  # the graph to differentiate, without running the kernels
        out = forward()
    return fwd, kernels_launched(backward(out))


@pytest.mark.parametrize("grid", [20, 32, 64, 100, 128])
@pytest.mark.parametrize("masked", [True, False], ids=["pair_mask", "no_mask"])
def test_pivotal_attention_on_a_small_grid_runs_each_kernel_once(grid, masked, device):
    """FloydNet's TSP block (B = 1, 6 heads of D = 64, bf16 under autocast): a forward and its
    backward launch no kernel-launching torch op (the statistics' gradients are not zero-filled)
    and at most one chunk's Triton kernels, whatever the grid up to 128 (chunking used to
    double them at 128)."""
    fwd, bwd = floyd_launches(*floyd_step(1, 6, grid, 64, masked, device))
    torch_ops = [k for k in fwd + bwd if k.startswith("aten::")]
    assert torch_ops == [], (fwd, bwd)
    assert len(fwd) + len(bwd) <= SMALL_GRID_LAUNCHES, (fwd, bwd)


@pytest.mark.parametrize("b, h, grid", [(16, 6, 128), (8, 12, 64)])
def test_a_small_grid_runs_each_kernel_once_for_any_batch(b, h, grid, device):
    """A batch of TSP grids at L = 128 (B*H = 96: the hybrid strategy's one chunk would pass the
    device's share, the fused kernels take it) and of graph-count graphs (12 heads, L = 64), and
    each strategy forced: one chunk's launches."""
    forward, backward = floyd_step(b, h, grid, 64, True, device, broadcast=True)
    fwd, bwd = floyd_launches(forward, backward)
    assert not [k for k in fwd + bwd if k.startswith("aten::")] and len(fwd) + len(bwd) <= SMALL_GRID_LAUNCHES
    forward, backward = floyd_step(1, 6, 128, 64, True, device)
    for forced, count in (("fused", 4), ("hybrid", SMALL_GRID_LAUNCHES)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(floyd_config, "STRATEGY", forced)
            fwd, bwd = floyd_launches(forward, backward)
        assert len(fwd) + len(bwd) == count and not [k for k in fwd + bwd if k.startswith("aten::")], (forced, fwd, bwd)
