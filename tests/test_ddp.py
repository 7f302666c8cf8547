"""Data-parallel training over two gloo processes on CPU (localhost only): one training step
of a model built from gradops.nn modules, under DistributedDataParallel and under FSDP2
(``fully_shard``), gives each rank the gradients a single process computes on the whole
batch, and the same parameters after the optimizer step. Both run in the same two worker
processes (spawning is the slow part)."""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradops.nn as gnn
from spawn import init_gloo, run_workers

try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    HAVE_FSDP2 = True
except ImportError:  # torch < 2.6
    HAVE_FSDP2 = False

WORLD = 2
BATCH = 4  # global batch, split evenly over the ranks
N, C, HEADS = 4, 8, 2
TIMEOUT_S = 120


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = gnn.LayerNorm(C)
        self.attn = gnn.FloydAttention(C, HEADS, bias=True)
        self.rms = gnn.RMSNorm(C)
        self.nsa = gnn.NsaCompress(block_size=4, stride=2, num_heads=2)
        self.head = nn.Linear(C // 2, 1)

    def forward(self, x):
        y = self.rms(x + self.attn(self.ln(x)))
        b = y.shape[0]
        tokens = y.reshape(b * N * N, 2, C // 2)  # one packed sequence of N*N tokens per sample
        ends = [(i + 1) * N * N for i in range(b)]
        return self.head(self.nsa(tokens, ends))


def make_model():
    torch.manual_seed(0)
    return Model()


def make_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, N, N, C, generator=g), torch.randn(BATCH * 7, 2, 1, generator=g)


def loss_fn(model, x, target):
    return torch.nn.functional.mse_loss(model(x), target)


def _local_step(model, params, rank):
    opt = torch.optim.SGD(params, lr=0.1)
    x, target = make_batch()
    per = BATCH // WORLD
    rows = 7 * per  # compressed blocks per rank: 7 per sample
    loss = loss_fn(model, x[rank * per:(rank + 1) * per], target[rank * rows:(rank + 1) * rows])
    loss.backward()  # DDP all-reduces, FSDP reduce-scatters: both average over the ranks
    return opt


def _full(t):
    """A DTensor (FSDP2's sharded parameters and gradients) gathered whole; plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port, TIMEOUT_S)
    try:
        results = {}
        ddp = nn.parallel.DistributedDataParallel(make_model())
        opt = _local_step(ddp, ddp.parameters(), rank)
        grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        opt.step()
        results["ddp"] = {"grads": grads, "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()}}

        if HAVE_FSDP2:
            model = make_model()
            # a CPU mesh: without one, fully_shard takes the accelerator's where there is one
            # (both ranks then land on cuda:0, beside the CPU batch)
            mesh = init_device_mesh("cpu", (WORLD,))
            fully_shard(model.attn, mesh=mesh)  # a block of its own, as a transformer would wrap its layers
            fully_shard(model, mesh=mesh)
            opt = _local_step(model, model.parameters(), rank)
            grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
            opt.step()
            results["fsdp2"] = {"grads": grads,
                                "params": {n: _full(p.detach()).clone() for n, p in model.named_parameters()}}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    """Runs both training steps in two spawned gloo workers; returns each rank's results."""
    out_dir = tmp_path_factory.mktemp("ddp")
    run_workers(_worker, WORLD, (str(out_dir),), TIMEOUT_S)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)]


def single_process_step():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = make_batch()
    loss_fn(model, x, target).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_against_single_process(per_rank):
    grads, params = single_process_step()
    for got in per_rank:
        assert got["grads"].keys() == grads.keys()
        for name in grads:
            # float32: the two halves' gradients are summed in another order than the whole batch's
            torch.testing.assert_close(got["grads"][name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(got["params"][name], params[name], atol=1e-6, rtol=1e-5, msg=name)
        assert all(g.abs().sum() > 0 for g in got["grads"].values())  # every parameter was trained


def test_ddp_gradients_equal_a_single_process(distributed_results):
    check_against_single_process([r["ddp"] for r in distributed_results])


@pytest.mark.skipif(not HAVE_FSDP2, reason="needs torch.distributed.fsdp.fully_shard (FSDP2)")
def test_fsdp2_gradients_equal_a_single_process(distributed_results):
    check_against_single_process([r["fsdp2"] for r in distributed_results])
