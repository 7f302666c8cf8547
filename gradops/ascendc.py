"""AscendC kernel-level API: LayerNormGrad and LayerNormGradBeta, their tiling structs and
the host functions that fill them (OPERATORS.md section 2).

Code written against AscendC's high-level API calls the host functions on the CPU side to
size a scratch buffer and produce a tiling struct, then hands both to the kernel function.
The same calls work here on PyTorch tensors:

    lo_hi = GetLayerNormGradMaxMinTmpSize([B, S, H, H], 4, False)        # bytes
    tiling = GetLayerNormGradNDTilingInfo([B, S, H, H], lo_hi[1], 4, False)
    buf = torch.empty(lo_hi[1], dtype=torch.uint8)
    LayerNormGrad(pd_x, res_for_gamma, dy, x, variance, mean, gamma, buf, 1e-5, tiling)

The host functions return CANN's numbers exactly (they are plain integer arithmetic, so
they are reproduced formula by formula; Python ints do not wrap where CANN's uint32 fields
would, past 4 GiB, which no real unified buffer comes near). The kernel functions follow the tiling: they walk
the ``B*S`` rows in steps of ``oneCalSize`` elements and then the tail, keep their float32
working copies in ``sharedTmpBuffer`` at the tiling's positions, and compute every step with
the library's one LayerNormGrad engine (the backend chosen by ``gradops._backend``), so
there is a single implementation of the math.

Status codes: a None tensor, tiling or epsilon -> 161001; a wrong dtype, shape, tiling that
does not describe the tensors, a tmp buffer below the minimum size, or isReuseSource with
half -> 161002. Host-side asserts of CANN's tiling functions: a bad typeSize or srcShape
-> 161002, "stackBufferSize is not enough" -> 561002 (CANN's tiling error).
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ._backend import implementation
from .aclnn import check_written
from .errors import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    AclnnError,
    AclnnTypeError,
)
from .ops._checks import (
    check_bool_attr,
    check_float_attr,
    dtype_name,
    invalid,
    require_tensor,
    shares_memory,
    short_repr,
    wrong_type,
)

__all__ = [
    "LayerNormGradTiling",
    "LayerNormGradBetaTiling",
    "GetLayerNormGradMaxMinTmpSize",
    "GetLayerNormGradNDTilingInfo",
    "GetLayerNormGradBetaMaxMinTmpSize",
    "GetLayerNormGradBetaNDTilingInfo",
    "LayerNormGrad",
    "LayerNormGradBeta",
]

_UINT32_MAX = 0xFFFFFFFF
_FLOAT_BYTES = 4  # every scratch position and size in the tilings counts float32 elements
_KERNEL_DTYPES = {2: torch.float16, 4: torch.float32}  # AscendC T: half or float


# ----------------------------------------------------------------------------------------
# Tiling structs: every field by its CANN name, in CANN's order (all uint32 in CANN).
# ----------------------------------------------------------------------------------------

@dataclass
class LayerNormGradTiling:
    stackBufferSize: int = 0
    bLength: int = 0
    sLength: int = 0
    hLength: int = 0
    originalHLength: int = 0
    oneCalSize: int = 0
    nohCalSize: int = 0
    loopNum: int = 0
    tailSize: int = 0
    nohTailSize: int = 0
    tmpTensorBSHPos: int = 0
    tmpTensorBSHSize: int = 0
    pdVarTensorPos: int = 0
    pdVarTensorSize: int = 0
    pdMeanTensorPos: int = 0
    pdMeanTensorSize: int = 0
    x1TensorPos: int = 0
    x1TensorSize: int = 0
    x2TensorPos: int = 0
    x2TensorSize: int = 0
    x3TensorPos: int = 0
    x3TensorSize: int = 0
    tmpTensorPos: int = 0
    tmpTensorSize: int = 0
    tmpTensor1Pos: int = 0
    tmpTensor1Size: int = 0
    tmpTensor2Pos: int = 0
    tmpTensor2Size: int = 0
    lastDimValueBack: int = 0
    lastDimValueBackMulTwo: int = 0


@dataclass
class LayerNormGradBetaTiling:
    stackBufferSize: int = 0
    bLength: int = 0
    sLength: int = 0
    hLength: int = 0
    originalHLength: int = 0
    bshLength: int = 0
    bsLength: int = 0
    oneCalSize: int = 0
    numberOfTmpBuf: int = 0
    loopRound: int = 0
    inputTailSize: int = 0
    inputTailPos: int = 0
    bsTailSize: int = 0
    bshCurLength: int = 0
    bsCurLength: int = 0
    gammaTempTensorPos: int = 0
    betaTempTensorPos: int = 0
    inputDyTmpTensorPos: int = 0
    resForGammaTmpTensorPos: int = 0


# ----------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------

def _host_error(api: str, func: str, message: str, status: int = ACLNN_ERR_PARAM_INVALID,
                type_error: bool = False):
    raise (AclnnTypeError if type_error else AclnnError)(status, f"{api}: {func}: {message}")


def _flag(api: str, name: str, value) -> bool:
    """A bool argument (isReuseSource): True or False; None -> 161001, anything else -> 161002
    (an AclnnTypeError), as every bool flag of the library."""
    return check_bool_attr(api, name, value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_host_args(api: str, func: str, srcShape, typeSize) -> Tuple[int, int, int, int]:
    """CANN's common host asserts: typeSize 2 or 4; srcShape exactly [B, S, storageH, originH],
    every dim > 0."""
    if srcShape is None:
        _host_error(api, func, "srcShape is None, expected [B, S, storageH, originH]", ACLNN_ERR_PARAM_NULLPTR)
    if typeSize is None:
        _host_error(api, func, "typeSize is None, expected 2 (half) or 4 (float)", ACLNN_ERR_PARAM_NULLPTR)
    if not _is_int(typeSize) or typeSize not in (2, 4):
        _host_error(api, func, f"typeSize is {short_repr(typeSize)}, expected 2 (half) or 4 (float)",
                    type_error=not _is_int(typeSize))
    try:
        dims = [operator.index(d) for d in srcShape]
    except TypeError:
        dims = None
    if dims is None or isinstance(srcShape, (str, bytes)):
        _host_error(api, func, f"srcShape is {short_repr(srcShape)}, expected a sequence of 4 ints "
                               f"[B, S, storageH, originH]", type_error=True)
    if len(dims) != 4:
        _host_error(api, func, f"srcShape has {len(dims)} dims ({short_repr(dims)}), expected 4 dims "
                               f"[B, S, storageH, originH]")
    if any(d <= 0 for d in dims):
        _host_error(api, func, f"srcShape is {short_repr(dims)}, expected every dim > 0")
    if any(d > _UINT32_MAX for d in dims):  # the tilings keep each dim in a uint32 field
        _host_error(api, func, f"srcShape is {short_repr(dims)}, expected every dim <= 2^32-1 (a uint32 tiling "
                               f"field)")
    return dims[0], dims[1], dims[2], dims[3]


def _check_stack_buffer(api: str, func: str, stackBufferSize) -> int:
    if stackBufferSize is None:
        _host_error(api, func, "stackBufferSize is None, expected a size in bytes", ACLNN_ERR_PARAM_NULLPTR)
    if not _is_int(stackBufferSize) or stackBufferSize < 0 or stackBufferSize > _UINT32_MAX:
        _host_error(api, func, f"stackBufferSize is {short_repr(stackBufferSize)}, expected an int in "
                               f"0..2^32-1 (bytes)", type_error=not _is_int(stackBufferSize))
    return int(stackBufferSize)


def _float_bits(value: float) -> int:
    """The bit pattern of a float32 as uint32 (CANN's LastDimValue union)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _layer_norm_grad_buffers(typeSize: int, isReuseSource: bool) -> int:
    """float32 buffers of oneCalSize elements LayerNormGrad's kernel keeps: tmpTensorBSH,
    pdVar, pdMean, x1, x2, x3; float with reuse keeps x1 and x2 in inputDy and inputX (4);
    half adds three buffers for the inputs converted to float (9)."""
    if typeSize == 2:
        return 9
    return 4 if isReuseSource else 6


def GetLayerNormGradMaxMinTmpSize(srcShape: Sequence[int], typeSize: int,
                                  isReuseSource: bool = False) -> Tuple[int, int]:
    """(maxValue, minValue) in bytes of the sharedTmpBuffer LayerNormGrad needs."""
    func = "GetLayerNormGradMaxMinTmpSize"
    b, s, h, _ = _check_host_args("LayerNormGrad", func, srcShape, typeSize)
    n = _layer_norm_grad_buffers(typeSize, _flag(f"LayerNormGrad: {func}", "isReuseSource", isReuseSource))
    bsh, hh = b * s * h, h * h
    max_value, min_value = n * max(bsh, hh) * typeSize, n * min(bsh, hh) * typeSize
    return max_value, min_value


def GetLayerNormGradNDTilingInfo(srcShape: Sequence[int], stackBufferSize: int, typeSize: int,
                                 isReuseSource: bool = False) -> LayerNormGradTiling:
    func = "GetLayerNormGradNDTilingInfo"
    b, s, h, origin_h = _check_host_args("LayerNormGrad", func, srcShape, typeSize)
    stack = _check_stack_buffer("LayerNormGrad", func, stackBufferSize)
    reuse = _flag(f"LayerNormGrad: {func}", "isReuseSource", isReuseSource)
    bsh = b * s * h

    need = _layer_norm_grad_buffers(typeSize, reuse)
    one_cal = stack // _FLOAT_BYTES // need // h * h
    if one_cal <= 0:
        _host_error("LayerNormGrad", func,
                    f"stackBufferSize is not enough: {stack} bytes hold no row of {need} float32 "
                    f"buffers of H = {h} (need >= {need * h * _FLOAT_BYTES})", ACLNN_ERR_INNER_TILING_ERROR)
    # Rows per step are rounded up to a whole 32-byte block of the input type (8 floats or
    # 16 halves), so the positions below may reach past stackBufferSize: CANN does the same.
    rows_per_block = 8 if typeSize == 4 else 16
    noh_cal = -(-(one_cal // h) // rows_per_block) * rows_per_block
    one_cal = noh_cal * h

    t = LayerNormGradTiling()
    t.stackBufferSize = stack
    t.bLength, t.sLength, t.hLength, t.originalHLength = b, s, h, origin_h
    t.oneCalSize, t.nohCalSize = one_cal, noh_cal
    t.loopNum, t.tailSize = bsh // one_cal, bsh % one_cal
    t.nohTailSize = t.tailSize // h
    t.tmpTensorBSHPos = 0
    t.pdVarTensorPos = one_cal
    t.pdMeanTensorPos = 2 * one_cal
    if reuse and typeSize == 4:
        t.x1TensorPos = t.x2TensorPos = 0
        t.x3TensorPos = 3 * one_cal
    else:
        t.x1TensorPos, t.x2TensorPos, t.x3TensorPos = 3 * one_cal, 4 * one_cal, 5 * one_cal
    if typeSize == 2:
        t.tmpTensorPos = t.x3TensorPos + one_cal
        t.tmpTensor1Pos = t.tmpTensorPos + one_cal
        t.tmpTensor2Pos = t.tmpTensor1Pos + one_cal
    for name in ("tmpTensorBSH", "pdVarTensor", "pdMeanTensor", "x1Tensor", "x2Tensor", "x3Tensor",
                 "tmpTensor", "tmpTensor1", "tmpTensor2"):
        setattr(t, name + "Size", one_cal)
    t.lastDimValueBack = _float_bits(_float32(1.0) / _float32(origin_h))
    t.lastDimValueBackMulTwo = _float_bits(_float32(2.0) / _float32(origin_h))
    return t


def GetLayerNormGradBetaMaxMinTmpSize(srcShape: Sequence[int], typeSize: int,
                                      isReuseSource: bool = False) -> Tuple[int, int]:
    """(maxValue, minValue) in bytes; isReuseSource is ignored, as in CANN."""
    func = "GetLayerNormGradBetaMaxMinTmpSize"
    b, s, h, _ = _check_host_args("LayerNormGradBeta", func, srcShape, typeSize)
    _flag(f"LayerNormGradBeta: {func}", "isReuseSource", isReuseSource)  # checked, then ignored
    # float32 buffers: half keeps pdGamma/pdBeta accumulators plus dy and resForGamma converted
    # to float (4); float keeps two.
    k = 4 if typeSize == 2 else 2
    max_value, min_value = k * b * s * h * _FLOAT_BYTES, k * h * _FLOAT_BYTES
    return max_value, min_value


def GetLayerNormGradBetaNDTilingInfo(srcShape: Sequence[int], stackBufferSize: int, typeSize: int,
                                     isReuseSource: bool = False) -> LayerNormGradBetaTiling:
    func = "GetLayerNormGradBetaNDTilingInfo"
    b, s, h, origin_h = _check_host_args("LayerNormGradBeta", func, srcShape, typeSize)
    stack = _check_stack_buffer("LayerNormGradBeta", func, stackBufferSize)
    _flag(f"LayerNormGradBeta: {func}", "isReuseSource", isReuseSource)
    bsh = b * s * h

    elements = stack // _FLOAT_BYTES
    if elements < 2 * h:
        _host_error("LayerNormGradBeta", func,
                    f"stackBufferSize is not enough: {stack} bytes < 2*H float32 = {2 * h * _FLOAT_BYTES}",
                    ACLNN_ERR_INNER_TILING_ERROR)
    one_cal, n_buf = elements, 1
    if typeSize == 2:
        n_buf = 2
        one_cal = (one_cal - 2 * h) // n_buf
    one_cal = one_cal // h * h
    if one_cal == 0:
        _host_error("LayerNormGradBeta", func,
                    f"stackBufferSize is not enough: {stack} bytes hold no row of H = {h} after the "
                    f"2*H float32 accumulators", ACLNN_ERR_INNER_TILING_ERROR)
    one_cal = min(one_cal, bsh)

    t = LayerNormGradBetaTiling()
    t.stackBufferSize = elements  # CANN stores it in float32 elements, not bytes
    t.bLength, t.sLength, t.hLength, t.originalHLength = b, s, h, origin_h
    t.bshLength, t.bsLength = bsh, b * s
    t.oneCalSize, t.numberOfTmpBuf = one_cal, n_buf
    t.loopRound, t.inputTailSize = bsh // one_cal, bsh % one_cal
    t.inputTailPos = bsh - t.inputTailSize
    t.bsTailSize = t.inputTailSize // h
    t.bshCurLength, t.bsCurLength = one_cal, one_cal // h
    if typeSize == 2:
        t.gammaTempTensorPos = 0
        t.betaTempTensorPos = h
        t.inputDyTmpTensorPos = 2 * h
        t.resForGammaTmpTensorPos = 2 * h + one_cal
    return t


# ----------------------------------------------------------------------------------------
# Kernel functions
# ----------------------------------------------------------------------------------------

def _fail(op: str, status: int, message: str):
    raise AclnnError(status, f"{op}: {message}")


def _check_present(op: str, named, tiling, tiling_cls) -> None:
    """None -> 161001; a non-tensor or a tiling of another type -> 161002 (an AclnnTypeError,
    also a TypeError); a sparse or other non-strided tensor -> 161002."""
    for name, t in named:
        if t is None:
            _fail(op, ACLNN_ERR_PARAM_NULLPTR, f"{name} is None, expected a tensor")
    if tiling is None:
        _fail(op, ACLNN_ERR_PARAM_NULLPTR, f"tiling is None, expected a {tiling_cls.__name__}")
    for name, t in named:
        require_tensor(op, name, t)
    if not isinstance(tiling, tiling_cls):
        wrong_type(op, f"tiling is a {type(tiling).__name__}, expected a {tiling_cls.__name__}")
    for f in dataclasses.fields(tiling_cls):
        v = getattr(tiling, f.name)
        if v is None:
            _fail(op, ACLNN_ERR_PARAM_NULLPTR, f"tiling.{f.name} is None, expected an int >= 0")
        if not _is_int(v):
            wrong_type(op, f"tiling.{f.name} is {short_repr(v)}, expected an int >= 0")
        if v < 0:
            _fail(op, ACLNN_ERR_PARAM_INVALID, f"tiling.{f.name} is {short_repr(v)}, expected an int >= 0")


def _check_kernel_tensors(op: str, named, shapes, is_reuse: bool) -> torch.dtype:
    """Every tensor of the kernel's type T (half or float), one dtype, one device, in the
    shape the tiling describes."""
    first_name, first = named[0]
    dtype = first.dtype
    if dtype not in _KERNEL_DTYPES.values():
        _fail(op, ACLNN_ERR_PARAM_INVALID,
              f"{first_name} has dtype {dtype_name(dtype)}, expected dtype in float16/float32 (AscendC T: half/float)")
    # the device: the first tensor's, unless that one alone is a meta tensor (no memory): name the odd one out
    ref_name, ref = next(((n, t) for n, t in named if t.device.type != "meta"), (first_name, first))
    for name, t in named[1:]:
        if t.dtype != dtype:
            _fail(op, ACLNN_ERR_PARAM_INVALID,
                  f"{name} has dtype {dtype_name(t.dtype)}, expected the dtype of {first_name} ({dtype_name(dtype)})")
    for name, t in named:
        if t.device != ref.device:
            _fail(op, ACLNN_ERR_PARAM_INVALID,
                  f"{name} is on {t.device}, expected the device of {ref_name} ({ref.device})")
    for (name, t), (shape, rule) in zip(named, shapes):
        if tuple(t.shape) != tuple(shape):
            _fail(op, ACLNN_ERR_PARAM_INVALID,
                  f"{name} has shape {tuple(t.shape)}, expected {rule} == {tuple(shape)}")
    if is_reuse and dtype == torch.float16:
        _fail(op, ACLNN_ERR_PARAM_INVALID, "isReuseSource is True with dtype float16, expected dtype float32 "
              "(AscendC supports isReuseSource for float only)")
    return dtype


def _check_tiling_h(op: str, tiling, uses_origin_h: bool = True) -> int:
    for name in ("bLength", "sLength", "hLength"):
        if getattr(tiling, name) <= 0:
            _fail(op, ACLNN_ERR_PARAM_INVALID, f"tiling.{name} is {getattr(tiling, name)}, expected > 0")
    h = tiling.hLength
    # LayerNormGradBeta's per-column sums never use originH; LayerNormGrad's factors do
    if uses_origin_h and not 0 < tiling.originalHLength <= h:
        _fail(op, ACLNN_ERR_PARAM_INVALID,
              f"tiling.originalHLength is {tiling.originalHLength}, expected 1..hLength ({h}): "
              f"rows are stored hLength wide, the original width at most that")
    return h


def _check_steps(op: str, one: int, loops: int, tail: int, names: Tuple[str, str, str], bsh: int, h: int):
    one_name, loop_name, tail_name = names
    if one <= 0 or one % h:
        _fail(op, ACLNN_ERR_PARAM_INVALID, f"tiling.{one_name} is {one}, expected a positive multiple of hLength ({h})")
    if tail % h or loops * one + tail != bsh:
        _fail(op, ACLNN_ERR_PARAM_INVALID,
              f"tiling.{loop_name} * {one_name} + {tail_name} is {loops} * {one} + {tail}, expected "
              f"B*S*H == {bsh} with {tail_name} a multiple of hLength")


def _check_tmp_buffer(op: str, buf, min_bytes: int, device: torch.device) -> None:
    if buf is None:
        return
    if not isinstance(buf, torch.Tensor):
        wrong_type(op, f"sharedTmpBuffer is a {type(buf).__name__}, expected a uint8 tensor")
    require_tensor(op, "sharedTmpBuffer", buf)  # a sparse one -> 161002
    if buf.dtype != torch.uint8:
        _fail(op, ACLNN_ERR_PARAM_INVALID, f"sharedTmpBuffer has dtype {dtype_name(buf.dtype)}, expected dtype uint8")
    if buf.device != device:
        _fail(op, ACLNN_ERR_PARAM_INVALID, f"sharedTmpBuffer is on {buf.device}, expected {device}")
    if not buf.is_contiguous():
        _fail(op, ACLNN_ERR_PARAM_INVALID, "sharedTmpBuffer is not contiguous, expected one block of bytes")
    if buf.numel() < min_bytes:
        _fail(op, ACLNN_ERR_PARAM_INVALID,
              f"sharedTmpBuffer has {buf.numel()} bytes, expected at least the minimum tmp size ({min_bytes} bytes)")
    check_written(op, [("sharedTmpBuffer", buf)])  # the kernel's scratch: written


def _check_writes(op: str, written, read, buf, in_place=()) -> None:
    """What a kernel writes, against what it reads, all before anything runs -> 161002 naming
    the tensors: ``written`` (its outputs, and with isReuseSource the inputs it overwrites in
    place, which may require grad) each writable and no two sharing memory; none of them
    sharing memory with a tensor it only reads (``read``), except as the very same view of an
    input of its shape (elementwise in place: each step reads its rows before writing them);
    sharedTmpBuffer, written as scratch throughout, sharing memory with no tensor argument."""
    check_written(op, written, in_place=in_place)
    for w_name, w in written:
        for r_name, r in read:
            same_view = (w.shape == r.shape and w.stride() == r.stride() and w.dtype == r.dtype
                         and w.data_ptr() == r.data_ptr())
            if not same_view and shares_memory(w, r):
                invalid(op, f"{w_name} shares memory with {r_name}, expected separate memory (or the very same "
                            f"view, written in place): the kernel writes {w_name} step by step while it reads "
                            f"{r_name}")
    if buf is not None:
        for name, t in list(written) + list(read):
            if shares_memory(buf, t):
                invalid(op, f"sharedTmpBuffer shares memory with {name}, expected scratch memory of its own")


def _check_apart(op: str, regions) -> None:
    """Scratch regions ``(tiling field, position, size)`` in float32 elements that a step holds
    at the same time: pairwise disjoint, else one would overwrite the other (161002)."""
    for i, (name_a, a, size_a) in enumerate(regions):
        for name_b, b, size_b in regions[i + 1:]:
            if a < b + size_b and b < a + size_a:
                _fail(op, ACLNN_ERR_PARAM_INVALID,
                      f"tiling.{name_a} ({a}, {size_a} elements) overlaps tiling.{name_b} ({b}, {size_b} "
                      f"elements), expected separate scratch regions")


class _Scratch:
    """float32 scratch at the tiling's positions: the caller's sharedTmpBuffer when it holds
    ``need_floats`` elements, else our own, one piece of ``piece_floats`` (what a step uses)
    per position, so that a tiling's positions (which round rows up, or come from the
    caller) never size an allocation."""

    def __init__(self, buf: Optional[torch.Tensor], need_floats: int, piece_floats: int, device: torch.device):
        need_bytes = need_floats * _FLOAT_BYTES
        self.buf = None
        if buf is not None and buf.numel() >= need_bytes and buf.storage_offset() % _FLOAT_BYTES == 0:
            self.buf = buf.reshape(-1)[:need_bytes].view(torch.float32)
        self.piece, self.device, self.own = piece_floats, device, {}

    def region(self, pos: int, n: int) -> torch.Tensor:
        if self.buf is not None:
            return self.buf[pos:pos + n]
        if pos not in self.own:
            self.own[pos] = torch.empty(self.piece, dtype=torch.float32, device=self.device)
        return self.own[pos][:n]


class _Rows:
    """Row ranges of a ``[B, S, H]`` tensor as ``[rows, H]`` tensors: views when B and S
    merge into one strided dim, else rows of a copy, written back by index."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        h = t.shape[-1]
        try:
            self.flat, self.is_view = t.view(-1, h), True
        except RuntimeError:
            self.flat, self.is_view = t.reshape(-1, h), False

    def read(self, r0: int, r1: int) -> torch.Tensor:
        return self.flat[r0:r1]

    def write(self, r0: int, r1: int, value: torch.Tensor) -> None:
        if self.is_view:
            self.flat[r0:r1].copy_(value)
            return
        rows = torch.arange(r0, r1, device=self.t.device)
        s = self.t.shape[1]
        self.t[rows // s, rows % s] = value.to(self.t.dtype)


def _steps(loops: int, one_rows: int, tail_rows: int):
    """(first row, row count) of each step: ``loops`` full steps (maybe none), then the tail."""
    for i in range(loops):
        yield i * one_rows, one_rows
    if tail_rows:
        yield loops * one_rows, tail_rows


def _kernel_eps(epsilon, dtype: torch.dtype) -> float:
    """epsilon is a T-typed kernel argument: rounded to half for half, to float for float."""
    return float(torch.tensor(float(epsilon), dtype=dtype).item())


def _type_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def LayerNormGrad(outputPdX, resForGamma, inputDy, inputX, inputVariance, inputMean, inputGamma,
                  sharedTmpBuffer, epsilon, tiling, isReuseSource: bool = False) -> None:
    """AscendC LayerNormGrad: writes pd_x into outputPdX and x-hat into resForGamma.

    inputVariance is the variance (eps is added here). With isReuseSource (float only)
    inputDy is left holding dy*gamma and inputX holding x-mean, as CANN's kernel leaves them.
    """
    op = "LayerNormGrad"
    named = [("inputX", inputX), ("inputDy", inputDy), ("inputVariance", inputVariance),
             ("inputMean", inputMean), ("inputGamma", inputGamma), ("outputPdX", outputPdX),
             ("resForGamma", resForGamma)]
    _check_present(op, named, tiling, LayerNormGradTiling)
    check_float_attr(op, "epsilon", epsilon)  # None -> 161001, not a number -> 161002, past float64 -> 161002
    reuse = _flag(op, "isReuseSource", isReuseSource)
    b, s, h = tiling.bLength, tiling.sLength, tiling.hLength
    bsh_rule, bs_rule = "[B, S, H] of the tiling", "[B, S] of the tiling"
    dtype = _check_kernel_tensors(op, named, [
        ((b, s, h), bsh_rule), ((b, s, h), bsh_rule), ((b, s), bs_rule), ((b, s), bs_rule),
        ((h,), "[H] of the tiling"), ((b, s, h), bsh_rule), ((b, s, h), bsh_rule)], reuse)
    _check_tiling_h(op, tiling)
    one, loops, tail = tiling.oneCalSize, tiling.loopNum, tiling.tailSize
    _check_steps(op, one, loops, tail, ("oneCalSize", "loopNum", "tailSize"), b * s * h, h)
    device = inputX.device
    min_bytes = GetLayerNormGradMaxMinTmpSize([b, s, h, h], _type_size(dtype), reuse)[1]
    _check_tmp_buffer(op, sharedTmpBuffer, min_bytes, device)
    written = [("outputPdX", outputPdX), ("resForGamma", resForGamma)]
    read = [("inputDy", inputDy), ("inputX", inputX)]
    if reuse:  # inputDy and inputX are overwritten (dy*gamma, x-mean)
        written, read = written + read, []
    read += [("inputVariance", inputVariance), ("inputMean", inputMean), ("inputGamma", inputGamma)]
    _check_writes(op, written, read, sharedTmpBuffer, in_place=("inputDy", "inputX"))
    # Padded rows (originH < storageH): sums over the stored width, factors from originH. Only
    # the reference engine takes origin_h; the kernels leave such calls to it.
    origin_h = tiling.originalHLength
    padded = origin_h != h
    engine = implementation(op, "layer_norm", None, device,
                            kernel_limit=lambda kernels: "padded rows (originH < storageH)" if padded else None)
    padding = {"origin_h": origin_h} if padded else {}
    eps = _kernel_eps(epsilon, dtype)

    # Each step's float32 working set lives at the tiling's positions: x3 holds pd_x and
    # tmpTensorBSH x-hat; half inputs are converted into tmpTensor (dy) and tmpTensor1 (x).
    half = dtype == torch.float16
    used = [tiling.x3TensorPos, tiling.tmpTensorBSHPos]
    if half:
        used += [tiling.tmpTensorPos, tiling.tmpTensor1Pos]
        # dy and x are converted into two regions that hold a step at once (pd_x and x-hat go
        # into theirs one after the other, after the step's math)
        step = min(one, b * s * h)  # what a step uses of each (oneCalSize may round past B*S*H)
        _check_apart(op, [("tmpTensorPos", tiling.tmpTensorPos, step), ("tmpTensor1Pos", tiling.tmpTensor1Pos, step)])
    scratch = _Scratch(sharedTmpBuffer, max(used) + one, min(one, b * s * h), device)

    def region(pos: int, rows: int) -> torch.Tensor:
        return scratch.region(pos, rows * h).view(rows, h)

    with _kernel_launch(op):
        _layer_norm_grad_steps(engine, tiling, region, half, reuse, padding, eps, outputPdX, resForGamma, inputDy,
                               inputX, inputVariance, inputMean, inputGamma)
        if reuse:
            _written_in_place(inputDy, inputX)


@contextlib.contextmanager
def _kernel_launch(op: str):
    """A kernel's steps, checked in full beforehand: outside autograd (the kernel-level API is
    not differentiable; an overwritten input that requires grad has its version bumped), and a
    failure of the device underneath (out of memory, a launch) -> 361001, as aclnn's phase two."""
    try:
        with torch.no_grad():
            yield
    except AclnnError:
        raise
    except RuntimeError as e:
        raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, f"{op}: the kernel failed: {e}") from e


def _written_in_place(*tensors: torch.Tensor) -> None:
    """Inputs an engine overwrote (a Triton kernel writes through a pointer, unseen by
    autograd): move their version counters, so a graph that saved one notices."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


def _layer_norm_grad_steps(engine, tiling, region, half, reuse, padding, eps, outputPdX, resForGamma, inputDy,
                           inputX, inputVariance, inputMean, inputGamma) -> None:
    h, one, loops, tail = tiling.hLength, tiling.oneCalSize, tiling.loopNum, tiling.tailSize
    dy_rows, x_rows = _Rows(inputDy), _Rows(inputX)
    pdx_rows, res_rows = _Rows(outputPdX), _Rows(resForGamma)
    var_flat, mean_flat = inputVariance.reshape(-1), inputMean.reshape(-1)
    gamma = inputGamma.float() if half else inputGamma
    for r0, rows in _steps(loops, one // h, tail // h):
        r1 = r0 + rows
        dy_c, x_c = dy_rows.read(r0, r1), x_rows.read(r0, r1)
        var_c, mean_c = var_flat[r0:r1], mean_flat[r0:r1]
        if half:
            dy_c = region(tiling.tmpTensorPos, rows).copy_(dy_c)
            x_c = region(tiling.tmpTensor1Pos, rows).copy_(x_c)
            var_c, mean_c = var_c.float(), mean_c.float()
        pd_x, res = engine.layer_norm_grad(dy_c, x_c, var_c, mean_c, gamma, eps, reuse, **padding)
        if reuse:  # the engine overwrote dy_c and x_c; rows of a copy must reach the tensor
            if not dy_rows.is_view:
                dy_rows.write(r0, r1, dy_c)
            if not x_rows.is_view:
                x_rows.write(r0, r1, x_c)
        pdx_rows.write(r0, r1, region(tiling.x3TensorPos, rows).copy_(pd_x))
        res_rows.write(r0, r1, region(tiling.tmpTensorBSHPos, rows).copy_(res))


def LayerNormGradBeta(outputPdGamma, outputPdBeta, resForGamma, inputDy, sharedTmpBuffer, tiling,
                      isReuseSource: bool = False) -> None:
    """AscendC LayerNormGradBeta: pdGamma = sum_{b,s} dy*resForGamma, pdBeta = sum_{b,s} dy,
    accumulated in float32 over the tiling's steps, written in T. With isReuseSource (float
    only) resForGamma is left holding dy*resForGamma, as CANN's kernel leaves it."""
    op = "LayerNormGradBeta"
    named = [("resForGamma", resForGamma), ("inputDy", inputDy), ("outputPdGamma", outputPdGamma),
             ("outputPdBeta", outputPdBeta)]
    _check_present(op, named, tiling, LayerNormGradBetaTiling)
    reuse = _flag(op, "isReuseSource", isReuseSource)
    b, s, h = tiling.bLength, tiling.sLength, tiling.hLength
    bsh_rule, h_rule = "[B, S, H] of the tiling", "[H] of the tiling"
    dtype = _check_kernel_tensors(op, named, [((b, s, h), bsh_rule), ((b, s, h), bsh_rule),
                                              ((h,), h_rule), ((h,), h_rule)], reuse)
    _check_tiling_h(op, tiling, uses_origin_h=False)
    bsh = b * s * h
    if (tiling.bshLength, tiling.bsLength) != (bsh, b * s):
        _fail(op, ACLNN_ERR_PARAM_INVALID,
              f"tiling (bshLength, bsLength) is {(tiling.bshLength, tiling.bsLength)}, expected {(bsh, b * s)}")
    one, loops, tail = tiling.oneCalSize, tiling.loopRound, tiling.inputTailSize
    _check_steps(op, one, loops, tail, ("oneCalSize", "loopRound", "inputTailSize"), bsh, h)
    if tiling.inputTailPos != bsh - tail:
        _fail(op, ACLNN_ERR_PARAM_INVALID, f"tiling.inputTailPos is {tiling.inputTailPos}, expected {bsh - tail}")
    device = inputDy.device
    min_bytes = GetLayerNormGradBetaMaxMinTmpSize([b, s, h, h], _type_size(dtype), reuse)[1]
    _check_tmp_buffer(op, sharedTmpBuffer, min_bytes, device)
    written = [("outputPdGamma", outputPdGamma), ("outputPdBeta", outputPdBeta)]
    read = [("inputDy", inputDy)]
    if reuse:  # resForGamma is overwritten (dy*resForGamma)
        written.append(("resForGamma", resForGamma))
    else:
        read.append(("resForGamma", resForGamma))
    _check_writes(op, written, read, sharedTmpBuffer, in_place=("resForGamma",))
    engine = implementation(op, "layer_norm", None, device)

    # float32 accumulators for pdGamma and pdBeta; half also converts each step's dy and
    # resForGamma into scratch. Float's tiling positions are all 0: its two accumulators
    # take the two H-sized float32 rows of the minimum buffer.
    half = dtype == torch.float16
    if half:
        gamma_pos, beta_pos = tiling.gammaTempTensorPos, tiling.betaTempTensorPos
        dy_pos, res_pos = tiling.inputDyTmpTensorPos, tiling.resForGammaTmpTensorPos
        need = max(gamma_pos + h, beta_pos + h, dy_pos + one, res_pos + one)
        _check_apart(op, [("gammaTempTensorPos", gamma_pos, h), ("betaTempTensorPos", beta_pos, h),
                          ("inputDyTmpTensorPos", dy_pos, min(one, bsh)),
                          ("resForGammaTmpTensorPos", res_pos, min(one, bsh))])
    else:
        gamma_pos, beta_pos, dy_pos, res_pos = 0, h, None, None
        need = 2 * h
    scratch = _Scratch(sharedTmpBuffer, need, max(h, min(one, bsh)), device)
    with _kernel_launch(op):
        _layer_norm_grad_beta_steps(engine, scratch, half, reuse, h, one, loops, tail, (gamma_pos, beta_pos, dy_pos,
                                    res_pos), outputPdGamma, outputPdBeta, resForGamma, inputDy)
        if reuse:
            _written_in_place(resForGamma)


def _layer_norm_grad_beta_steps(engine, scratch, half, reuse, h, one, loops, tail, positions, outputPdGamma,
                                outputPdBeta, resForGamma, inputDy) -> None:
    gamma_pos, beta_pos, dy_pos, res_pos = positions
    acc_gamma, acc_beta = scratch.region(gamma_pos, h), scratch.region(beta_pos, h)
    acc_gamma.zero_()
    acc_beta.zero_()

    res_rows, dy_rows = _Rows(resForGamma), _Rows(inputDy)
    for r0, rows in _steps(loops, one // h, tail // h):
        r1 = r0 + rows
        res_c, dy_c = res_rows.read(r0, r1), dy_rows.read(r0, r1)
        if half:
            dy_c = scratch.region(dy_pos, rows * h).view(rows, h).copy_(dy_c)
            res_c = scratch.region(res_pos, rows * h).view(rows, h).copy_(res_c)
        pd_gamma, pd_beta = engine.layer_norm_grad_beta(res_c, dy_c, reuse)
        acc_gamma += pd_gamma
        acc_beta += pd_beta
        if reuse and not res_rows.is_view:
            res_rows.write(r0, r1, res_c)
    outputPdGamma.copy_(acc_gamma)
    outputPdBeta.copy_(acc_beta)
