"""Train a FloydNet block with its grid sharded by rows over several processes, and check that
it learns exactly what one process learns.

    python examples/train_floydnet_sharded.py                 # 2 processes, gloo, CPU, float64
    python examples/train_floydnet_sharded.py --world 3 --steps 50
    python examples/train_floydnet_sharded.py --backend nccl --dtype float32   # one GPU per rank

Each rank holds rows ``[B, L_r, L, C]`` of the grid. ``gradops.distributed.RowShardedBlock``
runs ``floydnet.PivotalAttentionBlock`` on them: its per-cell layers (projections, norms, FFN)
as they are, its pivotal attention and its symmetric mix's transpose row-sharded. The block's
parameters are replicated: DistributedDataParallel all-reduces their gradients.

Two process groups, so that the two kinds of collectives cannot interleave wrongly: the
attention's (issued by autograd's backward in a fixed order) run on ``attention_group``;
DDP's all-reduces (issued as gradient buckets fill, asynchronously) on the default group.
On one group, a rank could reach a bucket's all-reduce while another is in the attention's
backward gather, and both would wait forever (NCCL) or exchange the wrong tensors.

Each rank's loss is its rows' share of the whole grid's loss, so the parameters' gradient is
the *sum* of the ranks' gradients: DDP averages by default, hence the summing comm hook.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRID, CHANNELS, HEADS, BATCH = 6, 8, 2, 2
LEARNING_RATE = 1e-2


def make_block(dtype=torch.float64):
    """The block every run starts from (the same on every rank and in the single process)."""
    from floydnet.transformer import PivotalAttentionBlock

    torch.manual_seed(0)
    block = PivotalAttentionBlock(CHANNELS, HEADS, bias=True).to(dtype)
    torch.manual_seed(1)
    with torch.no_grad():  # off FloydNet's zero initialisations, so that every path carries a gradient at once
        for p in block.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return block


def training_data(dtype=torch.float64):
    """One fixed grid and target, [B, L, L, C]."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn((BATCH, GRID, GRID, CHANNELS), generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)


def row_split(length: int, world: int):
    """Rows per rank, as torch.chunk (and DTensor) split them: the first ranks one more."""
    per = -(-length // world)
    return [max(0, min(per, length - r * per)) for r in range(world)]


def _sum_gradients(group, bucket):
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def train_sharded(steps: int, device: torch.device, dtype=torch.float64, rows=None):
    """This rank's run (the process group initialised): the whole grid's loss after each step."""
    import gradops.distributed as GD

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = rows or row_split(GRID, world)
    attention_group = dist.new_group(list(range(world)))
    block = GD.RowShardedBlock(make_block(dtype).to(device), group=attention_group)
    model = torch.nn.parallel.DistributedDataParallel(block)  # on the default group
    model.register_comm_hook(None, _sum_gradients)
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    x, target = (t.to(device) for t in training_data(dtype))
    start = sum(rows[:rank])
    x_rows, target_rows = x[:, start:start + rows[rank]], target[:, start:start + rows[rank]]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x_rows) - target_rows) ** 2).sum() / target.numel()
        loss.backward()
        opt.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item())
    return losses


def train_single(steps: int, dtype=torch.float64):
    """The unmodified floydnet block on the whole grid in one process."""
    block = make_block(dtype)
    opt = torch.optim.Adam(block.parameters(), lr=LEARNING_RATE)
    x, target = training_data(dtype)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((block(x) - target) ** 2).sum() / target.numel()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _worker(rank, world, port, backend, steps, dtype_name):
    torch.set_num_threads(1)
    if backend == "gloo" and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the rendezvous is on the loopback: keep gloo there
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        losses = train_sharded(steps, device, getattr(torch, dtype_name))
        if rank == 0:
            single = train_single(steps, getattr(torch, dtype_name))
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, single))
            print(f"{world} ranks, {steps} steps: loss {losses[0]:.6f} -> {losses[-1]:.6f}; "
                  f"one process: {single[0]:.6f} -> {single[-1]:.6f}; largest relative difference {worst:.2e}")
    finally:
        dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes (ranks), each holding rows of the grid")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(args.world, port, args.backend, args.steps, args.dtype), nprocs=args.world,
                       start_method="spawn")


if __name__ == "__main__":
    main()
