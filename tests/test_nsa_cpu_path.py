"""The CPU path of NSA compression (the chunked strided loop of gradops/reference/nsa_compress.py)
against the float64 oracles of ``gradops.oracles``: every tiling (overlap, l == s, l not a
multiple of s, gaps l < s), varlen packings with sequences shorter than a block, C = 0, every
dtype, non-contiguous x, chunks cut inside a sequence and chunks of one block. The chunk size is
shrunk so that small problems take the chunked path (asserted), not the gather fallback."""
import pytest
import torch

import gradops
from gradops import oracles
from gradops.oracles import TOLERANCE, rel_error
from gradops.reference import nsa_compress as reference_nsa

from helpers import nsa_problem

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
TILINGS = [(1, 1), (3, 1), (4, 2), (5, 2), (3, 3), (6, 4), (7, 3), (2, 3), (3, 7), (8, 8)]


@pytest.fixture
def strided_calls(monkeypatch):
    """Counts calls of the chunked path's forward and backward."""
    calls = []
    for name in ("_strided_forward", "_strided_backward"):
        original = getattr(reference_nsa, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(reference_nsa, name, wrapper)
    return calls


def chunk_blocks(monkeypatch, blocks, heads, dims):
    """Chunks of ``blocks`` blocks for x of ``heads`` x ``dims``."""
    monkeypatch.setattr(reference_nsa, "_CHUNK_ELEMS", blocks * heads * dims)


def problem(lengths, heads, dims, block_size, stride, dtype, seed=0):
    return nsa_problem(lengths, heads, dims, block_size, stride, dtype,
                       generator=torch.Generator().manual_seed(seed))


def check(x, weight, dout, block_size, stride, ends, dtype):
    out = gradops.nsa_compress(x, weight, block_size, stride, ends, backend="reference")
    assert out.dtype == dtype and out.shape == dout.shape
    assert rel_error(out, oracles.nsa_compress(x, weight, block_size, stride, ends)) <= TOLERANCE[dtype]
    dx, dweight = gradops.nsa_compress_grad(dout, x, weight, block_size, stride, ends, backend="reference")
    assert dx.dtype == dtype and dweight.dtype == dtype
    assert dx.shape == x.shape and dweight.shape == weight.shape
    dx_ref, dweight_ref = oracles.nsa_compress_backward(dout, x, weight, block_size, stride, ends)
    assert rel_error(dx, dx_ref) <= TOLERANCE[dtype]
    assert rel_error(dweight, dweight_ref) <= TOLERANCE[dtype]
    return out, dx, dweight


def varlen(block_size, stride):
    """Empty, shorter than a block, one block, one block and a tail, many blocks (several
    chunks, the last one partial), a long sequence ending exactly on a block."""
    return [0, block_size - 1, block_size, block_size + 1, block_size + 9 * stride + 1, 3,
            block_size + 11 * stride]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,stride", TILINGS)
def test_chunked_path_matches_float64_oracle(block_size, stride, dtype, monkeypatch, strided_calls):
    chunk_blocks(monkeypatch, 3, 2, 4)
    ends, x, weight, dout = problem(varlen(block_size, stride), 2, 4, block_size, stride, dtype)
    check(x, weight, dout, block_size, stride, ends, dtype)
    assert strided_calls == ["_strided_forward", "_strided_backward"]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 5, 12])
def test_every_chunk_size(blocks_per_chunk, monkeypatch, strided_calls):
    block_size, stride = 5, 2
    chunk_blocks(monkeypatch, blocks_per_chunk, 3, 8)
    ends, x, weight, dout = problem([40, 7, 61, 5, 5, 90], 3, 8, block_size, stride, torch.float32, seed=1)
    check(x, weight, dout, block_size, stride, ends, torch.float32)
    assert strided_calls


@pytest.mark.parametrize("block_size,stride", [(3, 2), (2, 5)])
def test_tokens_no_block_covers_get_zero_gradient(block_size, stride, monkeypatch, strided_calls):
    chunk_blocks(monkeypatch, 2, 2, 3)
    lengths = [block_size - 1, 4 * stride + block_size + 1, 0, 2 * stride + block_size]
    ends, x, weight, dout = problem(lengths, 2, 3, block_size, stride, torch.float32)
    covered = set()
    for start in oracles.nsa_blocks(ends, block_size, stride):
        covered.update(range(start, start + block_size))
    dx, _ = gradops.nsa_compress_grad(dout, x, weight, block_size, stride, ends, backend="reference")
    uncovered = [t for t in range(x.shape[0]) if t not in covered]
    assert uncovered
    assert torch.equal(dx[uncovered], torch.zeros_like(dx[uncovered]))
    assert strided_calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", [[3], [1, 2, 0], [0]], ids=str)
def test_no_blocks(lengths, dtype):
    block_size, stride = 4, 2
    ends, x, weight, dout = problem(lengths, 2, 3, block_size, stride, dtype)
    assert dout.shape[0] == 0
    out, dx, dweight = check(x, weight, dout, block_size, stride, ends, dtype)
    assert out.shape == (0, 2, 3)
    assert not dx.any() and not dweight.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_non_contiguous_inputs(layout, dtype, monkeypatch, strided_calls):
    block_size, stride = 5, 3
    chunk_blocks(monkeypatch, 2, 3, 4)
    ends, x, weight, dout = problem([30, 4, 26], 3, 4, block_size, stride, dtype, seed=2)
    if layout == "transposed":
        x = x.transpose(0, 2).contiguous().transpose(0, 2)
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "sliced":
        x = torch.cat([x, x], dim=2)[:, :, ::2]
        dout = torch.cat([dout, dout], dim=0)[::2]
        weight = weight.t().contiguous().t()
    else:
        x = x[:, :1].expand(x.shape)
    assert not x.is_contiguous()
    check(x, weight, dout, block_size, stride, ends, dtype)
    assert strided_calls


def test_one_block_larger_than_a_chunk(strided_calls):
    """N*D above the chunk size: chunks of one block each."""
    block_size, stride = 4, 2
    ends, x, weight, dout = problem([50, 33], 8, 4200, block_size, stride, torch.float32, seed=3)
    check(x, weight, dout, block_size, stride, ends, torch.float32)
    assert strided_calls


def test_default_chunks_at_a_realistic_shape(strided_calls):
    block_size, stride = 32, 16
    ends, x, weight, dout = problem([2100, 20, 3000], 4, 64, block_size, stride, torch.bfloat16, seed=4)
    check(x, weight, dout, block_size, stride, ends, torch.bfloat16)
    assert strided_calls == ["_strided_forward", "_strided_backward"]


def test_many_short_sequences_take_the_gather_loop(strided_calls):
    block_size, stride = 4, 2
    ends, x, weight, dout = problem([5, 6, 4, 7] * 10, 2, 4, block_size, stride, torch.float32)
    check(x, weight, dout, block_size, stride, ends, torch.float32)
    assert strided_calls == []


def test_differentiating_the_formula_takes_the_gather_loop(strided_calls):
    block_size, stride = 4, 2
    ends, x, weight, dout = problem([300], 2, 4, block_size, stride, torch.float64)
    xl, wl = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = reference_nsa.nsa_compress(xl, wl, block_size, stride, [0] + ends, dout.shape[0])
    dx, dweight = torch.autograd.grad(out, (xl, wl), dout)
    dx_ref, dweight_ref = oracles.nsa_compress_backward(dout, x, weight, block_size, stride, ends)
    assert rel_error(dx, dx_ref) <= TOLERANCE[torch.float64]
    assert rel_error(dweight, dweight_ref) <= TOLERANCE[torch.float64]
    assert strided_calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_and_independent_of_threads(dtype, strided_calls):
    block_size, stride = 32, 16
    ends, x, weight, dout = problem([900, 1300], 4, 64, block_size, stride, dtype, seed=5)
    first = gradops.nsa_compress_grad(dout, x, weight, block_size, stride, ends, backend="reference")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        again = gradops.nsa_compress_grad(dout, x, weight, block_size, stride, ends, backend="reference")
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert strided_calls
