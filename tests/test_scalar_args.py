"""gradops.kernels._scalar_args: a float64 scalar reaches a kernel as two int32 words, bit for
bit. One int64 would be exact too, but Inductor (torch 2.11) fails to compile a user Triton
kernel with an integer argument past 2^31, and the norm forwards are such kernels under
torch.compile (the GPU run of 2026-11-28: ``'int' object has no attribute 'xreplace'``)."""
import math
import struct

import pytest
import torch
import triton
import triton.language as tl

from gradops.kernels._scalar_args import float64_bits, unpack_float64

VALUES = (1e-5, 1e-6, 0.0, -0.0, 1 / 3, -2.718281828459045, 5e-324, 1.7976931348623157e308, math.inf, -math.inf,
          math.nan)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_each_word_is_an_int32(value):
    words = float64_bits(value)
    assert len(words) == 2 and all(type(w) is int and -2**31 <= w < 2**31 for w in words), words


@triton.jit
def _unpack_kernel(out64, out32, high, low):
    tl.store(out64, unpack_float64(high, low, tl.float64))
    tl.store(out32, unpack_float64(high, low, tl.float32))


def test_the_words_give_the_float64_back_in_a_kernel(device):
    for value in VALUES:
        out64 = torch.empty(1, dtype=torch.float64, device=device)
        out32 = torch.empty(1, dtype=torch.float32, device=device)
        _unpack_kernel[(1,)](out64, out32, *float64_bits(value))
        got = struct.pack("<d", out64.item())
        assert got == struct.pack("<d", value) or (math.isnan(value) and math.isnan(out64.item())), value
        # rounded once to float32, as torch rounds a Python float
        want32 = torch.tensor(value, dtype=torch.float32)
        assert torch.equal(out32.cpu(), want32.reshape(1)) or (math.isnan(value) and out32.isnan().all()), value
