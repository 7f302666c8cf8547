"""CANN's two-phase aclnn API on PyTorch tensors (OPERATORS.md sections 1-6).

    workspace_size, executor = aclnnRmsNormGradGetWorkspaceSize(dy, x, rstd, gamma, dxOut, dgammaOut)
    workspace = torch.empty(workspace_size, dtype=torch.uint8, device=x.device) if workspace_size else None
    aclnnRmsNormGrad(workspace, workspace_size, executor, stream)     # -> ACLNN_SUCCESS

Phase one (``...GetWorkspaceSize``) applies what CANN alone demands (its dtype tables without
float64, its documented limits, the TND layout, the ``[B,H,N,M,8]`` statistics, its argument
names, None -> 161001 for what it requires, the output tensors' shapes and dtypes), then the
shared validator ``gradops.ops.<family>.prepare_<name>`` that the Python API uses, so every
rule the two layers share is decided in one place. It reads no tensor data (``actSeqLen`` is
host metadata) and writes nothing.

Phase two runs the validated call on the stream given (None: the current one) and copies
each result into the output tensor given in phase one, cast to that tensor's dtype.

Workspace: the float32 staging a call needs beyond its outputs, planned from shapes and
dtypes alone. Two operators have any:
- aclnnLayerNormBackward: ``2 * rows * 4`` bytes when mean/rstd are not float32 or not in a
  ``[A...]``/keepdim shape (CANN computes in float32; they are converted there), else 0;
- aclnnFusedFloydAttentionGrad: ``2 * B*H*N*M * 4`` bytes: CANN's ``[B,H,N,M,8]`` statistics
  are compacted there to the contiguous ``[B,H,N,M]`` float32 the kernels read.
Every other operator needs 0 bytes (workspace None).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .errors import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    ACLNN_SUCCESS,
    AclnnError,
)
from .ops._checks import (
    renamed_errors,
    INT64_MAX,
    check_int_attr,
    check_no_shared_outputs,
    check_writable,
    dtype_name,
    dtype_names,
    require_tensor,
    shares_memory,
    short_repr,
    wrong_type,
)
from .ops._shapes import as_bool_triple, check_trailing, int_sequence
from .ops.floyd_attention import prepare_floyd_attention, prepare_floyd_attention_grad
from .ops.layer_norm import prepare_layer_norm, prepare_layer_norm_backward
from .ops.nsa_compress import prepare_nsa_compress, prepare_nsa_compress_grad
from .ops.rms_norm import prepare_rms_norm, prepare_rms_norm_grad

__all__ = [
    "ACLNN_SUCCESS",
    "AclOpExecutor",
    "aclOpExecutor",
    "aclSetAclOpExecutorRepeatable",
    "aclDestroyAclOpExecutor",
    "aclnnLayerNormGetWorkspaceSize",
    "aclnnLayerNorm",
    "aclnnLayerNormBackwardGetWorkspaceSize",
    "aclnnLayerNormBackward",
    "aclnnRmsNormGetWorkspaceSize",
    "aclnnRmsNorm",
    "aclnnRmsNormGradGetWorkspaceSize",
    "aclnnRmsNormGrad",
    "aclnnNsaCompressGetWorkspaceSize",
    "aclnnNsaCompress",
    "aclnnNsaCompressGradGetWorkspaceSize",
    "aclnnNsaCompressGrad",
    "aclnnFusedFloydAttentionGetWorkspaceSize",
    "aclnnFusedFloydAttention",
    "aclnnFusedFloydAttentionGradGetWorkspaceSize",
    "aclnnFusedFloydAttentionGrad",
]

NULLPTR, INVALID, TILING = ACLNN_ERR_PARAM_NULLPTR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_INNER_TILING_ERROR
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CANN_FLOATS = (F32, F16, BF16)  # CANN's float table: no float64 anywhere
CANN_HALVES = (F16, BF16)
MAX_DIMS = 8
UINT64_MAX = 2**64 - 1
_F32_BYTES = 4


# ----------------------------------------------------------------------------------------
# Checks of the CANN layer (status and message conventions of gradops.ops._checks)
# ----------------------------------------------------------------------------------------

def _fail(op: str, status: int, message: str):
    raise AclnnError(status, f"{op}: {message}")


def _present(op: str, named: Sequence[Tuple[str, object]]) -> None:
    """CANN's null checks come first: a required argument that is None -> 161001."""
    for name, value in named:
        if value is None:
            _fail(op, NULLPTR, f"{name} is None (a null pointer to CANN), expected a value")


def _tensors(op: str, named: Sequence[Tuple[str, object]]) -> None:
    """Each given tensor argument a strided torch.Tensor: another type -> 161002 as an
    AclnnTypeError (also a TypeError), a sparse or other non-strided layout -> 161002."""
    for name, t in named:
        require_tensor(op, name, t, optional=True)


def _dtype(op: str, name: str, t: Optional[torch.Tensor], allowed: Sequence[torch.dtype]) -> None:
    if t is not None and t.dtype not in allowed:
        _fail(op, INVALID, f"{name} has dtype {dtype_name(t.dtype)}, expected dtype in {dtype_names(allowed)} "
                           f"(CANN's table)")


def _same_dtype(op: str, names: Sequence[Tuple[str, Optional[torch.Tensor]]], ref_name: str,
                ref: torch.Tensor) -> None:
    for name, t in names:
        if t is not None and t.dtype != ref.dtype:
            _fail(op, INVALID, f"{name} has dtype {dtype_name(t.dtype)}, expected the dtype of {ref_name} "
                               f"({dtype_name(ref.dtype)})")


def _rank(op: str, name: str, t: torch.Tensor, lo: int, hi: int, status: int) -> None:
    if not lo <= t.dim() <= hi:
        _fail(op, status, f"{name} has {t.dim()} dims (shape {tuple(t.shape)}), expected {lo}..{hi} dims")


def _limit(op: str, ok: bool, status: int, message: str) -> None:
    if not ok:
        _fail(op, status, message)


def _int_attr(op: str, name: str, value) -> int:
    """An int64 attribute of CANN (None -> 161001)."""
    return check_int_attr(op, name, value, -INT64_MAX - 1)


def _out(op: str, name: str, t: Optional[torch.Tensor], shapes: Sequence[Tuple[int, ...]],
         dtypes: Sequence[torch.dtype], device: torch.device, shape_status: int) -> None:
    """An output tensor given in phase one: one of ``shapes`` (status ``shape_status``, the
    family's shape code), a dtype of ``dtypes`` (161002), on the operator's device (161002)."""
    if t is None:
        return
    if t.dtype not in dtypes:
        _fail(op, INVALID, f"{name} has dtype {dtype_name(t.dtype)}, expected dtype in {dtype_names(dtypes)}")
    if tuple(t.shape) not in [tuple(s) for s in shapes]:
        rule = " or ".join(str(tuple(s)) for s in shapes)
        _fail(op, shape_status, f"{name} has shape {tuple(t.shape)}, expected {rule}")
    if t.device != device:
        _fail(op, INVALID, f"{name} is on {t.device}, expected the operator's device {device}")


def check_written(op: str, named: Sequence[Tuple[str, Optional[torch.Tensor]]], *,
                  in_place: Sequence[str] = ()) -> None:
    """The tensors a call writes (``(name, tensor-or-None)``: its outputs, and the inputs named
    in ``in_place``, which it overwrites and which may require grad) -> 161002 naming the
    tensor unless each can be written (``check_writable``) and no two share memory (written one
    after the other, one result would be lost). Checked before anything runs or is written."""
    given = [(name, t) for name, t in named if t is not None]
    for name, t in given:
        check_writable(op, name, t, requires_grad_ok=name in in_place)
    check_no_shared_outputs(op, given)


def _signature(t: torch.Tensor):
    """What phase two re-checks of an output phase one accepted (cheap: no data read)."""
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().data_ptr())


def _placeholder(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor with a shape, dtype and device but no memory of its own (a 0-dim tensor
    expanded): lets the shared validator check a call whose tensor phase two converts."""
    return torch.empty((), dtype=dtype, device=device).expand(tuple(shape))  # () included: one row


# ----------------------------------------------------------------------------------------
# The executor
# ----------------------------------------------------------------------------------------

class _Stage:
    """An input that phase two copies into the workspace as contiguous float32."""

    def __init__(self, source: Callable[[], torch.Tensor], shape: Tuple[int, ...], offset: int):
        self.source, self.shape, self.offset = source, tuple(shape), offset
        self.nbytes = math.prod(self.shape) * _F32_BYTES


class AclOpExecutor:
    """What phase one planned: the validated call, the outputs to fill, the workspace.

    Runs once; ``aclSetAclOpExecutorRepeatable`` before the first run lets it run again (each
    run reads the inputs' current data, like CANN's executor holding device addresses).
    ``aclDestroyAclOpExecutor`` releases it; a destroyed executor refuses to run.
    """

    def __init__(self, op: str, device: torch.device, stages: List[_Stage],
                 compute: Callable[[List[torch.Tensor]], Sequence[Optional[torch.Tensor]]],
                 writes: List[Tuple[torch.Tensor, Callable]],
                 outputs: Sequence[Tuple[str, Optional[torch.Tensor]]] = (),
                 inputs: Sequence[Tuple[str, object]] = ()):
        self.op = op
        self.device = device
        self._stages = stages
        self.workspace_size = sum(s.nbytes for s in stages)
        self._compute = compute
        self._writes = writes  # (output tensor, results -> tensor to copy into it)
        # Phase one's checks of the outputs (check_written, called by every ...GetWorkspaceSize
        # before it builds the executor) hold while their geometry is the one checked: phase
        # two re-checks that, and requires_grad, before it writes anything.
        self._outputs = [(name, t, _signature(t)) for name, t in outputs if t is not None]
        # the tensors the workspace must not share memory with (staging writes it first)
        self._tensors = [(name, t) for name, t in list(outputs) + list(inputs) if isinstance(t, torch.Tensor)]
        self.repeatable = False
        self.runs = 0
        self.destroyed = False

    def __repr__(self):
        state = "destroyed" if self.destroyed else f"runs={self.runs}, repeatable={self.repeatable}"
        return f"AclOpExecutor({self.op}, workspace_size={self.workspace_size}, {state})"

    def _launch(self, workspace: Optional[torch.Tensor]) -> None:
        staged = []
        for stage in self._stages:
            if stage.nbytes == 0:  # nothing to stage (no rows): no workspace either
                staged.append(torch.empty(stage.shape, dtype=torch.float32, device=self.device))
                continue
            region = workspace.reshape(-1)[stage.offset:stage.offset + stage.nbytes].view(torch.float32)
            staged.append(region.view(stage.shape).copy_(stage.source()))
        # every result is computed before any output is written, so outputs may alias inputs
        results = self._compute(staged)
        values = [pick(results) for _, pick in self._writes]
        outs = [out for out, _ in self._writes]
        for i, value in enumerate(values):  # a result in an output's memory would change as it is written
            if any(j != i and shares_memory(value, out) for j, out in enumerate(outs)):
                values[i] = value.clone()
        for out, value in zip(outs, values):
            out.copy_(value)

    def _check_outputs(self, op: str) -> None:
        for name, t, planned in self._outputs:
            if _signature(t) != planned:
                _fail(op, INVALID, f"{name} changed since phase one (now shape {tuple(t.shape)}, strides "
                                   f"{t.stride()}, dtype {dtype_name(t.dtype)}, on {t.device}), expected the "
                                   f"output tensor phase one checked")
            if t.requires_grad:
                check_writable(op, name, t)  # requires grad now: its message

    def _check_workspace_apart(self, op: str, workspace: torch.Tensor) -> None:
        used = workspace.reshape(-1)[:self.workspace_size]
        for name, t in self._tensors:
            if shares_memory(used, t):
                _fail(op, INVALID, f"workspace shares memory with {name}, expected its own memory (phase two "
                                   f"writes the workspace first)")


aclOpExecutor = AclOpExecutor  # CANN's spelling of the type


def _executor_arg(op: str, executor) -> AclOpExecutor:
    if executor is None:
        _fail(op, NULLPTR, "executor is None, expected the executor of phase one")
    if not isinstance(executor, AclOpExecutor):
        wrong_type(op, f"executor is a {type(executor).__name__}, expected an AclOpExecutor")
    if executor.destroyed:
        _fail(op, INVALID, f"executor of {executor.op} was destroyed (aclDestroyAclOpExecutor)")
    return executor


def aclSetAclOpExecutorRepeatable(executor) -> int:
    """Let ``executor`` run more than once (call it before the first run)."""
    op = "aclSetAclOpExecutorRepeatable"
    ex = _executor_arg(op, executor)
    if ex.runs and not ex.repeatable:
        _fail(op, INVALID, f"executor of {ex.op} already ran once, expected it to be made repeatable "
                           f"before its first run")
    ex.repeatable = True
    return ACLNN_SUCCESS


def aclDestroyAclOpExecutor(executor) -> int:
    ex = _executor_arg("aclDestroyAclOpExecutor", executor)
    ex.destroyed = True
    ex._compute, ex._writes, ex._stages = None, [], []  # drop the references to the tensors
    ex._outputs, ex._tensors = [], []
    return ACLNN_SUCCESS


def _stream_context(op: str, stream, device: torch.device):
    if stream is None:
        return contextlib.nullcontext()
    if device.type == "cuda" and isinstance(stream, torch.cuda.Stream):
        if stream.device != device:
            _fail(op, INVALID, f"stream is on {stream.device}, expected a stream of {device}")
        return torch.cuda.stream(stream)
    cpu_stream = getattr(torch.cpu, "Stream", None)
    generic = getattr(torch, "Stream", None)
    if device.type == "cpu" and ((cpu_stream is not None and isinstance(stream, cpu_stream)) or
                                 (generic is not None and isinstance(stream, generic) and stream.device.type == "cpu")):
        return contextlib.nullcontext()  # the CPU has one stream: the call runs in order, synchronously
    rule = f"expected None (the current stream) or a torch.cuda.Stream of {device}"
    stream_types = tuple(t for t in (torch.cuda.Stream, cpu_stream, generic) if isinstance(t, type))
    if not isinstance(stream, stream_types):
        wrong_type(op, f"stream is {short_repr(stream)}, {rule}")
    _fail(op, INVALID, f"stream is {short_repr(stream)}, {rule}")


def _run_phase_two(op: str, workspace, workspace_size, executor, stream) -> int:
    ex = _executor_arg(op, executor)
    if ex.op != op:
        _fail(op, INVALID, f"executor was planned by {ex.op}GetWorkspaceSize, expected one of {op}GetWorkspaceSize")
    if ex.runs and not ex.repeatable:
        _fail(op, INVALID, "executor already ran, expected a fresh executor or one made repeatable with "
                           "aclSetAclOpExecutorRepeatable before its first run")
    if workspace_size is None:
        _fail(op, NULLPTR, "workspaceSize is None, expected the size phase one returned")
    if isinstance(workspace_size, bool) or not isinstance(workspace_size, int):
        wrong_type(op, f"workspaceSize is {short_repr(workspace_size)}, expected an int >= 0")
    if not 0 <= workspace_size <= UINT64_MAX:
        _fail(op, INVALID, f"workspaceSize is {short_repr(workspace_size)}, expected an int in 0..{UINT64_MAX} "
                           f"(uint64)")
    if workspace_size < ex.workspace_size:
        _fail(op, INVALID, f"workspaceSize is {workspace_size}, expected >= {ex.workspace_size} "
                           f"(phase one's size)")
    if workspace is None:
        if ex.workspace_size:
            _fail(op, NULLPTR, f"workspace is None, expected a uint8 tensor of >= {ex.workspace_size} bytes")
    else:
        if not isinstance(workspace, torch.Tensor):
            wrong_type(op, f"workspace is a {type(workspace).__name__}, expected a uint8 tensor")
        require_tensor(op, "workspace", workspace)  # a sparse one -> 161002
        if workspace.dtype != torch.uint8:
            _fail(op, INVALID, f"workspace has dtype {dtype_name(workspace.dtype)}, expected dtype uint8")
        if workspace.device != ex.device:
            _fail(op, INVALID, f"workspace is on {workspace.device}, expected the operator's device {ex.device}")
        if not workspace.is_contiguous():
            _fail(op, INVALID, "workspace is not contiguous, expected one block of bytes")
        if workspace.numel() < max(ex.workspace_size, workspace_size):
            _fail(op, INVALID, f"workspace has {workspace.numel()} bytes, expected >= workspaceSize "
                               f"({max(ex.workspace_size, workspace_size)})")
        if ex.workspace_size and workspace.storage_offset() % _F32_BYTES:
            _fail(op, INVALID, "workspace starts at a byte offset that is not a multiple of 4, "
                               "expected float32 alignment")
        if ex.workspace_size:  # phase two writes it: writable, apart from every tensor of the call
            check_written(op, [("workspace", workspace)])
            ex._check_workspace_apart(op, workspace)
    ex._check_outputs(op)
    context = _stream_context(op, stream, ex.device)
    ex.runs += 1
    try:
        with context:
            ex._launch(workspace)
    except AclnnError:
        raise
    except RuntimeError as e:  # a failed device call (launch, out of memory, ...)
        raise AclnnError(ACLNN_ERR_RUNTIME_ERROR, f"{op}: the launch failed: {e}") from e
    return ACLNN_SUCCESS


# ----------------------------------------------------------------------------------------
# LayerNorm
# ----------------------------------------------------------------------------------------

_LN_NAMES = {"x": "input", "normalized_shape": "normalizedShape", "weight": "weightOptional",
             "bias": "biasOptional", "dy": "gradOut", "output_mask": "outputMask"}


def _normalized_shape(op: str, normalizedShape) -> Tuple[int, ...]:
    if isinstance(normalizedShape, torch.Tensor) or not isinstance(normalizedShape, (list, tuple, torch.Size)):
        wrong_type(op, f"normalizedShape is {short_repr(normalizedShape)}, expected a list of ints (aclIntArray)")
    shape = int_sequence(op, "normalizedShape", normalizedShape)
    _limit(op, 1 <= len(shape) <= MAX_DIMS, INVALID,
           f"normalizedShape has length {len(shape)}, expected 1..{MAX_DIMS}")
    return shape


def _lead(x: torch.Tensor, n: int) -> Tuple[int, ...]:
    return tuple(x.shape[: x.dim() - n])


def _stat_out_shapes(x: torch.Tensor, n: int) -> List[Tuple[int, ...]]:
    lead = _lead(x, n)
    return [lead, lead + (1,) * n]


def aclnnLayerNormGetWorkspaceSize(input, normalizedShape, weightOptional, biasOptional, eps, out,
                                   meanOutOptional, rstdOutOptional):
    op = "aclnnLayerNorm"
    _present(op, [("input", input), ("normalizedShape", normalizedShape), ("eps", eps), ("out", out)])
    _tensors(op, [("input", input), ("weightOptional", weightOptional), ("biasOptional", biasOptional),
                  ("out", out), ("meanOutOptional", meanOutOptional), ("rstdOutOptional", rstdOutOptional)])
    _dtype(op, "input", input, CANN_FLOATS)
    if weightOptional is not None and biasOptional is not None:
        # CANN's aclnnLayerNorm page: with both present, bias has weight's dtype
        _same_dtype(op, [("biasOptional", biasOptional)], "weightOptional", weightOptional)
    _rank(op, "input", input, 1, MAX_DIMS, INVALID)
    shape = _normalized_shape(op, normalizedShape)
    with renamed_errors(_LN_NAMES):
        prepared = prepare_layer_norm(input, shape, weightOptional, biasOptional, eps, op=op)
    device = prepared.device
    n = len(shape)
    _out(op, "out", out, [input.shape], CANN_FLOATS, device, INVALID)
    for name, t in (("meanOutOptional", meanOutOptional), ("rstdOutOptional", rstdOutOptional)):
        _out(op, name, t, _stat_out_shapes(input, n), CANN_FLOATS, device, INVALID)
    outs = [("out", out), ("meanOutOptional", meanOutOptional), ("rstdOutOptional", rstdOutOptional)]
    check_written(op, outs)
    writes = [(out, lambda r: r[0])]
    if meanOutOptional is not None:
        writes.append((meanOutOptional, lambda r: r[1].reshape(meanOutOptional.shape)))
    if rstdOutOptional is not None:
        writes.append((rstdOutOptional, lambda r: r[2].reshape(rstdOutOptional.shape)))
    ex = AclOpExecutor(op, device, [], lambda staged: prepared.run(), writes, outs)
    return ex.workspace_size, ex


def aclnnLayerNorm(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnLayerNorm", workspace, workspaceSize, executor, stream)


def aclnnLayerNormBackwardGetWorkspaceSize(gradOut, input, normalizedShape, mean, rstd, weightOptional,
                                           biasOptional, outputMask, gradInputOut, gradWeightOut, gradBiasOut):
    op = "aclnnLayerNormBackward"
    _present(op, [("gradOut", gradOut), ("input", input), ("normalizedShape", normalizedShape),
                  ("mean", mean), ("rstd", rstd), ("outputMask", outputMask)])
    with renamed_errors(_LN_NAMES):
        mask = as_bool_triple(op, "output_mask", outputMask)
    outs = (("gradInputOut", gradInputOut), ("gradWeightOut", gradWeightOut), ("gradBiasOut", gradBiasOut))
    _present(op, [(name, t) for (name, t), wanted in zip(outs, mask) if wanted])
    _tensors(op, [("gradOut", gradOut), ("input", input), ("mean", mean), ("rstd", rstd),
                  ("weightOptional", weightOptional), ("biasOptional", biasOptional)] + list(outs))
    _dtype(op, "input", input, CANN_FLOATS)
    _dtype(op, "mean", mean, CANN_FLOATS)  # f16/bf16 statistics are accepted, computed in float32
    _dtype(op, "rstd", rstd, CANN_FLOATS)
    _rank(op, "input", input, 1, MAX_DIMS, INVALID)
    _rank(op, "gradOut", gradOut, 1, MAX_DIMS, INVALID)
    shape = _normalized_shape(op, normalizedShape)
    check_trailing(op, "normalizedShape", input, "input", shape)
    n = len(shape)
    device = input.device
    lead = _lead(input, n)
    rows = math.prod(lead)
    # CANN checks only that mean and rstd agree and hold one value per row
    _limit(op, mean.numel() == rows, INVALID,
           f"mean has {mean.numel()} elements (shape {tuple(mean.shape)}), expected one per row of input: "
           f"prod(input.shape[:-{n}]) == {rows}")
    _limit(op, tuple(rstd.shape) == tuple(mean.shape), INVALID,
           f"rstd has shape {tuple(rstd.shape)}, expected mean.shape == {tuple(mean.shape)}")
    # Statistics the shared validator does not take as they are (a half dtype, or a shape other
    # than [A...] / keepdim) are converted into the workspace in phase two.
    stage_stats = mean.dtype != F32 or rstd.dtype != F32 or tuple(mean.shape) not in _stat_out_shapes(input, n)
    stat_m = _placeholder(lead, F32, mean.device) if stage_stats else mean
    stat_r = _placeholder(lead, F32, rstd.device) if stage_stats else rstd

    def prepare(m, r):
        return prepare_layer_norm_backward(gradOut, input, shape, m, r, weightOptional, biasOptional, mask, op=op)

    with renamed_errors(_LN_NAMES):
        prepared = prepare(stat_m, stat_r)
    _out(op, "gradInputOut", gradInputOut if mask[0] else None, [input.shape], CANN_FLOATS, device, INVALID)
    _out(op, "gradWeightOut", gradWeightOut if mask[1] else None, [shape], CANN_FLOATS, device, INVALID)
    _out(op, "gradBiasOut", gradBiasOut if mask[2] else None, [shape], CANN_FLOATS, device, INVALID)
    written = [(name, t) for (name, t), wanted in zip(outs, mask) if wanted]
    check_written(op, written)

    stages = []
    if stage_stats:
        stages = [_Stage(lambda: mean.reshape(lead), lead, 0),
                  _Stage(lambda: rstd.reshape(lead), lead, rows * _F32_BYTES)]

    # CANN sums gradWeight/gradBias in float32 and casts once, to the output's dtype; the shared
    # engine would round them to a half weight's dtype first (a second rounding on the way into
    # a float32 output), so phase two hands it the weight widened to float32 (exact: dx is the same)
    widen = weightOptional is not None and weightOptional.dtype != F32 and (mask[1] or mask[2])

    def compute(staged):
        if not widen:
            return prepare(*staged).run() if staged else prepared.run()
        m, r = staged if staged else (mean, rstd)
        return prepare_layer_norm_backward(gradOut, input, shape, m, r, weightOptional.float(), biasOptional,
                                           mask, op=op).run()

    writes = [(t, (lambda i: lambda r: r[i])(i)) for i, ((_, t), wanted) in enumerate(zip(outs, mask)) if wanted]
    inputs = [("gradOut", gradOut), ("input", input), ("mean", mean), ("rstd", rstd),
              ("weightOptional", weightOptional), ("biasOptional", biasOptional)]
    ex = AclOpExecutor(op, device, stages, compute, writes, written, inputs)
    return ex.workspace_size, ex


def aclnnLayerNormBackward(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnLayerNormBackward", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------
# RMSNorm (CANN checks its shapes at tiling: 561002)
# ----------------------------------------------------------------------------------------

_RMS_NAMES = {"eps": "epsilon"}


def _rms_shapes(op: str, named, gamma: torch.Tensor, lo: int) -> None:
    for name, t in named:
        _rank(op, name, t, lo, MAX_DIMS, TILING)
        _limit(op, t.shape[-1] != 0, TILING, f"{name} has a last dim of 0 (shape {tuple(t.shape)}), expected > 0 "
                                             f"(CANN allows empty leading dims only)")
    _rank(op, "gamma", gamma, 1, MAX_DIMS, TILING)


def aclnnRmsNormGetWorkspaceSize(x, gamma, epsilon, yOut, rstdOut):
    op = "aclnnRmsNorm"
    _present(op, [("x", x), ("gamma", gamma), ("epsilon", epsilon), ("yOut", yOut), ("rstdOut", rstdOut)])
    _tensors(op, [("x", x), ("gamma", gamma), ("yOut", yOut), ("rstdOut", rstdOut)])
    _dtype(op, "x", x, CANN_FLOATS)
    _same_dtype(op, [("yOut", yOut)], "x", x)
    _dtype(op, "rstdOut", rstdOut, (F32,))
    with renamed_errors(_RMS_NAMES):
        prepared = prepare_rms_norm(x, gamma, epsilon, op=op)
    _rms_shapes(op, [("x", x)], gamma, 1)  # after every dtype rule: CANN checks shapes at tiling
    device = prepared.device
    _out(op, "yOut", yOut, [x.shape], (x.dtype,), device, TILING)
    _out(op, "rstdOut", rstdOut, _stat_out_shapes(x, gamma.dim()), (F32,), device, TILING)
    outs = [("yOut", yOut), ("rstdOut", rstdOut)]
    check_written(op, outs)
    writes = [(yOut, lambda r: r[0]), (rstdOut, lambda r: r[1].reshape(rstdOut.shape))]
    ex = AclOpExecutor(op, device, [], lambda staged: prepared.run(), writes, outs)
    return ex.workspace_size, ex


def aclnnRmsNorm(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnRmsNorm", workspace, workspaceSize, executor, stream)


def aclnnRmsNormGradGetWorkspaceSize(dy, x, rstd, gamma, dxOut, dgammaOut):
    op = "aclnnRmsNormGrad"
    _present(op, [("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma), ("dxOut", dxOut),
                  ("dgammaOut", dgammaOut)])
    _tensors(op, [("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma), ("dxOut", dxOut),
                  ("dgammaOut", dgammaOut)])
    _dtype(op, "x", x, CANN_FLOATS)
    _dtype(op, "dy", dy, CANN_FLOATS)
    # the whole dtype table before any shape: CANN checks dtypes in its op API, shapes at tiling
    _same_dtype(op, [("dy", dy)], "x", x)
    _dtype(op, "rstd", rstd, (F32,))
    _same_dtype(op, [("dxOut", dxOut)], "dy", dy)
    _dtype(op, "dgammaOut", dgammaOut, (F32,))
    with renamed_errors(_RMS_NAMES):
        prepared = prepare_rms_norm_grad(dy, x, rstd, gamma, op=op)
    _rms_shapes(op, [("dy", dy), ("x", x)], gamma, 2)  # CANN's grad takes 2..8 dims; at tiling
    device = prepared.device
    _out(op, "dxOut", dxOut, [dy.shape], (dy.dtype,), device, TILING)
    _out(op, "dgammaOut", dgammaOut, [gamma.shape], (F32,), device, TILING)
    outs = [("dxOut", dxOut), ("dgammaOut", dgammaOut)]
    check_written(op, outs)
    writes = [(dxOut, lambda r: r[0]), (dgammaOut, lambda r: r[1])]
    ex = AclOpExecutor(op, device, [], lambda staged: prepared.run(), writes, outs)
    return ex.workspace_size, ex


def aclnnRmsNormGrad(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnRmsNormGrad", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------
# NSA compression: TND, f16/bf16, actSeqLen as cumulative ends (type 0)
# ----------------------------------------------------------------------------------------

_NSA_NAMES = {"x": "input", "block_size": "compressBlockSize", "stride": "compressStride",
              "seq_lens_type": "actSeqLenType", "seq_lens": "actSeqLenOptional", "dout": "outputGrad"}
NSA_MAX_N, NSA_MAX_D, NSA_MAX_BLOCK, NSA_ALIGN = 128, 256, 128, 16


def _nsa_host_args(op: str, actSeqLen, layout, blockSize, stride, seqType):
    """CANN's op-API rules for the host arguments (all 161002, a missing actSeqLen included)."""
    block = _int_attr(op, "compressBlockSize", blockSize)
    stride = _int_attr(op, "compressStride", stride)
    seq_type = _int_attr(op, "actSeqLenType", seqType)
    if layout != "TND":
        _fail(op, INVALID, f"layoutOptional is {short_repr(layout)}, expected 'TND' (CANN supports TND only)")
    if actSeqLen is None:
        _fail(op, INVALID, "actSeqLenOptional is None, expected the cumulative sequence ends (CANN requires it)")
    if isinstance(actSeqLen, torch.Tensor):
        if actSeqLen.dtype != torch.int64 or actSeqLen.dim() != 1:
            _fail(op, INVALID, f"actSeqLenOptional is a {dtype_name(actSeqLen.dtype)} tensor of shape "
                               f"{tuple(actSeqLen.shape)}, expected a 1-D int64 tensor or a list of ints")
    elif not isinstance(actSeqLen, (list, tuple)):
        _fail(op, INVALID, f"actSeqLenOptional is {short_repr(actSeqLen)}, expected a list of ints (aclIntArray)")
    if len(actSeqLen) == 0:
        _fail(op, INVALID, "actSeqLenOptional is empty, expected the cumulative sequence ends")
    _limit(op, seq_type == 0, INVALID, f"actSeqLenType is {seq_type}, expected 0 (CANN supports cumulative "
                                       f"ends only)")
    return block, stride


def _nsa_limits(op: str, x: torch.Tensor, block: int, stride: int, grad: bool, num_blocks: int) -> None:
    t, n, d = x.shape
    _limit(op, t > 0 and n > 0 and d > 0 and num_blocks > 0, INVALID,
           f"input has shape {tuple(x.shape)} with {num_blocks} compressed blocks, expected no empty tensors "
           f"(CANN supports none)")
    _limit(op, n <= NSA_MAX_N, TILING, f"input has N = {n} heads, expected N <= {NSA_MAX_N}")
    _limit(op, d % NSA_ALIGN == 0 and d <= NSA_MAX_D, TILING,
           f"input has D = {d}, expected a multiple of {NSA_ALIGN} and <= {NSA_MAX_D}")
    _limit(op, block % NSA_ALIGN == 0 and block <= NSA_MAX_BLOCK, TILING,
           f"compressBlockSize is {block}, expected a multiple of {NSA_ALIGN} and <= {NSA_MAX_BLOCK}")
    _limit(op, stride % NSA_ALIGN == 0, TILING, f"compressStride is {stride}, expected a multiple of {NSA_ALIGN}")
    if grad:
        _limit(op, block > stride, TILING, f"compressBlockSize ({block}) <= compressStride ({stride}), "
                                           f"expected compressBlockSize > compressStride")
    else:
        _limit(op, block >= stride, TILING, f"compressBlockSize ({block}) < compressStride ({stride}), "
                                            f"expected compressBlockSize >= compressStride")


def aclnnNsaCompressGetWorkspaceSize(input, weight, actSeqLenOptional, layoutOptional, compressBlockSize,
                                     compressStride, actSeqLenType, output):
    op = "aclnnNsaCompress"
    _present(op, [("input", input), ("weight", weight), ("output", output)])
    _tensors(op, [("input", input), ("weight", weight), ("output", output)])
    _dtype(op, "input", input, CANN_HALVES)
    _same_dtype(op, [("weight", weight), ("output", output)], "input", input)
    block, stride = _nsa_host_args(op, actSeqLenOptional, layoutOptional, compressBlockSize, compressStride,
                                   actSeqLenType)
    with renamed_errors(_NSA_NAMES):
        prepared = prepare_nsa_compress(input, weight, block, stride, actSeqLenOptional, "cumsum", op=op)
    out_shape, _ = prepared.outputs[0]
    _nsa_limits(op, input, block, stride, False, out_shape[0])
    _out(op, "output", output, [out_shape], (input.dtype,), prepared.device, INVALID)
    check_written(op, [("output", output)])
    ex = AclOpExecutor(op, prepared.device, [], lambda staged: (prepared.run(),), [(output, lambda r: r[0])],
                       [("output", output)])
    return ex.workspace_size, ex


def aclnnNsaCompress(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnNsaCompress", workspace, workspaceSize, executor, stream)


def aclnnNsaCompressGradGetWorkspaceSize(outputGrad, input, weight, actSeqLenOptional, compressBlockSize,
                                         compressStride, actSeqLenType, layoutOptional, inputGradOut,
                                         weightGradOut):
    op = "aclnnNsaCompressGrad"
    _present(op, [("outputGrad", outputGrad), ("input", input), ("weight", weight),
                  ("inputGradOut", inputGradOut), ("weightGradOut", weightGradOut)])
    _tensors(op, [("outputGrad", outputGrad), ("input", input), ("weight", weight),
                  ("inputGradOut", inputGradOut), ("weightGradOut", weightGradOut)])
    _dtype(op, "input", input, CANN_HALVES)
    _same_dtype(op, [("outputGrad", outputGrad), ("weight", weight), ("inputGradOut", inputGradOut),
                     ("weightGradOut", weightGradOut)], "input", input)
    block, stride = _nsa_host_args(op, actSeqLenOptional, layoutOptional, compressBlockSize, compressStride,
                                   actSeqLenType)
    with renamed_errors(_NSA_NAMES):
        prepared = prepare_nsa_compress_grad(outputGrad, input, weight, block, stride, actSeqLenOptional,
                                             "cumsum", op=op)
    _nsa_limits(op, input, block, stride, True, outputGrad.shape[0])
    _out(op, "inputGradOut", inputGradOut, [input.shape], (input.dtype,), prepared.device, INVALID)
    _out(op, "weightGradOut", weightGradOut, [weight.shape], (input.dtype,), prepared.device, INVALID)
    outs = [("inputGradOut", inputGradOut), ("weightGradOut", weightGradOut)]
    check_written(op, outs)
    writes = [(inputGradOut, lambda r: r[0]), (weightGradOut, lambda r: r[1])]
    ex = AclOpExecutor(op, prepared.device, [], lambda staged: prepared.run(), writes, outs)
    return ex.workspace_size, ex


def aclnnNsaCompressGrad(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnNsaCompressGrad", workspace, workspaceSize, executor, stream)


# ----------------------------------------------------------------------------------------
# Floyd attention: f16/bf16, shape limits at tiling (561002), statistics [B,H,N,M,8]
# ----------------------------------------------------------------------------------------

_FLOYD_NAMES = {"q": "query", "k1": "key1", "v1": "value1", "k2": "key2", "v2": "value2",
                "mask": "attenMaskOptional", "scale": "scaleValue", "out": "attentionIn",
                "softmax_max": "softmaxMax", "softmax_sum": "softmaxSum"}
STAT_REPLICAS = 8
FLOYD_MAX_LEN = 1 << 20  # CANN's "1M"
FLOYD_D = (32, 64, 128)


def _floyd_limits(op: str, q: torch.Tensor, k1: torch.Tensor) -> None:
    b, h, n, m, d = q.shape
    kk = k1.shape[3]
    _limit(op, 1 <= b <= 2048, TILING, f"query has B = {b}, expected 1..2048")
    _limit(op, 1 <= h <= 256, TILING, f"query has H = {h}, expected 1..256")
    _limit(op, 16 <= n <= FLOYD_MAX_LEN and n % 16 == 0, TILING,
           f"query has N = {n}, expected 16..{FLOYD_MAX_LEN} and a multiple of 16")
    _limit(op, 128 <= m <= FLOYD_MAX_LEN and m % 128 == 0, TILING,
           f"query has M = {m}, expected 128..{FLOYD_MAX_LEN} and a multiple of 128")
    _limit(op, 128 <= kk <= FLOYD_MAX_LEN and kk % 128 == 0, TILING,
           f"key1 has K = {kk}, expected 128..{FLOYD_MAX_LEN} and a multiple of 128")
    _limit(op, d in FLOYD_D, TILING, f"query has D = {d}, expected one of {FLOYD_D}")


def aclnnFusedFloydAttentionGetWorkspaceSize(query, key1, value1, key2, value2, attenMaskOptional, scaleValue,
                                             softmaxMaxOut, softmaxSumOut, attentionOutOut):
    op = "aclnnFusedFloydAttention"
    inputs = [("query", query), ("key1", key1), ("value1", value1), ("key2", key2), ("value2", value2)]
    outs = [("softmaxMaxOut", softmaxMaxOut), ("softmaxSumOut", softmaxSumOut),
            ("attentionOutOut", attentionOutOut)]
    _present(op, inputs + [("scaleValue", scaleValue)] + outs)
    _tensors(op, inputs + [("attenMaskOptional", attenMaskOptional)] + outs)
    _dtype(op, "query", query, CANN_HALVES)
    _dtype(op, "softmaxMaxOut", softmaxMaxOut, (F32,))
    _dtype(op, "softmaxSumOut", softmaxSumOut, (F32,))
    _same_dtype(op, [("attentionOutOut", attentionOutOut)], "query", query)
    with renamed_errors(_FLOYD_NAMES):
        prepared = prepare_floyd_attention(query, key1, value1, key2, value2, attenMaskOptional, scaleValue, op=op)
    _floyd_limits(op, query, key1)
    device = prepared.device
    stat_shape = tuple(query.shape[:4]) + (STAT_REPLICAS,)
    _out(op, "softmaxMaxOut", softmaxMaxOut, [stat_shape], (F32,), device, TILING)
    _out(op, "softmaxSumOut", softmaxSumOut, [stat_shape], (F32,), device, TILING)
    _out(op, "attentionOutOut", attentionOutOut, [query.shape], (query.dtype,), device, TILING)
    check_written(op, outs)
    writes = [(softmaxMaxOut, lambda r: r[1].unsqueeze(-1).expand(stat_shape)),
              (softmaxSumOut, lambda r: r[2].unsqueeze(-1).expand(stat_shape)),
              (attentionOutOut, lambda r: r[0])]
    ex = AclOpExecutor(op, device, [], lambda staged: prepared.run(), writes, outs)
    return ex.workspace_size, ex


def aclnnFusedFloydAttention(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnFusedFloydAttention", workspace, workspaceSize, executor, stream)


def aclnnFusedFloydAttentionGradGetWorkspaceSize(query, key1, value1, key2, value2, dy, attenMaskOptional,
                                                 softmaxMax, softmaxSum, attentionIn, scaleValue, dqOut, dk1Out,
                                                 dv1Out, dk2Out, dv2Out):
    op = "aclnnFusedFloydAttentionGrad"
    inputs = [("query", query), ("key1", key1), ("value1", value1), ("key2", key2), ("value2", value2),
              ("dy", dy)]
    stats = [("softmaxMax", softmaxMax), ("softmaxSum", softmaxSum), ("attentionIn", attentionIn)]
    outs = [("dqOut", dqOut), ("dk1Out", dk1Out), ("dv1Out", dv1Out), ("dk2Out", dk2Out), ("dv2Out", dv2Out)]
    _present(op, inputs + stats + [("scaleValue", scaleValue)] + outs)
    _tensors(op, inputs + [("attenMaskOptional", attenMaskOptional)] + stats + outs)
    _dtype(op, "query", query, CANN_HALVES)
    _same_dtype(op, outs, "query", query)
    # the statistics' dtype before any shape (shapes are CANN's tiling checks, 561002)
    _dtype(op, "softmaxMax", softmaxMax, (F32,))
    _dtype(op, "softmaxSum", softmaxSum, (F32,))
    with renamed_errors(_FLOYD_NAMES):
        prepared = prepare_floyd_attention_grad(dy, query, key1, value1, key2, value2, attentionIn, softmaxMax,
                                                softmaxSum, attenMaskOptional, scaleValue, op=op)
    b, h, n, m, _ = query.shape
    stat_shape = (b, h, n, m, STAT_REPLICAS)
    for name, t in (("softmaxMax", softmaxMax), ("softmaxSum", softmaxSum)):
        _limit(op, tuple(t.shape) == stat_shape, TILING,
               f"{name} has shape {tuple(t.shape)}, expected CANN's [B,H,N,M,8] == {stat_shape}")
    _floyd_limits(op, query, key1)
    device = prepared.device
    for (name, t), src in zip(outs, (query, key1, value1, key2, value2)):
        _out(op, name, t, [src.shape], (query.dtype,), device, TILING)
    check_written(op, outs)

    # the replicated statistics are compacted into the workspace: contiguous [B,H,N,M] float32
    compact = (b, h, n, m)
    stages = [_Stage(lambda: softmaxMax[..., 0], compact, 0),
              _Stage(lambda: softmaxSum[..., 0], compact, math.prod(compact) * _F32_BYTES)]

    def compute(staged):
        smax, ssum = staged
        return prepare_floyd_attention_grad(dy, query, key1, value1, key2, value2, attentionIn, smax, ssum,
                                            attenMaskOptional, scaleValue, op=op).run()

    writes = [(t, (lambda i: lambda r: r[i])(i)) for i, (_, t) in enumerate(outs)]
    ex = AclOpExecutor(op, device, stages, compute, writes, outs,
                       inputs + [("attenMaskOptional", attenMaskOptional)] + stats)
    return ex.workspace_size, ex


def aclnnFusedFloydAttentionGrad(workspace, workspaceSize, executor, stream=None) -> int:
    return _run_phase_two("aclnnFusedFloydAttentionGrad", workspace, workspaceSize, executor, stream)
