"""gradops' norms and NSA compression on DTensors (``gradops.distributed.sharding``): tensor and
sequence parallelism as torch runs them, on 2 and 4 gloo processes (CPU, loopback), against
one process's unsharded PyTorch.

- the sequence-parallel block (RMSNorm -> LayerNorm -> colwise Linear -> rowwise Linear),
  patched with gradops then parallelized (``SequenceParallel`` on both norms), and parallelized
  then patched: its output and every gradient against torch's own unsharded block, float64 and
  bf16, both backends;
- direct calls of every norm functional (the fused adds, Gemma's offset, the llama cast, no
  weight) on ``Shard(0)``, ``Shard(1)``, ``Shard(-1)`` and ``Replicate()``, and NSA compression on
  heads (and on tokens, redistributed), float64 and bf16, both backends;
- a 2x2 mesh (FSDP2 x TP) training a patched 2-layer Llama-like model for 5 steps against the
  unsharded model;
- the sequence-parallel block under ``torch.compile(fullgraph=True)``: one graph, gradops' ops in it;
- the collectives each rule adds (``CommDebugMode``): none for row shards;
- a plain tensor beside DTensors refused with AclnnError; a cached sharding decision not reused
  for other arguments.

The oracle is float64 PyTorch on the inputs as the sharded run holds them (rounded to bf16 for
the bf16 runs): 1e-10 in float64, the suite's tolerance (``oracles.TOLERANCE``) in bf16.
Each world size runs every check in one set of spawned workers (spawning is the slow part),
with a process-group timeout, so that a failing rank fails its peers instead of hanging them;
they save what they computed, and the tests compare it here.
"""
import contextlib
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradops
import gradops.nn.functional as GF
from gradops.oracles import TOLERANCE, rel_error
from conftest import TEST_DEVICE
from spawn import init_gloo, load_ranks, once_per_session, outcomes, run_workers

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="W ranks need W GPUs under NCCL; the gloo runs are "
                                                             "the CPU suite's")

PG_TIMEOUT_S = 60  # a collective waits this long for a failed peer, then raises
WORKERS_TIMEOUT_S = 300
BACKENDS = ("reference", "triton")
DTYPES = (torch.float64, torch.bfloat16)
B, S, H, HIDDEN = 4, 6, 16, 32  # 4 ranks: S uneven (2, 2, 1, 1)
EPS = 1e-6
PLACEMENTS = ("Shard(0)", "Shard(1)", "Shard(-1)", "Replicate()")
GATHER = "c10d_functional.all_gather_into_tensor"


def _row_shard(case, placement):
    """Whether x's placement shards a row dim of the case's norm (not a normalized dim)."""
    rows = ("Shard(0)",) if case.startswith("layer_norm over") else ("Shard(0)", "Shard(1)")
    return placement in rows


def _placement(name):
    from torch.distributed.tensor import Replicate, Shard

    return {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Shard(-1)": Shard(-1), "Replicate()": Replicate()}[name]


def _draw(shape, seed, dtype=torch.float64):
    """Values drawn in float64 on the CPU, then rounded to ``dtype`` (the oracle reads them back)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------
# Direct calls: each case is (gradops call, float64 oracle), both taking (x, residual, weight,
# bias) and returning a tuple of outputs.

def _xhat(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


NORM_CASES = {
    "layer_norm": (lambda x, r, w, b: (GF.layer_norm(x, (H,), w, b),),
                   lambda x, r, w, b: (F.layer_norm(x, (H,), w, b),)),
    "layer_norm over (S, H), no affine": (lambda x, r, w, b: (GF.layer_norm(x, (S, H)),),
                                          lambda x, r, w, b: (F.layer_norm(x, (S, H)),)),
    "fused_add_layer_norm": (lambda x, r, w, b: GF.fused_add_layer_norm(x, r, (H,), w, b),
                             lambda x, r, w, b: (F.layer_norm(x + r, (H,), w, b), x + r)),
    "rms_norm": (lambda x, r, w, b: (GF.rms_norm(x, (H,), w, EPS),), lambda x, r, w, b: (w * _xhat(x),)),
    "rms_norm, no weight": (lambda x, r, w, b: (GF.rms_norm(x, (H,), None, EPS),), lambda x, r, w, b: (_xhat(x),)),
    "rms_norm, Gemma's offset": (lambda x, r, w, b: (GF.rms_norm(x, (H,), w, EPS, offset=1.0),),
                                 lambda x, r, w, b: ((1 + w) * _xhat(x),)),
    "rms_norm, llama": (lambda x, r, w, b: (GF.rms_norm(x, (H,), w, EPS, casting_mode="llama"),),
                        lambda x, r, w, b: (w * _xhat(x),)),
    # a float32 master weight beside 16-bit input: the weight product outside the operator (a
    # float64 input keeps its own weight)
    "rms_norm, llama, float32 weight": (
        lambda x, r, w, b: (GF.rms_norm(x, (H,), w if x.dtype == torch.float64 else w.float(), EPS,
                                        casting_mode="llama"),),
        lambda x, r, w, b: (w * _xhat(x),)),
    "fused_add_rms_norm": (lambda x, r, w, b: GF.fused_add_rms_norm(x, r, (H,), w, EPS),
                           lambda x, r, w, b: (w * _xhat(x + r), x + r)),
}


def norm_inputs(dtype):
    """x, residual, weight, bias (rounded to ``dtype``) and an upstream gradient per output."""
    x, r = _draw((B, S, H), 1, dtype), _draw((B, S, H), 2, dtype)
    w, b = (1 + 0.5 * _draw((H,), 3)).to(dtype), _draw((H,), 4, dtype)
    dys = [_draw((B, S, H), 5, dtype), _draw((B, S, H), 6, dtype)]
    return (x, r, w, b), dys


def norm_oracle(case, dtype):
    """The float64 outputs and gradients (x, residual, weight, bias; None where none flows)."""
    (x, r, w, b), dys = norm_inputs(dtype)
    leaves = [t.double().requires_grad_() for t in (x, r, w, b)]
    outs = NORM_CASES[case][1](*leaves)
    torch.autograd.backward(outs, [d.double() for d in dys[:len(outs)]])
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _counted_collectives(comm):
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def _norm_calls(mesh, backends, dtypes):
    """Every norm case on every placement: outputs and gradients whole, their placements, and the
    collectives its forward and backward issued."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    results = {}
    for backend in backends:
        for dtype in dtypes:
            (x, r, w, b), dys = norm_inputs(dtype)
            for case, (call, _) in NORM_CASES.items():
                for placement in PLACEMENTS:
                    with gradops.use_backend(backend):
                        xd, rd = (distribute_tensor(t, mesh, [_placement(placement)]).requires_grad_() for t in (x, r))
                        wd, bd = (distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
                        with CommDebugMode() as comm:
                            outs = call(xd, rd, wd, bd)
                        upstream = [distribute_tensor(d, mesh, o.placements) for o, d in zip(outs, dys)]
                        # (autograd.grad, not backward: accumulating a gradient two leaves share
                        # copies it, and torch 2.11's DTensor gathers that copy of uneven shards)
                        with CommDebugMode() as comm_backward:
                            grads = torch.autograd.grad(outs, (xd, rd, wd, bd), upstream, allow_unused=True)
                    results[backend, dtype, case, placement] = {
                        "outs": [o.full_tensor() for o in outs],
                        "grads": [None if g is None else g.full_tensor() for g in grads],
                        "in placements": str(xd.placements),  # (Shard(-1) becomes Shard(dim=2))
                        "out placements": [str(o.placements) for o in outs],
                        "weight grad placements": None if grads[2] is None else str(grads[2].placements),
                        "collectives": _counted_collectives(comm),
                        "backward collectives": _counted_collectives(comm_backward),
                    }
    return results


# NSA compression: x [T, N, D], weight [block_size, N]; two packed sequences
NSA_T, NSA_N, NSA_D, NSA_BLOCK, NSA_STRIDE, NSA_SEQ = 40, 4, 16, 8, 4, [16, 40]
NSA_PLACEMENTS = {"heads": ("Shard(1)", "Shard(1)"), "tokens": ("Shard(0)", "Replicate()"),
                  "replicated": ("Replicate()", "Replicate()")}


def nsa_inputs(dtype):
    return _draw((NSA_T, NSA_N, NSA_D), 7, dtype), _draw((NSA_BLOCK, NSA_N), 8, dtype)


def nsa_oracle(dtype):
    """Compression in float64 by its definition: each block's tokens weighted per head."""
    x, w = (t.double().requires_grad_() for t in nsa_inputs(dtype))
    blocks, start = [], 0
    for end in NSA_SEQ:
        for first in range(start, end - NSA_BLOCK + 1, NSA_STRIDE):
            blocks.append((x[first:first + NSA_BLOCK] * w[:, :, None]).sum(0))
        start = end
    out = torch.stack(blocks)
    dy = _draw(out.shape, 9, dtype).double()
    out.backward(dy)
    return out.detach(), dy, x.grad, w.grad


def _nsa_calls(mesh, backends, dtypes):
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    results = {}
    for backend in backends:
        for dtype in dtypes:
            x, w = nsa_inputs(dtype)
            _, dy, _, _ = nsa_oracle(dtype)
            for name, (x_placement, w_placement) in NSA_PLACEMENTS.items():
                xd = distribute_tensor(x, mesh, [_placement(x_placement)]).requires_grad_()
                wd = distribute_tensor(w, mesh, [_placement(w_placement)]).requires_grad_()
                with CommDebugMode() as comm:
                    out = GF.nsa_compress(xd, wd, NSA_BLOCK, NSA_STRIDE, NSA_SEQ, backend=backend)
                grad = distribute_tensor(dy.to(dtype), mesh, out.placements)
                with CommDebugMode() as comm_backward:
                    out.backward(grad)
                results[backend, dtype, name] = {
                    "out": out.full_tensor(), "dx": xd.grad.full_tensor(), "dw": wd.grad.full_tensor(),
                    "placements": [str(t.placements) for t in (out, xd.grad, wd.grad)],
                    "collectives": _counted_collectives(comm), "backward collectives": _counted_collectives(comm_backward)}
    return results


# --------------------------------------------------------------------------------------------
# The sequence-parallel block

class SequenceParallelBlock(nn.Module):
    """RMSNorm -> LayerNorm -> Linear -> GELU -> Linear, torch's own modules."""

    def __init__(self):
        super().__init__()
        self.rms = nn.RMSNorm(H, eps=EPS)
        self.ln = nn.LayerNorm(H)
        self.up = nn.Linear(H, HIDDEN)
        self.down = nn.Linear(HIDDEN, H)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.ln(self.rms(x)))))


def block(dtype):
    torch.manual_seed(0)
    model = SequenceParallelBlock().to(dtype)
    with torch.no_grad():  # weights away from 1 and biases away from 0, so that a wrong one shows
        for norm in (model.rms, model.ln):
            norm.weight.copy_(1 + 0.5 * _draw((H,), 10))
        model.ln.bias.copy_(_draw((H,), 11))
    return model


BLOCK_S = 8  # SequenceParallel takes a plain input as this rank's equal share of the sequence


def block_data(dtype):
    return _draw((B, BLOCK_S, H), 12, dtype), _draw((B, BLOCK_S, H), 13, dtype)


def block_oracle(dtype):
    """torch's unsharded block in float64 on the same (rounded) parameters and input: output,
    the input's gradient, and each parameter's by name."""
    model = block(dtype).double()
    x, dy = (t.double() for t in block_data(dtype))
    x.requires_grad_()
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, {name: p.grad for name, p in model.named_parameters()}


def _sequence_parallel_plan():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"rms": SequenceParallel(), "ln": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def _rows(t, world, rank):
    """This rank's share of the sequence (dim 1), as ``SequenceParallel`` takes a plain input."""
    return t.tensor_split(world, dim=1)[rank]


class GradopsOps(TorchDispatchMode):
    """Counts the gradops ops that run (and whether on DTensors)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gradops":
            on_dtensors = any(type(a).__name__ == "DTensor" for a in args)
            self.counts[f"{func._opname}{' on DTensors' if on_dtensors else ''}"] += 1
        return func(*args, **(kwargs or {}))


def _run_block(model, mesh, world, rank, dtype, count_ops=True):
    """One forward and backward of a parallelized block on this rank's rows: output rows, input
    gradient rows, parameter gradients whole, and the gradops ops that ran (``count_ops``)."""
    x, dy = block_data(dtype)
    x = _rows(x, world, rank).clone().requires_grad_()
    ops = GradopsOps()
    with ops if count_ops else contextlib.nullcontext():
        y = model(x)  # RowwiseParallel hands back this rank's rows, a plain tensor
        y.backward(_rows(dy, world, rank))
    # (RowwiseParallel's rows are an AsyncCollectiveTensor: an op on it waits for its collective)
    return {"y": y.detach().clone(), "dx": x.grad.clone(), "ops": dict(ops.counts),
            "param grads": {name.removeprefix("_orig_mod."): p.grad.full_tensor()  # (a compiled module's prefix)
                            for name, p in model.named_parameters()}}


def _sequence_parallel_blocks(mesh, world, rank, backends, dtypes):
    from torch.distributed.tensor.parallel import parallelize_module

    results = {}
    for backend in backends:
        for dtype in dtypes:
            model = block(dtype)
            report = gradops.patch(model)
            parallelize_module(model, mesh, _sequence_parallel_plan())
            with gradops.use_backend(backend):
                results["patched first", backend, dtype] = dict(_run_block(model, mesh, world, rank, dtype),
                                                                replaced=len(report))
    model = parallelize_module(block(torch.float64), mesh, _sequence_parallel_plan())
    report = gradops.patch(model)
    results["parallelized first"] = dict(_run_block(model, mesh, world, rank, torch.float64), replaced=len(report),
                                         left=[entry.reason for entry in report.left])
    return results


class _GraphOps:
    """A torch.compile backend (AOTAutograd, then the graphs run as traced) recording the ops of
    the forward and backward graphs it is handed."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def record(graph, _inputs):
            self.graphs.append(sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"}))
            return make_boxed_func(graph.forward)

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)


def _compiled_block(mesh, world, rank):
    """The patched sequence-parallel block compiled with fullgraph=True (a graph break raises)."""
    import torch._dynamo
    from torch.distributed.tensor.parallel import parallelize_module

    torch._dynamo.reset()
    model = block(torch.float64)
    gradops.patch(model)
    parallelize_module(model, mesh, _sequence_parallel_plan())
    backend = _GraphOps()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with gradops.use_backend("reference"):
        result = _run_block(compiled, mesh, world, rank, torch.float64, count_ops=False)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return dict(result, graphs=backend.graphs, frames=frames)


# --------------------------------------------------------------------------------------------
# A Llama-like model on a 2x2 mesh: FSDP2 over "dp", tensor and sequence parallelism over "tp"

VOCAB, DIM, HEAD_DIM, FFN, LAYERS, STEPS, BATCH, SEQ = 32, 16, 4, 32, 2, 5, 4, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape  # the heads this rank holds: -1 (ColwiseParallel splits them)
        q, k, v = (w(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM, eps=EPS), nn.RMSNorm(DIM, eps=EPS)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=EPS)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def llama():
    torch.manual_seed(0)
    return Llama().double()


def llama_batches():
    g = torch.Generator().manual_seed(14)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def llama_oracle():
    """The unsharded model (torch's modules), trained on the whole batches: losses, parameters."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens, targets in llama_batches():
        loss = _loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def _parallelize_llama(model, mesh):
    """torchtitan's plan: TP and sequence parallelism over "tp", then FSDP2 over "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for layer in model.layers:
        parallelize_module(layer, tp, {
            "attention_norm": SequenceParallel(), "attention": gathered,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(), "feed_forward": gathered,
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def _train_llama(backend):
    """The patched model trained on this rank's batch rows (its "dp" coordinate's): the step
    losses averaged over the ranks, the parameters whole, and the gradops ops of the first step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = llama()
    report = gradops.patch(model)
    _parallelize_llama(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp, rows = mesh["dp"].get_local_rank(), BATCH // 2
    losses, ops = [], None
    with gradops.use_backend(backend):
        for tokens, targets in llama_batches():
            counter = GradopsOps()
            with counter:
                loss = _loss(model(tokens[dp * rows:(dp + 1) * rows]), targets[dp * rows:(dp + 1) * rows])
                loss.backward()
            ops = ops or dict(counter.counts)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # each "dp" row's loss, once per "tp" rank: the mean is the whole batch's
            losses.append(mean.item() / dist.get_world_size())
    params = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "ops": ops, "replaced": len(report)}


# --------------------------------------------------------------------------------------------
# Errors, and the sharding cache

def _errors(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    (x, r, w, b), _ = norm_inputs(torch.float64)
    xd, wd = distribute_tensor(x, mesh, [_placement("Shard(0)")]), distribute_tensor(w, mesh, [Replicate()])
    nx, nw = nsa_inputs(torch.float64)
    nxd = distribute_tensor(nx, mesh, [_placement("Shard(1)")])
    attempts = {
        "layer_norm: plain weight": lambda: GF.layer_norm(xd, (H,), w),
        "layer_norm: plain input": lambda: GF.layer_norm(x, (H,), wd),
        "rms_norm: plain residual": lambda: GF.fused_add_rms_norm(xd, r, (H,), wd),
        "nsa_compress: plain weight": lambda: GF.nsa_compress(nxd, nw, NSA_BLOCK, NSA_STRIDE, NSA_SEQ),
        "layer_norm: weight shape": lambda: GF.layer_norm(xd, (H,), distribute_tensor(w[:-1], mesh, [Replicate()])),
        # Floyd's row-sharded path checks its arguments with the same rule
        "pivotal_attention: plain attn_mask": lambda: gradops.pivotal_attention(
            *(distribute_tensor(_draw((1, 1, 4, 4, 4), 20 + i), mesh, [_placement("Shard(1)")]) for i in range(5)),
            attn_mask=torch.zeros(1, 1, 4, 1, 4, dtype=torch.bool)),
        "nsa_compress: DTensor seq_lens": lambda: GF.nsa_compress(
            nxd, distribute_tensor(nw, mesh, [_placement("Shard(1)")]), NSA_BLOCK, NSA_STRIDE,
            distribute_tensor(torch.tensor(NSA_SEQ), mesh, [Replicate()])),
        # 3-Floyd has no sharding rule: refused before torch's own error
        "pivotal_attention3: DTensor": lambda: gradops.pivotal_attention3(
            *(distribute_tensor(_draw((1, 2, 2, 2, 2, 4), 30 + i), mesh, [Replicate()]) for i in range(7))),
    }
    return outcomes(attempts)


def _cache(mesh):
    """Calls that DTensor's sharding cache would confuse if it keyed on the tensors alone: the
    same input normalized over (H,) then over (S, H), and a backward wanting the weight's
    gradient then not. Each result whole, against torch. And a dim of fewer rows than ranks."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    (x, _, w, b), (dy, _) = norm_inputs(torch.float64)
    one_row = distribute_tensor(x[:1], mesh, [_placement("Shard(0)")])
    y = GF.rms_norm(one_row, (H,), distribute_tensor(w, mesh, [Replicate()]), EPS)
    out = {"one row": y.full_tensor(), "one row placements": str(y.placements)}
    xd = distribute_tensor(x, mesh, [_placement("Shard(1)")])
    out.update({"(H,)": GF.layer_norm(xd, (H,)).full_tensor(), "(S, H)": GF.layer_norm(xd, (S, H)).full_tensor()})
    for wants_weight_grad in (True, False):
        xd = distribute_tensor(x, mesh, [_placement("Shard(1)")]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_(wants_weight_grad)
        GF.layer_norm(xd, (H,), wd).backward(distribute_tensor(dy, mesh, [_placement("Shard(1)")]))
        out["dx", wants_weight_grad] = xd.grad.full_tensor()
        out["dw", wants_weight_grad] = None if wd.grad is None else wd.grad.full_tensor()
    return out


FUSED_CASES = ("fused_add_layer_norm", "fused_add_rms_norm")


def _one_output_used(mesh):
    """The fused adds with a gradient for y only, then for h only (a last layer drops h): the
    gradients of x, the residual and the weight, whole."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    (x, r, w, b), dys = norm_inputs(torch.float64)
    out = {}
    for case in FUSED_CASES:
        for used in (0, 1):
            xd, rd = (distribute_tensor(t, mesh, [_placement("Shard(1)")]).requires_grad_() for t in (x, r))
            wd, bd = (distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
            output = NORM_CASES[case][0](xd, rd, wd, bd)[used]
            grads = torch.autograd.grad(output, (xd, rd, wd), distribute_tensor(dys[used], mesh, output.placements),
                                        allow_unused=True)
            out[case, used] = [None if g is None else g.full_tensor() for g in grads]
    return out


# --------------------------------------------------------------------------------------------
# The workers

def _worker(rank, port, world, out_dir):
    import interpreter_fixes
    from torch.distributed.device_mesh import init_device_mesh

    interpreter_fixes.install()  # as the suite's conftest: bf16 rounds as on a GPU
    torch.set_num_threads(1)
    init_gloo(rank, world, port, PG_TIMEOUT_S)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = {}
        if world == 2:  # first: the process's first DTensor call of a gradops op is traced by dynamo
            results["compiled"] = _compiled_block(mesh, world, rank)
        results["cache"] = _cache(mesh)  # before the calls that would fill DTensor's cache for it
        results["norms"] = _norm_calls(mesh, BACKENDS, DTYPES)
        results["nsa"] = _nsa_calls(mesh, BACKENDS, DTYPES)
        results["blocks"] = _sequence_parallel_blocks(mesh, world, rank, BACKENDS, DTYPES)
        results["errors"] = _errors(mesh)
        results["one output used"] = _one_output_used(mesh)
        if world == 4:  # a 2x2 mesh (the world of 2 compiles instead)
            results["llama"] = {backend: _train_llama(backend) for backend in BACKENDS}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _world(tmp_path_factory, world):
    out_dir = once_per_session(tmp_path_factory, f"distributed-dtensor-world{world}",
                               lambda folder: run_workers(_worker, world, (world, str(folder)), WORKERS_TIMEOUT_S))
    return world, load_ranks(out_dir, world)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request, tmp_path_factory):
    return _world(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _world(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _world(tmp_path_factory, 4)


def _close(actual, expected, dtype, what):
    error = rel_error(actual, expected)
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.3g} > {TOLERANCE[dtype]:.3g}"


# --------------------------------------------------------------------------------------------
# The tests

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequence_parallel_block_matches_the_unsharded_torch_block(world_results, backend, dtype):
    world, results = world_results
    y, dx, param_grads = block_oracle(dtype)
    for rank, r in enumerate(results):
        run = r["blocks"]["patched first", backend, dtype]
        assert run["replaced"] == 2
        assert run["ops"] == {"rms_norm on DTensors": 1, "layer_norm on DTensors": 1,
                              "rms_norm_backward on DTensors": 1, "layer_norm_backward on DTensors": 1}, run["ops"]
        _close(run["y"], _rows(y, world, rank), dtype, f"rank {rank}: y")
        _close(run["dx"], _rows(dx, world, rank), dtype, f"rank {rank}: dx")
        for name, grad in param_grads.items():
            _close(run["param grads"][name], grad, dtype, f"rank {rank}: {name}'s gradient")


def test_parallelized_then_patched_works_too(world_results):
    # SequenceParallel replicates a norm's weight: patch replaces the module, keeping the
    # DTensor parameters and the parallel style's hooks
    world, results = world_results
    y, dx, param_grads = block_oracle(torch.float64)
    for rank, r in enumerate(results):
        run = r["blocks"]["parallelized first"]
        assert run["replaced"] == 2 and run["left"] == []
        assert run["ops"]["rms_norm on DTensors"] == run["ops"]["layer_norm on DTensors"] == 1
        _close(run["y"], _rows(y, world, rank), torch.float64, "y")
        _close(run["dx"], _rows(dx, world, rank), torch.float64, "dx")
        for name, grad in param_grads.items():
            _close(run["param grads"][name], grad, torch.float64, f"{name}'s gradient")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_norm_calls_on_every_placement(world_results, case, dtype, backend):
    _, results = world_results
    outs, grads = norm_oracle(case, dtype)
    for placement in PLACEMENTS:
        for rank, r in enumerate(results):
            run = r["norms"][backend, dtype, case, placement]
            where = f"{case}, {placement}, rank {rank}"
            for i, (actual, expected) in enumerate(zip(run["outs"], outs)):
                _close(actual, expected, dtype, f"{where}: output {i}")
            for name, actual, expected in zip(("x", "residual", "weight", "bias"), run["grads"], grads):
                assert (actual is None) == (expected is None), f"{where}: {name}'s gradient"
                if expected is not None:
                    _close(actual, expected, dtype, f"{where}: {name}'s gradient")
            # a row shard stays one, with the weight's gradient a Partial sum; a sharded normalized
            # dim is redistributed (replicated, or moved to a row dim), and the weight's gradient is
            # then whatever that gives
            if _row_shard(case, placement) or placement == "Replicate()":
                assert set(run["out placements"]) == {run["in placements"]}, (where, run["out placements"])
                if run["weight grad placements"] is not None and placement != "Replicate()":
                    assert run["weight grad placements"] == "(Partial(sum),)", where
            else:
                assert run["in placements"] not in run["out placements"], (where, run["out placements"])


@pytest.mark.parametrize("case", list(NORM_CASES))
def test_row_shards_add_no_collective(world_results, case):
    _, results = world_results
    for r in results:
        for (backend, dtype, name, placement), run in r["norms"].items():
            if name != case:
                continue
            if _row_shard(case, placement) or placement == "Replicate()":
                assert run["collectives"] == {} and run["backward collectives"] == {}, (placement, run)
            else:  # a normalized dim sharded: each sharded input gathered (x and the residual of a fused
                # add), and x again in the backward, where the op saved x as the caller holds it
                fused = case.startswith("fused_add")
                assert run["collectives"] == {GATHER: 2 if fused else 1}, (placement, run["collectives"])
                assert run["backward collectives"] == ({} if fused else {GATHER: 1}), run["backward collectives"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nsa_compress_on_heads_and_tokens(world_results, backend, dtype):
    _, results = world_results
    out, _, dx, dw = nsa_oracle(dtype)
    for r in results:
        for name in NSA_PLACEMENTS:
            run = r["nsa"][backend, dtype, name]
            for what, actual, expected in (("out", run["out"], out), ("dx", run["dx"], dx), ("dw", run["dw"], dw)):
                _close(actual, expected, dtype, f"{name}: {what}")
        heads = r["nsa"][backend, dtype, "heads"]
        assert heads["placements"] == ["(Shard(dim=1),)"] * 3
        assert heads["collectives"] == {} and heads["backward collectives"] == {}
        assert r["nsa"][backend, dtype, "replicated"]["collectives"] == {}
        tokens = r["nsa"][backend, dtype, "tokens"]  # gathered: a block may span two ranks' tokens
        assert tokens["collectives"] == tokens["backward collectives"] == {GATHER: 1}


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_adds_with_one_output_used(world_results, case):
    _, results = world_results
    (x, r, w, b), dys = norm_inputs(torch.float64)
    for used in (0, 1):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        output = NORM_CASES[case][1](*leaves)[used]
        expected = torch.autograd.grad(output, leaves[:3], dys[used], allow_unused=True)
        for rank, r_ in enumerate(results):
            for name, actual, grad in zip(("x", "residual", "weight"), r_["one output used"][case, used], expected):
                if grad is None:  # h alone does not reach the weight: torch says None, the fused node zeros
                    assert actual is None or not actual.any(), (rank, used, name)
                else:
                    _close(actual, grad, torch.float64, f"rank {rank}, output {used} used: {name}'s gradient")


def test_errors_are_aclnn_errors(world_results):
    _, results = world_results
    words = {"layer_norm: plain weight": "weight is a plain tensor beside DTensor",
             "layer_norm: plain input": "input is a plain tensor beside DTensor",
             "rms_norm: plain residual": "residual is a plain tensor beside DTensor",
             "nsa_compress: plain weight": "weight is a plain tensor beside DTensor",
             "layer_norm: weight shape": "weight has shape (15,)",
             "nsa_compress: DTensor seq_lens": "seq_lens is a DTensor",
             "pivotal_attention: plain attn_mask": "attn_mask is a plain tensor beside DTensor",
             "pivotal_attention3: DTensor": "q_ijk is a DTensor; 3-Floyd attention has no sharding rule"}
    for r in results:
        for name, word in words.items():
            status, message = r["errors"][name]
            assert status == gradops.ACLNN_ERR_PARAM_INVALID and word in message, (name, message)


def test_the_sharding_cache_tells_calls_apart_and_a_short_dim_is_replicated(world_results):
    _, results = world_results
    (x, _, w, _), (dy, _) = norm_inputs(torch.float64)
    oracle = {"(H,)": F.layer_norm(x, (H,)), "(S, H)": F.layer_norm(x, (S, H))}
    for wants_weight_grad in (True, False):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_(wants_weight_grad)
        F.layer_norm(xr, (H,), wr).backward(dy)
        oracle["dx", wants_weight_grad], oracle["dw", wants_weight_grad] = xr.grad, wr.grad
    # fewer rows than ranks on the sharded dim: DTensor redistributes (register_sharding's
    # expansion takes a dim as shardable only with at least a row per rank)
    oracle["one row"] = w * _xhat(x[:1])
    for r in results:
        assert r["cache"]["one row placements"] == "(Replicate(),)"
        for key, expected in oracle.items():
            actual = r["cache"][key]
            assert (actual is None) == (expected is None), key
            if expected is not None:
                _close(actual, expected, torch.float64, str(key))


def test_the_sequence_parallel_block_compiles_to_one_graph(two_ranks):
    world, results = two_ranks
    y, dx, param_grads = block_oracle(torch.float64)
    for rank, r in enumerate(results):
        run = r["compiled"]
        assert run["frames"] == 1  # fullgraph=True: a graph break would have raised
        forward, backward = run["graphs"]
        assert {"gradops.rms_norm.default", "gradops.layer_norm.default"} <= set(forward), forward
        assert {"gradops.rms_norm_backward.default", "gradops.layer_norm_backward.default"} <= set(backward)
        _close(run["y"], _rows(y, world, rank), torch.float64, "y")
        _close(run["dx"], _rows(dx, world, rank), torch.float64, "dx")
        for name, grad in param_grads.items():
            _close(run["param grads"][name], grad, torch.float64, f"{name}'s gradient")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_and_tensor_parallel_training_matches_the_unsharded_model(four_ranks, backend):
    _, results = four_ranks
    losses, params = llama_oracle()
    for rank, r in enumerate(results):
        run = r["llama"][backend]
        assert run["replaced"] == 2 * LAYERS + 1
        # every RMSNorm, forward and backward, on gradops, on DTensors (FSDP2 gathers the weights)
        assert run["ops"] == {"rms_norm on DTensors": 2 * LAYERS + 1, "rms_norm_backward on DTensors": 2 * LAYERS + 1}
        for step, (actual, expected) in enumerate(zip(run["losses"], losses)):
            assert abs(actual - expected) <= TOLERANCE[torch.float64] * abs(expected), (rank, step, actual, expected)
        for name, expected in params.items():
            _close(run["params"][name], expected, torch.float64, f"rank {rank}: {name} after {STEPS} steps")


def test_patch_refuses_fully_sharded_norms_and_says_why():
    """FSDP2 swaps the parameters on the module object it wraps: patch leaves a norm whose
    class fully_shard made, or whose parameters it sharded, naming fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group exists in this process already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.RMSNorm(H), nn.Sequential(nn.LayerNorm(H)))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[1], mesh=mesh)
        report = gradops.patch(model)
    finally:
        dist.destroy_process_group()
    assert len(report) == 0 and [entry.name for entry in report.left] == ["0", "1.0"]
    assert all("patch before fully_shard" in entry.reason for entry in report.left)
    assert "FSDPRMSNorm" in report.left[0].reason and "Shard(dim=0)" in report.left[1].reason


def test_the_triton_norm_ops_get_their_rules_whenever_they_are_defined():
    """The Triton norm ops (what Inductor compiles on a GPU) are defined by the first traced
    CUDA call, which may come after the first DTensor call registered the rules: they get
    theirs then. A fresh process, so that the order is this one."""
    code = ("import json, torch, gradops\n"
            "from gradops.nn import _triton_ops\n"
            "from gradops.nn import _custom_ops\n"
            "_custom_ops._register_dtensor_rules()  # what the first DTensor call does\n"
            "from torch.distributed.tensor import DTensor\n"
            "rules = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
            "before = sorted(str(op) for op in rules if op.namespace == 'gradops')\n"
            "defined = _triton_ops._register_triton_ops()\n"
            "after = sorted(str(op) for op in rules if op.namespace == 'gradops')\n"
            "print(json.dumps([before, defined, after]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, defined, after = json.loads(out.stdout.strip().splitlines()[-1])
    ops = [f"gradops.{name}.default" for name in ("layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward",
                                                  "nsa_compress", "nsa_compress_backward")]
    assert before == sorted(ops)
    assert defined and after == sorted(ops + ["gradops.triton_layer_norm.default", "gradops.triton_rms_norm.default"])
