"""No host synchronisation on the path a CUDA user gets.

Once a shape (and an NSA packing) has been seen, a forward and backward of every operator
must neither wait for the GPU nor copy host data to it: a training step can then run ahead
of the GPU and be captured in a CUDA graph. On a GPU (GRADOPS_TEST_DEVICE=cuda) a training
step using every operator runs under ``torch.cuda.set_sync_debug_mode("error")`` and is
captured in a CUDA graph and replayed, on both backends. On CPU three proxies run: a repeated
call of every operator, and a repeated training step through every module, bring no host
data in, and a ``seq_lens`` tensor is read once per training step.
"""
import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradops
import gradops.nn as gnn
import gradops.ops.nsa_compress as nsa_ops

from conftest import TEST_DEVICE

cuda_only = pytest.mark.skipif(TEST_DEVICE != "cuda" or not torch.cuda.is_available(),
                               reason="needs a GPU (GRADOPS_TEST_DEVICE=cuda)")


class _HostData(TorchDispatchMode):
    """Records the operators that make a tensor out of host data (``torch.tensor``: lift_fresh),
    read a device value back (``.item()``: _local_scalar_dense), or copy between the CPU and
    another device, either way (``.to(device)``, ``.cpu()``, ``.tolist()``)."""

    READS = ("aten.lift_fresh", "aten.lift_fresh_copy", "aten._local_scalar_dense")

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in self.READS:
            self.seen[name] += 1
        elif name in ("aten._to_copy", "aten.copy_"):
            src = args[1] if name == "aten.copy_" else args[0]
            dst = args[0].device if name == "aten.copy_" else torch.device(kwargs.get("device") or src.device)
            if (src.device.type == "cpu") != (dst.type == "cpu"):
                self.seen[f"{name} {src.device} -> {dst}"] += 1
        return func(*args, **kwargs)


def test_the_recorder_sees_host_data(device):
    with _HostData() as watch:
        torch.tensor([0.3], device=device)
    assert watch.seen


def _every_operator(device):
    """Inputs for all ten operators, and a function calling them all (forward and backward)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(shape, generator=g, device="cpu").to(device)

    x, w, b = r(4, 16), r(16), r(16)
    xs, ws = r(12, 2, 8), r(4, 2)
    q, k1, v1, k2, v2 = r(1, 2, 3, 4, 8), r(1, 2, 3, 5, 8), r(1, 2, 3, 5, 8), r(1, 2, 5, 4, 8), r(1, 2, 5, 4, 8)
    mask = (torch.rand(1, 1, 3, 1, 5, generator=g, device="cpu") < 0.3).to(device)
    var, mean = x.var(-1, unbiased=False), x.mean(-1)

    def run():
        y, m, s = gradops.layer_norm(x, (16,), w, b)
        gradops.layer_norm_backward(y, x, (16,), m, s, w, b)
        y, s = gradops.rms_norm(x, w)
        gradops.rms_norm_grad(y, x, s, w)
        pd_x, res = gradops.layer_norm_grad(x, x, var, mean, w, 1e-5)
        gradops.layer_norm_grad_beta(res, x)
        out = gradops.nsa_compress(xs, ws, 4, 2, [5, 12])
        gradops.nsa_compress_grad(out, xs, ws, 4, 2, [5, 12])
        out, smax, ssum = gradops.floyd_attention(q, k1, v1, k2, v2, mask, 0.3)
        gradops.floyd_attention_grad(out, q, k1, v1, k2, v2, out, smax, ssum, mask, 0.3)
    return run


def test_repeated_calls_bring_no_host_data(backend, device):
    run = _every_operator(device)
    run()  # first call: compiles kernels, builds the NSA tables of this packing
    with _HostData() as watch:
        run()
    assert not watch.seen, f"host data brought in by a repeated call: {dict(watch.seen)}"


def test_seq_lens_tensor_is_read_once_per_step(backend, device, monkeypatch):
    """A seq_lens tensor is read on the host in the forward (the output length depends on its
    values) and not again in the backward."""
    reads = []
    real = nsa_ops.int_sequence

    def spy(op, name, value, **kwargs):
        if isinstance(value, torch.Tensor):
            reads.append(op)
        return real(op, name, value, **kwargs)

    monkeypatch.setattr(nsa_ops, "int_sequence", spy)
    x = torch.randn(12, 2, 8, device=device, requires_grad=True)
    m = gnn.NsaCompress(4, 2, 2).to(device)
    m(x, torch.tensor([5, 12], device=device)).sum().backward()
    assert reads == ["nsa_compress"] and x.grad is not None and m.weight.grad is not None


class _EveryModule(nn.Module):
    """A training step touching every operator through the layers users call."""

    def __init__(self):
        super().__init__()
        self.norm, self.rms = gnn.LayerNorm(16), gnn.RMSNorm(16)
        self.attn = gnn.FloydAttention(16, 2)
        self.nsa = gnn.NsaCompress(4, 2, 2)

    def forward(self, x, mask):
        h = self.rms(x + self.attn(self.norm(x), attn_mask=mask))  # [2, 6, 6, 16]
        tokens = h.reshape(-1, 2, 8)  # 72 tokens of 2 heads
        return h.square().mean() + self.nsa(tokens, [30, 72]).square().mean()


def _inputs(device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 6, 16, generator=g, device="cpu").to(device)
    mask = (torch.rand(2, 1, 6, 1, 6, generator=g, device="cpu") < 0.3).to(device)
    return x, mask


def test_repeated_training_steps_through_the_modules_bring_no_host_data(backend, device):
    """Forward and backward of every module (the layers users call, a Python-list seq_lens
    included): after the first step, none makes a tensor from host data, reads one back or
    copies across devices."""
    torch.manual_seed(0)
    model = _EveryModule().to(device)
    x, mask = _inputs(device, 0)
    model(x, mask).backward()  # first step: compiles kernels, builds the NSA tables of this packing
    with _HostData() as watch:
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            model(x, mask).backward()
    assert not watch.seen, f"host data brought in by a repeated step: {dict(watch.seen)}"


@cuda_only
def test_training_step_does_not_synchronise(backend):
    torch.manual_seed(0)
    model = _EveryModule().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x, mask = _inputs("cuda", 0)
    for sync_mode in ("default", "error"):  # the first step may compile kernels and build tables
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            opt.zero_grad(set_to_none=False)
            model(x, mask).backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@cuda_only
def test_training_step_is_captured_in_a_cuda_graph_and_replayed(backend):
    """Forward, backward and an AdamW step captured once and replayed on new inputs give what
    the same steps give eagerly."""
    torch.manual_seed(0)
    eager, graphed = _EveryModule().cuda(), _EveryModule().cuda()
    graphed.load_state_dict(eager.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True) for m in (eager, graphed)]
    static_x, static_mask = _inputs("cuda", 0)

    def step(model, opt, x, mask):
        opt.zero_grad(set_to_none=False)
        loss = model(x, mask)
        loss.backward()
        opt.step()
        return loss

    # warm-up (kernel compilation, NSA tables, optimizer state): the same two steps on both
    # copies, the graphed one on a side stream as capture requires, so they stay identical
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(2):
        step(eager, opts[0], static_x, static_mask)
        with torch.cuda.stream(side):
            step(graphed, opts[1], static_x, static_mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graphed, opts[1], static_x, static_mask)

    for seed in (1, 2, 3):
        x, mask = _inputs("cuda", seed)
        static_x.copy_(x)
        static_mask.copy_(mask)
        graph.replay()
        loss = step(eager, opts[0], x, mask)
        torch.testing.assert_close(static_loss, loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
