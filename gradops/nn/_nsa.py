"""NSA key/value compression as a differentiable functional: its custom ops (seq_lens as a
list, and as a tensor for torch.compile), their fakes, autograd and autocast rules, and the
eager path (see ``_custom_ops``)."""
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ..ops import nsa_compress as _nsa_ops
from ..ops._checks import check_int_attr, require_tensor
from ._custom_ops import (backend_arg, double_backward_error, dtensor_arguments, dtensor_errors, empty_like_spec, fresh,
                          no_autocast, register_autocast, takes_eager_path)
from ._transforms import refuse_batched, register_folded_vmap, transformable, transformed

def _nsa_forward(x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    with no_autocast(x.device.type):
        out = _nsa_ops.prepare_nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type,
                                            backend=backend).run()
    return fresh(out)


def _nsa_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    with no_autocast(x.device.type):
        dx, dw = _nsa_ops.prepare_nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens,
                                                    seq_lens_type, backend=backend).run()
    return fresh(dx), fresh(dw)


@torch.library.custom_op("gradops::nsa_compress", mutates_args=())
def _nsa_compress_op(x: Tensor, weight: Tensor, block_size: int, stride: int, seq_lens: List[int],
                     seq_lens_type: str, backend: Optional[str]) -> Tensor:
    return _nsa_forward(x, weight, block_size, stride, seq_lens, seq_lens_type, backend)


def _specialized(seq_lens: List[int]) -> List[int]:
    # Under torch.compile dynamo turns a list's ints into symbolic ints once it has seen them
    # change (automatic dynamic shapes) or with dynamic=True. The block plan needs their
    # values: int() guards on each one, so the list stays a compile-time constant and a new
    # list recompiles (as documented) instead of failing validation.
    return [int(v) for v in seq_lens]


@_nsa_compress_op.register_fake
def _(x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    seq_lens = _specialized(seq_lens)
    p = _nsa_ops.prepare_nsa_compress(x, weight, block_size, stride, seq_lens, seq_lens_type, backend=backend)
    return empty_like_spec(p.outputs[0], x)


@torch.library.custom_op("gradops::nsa_compress_backward", mutates_args=())
def _nsa_compress_backward_op(dout: Tensor, x: Tensor, weight: Tensor, block_size: int, stride: int,
                              seq_lens: List[int], seq_lens_type: str, backend: Optional[str]
                              ) -> Tuple[Tensor, Tensor]:
    return _nsa_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend)


@_nsa_compress_backward_op.register_fake
def _(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    seq_lens = _specialized(seq_lens)
    p = _nsa_ops.prepare_nsa_compress_grad(dout, x, weight, block_size, stride, seq_lens, seq_lens_type,
                                           backend=backend)
    return tuple(empty_like_spec(s, x) for s in p.outputs)


# The same pair with seq_lens as an integer tensor. The number of compressed blocks then
# depends on the tensor's values, so the fake implementation gives the output an unbacked
# (data-dependent) first dimension: torch.compile traces it without a graph break, and the
# values are read on the host only when the op really runs.
@torch.library.custom_op("gradops::nsa_compress_seqlens_tensor", mutates_args=())
def _nsa_compress_t_op(x: Tensor, weight: Tensor, block_size: int, stride: int, seq_lens: Tensor,
                       seq_lens_type: str, backend: Optional[str]) -> Tensor:
    return _nsa_forward(x, weight, block_size, stride, _nsa_ops.seq_lens_to_list("nsa_compress", seq_lens),
                        seq_lens_type, backend)


@_nsa_compress_t_op.register_fake
def _(x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    op = "nsa_compress"
    block_size, stride = _nsa_ops._check_common(op, x, weight, block_size, stride)
    _nsa_ops.seq_lens_type_code(op, seq_lens_type)
    if seq_lens.dim() != 1 or seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: seq_lens is a {seq_lens.dtype} tensor of shape "
                                                  f"{tuple(seq_lens.shape)}, expected a 1-D integer tensor")
    num_blocks = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((num_blocks,) + tuple(x.shape[1:]))


@torch.library.custom_op("gradops::nsa_compress_seqlens_tensor_backward", mutates_args=())
def _nsa_compress_t_backward_op(dout: Tensor, x: Tensor, weight: Tensor, block_size: int, stride: int,
                                seq_lens: Tensor, seq_lens_type: str, backend: Optional[str]
                                ) -> Tuple[Tensor, Tensor]:
    return _nsa_grad(dout, x, weight, block_size, stride,
                     _nsa_ops.seq_lens_to_list("nsa_compress_grad", seq_lens), seq_lens_type, backend)


@_nsa_compress_t_backward_op.register_fake
def _(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(weight, memory_format=torch.contiguous_format)


def _nsa_setup(ctx, inputs, output):
    x, weight, block_size, stride, seq_lens, seq_lens_type, backend = inputs
    if isinstance(seq_lens, Tensor):
        ctx.save_for_backward(x, weight, seq_lens)
    else:
        ctx.save_for_backward(x, weight)
        ctx.seq_lens = seq_lens
    ctx.args = (block_size, stride, seq_lens_type, backend)


def _nsa_backward(ctx, dout):
    block_size, stride, seq_lens_type, backend = ctx.args
    saved = ctx.saved_tensors
    if len(saved) == 3:
        x, weight, seq_lens = saved
        grad_op = torch.ops.gradops.nsa_compress_seqlens_tensor_backward
    else:
        (x, weight), seq_lens = saved, ctx.seq_lens
        grad_op = torch.ops.gradops.nsa_compress_backward
    need_x, need_w = ctx.needs_input_grad[:2]
    if not (need_x or need_w):
        return (None,) * 7
    dx, dw = transformed(grad_op)(dout, x, weight, block_size, stride, seq_lens, seq_lens_type, backend)
    return dx if need_x else None, dw if need_w else None, None, None, None, None, None


class _NsaCompressFunction(torch.autograd.Function):
    """The eager path of ``gradops::nsa_compress`` (as the norms', see ``takes_eager_path``): the same
    validation and backend code without the custom op's dispatch layers, which cost a small
    call more host time than its kernels take on a GPU."""

    @staticmethod
    def forward(ctx, x, weight, block_size, stride, seq_lens, seq_lens_type, backend):
        out = _nsa_forward(x, weight, block_size, stride, seq_lens, seq_lens_type, backend)
        ctx.save_for_backward(x, weight)
        ctx.seq_lens = seq_lens
        ctx.args = (block_size, stride, seq_lens_type, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # create_graph: the op's autograd says why it cannot
            return _nsa_backward(ctx, dout)
        need_x, need_w = ctx.needs_input_grad[:2]
        if not (need_x or need_w):
            return (None,) * 7
        (x, weight), (block_size, stride, seq_lens_type, backend) = ctx.saved_tensors, ctx.args
        dx, dw = _nsa_grad(dout, x, weight, block_size, stride, ctx.seq_lens, seq_lens_type, backend)
        return dx if need_x else None, dw if need_w else None, None, None, None, None, None


for _name in ("nsa_compress", "nsa_compress_seqlens_tensor"):
    torch.library.register_autograd(f"gradops::{_name}", _nsa_backward, setup_context=_nsa_setup)
    torch.library.register_autograd(f"gradops::{_name}_backward",
                                    double_backward_error("nsa_compress", "a plain PyTorch formulation"))
    # torch.func transforms (see _transforms): heads are independent, so a vmapped dim is more heads
    transformable(_name, _nsa_setup, _nsa_backward)
    transformable(f"{_name}_backward", None, double_backward_error("nsa_compress", "a plain PyTorch formulation"))
    register_folded_vmap(_name, 1, unbatchable=("seq_lens",))
    register_folded_vmap(f"{_name}_backward", 1, unbatchable=("seq_lens",))


def _check_dtensor_seq_lens(op: str, seq_lens) -> None:
    """seq_lens beside DTensor arguments: a list, or a plain tensor read on the host. Under
    torch.compile a tensor's values make the output's size data-dependent, which DTensor's
    sharding propagation does not take; a DTensor cannot be read on the host at all."""
    if type(seq_lens).__name__ == "DTensor":
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: seq_lens is a DTensor, expected a list of ints or a plain "
                                                  f"tensor (its values are read on the host)")
    if isinstance(seq_lens, Tensor) and torch.compiler.is_compiling():
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: seq_lens is a tensor beside DTensor arguments under "
                                                  f"torch.compile, expected a list of ints (a tensor's values would "
                                                  f"make the output's size data-dependent, which DTensor cannot "
                                                  f"shard)")


def nsa_compress(x: Tensor, weight: Tensor, block_size: int, stride: int,
                 seq_lens: Union[Sequence[int], Tensor], seq_lens_type: str = "cumsum", *,
                 backend: Optional[str] = None) -> Tensor:
    """NSA key/value compression of packed sequences, differentiable in ``x`` and ``weight``.

    ``x [T, N, D]``, ``weight [block_size, N]`` (x's dtype) -> ``[C, N, D]``. ``seq_lens``:
    cumulative ends (``"cumsum"``) or lengths (``"lengths"``); a list of ints (under
    torch.compile a list is a compile-time constant: a new list recompiles) or a 1-D integer
    tensor (under torch.compile the output's first dimension is then data-dependent, so
    nothing recompiles).

    The number of blocks, hence the output's shape, depends on the values, so they are read
    on the host: a CUDA tensor costs a device-to-host copy (a synchronisation, and no CUDA
    graph capture); a list or a CPU tensor costs none. In eager mode a tensor is read once,
    in the forward; the backward reuses the values.
    """
    op = "nsa_compress"
    require_tensor(op, "x", x)
    require_tensor(op, "weight", weight)
    block_size = check_int_attr(op, "block_size", block_size, 1)
    stride = check_int_attr(op, "stride", stride, 1)
    code = _nsa_ops.seq_lens_type_code(op, seq_lens_type)
    type_name = "lengths" if code == 1 else "cumsum"
    backend = backend_arg(op, backend)
    dtensors = dtensor_arguments(op, ("x", "weight"), (x, weight))
    if dtensors:
        _check_dtensor_seq_lens(op, seq_lens)
    if isinstance(seq_lens, Tensor) and torch.compiler.is_compiling():
        require_tensor(op, "seq_lens", seq_lens)
        return transformed(torch.ops.gradops.nsa_compress_seqlens_tensor)(x, weight, block_size, stride, seq_lens,
                                                                          type_name, backend)
    refuse_batched(op, "seq_lens", seq_lens)
    seq_lens = _nsa_ops.seq_lens_to_list(op, seq_lens)
    if takes_eager_path(x) and not torch.is_autocast_enabled(x.device.type):  # (autocast casts through the op)
        return _NsaCompressFunction.apply(x, weight, block_size, stride, seq_lens, type_name, backend)
    with dtensor_errors(dtensors):
        return transformed(torch.ops.gradops.nsa_compress)(x, weight, block_size, stride, seq_lens, type_name,
                                                           backend)


# matmul-like: the forwards take the autocast dtype, the backwards what autograd hands them
for _name, _cast in (("nsa_compress", True), ("nsa_compress_seqlens_tensor", True),
                     ("nsa_compress_backward", False), ("nsa_compress_seqlens_tensor_backward", False)):
    register_autocast(_name, _cast)
del _name, _cast
