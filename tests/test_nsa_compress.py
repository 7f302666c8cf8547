"""NSA compression (``gradops.nsa_compress`` / ``nsa_compress_grad``) through the public API,
against the independent float64 oracles of ``gradops.oracles`` (a per-block loop for the
forward, autograd through it for the backward). Most tests run on the reference backend;
the NaN-locality, empty-problem and host-transfer tests run on both (``backend`` fixture;
on CPU the Triton kernels go through the interpreter)."""
import gc
import itertools
import re
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import gradops
from gradops import oracles
from gradops.oracles import TOLERANCE, rel_error
from gradops.reference import nsa_compress as reference_nsa

from helpers import nsa_problem

BACKEND = "reference"
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def compress(x, weight, block_size, stride, seq_lens, seq_lens_type="cumsum", backend=BACKEND):
    return gradops.nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type, backend=backend)


def compress_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type="cumsum", backend=BACKEND):
    return gradops.nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type,
                                     backend=backend)


def cumulative(lengths):
    return list(itertools.accumulate(lengths))


def mixed_lengths(block_size, stride):
    """Empty, shorter than a block, exactly one block, one block plus a tail, several windows
    with a tail: every case of the block count formula."""
    return [0, block_size - 1, block_size, block_size + 1, block_size + 3 * stride + stride // 2 + 1, 0,
            2 * block_size + stride]


def covered_tokens(ends, block_size, stride):
    """{token: [(block, offset j), ...]} from the oracle's block starts."""
    cover = {}
    for c, s in enumerate(oracles.nsa_blocks(ends, block_size, stride)):
        for j in range(block_size):
            cover.setdefault(s + j, []).append((c, j))
    return cover


def random_problem(lengths, n, d, block_size, stride, dtype, device):
    return nsa_problem(lengths, n, d, block_size, stride, dtype, device)


# block/stride: stride < block (overlap), == block, block % stride != 0, stride > block (gaps), 1/1.
BLOCK_STRIDE = [(4, 2), (3, 3), (5, 2), (2, 3), (1, 1), (6, 4)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,stride", BLOCK_STRIDE)
def test_forward_and_backward_match_float64_oracle(block_size, stride, dtype, device):
    lengths = mixed_lengths(block_size, stride)
    ends, x, weight, dout = random_problem(lengths, 3, 5, block_size, stride, dtype, device)
    blocks = dout.shape[0]
    assert blocks > 0  # the mixed lengths always hold some blocks

    out = compress(x, weight, block_size, stride, ends)
    assert out.dtype == dtype and out.device == x.device
    assert tuple(out.shape) == (blocks, 3, 5)
    assert rel_error(out, oracles.nsa_compress(x, weight, block_size, stride, ends)) <= TOLERANCE[dtype]

    dx, dweight = compress_grad(dout, x, weight, block_size, stride, ends)
    assert dx.dtype == dtype and dweight.dtype == dtype
    assert dx.shape == x.shape and dweight.shape == weight.shape
    dx_ref, dweight_ref = oracles.nsa_compress_backward(dout, x, weight, block_size, stride, ends)
    assert rel_error(dx, dx_ref) <= TOLERANCE[dtype]
    assert rel_error(dweight, dweight_ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_float64_and_float32(seed, device):
    gen = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen, device="cpu"))

    block_size, stride = draw(1, 9), draw(1, 9)
    lengths = [draw(0, 3 * block_size + 2 * stride) for _ in range(draw(1, 6))]
    n, d = draw(1, 4), draw(1, 17)
    for dtype in (torch.float64, torch.float32):
        ends, x, weight, dout = random_problem(lengths, n, d, block_size, stride, dtype, device)
        out = compress(x, weight, block_size, stride, ends)
        assert rel_error(out, oracles.nsa_compress(x, weight, block_size, stride, ends)) <= TOLERANCE[dtype]
        dx, dweight = compress_grad(dout, x, weight, block_size, stride, ends)
        dx_ref, dweight_ref = oracles.nsa_compress_backward(dout, x, weight, block_size, stride, ends)
        assert rel_error(dx, dx_ref) <= TOLERANCE[dtype]
        assert rel_error(dweight, dweight_ref) <= TOLERANCE[dtype]


class _Compress(torch.autograd.Function):
    """Forward through gradops.nsa_compress, backward through gradops.nsa_compress_grad, so that
    gradcheck compares the library's backward with finite differences of its forward."""

    @staticmethod
    def forward(ctx, x, weight, block_size, stride, seq_lens):
        ctx.save_for_backward(x, weight)
        ctx.attrs = (block_size, stride, seq_lens)
        return compress(x, weight, block_size, stride, seq_lens)

    @staticmethod
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dx, dweight = compress_grad(dout, x, weight, *ctx.attrs)
        return dx, dweight, None, None, None


@pytest.mark.parametrize("block_size,stride", [(3, 2), (2, 3), (3, 3)])
def test_gradcheck_finite_differences(block_size, stride, device):
    ends = cumulative([0, 2, 3, 7])
    x = torch.randn(ends[-1], 2, 3, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(block_size, 2, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: _Compress.apply(a, w, block_size, stride, ends), (x, weight))


def test_seq_lens_forms_agree(device):
    block_size, stride = 4, 3
    lengths = [5, 0, 4, 11, 2]
    ends, x, weight, dout = random_problem(lengths, 2, 3, block_size, stride, torch.float64, device)
    expected = oracles.nsa_compress(x, weight, block_size, stride, ends)
    expected_dx, expected_dw = oracles.nsa_compress_backward(dout, x, weight, block_size, stride, ends)
    forms = [
        (ends, "cumsum"), (tuple(ends), "cumsum"), ([0] + ends, "cumsum"),
        (torch.tensor(ends, dtype=torch.int64), "cumsum"), (torch.tensor(ends, dtype=torch.int32), "cumsum"),
        (lengths, "lengths"), (tuple(lengths), "lengths"),
        (torch.tensor(lengths, dtype=torch.int64), "lengths"), (torch.tensor(lengths, dtype=torch.int32), "lengths"),
        ([0] + lengths + [0], "lengths"), (ends, 0), (lengths, 1),
    ]
    for seq_lens, kind in forms:
        out = compress(x, weight, block_size, stride, seq_lens, kind)
        assert rel_error(out, expected) <= 1e-12, (seq_lens, kind)
        dx, dw = compress_grad(dout, x, weight, block_size, stride, seq_lens, kind)
        assert rel_error(dx, expected_dx) <= 1e-12, (seq_lens, kind)
        assert rel_error(dw, expected_dw) <= 1e-12, (seq_lens, kind)


def test_leading_zero_cumsum_is_an_empty_sequence(device):
    # [0, 6] is two sequences (empty, then 6 tokens), so the blocks are those of one 6-token sequence
    x = torch.randn(6, 2, 3, dtype=torch.float64, device=device)
    weight = torch.randn(4, 2, dtype=torch.float64, device=device)
    out = compress(x, weight, 4, 1, [0, 6])
    assert out.shape == (3, 2, 3)
    assert rel_error(out, oracles.nsa_compress(x, weight, 4, 1, [6])) <= 1e-12


def test_uncovered_tokens_get_zero_gradient(device):
    # stride > block leaves gaps; the tails of sequences are not covered either
    block_size, stride = 2, 5
    lengths = [13, 1, 9]
    ends, x, weight, dout = random_problem(lengths, 2, 3, block_size, stride, torch.float32, device)
    dx, _ = compress_grad(dout, x, weight, block_size, stride, ends)
    cover = covered_tokens(ends, block_size, stride)
    uncovered = [t for t in range(ends[-1]) if t not in cover]
    assert uncovered and all(t in cover for t in range(ends[-1]) if t not in uncovered)
    assert torch.all(dx[uncovered] == 0)
    assert torch.all(dx[sorted(cover)] != 0)


# Empty problems: T = 0 (no sequence, empty sequences), C = 0 (no sequence holds a block),
# N = 0 or D = 0 (with and without blocks), and their combinations. (lengths, N, D)
EMPTY_CASES = [
    ([], 2, 3), ([0], 2, 3), ([0, 0], 2, 3),
    ([3, 0, 2], 2, 3), ([0, 3, 3], 1, 1),
    ([10], 0, 3), ([0, 10, 0, 7], 0, 3),
    ([10], 2, 0), ([7, 0, 10], 3, 0),
    ([10], 0, 0), ([], 0, 0), ([0, 0], 0, 5), ([], 3, 0), ([2, 1], 0, 3),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths,n,d", EMPTY_CASES, ids=str)
def test_empty_problems(backend, lengths, n, d, dtype, device):
    """Correct shapes and dtypes, and zero gradients: with no block (C = 0) no token is
    covered and dweight sums over nothing; with D = 0 dweight is a sum over an empty head
    dim; with N = 0 every output is empty."""
    block_size, stride = 4, 2
    ends = cumulative(lengths)
    blocks = len(oracles.nsa_blocks(ends, block_size, stride))
    assert blocks == 0 or n * d == 0  # nothing to compute in any case
    x = torch.randn(ends[-1] if ends else 0, n, d, device=device).to(dtype)
    weight = torch.randn(block_size, n, device=device).to(dtype)
    out = compress(x, weight, block_size, stride, ends, backend=backend)
    assert out.shape == (blocks, n, d) and out.dtype == dtype and out.device == x.device
    dout = torch.randn(blocks, n, d, device=device).to(dtype)
    dx, dweight = compress_grad(dout, x, weight, block_size, stride, ends, backend=backend)
    assert dx.shape == x.shape and dweight.shape == weight.shape
    assert dx.dtype == dweight.dtype == dtype and dx.device == dweight.device == x.device
    assert not dx.any() and not dweight.any()


def test_non_contiguous_inputs(device):
    block_size, stride = 3, 2
    ends = cumulative([7, 2, 8])
    t = ends[-1]
    blocks = len(oracles.nsa_blocks(ends, block_size, stride))
    x = torch.randn(4, t, 7, dtype=torch.float64, device=device).transpose(0, 1)[:, 1:, ::2]  # [T, 3, 4]
    weight = torch.randn(3, block_size, dtype=torch.float64, device=device).t()  # [block, 3]
    dout = torch.randn(4, 2 * blocks, 3, dtype=torch.float64, device=device).permute(1, 2, 0)[::2]
    assert not (x.is_contiguous() or weight.is_contiguous() or dout.is_contiguous())
    assert dout.shape == (blocks, 3, 4)

    out = compress(x, weight, block_size, stride, ends)
    assert rel_error(out, oracles.nsa_compress(x, weight, block_size, stride, ends)) <= 1e-10
    dx, dweight = compress_grad(dout, x, weight, block_size, stride, ends)
    dx_ref, dweight_ref = oracles.nsa_compress_backward(dout, x, weight, block_size, stride, ends)
    assert rel_error(dx, dx_ref) <= 1e-10 and rel_error(dweight, dweight_ref) <= 1e-10


def test_inputs_are_not_modified(device):
    block_size, stride = 4, 2
    ends, x, weight, dout = random_problem([9, 6], 2, 3, block_size, stride, torch.float32, device)
    seq_lens = torch.tensor(ends)
    before = [t.clone() for t in (x, weight, dout, seq_lens)]
    compress(x, weight, block_size, stride, seq_lens)
    compress_grad(dout, x, weight, block_size, stride, seq_lens)
    for old, new in zip(before, (x, weight, dout, seq_lens)):
        assert torch.equal(old, new)


# ---------------------------------------------------------------------------------------------
# NaN (and inf) locality: a non-finite input must reach exactly the outputs whose formula
# has it as a term. Expected patterns come from the block starts alone (the oracle's
# explicit loop), and the float64 oracle must agree with them.

# (block_size, stride, lengths)
NAN_PACKINGS = [
    (4, 3, [13]),                # blocks at 0, 3, 6, 9; token 12 is a tail
    (5, 2, [0, 11, 3, 0, 9]),    # l % s != 0, empty sequences, one shorter than a block, tails
    (2, 5, [12, 0, 8]),          # stride > block: gaps no block covers, an empty sequence
]


def expected_non_finite(kind, site, x_shape, block_size, starts):
    """Masks (out, dx, dweight) of the outputs that one non-finite value at ``site`` of
    ``kind`` ("x", "weight" or "dout") enters as a term:

        out[c, n, d]  = sum_j w[j, n] x[start_c + j, n, d]
        dx[t, n, d]   = sum over (c, j) with start_c + j = t of w[j, n] dout[c, n, d]
        dweight[j, n] = sum_c sum_d dout[c, n, d] x[start_c + j, n, d]

    Every other input is finite and non-zero, and each of these sums has at most one term
    with the bad value, so the result there is non-finite (NaN for a NaN, +-inf for an inf).
    On the CPU, where ``assert_non_finite_pattern`` compares them."""
    tokens, heads, dims = x_shape
    out = torch.zeros(len(starts), heads, dims, dtype=torch.bool, device="cpu")
    dx = torch.zeros(x_shape, dtype=torch.bool, device="cpu")
    dweight = torch.zeros(block_size, heads, dtype=torch.bool, device="cpu")
    if kind == "x":
        t, n, d = site
        for c, start in enumerate(starts):
            if start <= t < start + block_size:
                out[c, n, d] = True
                dweight[t - start, n] = True
    elif kind == "weight":
        j, n = site
        out[:, n, :] = True
        for start in starts:
            dx[start + j, n, :] = True
    else:
        c, n, d = site
        dx[starts[c]:starts[c] + block_size, n, d] = True
        dweight[:, n] = True
    return out, dx, dweight


def non_finite_sites(kind, x_shape, block_size, blocks):
    """Every token, weight row or block, with the head and head-dim index rotating."""
    tokens, heads, dims = x_shape
    if kind == "x":
        return [(t, t % heads, t % dims) for t in range(tokens)]
    if kind == "weight":
        return [(j, j % heads) for j in range(block_size)]
    return [(c, c % heads, c % dims) for c in range(blocks)]


def assert_non_finite_pattern(got, want, value, what):
    got = got.cpu()
    bad = ~torch.isfinite(got)
    assert torch.equal(bad, want), (f"{what}: non-finite at {bad.nonzero().tolist()}, "
                                    f"expected at {want.nonzero().tolist()}")
    # A NaN stays NaN; a single inf term gives +-inf, never NaN.
    assert torch.equal(torch.isnan(got), want if value != value else torch.zeros_like(want)), what


@pytest.mark.parametrize("kind,value", [("x", float("nan")), ("weight", float("nan")), ("dout", float("nan")),
                                        ("weight", float("-inf")), ("dout", float("inf"))], ids=str)
@pytest.mark.parametrize("block_size,stride,lengths", NAN_PACKINGS, ids=str)
def test_non_finite_values_stay_where_the_formulas_put_them(backend, kind, value, block_size, stride,
                                                            lengths, device):
    ends, x, weight, dout = random_problem(lengths, 2, 3, block_size, stride, torch.float32, device)
    assert (x != 0).all() and (weight != 0).all() and (dout != 0).all()
    starts = oracles.nsa_blocks(ends, block_size, stride)
    for site in non_finite_sites(kind, tuple(x.shape), block_size, len(starts)):
        inputs = dict(x=x.clone(), weight=weight.clone(), dout=dout.clone())
        inputs[kind][site] = value
        bx, bw, bg = inputs["x"], inputs["weight"], inputs["dout"]
        want_out, want_dx, want_dw = expected_non_finite(kind, site, tuple(x.shape), block_size, starts)
        where = f"{kind}[{site}] = {value}"
        # The expectation is the math's: the float64 oracle (autograd through a per-block
        # loop) puts the bad value in the same places.
        oracle_dx, oracle_dw = oracles.nsa_compress_backward(bg, bx, bw, block_size, stride, ends)
        assert_non_finite_pattern(oracle_dx, want_dx, value, f"oracle dx, {where}")
        assert_non_finite_pattern(oracle_dw, want_dw, value, f"oracle dweight, {where}")
        if kind != "dout":  # the forward does not read dout
            assert_non_finite_pattern(oracles.nsa_compress(bx, bw, block_size, stride, ends), want_out,
                                      value, f"oracle out, {where}")
            out = compress(bx, bw, block_size, stride, ends, backend=backend)
            assert_non_finite_pattern(out, want_out, value, f"out, {where}")
        dx, dweight = compress_grad(bg, bx, bw, block_size, stride, ends, backend=backend)
        assert_non_finite_pattern(dx, want_dx, value, f"dx, {where}")
        assert_non_finite_pattern(dweight, want_dw, value, f"dweight, {where}")


# ---------------------------------------------------------------------------------------------
# Errors: every rule carries CANN's status and names the parameter.

def _raises(status, name, *words):
    """pytest.raises(AclnnError) that also checks the status, that the message leads with the
    parameter (``"<op>: <name> ..."``) and that it contains ``words``."""
    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(gradops.AclnnError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            message = str(self.info.value)
            assert self.info.value.status == status, message
            assert re.match(rf"^\w+: {re.escape(name)}\b", message), (name, message)
            for word in words:
                assert word in message, (word, message)
            return suppressed
    return Check()


@pytest.fixture
def good(device):
    ends = [5, 9]
    x = torch.randn(9, 2, 3, device=device)
    weight = torch.randn(4, 2, device=device)
    blocks = len(oracles.nsa_blocks(ends, 4, 2))
    dout = torch.randn(blocks, 2, 3, device=device)
    return dict(dout=dout, x=x, weight=weight, block_size=4, stride=2, seq_lens=ends, seq_lens_type="cumsum")


def _fwd(args):
    a = dict(args)
    a.pop("dout")
    return gradops.nsa_compress(**a, backend=BACKEND)


def _bwd(args):
    return gradops.nsa_compress_grad(**args, backend=BACKEND)


NULLPTR = gradops.ACLNN_ERR_PARAM_NULLPTR
INVALID = gradops.ACLNN_ERR_PARAM_INVALID


@pytest.mark.parametrize("name", ["x", "weight", "seq_lens", "block_size", "stride", "dout"])
def test_none_is_nullptr(good, name):
    args = dict(good, **{name: None})
    calls = [_bwd] if name == "dout" else [_fwd, _bwd]
    for call in calls:
        with _raises(NULLPTR, name, "None"):
            call(args)


@pytest.mark.parametrize("name,dtype", [("x", torch.int32), ("x", torch.complex64), ("weight", torch.float64),
                                        ("weight", torch.float16), ("dout", torch.bfloat16)])
def test_dtype_errors(good, name, dtype):
    args = dict(good, **{name: good[name].to(dtype)})
    calls = [_bwd] if name == "dout" else [_fwd, _bwd]
    for call in calls:
        with _raises(INVALID, name, "dtype"):
            call(args)


@pytest.mark.parametrize("change,name", [
    (lambda device: dict(x=torch.randn(9, 6, device=device)), "x"),
    (lambda device: dict(x=torch.randn(9, 2, 3, 1, device=device)), "x"),
    (lambda device: dict(weight=torch.randn(3, 2, device=device)), "weight"),
    (lambda device: dict(weight=torch.randn(4, 3, device=device)), "weight"),
    (lambda device: dict(weight=torch.randn(4, device=device)), "weight"),
    (lambda device: dict(seq_lens=[5, 8]), "seq_lens"),            # last end != T
    (lambda device: dict(seq_lens=[5, 10]), "seq_lens"),
    (lambda device: dict(seq_lens=[6, 5, 9]), "seq_lens"),         # decreasing
    (lambda device: dict(seq_lens=[-1, 9]), "seq_lens"),
    (lambda device: dict(seq_lens=[]), "seq_lens"),               # no sequences but T = 9
    (lambda device: dict(seq_lens=[5, 3], seq_lens_type="lengths"), "seq_lens"),  # sum != T
    (lambda device: dict(seq_lens=[10, -1], seq_lens_type="lengths"), "seq_lens"),
    (lambda device: dict(seq_lens=[5.0, 9.0]), "seq_lens"),
    (lambda device: dict(seq_lens=[5, True]), "seq_lens"),
    (lambda device: dict(seq_lens=9), "seq_lens"),
    (lambda device: dict(seq_lens=torch.tensor([5.0, 9.0], device="cpu")), "seq_lens"),
    (lambda device: dict(seq_lens=torch.tensor([[5, 9]], device="cpu")), "seq_lens"),
    (lambda device: dict(seq_lens_type="bogus"), "seq_lens_type"),
    (lambda device: dict(seq_lens_type=2), "seq_lens_type"),
    (lambda device: dict(block_size=0), "block_size"),
    (lambda device: dict(block_size=-4), "block_size"),
    (lambda device: dict(block_size=4.0), "block_size"),
    (lambda device: dict(stride=0), "stride"),
    (lambda device: dict(stride=-1), "stride"),
    (lambda device: dict(stride=2.5), "stride"),
])
def test_shape_and_attribute_errors(good, change, name, device):
    # the table's tensors are made here, on the test device (a tensor in a parametrize table
    # would be made at collection, on the CPU); seq_lens tensors are host metadata
    args = dict(good, **change(device))
    for call in (_fwd, _bwd):
        with _raises(INVALID, name):
            call(args)


@pytest.mark.parametrize("shape", [(1, 2, 3), (3, 2, 3), (2, 2, 4), (2, 3, 3), (2, 6)])  # (2, 2, 3) is right
def test_dout_shape_error(good, shape, device):
    with _raises(INVALID, "dout"):
        _bwd(dict(good, dout=torch.randn(shape, device=device)))


def test_unknown_backend(good):
    with _raises(INVALID, "backend"):
        gradops.nsa_compress(good["x"], good["weight"], 4, 2, good["seq_lens"], backend="bogus")


@pytest.mark.parametrize("name", ["x", "weight", "dout"])
def test_non_tensor_input(good, name):
    args = dict(good, **{name: good[name].tolist()})
    calls = [_bwd] if name == "dout" else [_fwd, _bwd]
    for call in calls:
        with _raises(INVALID, name, "Tensor"):
            call(args)


# ---------------------------------------------------------------------------------------------
# Host and device: once a packing has been seen, a call moves nothing between them, so it can
# be captured in a CUDA graph. Without a GPU, the "device" is PyTorch's meta device: a copy of
# host data to it, or a read of its data on the host, shows as an aten op, and (unlike CPU
# tensors) nothing can pass between the two unseen.

class HostDeviceTraffic(TorchDispatchMode):
    """Records the aten ops that move data between the host and ``device``: an op with a host
    (CPU) tensor among its inputs and a ``device`` tensor among its inputs or outputs (a
    copy), and ``_local_scalar_dense`` of a ``device`` tensor (``.item()``, ``int()``,
    ``.tolist()``)."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        on_host = any(t.device.type == "cpu" for t in inputs)
        on_device = any(t.device == self.device for t in inputs + outputs)
        reads_device = func is torch.ops.aten._local_scalar_dense.default and on_device
        if (on_host and on_device) or reads_device:
            self.ops.append(str(func))
        return out


class KernelStub:
    """Stands in for a Triton kernel on the meta device (nothing can run there): records the
    arguments of every launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(args)


def counting(monkeypatch, module, name):
    """Wraps ``module.name`` so that the returned list collects the result of every call."""
    built = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(module, name, wrapper)
    return built


def table_builds(monkeypatch, backend):
    """The list of per-packing device tables the backend builds from now on (for triton also
    stubs its kernels)."""
    if backend == "reference":
        return counting(monkeypatch, reference_nsa, "block_starts")
    from gradops.kernels import nsa_compress as kernels_nsa
    for name in ("_nsa_compress_fwd_kernel", "_nsa_compress_bwd_kernel", "_sum_rows_kernel"):
        monkeypatch.setattr(kernels_nsa, name, KernelStub())
    return counting(monkeypatch, kernels_nsa, "_SeqTables")


def meta_calls(backend, block_size, stride, seq_lens, seq_lens_type="cumsum", heads=3, dims=5):
    """Forward and backward on meta tensors: through the public API for the reference, through
    the backend functions for triton (the public API sends meta tensors to no kernel)."""
    lengths = seq_lens if seq_lens_type == "lengths" else None
    ends = cumulative(lengths) if lengths is not None else list(seq_lens)
    x = torch.empty(ends[-1], heads, dims, device="meta")
    weight = torch.empty(block_size, heads, device="meta")
    blocks = len(oracles.nsa_blocks(ends, block_size, stride))
    dout = torch.empty(blocks, heads, dims, device="meta")
    if backend == "reference":
        for form in (seq_lens, torch.tensor(seq_lens)):  # a list, and a host tensor
            compress(x, weight, block_size, stride, form, seq_lens_type, backend=backend)
            compress_grad(dout, x, weight, block_size, stride, form, seq_lens_type, backend=backend)
    else:
        from gradops.kernels import nsa_compress as kernels_nsa
        cu = [0] + ends
        kernels_nsa.nsa_compress(x, weight, block_size, stride, cu, blocks)
        kernels_nsa.nsa_compress_grad(dout, x, weight, block_size, stride, cu, blocks)


def test_host_device_traffic_recorder_sees_transfers():
    with HostDeviceTraffic("meta") as seen:
        torch.ones(3).to("meta")
        torch.zeros(2, device="meta").copy_(torch.ones(2))
        torch.ones(4, device="meta") + torch.tensor(1.0)
        torch.ones(4).sum() + 1
    assert len(seen.ops) == 3, seen.ops


@pytest.mark.parametrize("seq_lens,seq_lens_type", [([9, 9, 17, 21], "cumsum"), ([0, 7, 4, 12], "lengths")],
                         ids=str)
def test_a_seen_packing_moves_nothing_between_host_and_device(backend, seq_lens, seq_lens_type, monkeypatch):
    block_size, stride = 3, 2
    builds = table_builds(monkeypatch, backend)
    meta_calls(backend, block_size, stride, seq_lens, seq_lens_type)  # first sight of the packing
    first = list(builds)
    assert first, "the packing's tables are built on first use"
    with HostDeviceTraffic("meta") as seen:
        meta_calls(backend, block_size, stride, seq_lens, seq_lens_type)
    assert seen.ops == [], f"host-device traffic with a packing already seen: {seen.ops}"
    assert len(builds) == len(first), "the packing's tables were built again"


def test_tables_a_cuda_graph_captured_outlive_the_cache(backend, monkeypatch):
    """A captured graph keeps reading its tables' addresses: the LRU may drop them, but they
    must stay alive (else the allocator hands their memory to other tensors). Capture is
    simulated (no GPU): the tables looked up "during capture" must survive 100 other packings
    and a garbage collection."""
    block_size, stride = 3, 2
    builds = table_builds(monkeypatch, backend)
    # raising=False: without these hooks (no pinning at all) the test runs and fails below.
    monkeypatch.setattr(reference_nsa, "_GRAPH_TABLES", {}, raising=False)
    monkeypatch.setattr(reference_nsa, "_capturing", lambda device: True, raising=False)
    meta_calls(backend, block_size, stride, [4, 4, 13])
    captured = [weakref.ref(t) for t in builds]
    assert captured
    monkeypatch.setattr(reference_nsa, "_capturing", lambda device: False)
    builds.clear()
    for n in range(100):
        meta_calls(backend, block_size, stride, [5 + n])
    gc.collect()
    assert all(ref() is not None for ref in captured), "tables a captured graph reads were freed"
    before = len(builds)
    meta_calls(backend, block_size, stride, [4, 4, 13])
    assert len(builds) > before, "the captured packing was not evicted from the cache: nothing tested"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_after_one_warm_up_call(backend, device):
    """On a GPU: after one call with a packing, forward and backward run without a host
    synchronisation (sync debug mode raises on one) and replay from a CUDA graph with the
    results of eager calls."""
    if device != "cuda":
        pytest.skip("needs GRADOPS_TEST_DEVICE=cuda")
    block_size, stride = 5, 2
    ends, x, weight, dout = random_problem([0, 11, 3, 0, 9], 3, 16, block_size, stride, torch.float32, device)
    for seq_lens in (ends, torch.tensor(ends, device="cpu")):  # a list, and a host tensor

        def step():
            out = compress(x, weight, block_size, stride, seq_lens, backend=backend)
            return (out,) + tuple(compress_grad(dout, x, weight, block_size, stride, seq_lens, backend=backend))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: tables built, kernels compiled
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for t in (x, weight, dout):  # new values in the same memory
            t.copy_(torch.randn_like(t))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)
