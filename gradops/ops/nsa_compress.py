"""NSA compression: ``nsa_compress`` / ``nsa_compress_grad`` (aclnnNsaCompress /
aclnnNsaCompressGrad, OPERATORS.md section 4). Layout TND, packed variable-length sequences.
All rules here are 161002 (CANN checks weight, actSeqLen, type and layout in its op API)."""
from __future__ import annotations

import numbers
from typing import List

from .._backend import implementation
from ._checks import (
    ACLNN_ERR_PARAM_NULLPTR,
    FLOAT_DTYPES,
    check_dtype,
    check_int_attr,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_shape,
    fail,
    invalid,
    require_tensor,
    short_repr,
    wrong_type,
)
from ._prepared import Prepared
from ._shapes import int_sequence
from ..reference.nsa_compress import blocks_per_sequence

FAMILY = "nsa_compress"
SEQ_LENS_TYPES = {"cumsum": 0, "lengths": 1}  # CANN actSeqLenType values


def seq_lens_type_code(op: str, seq_lens_type) -> int:
    """"cumsum"/"lengths" (or CANN's 0/1) -> 0/1. None -> 161001; neither a str nor an int ->
    161002 as a TypeError; another string or int -> 161002."""
    if seq_lens_type is None:
        fail(op, ACLNN_ERR_PARAM_NULLPTR, "seq_lens_type is None, expected 'cumsum' (0) or 'lengths' (1)")
    if isinstance(seq_lens_type, str):
        if seq_lens_type in SEQ_LENS_TYPES:
            return SEQ_LENS_TYPES[seq_lens_type]
    elif isinstance(seq_lens_type, numbers.Integral) and not isinstance(seq_lens_type, bool):
        if seq_lens_type in (0, 1):
            return int(seq_lens_type)
    else:
        wrong_type(op, f"seq_lens_type is {short_repr(seq_lens_type)}, expected 'cumsum' (0) or 'lengths' (1)")
    invalid(op, f"seq_lens_type is {short_repr(seq_lens_type)}, expected 'cumsum' (0) or 'lengths' (1)")


def seq_lens_to_list(op: str, seq_lens) -> List[int]:
    """A list/tuple of ints or a 1-D integer tensor -> list of ints (host metadata)."""
    return list(int_sequence(op, "seq_lens", seq_lens))


def cu_seqlens(op: str, seq_lens, seq_lens_type, total: int) -> List[int]:
    """``[0, e_0, ..., T]``: cumulative ends with a leading 0, checked against T."""
    code = seq_lens_type_code(op, seq_lens_type)
    values = seq_lens_to_list(op, seq_lens)
    if code == 1:
        if any(v < 0 for v in values):
            invalid(op, f"seq_lens has a negative length {min(values)}, expected lengths >= 0")
        ends, acc = [], 0
        for v in values:
            acc += v
            ends.append(acc)
        if acc != total:
            invalid(op, f"seq_lens sums to {acc}, expected the lengths to sum to x.shape[0] == {total}")
    else:
        ends = values
        prev = 0
        for i, v in enumerate(ends):
            if v < prev:
                invalid(op, f"seq_lens[{i}] is {v} after {prev}, expected non-decreasing cumulative "
                            f"ends starting at >= 0")
            prev = v
        last = ends[-1] if ends else 0
        if last != total:
            invalid(op, f"seq_lens ends at {last}, expected the last cumulative end == x.shape[0] == {total}")
    return [0] + ends


def _check_common(op, x, weight, block_size, stride):
    check_rank(op, "x", x, 3, 3)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_same_dtype(op, "weight", weight, "x", x)
    block_size = check_int_attr(op, "block_size", block_size, 1)
    stride = check_int_attr(op, "stride", stride, 1)
    check_shape(op, "weight", weight, (block_size, x.shape[1]), "(block_size, x.shape[1])")
    return block_size, stride


def plan_blocks(cu: List[int], block_size: int, stride: int) -> int:
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return sum(blocks_per_sequence(lengths, block_size, stride))


def prepare_nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type="cumsum", *,
                         backend=None, op="nsa_compress") -> Prepared:
    require_tensor(op, "x", x)
    require_tensor(op, "weight", weight)
    block_size, stride = _check_common(op, x, weight, block_size, stride)
    cu = cu_seqlens(op, seq_lens, seq_lens_type, x.shape[0])
    check_same_device(op, [("x", x), ("weight", weight)])
    impl = implementation(op, FAMILY, backend, x.device)
    num_blocks = plan_blocks(cu, block_size, stride)
    out_shape = (num_blocks,) + tuple(x.shape[1:])

    def run():
        return impl.nsa_compress(x, weight, block_size, stride, cu, num_blocks)

    return Prepared(op, x.device, impl, ((out_shape, x.dtype),), run)


def prepare_nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type="cumsum", *,
                              backend=None, op="nsa_compress_grad") -> Prepared:
    require_tensor(op, "dout", dout)
    require_tensor(op, "x", x)
    require_tensor(op, "weight", weight)
    block_size, stride = _check_common(op, x, weight, block_size, stride)
    check_same_dtype(op, "dout", dout, "x", x)
    cu = cu_seqlens(op, seq_lens, seq_lens_type, x.shape[0])
    num_blocks = plan_blocks(cu, block_size, stride)
    check_shape(op, "dout", dout, (num_blocks,) + tuple(x.shape[1:]),
                "(number of compressed blocks,) + x.shape[1:]")
    check_same_device(op, [("dout", dout), ("x", x), ("weight", weight)])
    impl = implementation(op, FAMILY, backend, x.device)

    def run():
        return impl.nsa_compress_grad(dout, x, weight, block_size, stride, cu, num_blocks)

    outputs = ((tuple(x.shape), x.dtype), (tuple(weight.shape), x.dtype))
    return Prepared(op, x.device, impl, outputs, run)
