"""torch.func transforms (``grad``, ``vjp``, ``jacrev``, ``vmap`` and their compositions) over the
``gradops`` custom ops.

Two things stand in their way, and this module removes both:

- ``torch.library.register_autograd`` gives each op an ``autograd.Function`` of torch's
  making with a ctx-style forward and no ``setup_context``, which functorch refuses
  outright. Under a transform the functionals therefore call the op through a functorch-style
  ``autograd.Function`` of ours (:func:`transformable`, reached through :func:`transformed`):
  its forward calls the op, its ``setup_context`` and backward are the ones the op
  registered with ``register_autograd``, and ``generate_vmap_rule`` lets vmap run the
  forward and backward as they are, so that the ops inside meet their batching rules. The
  backward ops get the same treatment (a backward that refuses double backward), since
  ``grad`` differentiates with ``create_graph=True`` and so reaches their autograd too.
- Without a batching rule vmap runs an op once per example through torch's fallback (slow,
  with a warning, or an error where the fallback is off). The rules here give each op the
  whole batch in one call wherever a vmapped dimension is simply more of what the op
  already iterates over: rows for the norms (:func:`register_rows_vmap`), Floyd's batch and
  NSA's heads (:func:`register_folded_vmap`). Where folding would mix examples (a batched
  weight, or a per-example weight gradient, which one call would sum over the batch) the
  rule calls the op once per example itself and stacks the results.
"""
import contextlib
import math
import threading
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ._custom_ops import NOT_COMPUTED

# "gradops::<op>" -> the apply of its functorch-style autograd.Function
_FUNCTIONS: Dict[str, Callable] = {}

_STATE = threading.local()


def transformed(op):
    """``op`` (a ``torch.ops.gradops`` packet) itself, or under a torch.func transform the
    autograd.Function that gives it an autograd functorch accepts. Not while dynamo traces:
    it turns transforms into higher-order ops of its own and cannot trace this Function."""
    if not torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return op
    return _FUNCTIONS[op._qualified_op_name]


def _nothing_saved(ctx, inputs, output):
    pass


@contextlib.contextmanager
def _param_grads_discarded():
    previous = getattr(_STATE, "param_grads_discarded", False)
    _STATE.param_grads_discarded = True
    try:
        yield
    finally:
        _STATE.param_grads_discarded = previous


def discarding_param_grads() -> bool:
    """Whether the backward op now called runs for a node that discards its parameter
    gradients (``transformable``'s ``param_grads``)."""
    return getattr(_STATE, "param_grads_discarded", False)


def transformable(op_name: str, setup_context: Optional[Callable], backward: Callable, *,
                  aliases: Sequence[str] = (), param_grads: Sequence[int] = ()) -> None:
    """Registers the functorch-style autograd.Function that :func:`transformed` gives for
    ``gradops::<op_name>`` (and for each of ``aliases``). ``setup_context`` and ``backward``:
    those the op registered with ``register_autograd`` (``setup_context`` None: nothing to
    save). ``param_grads``: the inputs whose gradients the backward op computes whether they
    are asked for or not; when none of them is, the backward tells the batching rules so
    (which may then fold the batch, see :func:`register_rows_vmap`) and returns None for them.
    """
    op = getattr(torch.ops.gradops, op_name).default

    def forward(*args):
        return op(*args)

    if param_grads:
        full_backward = backward

        def backward(ctx, *grads):
            if any(ctx.needs_input_grad[i] for i in param_grads):
                return full_backward(ctx, *grads)
            with _param_grads_discarded():
                result = full_backward(ctx, *grads)
            return tuple(None if i in param_grads else g for i, g in enumerate(result))

    function = type(f"Transformable_{op_name}", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context or _nothing_saved),
        "backward": staticmethod(backward),
        "generate_vmap_rule": True,
    })
    for name in (op_name, *aliases):
        _FUNCTIONS[f"gradops::{name}"] = function.apply


# --------------------------------------------------------------------------------------------
# Batching rules
# --------------------------------------------------------------------------------------------

def _batched_at(t: Tensor, bdim: Optional[int], size: int, at: int) -> Tensor:
    """``t`` with its vmapped dimension at ``at``; an unbatched ``t`` is expanded (every example
    shares it), which costs no copy until the op reads it."""
    if bdim is None:
        return t.unsqueeze(at).expand(*t.shape[:at], size, *t.shape[at:])
    return t.movedim(bdim, at)


def _not_computed(t: Tensor) -> bool:
    # An output an op skipped is an empty 1-D tensor, the same for every example: unbatched.
    # A computed output of that shape (a norm of empty rows) is empty for every example too,
    # so treating it alike gives the same result.
    return tuple(t.shape) == NOT_COMPUTED


def _per_example(op, size: int, args: tuple, in_dims: tuple):
    """One call per example, the results stacked: what vmap's fallback would do, here for the
    calls whose examples a single call would mix."""
    examples = range(size) if size else [None]  # (an empty batch: one stand-in example, for the shapes)
    results = []
    for i in examples:
        call = []
        for a, d in zip(args, in_dims):
            if isinstance(a, Tensor) and d is not None:  # (a list's in_dims is a list)
                a = a.select(d, i) if i is not None else a.new_zeros(a.shape[:d] + a.shape[d + 1:])
            call.append(a)
        out = op(*call)
        single = isinstance(out, Tensor)
        results.append((out,) if single else out)
    outs, dims = [], []
    for k, first in enumerate(results[0]):
        if _not_computed(first):
            outs.append(first)
            dims.append(None)
        else:
            stacked = torch.stack([r[k] for r in results])
            outs.append(stacked if size else stacked[:0])
            dims.append(0)
    if single:
        return outs[0], dims[0]
    return tuple(outs), tuple(dims)


def _schema_names(op) -> list:
    return [a.name for a in op._schema.arguments]


def register_rows_vmap(op_name: str, params: Sequence[str], *,
                       param_grads_wanted: Optional[Callable[[dict], bool]] = None,
                       param_grad_outputs: Sequence[int] = ()) -> None:
    """The batching rule of a norm op (forward or backward): a vmapped dimension is more rows.

    The norms normalise trailing dimensions, so the vmapped dimension goes in front, as a
    leading dimension, of every row tensor (input, residual, upstream gradients, statistics;
    an unbatched one is expanded) and one call computes the batch. ``params`` (the weight,
    bias or gamma: by the op's argument names) are shared by the rows; a batched one differs
    per example, so the rule then calls the op once per example. So it does where the call
    returns parameter gradients that are used (``param_grads_wanted``, given the arguments
    by name): one call would sum them over the batch, and vmap wants them per example.
    ``param_grad_outputs``: outputs holding parameter gradients the op computes whatever is
    asked: wanted unless the calling autograd node discards them (``transformable``'s
    ``param_grads``); folded, they come back NaN (one call can only give their sum over the
    batch), so that a use nobody foresaw shows.
    """
    op = getattr(torch.ops.gradops, op_name).default
    names = _schema_names(op)
    param_index = {names.index(n) for n in params}

    def rule(info, in_dims, *args):
        size = info.batch_size
        if param_grad_outputs:
            wanted = not discarding_param_grads()
        else:
            wanted = param_grads_wanted is not None and param_grads_wanted(dict(zip(names, args)))
        if wanted or any(in_dims[i] is not None for i in param_index):
            return _per_example(op, size, args, in_dims)
        folded = [_batched_at(a, d, size, 0) if isinstance(a, Tensor) and i not in param_index else a
                  for i, (a, d) in enumerate(zip(args, in_dims))]
        out = list(op(*folded))
        dims = [None if _not_computed(t) else 0 for t in out]
        for k in param_grad_outputs:
            out[k], dims[k] = torch.full_like(out[k], math.nan), None
        return tuple(out), tuple(dims)

    torch.library.register_vmap(f"gradops::{op_name}", rule)


def _batched_error(op: str, name: str) -> AclnnError:
    return AclnnError(ACLNN_ERR_PARAM_INVALID,
                      f"{op}: {name} is batched under torch.vmap, expected the same {name} for every example (its "
                      f"values decide the output's shape); vmap over the other arguments, or call once per {name}")


def refuse_batched(op: str, name: str, t) -> None:
    """Refuses a ``t`` that vmap batches where every example must have the same value (read
    on the host, as NSA's ``seq_lens``: a batched tensor has no values to read)."""
    if isinstance(t, Tensor) and torch._C._functorch.is_batchedtensor(t):
        raise _batched_error(op, name)


def register_folded_vmap(op_name: str, at: int, *, unbatchable: Sequence[str] = ()) -> None:
    """The batching rule of an op whose tensors (inputs and outputs alike) all have a dimension
    ``at`` over which the op computes independently (Floyd attention's batch, 0; NSA's heads,
    1): the vmapped dimension is folded into it (examples outermost; an unbatched tensor is
    expanded) and unfolded from every output, so one call computes the batch exactly,
    gradients included. ``unbatchable``: tensor arguments that must be the same for every
    example (by name)."""
    op = getattr(torch.ops.gradops, op_name).default
    names = _schema_names(op)
    family = op_name.split("_backward")[0].replace("_seqlens_tensor", "")

    def rule(info, in_dims, *args):
        size = info.batch_size
        folded, extent = [], None
        for name, a, d in zip(names, args, in_dims):
            if name in unbatchable:
                if isinstance(a, Tensor) and d is not None:
                    raise _batched_error(family, name)
            elif isinstance(a, Tensor):
                a = _batched_at(a, d, size, at)
                extent = a.shape[at + 1]  # (the same in every tensor: the op checks it)
                a = a.flatten(at, at + 1)
            folded.append(a)
        out = op(*folded)
        outs = (out,) if isinstance(out, Tensor) else out
        outs = tuple(t.unflatten(at, (size, extent)) for t in outs)
        return (outs[0], at) if isinstance(out, Tensor) else (outs, (at,) * len(outs))

    torch.library.register_vmap(f"gradops::{op_name}", rule)
