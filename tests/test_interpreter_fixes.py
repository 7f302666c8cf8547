"""The test harness's fix to the Triton interpreter (tests/interpreter_fixes.py): float32 ->
bfloat16 inside a kernel gives torch's (and the GPU's) round-to-nearest-even bits."""
import pytest
import torch

from conftest import TEST_DEVICE

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _to_bf16_kernel(X, Y, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < N).to(tl.bfloat16), mask=i < N)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fix concerns the CPU interpreter")
def test_float32_to_bfloat16_rounds_to_nearest_even():
    x = torch.randn(5000, dtype=torch.float64).mul(100).float()
    # halfway cases (ties go to the even neighbour), carries into the exponent, the extremes
    x[:6] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 2 - 2 ** -9, 3.4e38, 1e-40, -0.0])
    x[6:9] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _to_bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    assert torch.isnan(y[8])
    keep = torch.ones(x.numel(), dtype=torch.bool)
    keep[8] = False
    assert torch.equal(y[keep].view(torch.int16), expected[keep].view(torch.int16))


@triton.jit
def _dot_kernel(A, B, C, R: tl.constexpr, T: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, R)
    t = tl.arange(0, T)
    c = tl.arange(0, COLS)
    a = tl.load(A + r[:, None] * T + t[None, :])
    b = tl.load(B + t[:, None] * COLS + c[None, :])
    tl.store(C + r[:, None] * COLS + c[None, :], tl.dot(a, b, input_precision="ieee"))


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fix concerns the CPU interpreter")
def test_dot_element_does_not_depend_on_the_tile():
    """An element of tl.dot is the same bits in a 16 x 16 tile as in a 64 x 128 one (as on a
    GPU), and is its products summed in order of the contraction, in float32."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=gen)
    b = torch.randn(32, 128, generator=gen)
    big = torch.empty(64, 128)
    _dot_kernel[(1,)](a, b, big, R=64, T=32, COLS=128)
    small = torch.empty(16, 16)
    _dot_kernel[(1,)](a[:16].contiguous(), b[:, :16].contiguous(), small, R=16, T=32, COLS=16)
    assert torch.equal(small, big[:16, :16])
    in_order = a[:, 0:1] * b[0:1, :]
    for t in range(1, 32):
        in_order = in_order + a[:, t:t + 1] * b[t:t + 1, :]
    assert torch.equal(big, in_order)


@triton.jit
def _plus_one(x):
    return x + 1.0 + tl.zeros([16], x.dtype)  # tl.zeros: a helper that sees triton.language.core


@triton.jit
def _helpers_kernel(X, Y, STEPS: tl.constexpr):
    i = tl.arange(0, 16)
    x = tl.load(X + i)
    for _ in range(STEPS):
        x = _plus_one(x)
    tl.store(Y + i, x)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fix concerns the CPU interpreter")
def test_helpers_inside_a_launch_are_not_patched_again(monkeypatch):
    """The language is patched once per launch and once more for a module only a helper sees
    (triton.language.core, through tl.zeros), not at every helper call; the helpers still run
    and the launch's patch is undone after it."""
    from triton.runtime import interpreter

    import interpreter_fixes

    original = interpreter._patch_lang._gradops_original
    calls = []

    def counted(fn):
        calls.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", interpreter_fixes._patch_lang_once(counted, (tl, tl.core)))
    arange = tl.arange
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty_like(x)
    _helpers_kernel[(2,)](x, y, STEPS=5)
    assert torch.equal(y, x + 5)
    assert calls[0] == "_helpers_kernel" and len(calls) <= 2, calls  # not 1 + 2 programs x 5 steps x 2 helpers
    assert tl.arange is arange


@triton.jit
def _wrapping_add_kernel(X, Y):
    i = tl.arange(0, 4)
    tl.store(Y + i, tl.load(X + i) + 2_000_000_000)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fix concerns the CPU interpreter")
def test_overflow_checks_are_left_out_only_where_the_interpreter_drops_them(monkeypatch):
    """The interpreter's own options (overflow checks on, debug off) let an int32 add that
    overflows through, wrapped, as the fixed options (checks off) do: the check's assertion is
    dropped without debug, so leaving the check out changes nothing but the time."""
    import dataclasses

    from triton.runtime import interpreter

    fixed = interpreter.interpreter_builder.options
    assert not fixed.debug and not fixed.sanitize_overflow
    x = torch.tensor([0, 1, 2_000_000_000, -5], dtype=torch.int32)
    results = []
    for options in (dataclasses.replace(fixed, sanitize_overflow=True), fixed):
        monkeypatch.setattr(interpreter.interpreter_builder, "options", options)
        y = torch.empty_like(x)
        _wrapping_add_kernel[(1,)](x, y)
        results.append(y)
    wrapped = ((x.long() + 2_000_000_000 + 2 ** 31) % 2 ** 32 - 2 ** 31).int()
    assert torch.equal(results[0], wrapped) and torch.equal(results[1], wrapped)
