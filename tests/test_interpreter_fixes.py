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
