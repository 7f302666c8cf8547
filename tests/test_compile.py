"""torch.compile(fullgraph=True) traces models built from gradops.nn without graph breaks:
the custom ops stay opaque in the graphs (forward ops in the forward graph, gradops'
backward operators in the backward graph) and compiled results equal eager ones.

Most tests use the ``aot_eager`` backend, which runs dynamo and AOTAutograd (the fake
implementations, the autograd registrations, the autocast kernels) without code generation;
one test runs inductor end to end. Compilation is slow on CPU, so models are tiny and few.
"""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
import torch._dynamo.testing  # noqa: F401  (CompileCounterWithBackend; not imported by torch itself)

from helpers import TEST_DEVICE, autocast

import gradops.nn as gnn
from gradops.nn.pivotal import pivotal_attention


class PairModel(nn.Module):
    """Every gradops module in one forward: pair representation -> compressed tokens."""

    def __init__(self, c=8, heads=2):
        super().__init__()
        self.ln = gnn.LayerNorm(c)
        self.attn = gnn.FloydAttention(c, heads, bias=True)
        self.rms = gnn.RMSNorm(c)
        self.nsa = gnn.NsaCompress(block_size=4, stride=2, num_heads=2)

    def forward(self, x, seq_lens, attn_mask=None):
        y = self.rms(x + self.attn(self.ln(x), attn_mask))
        b, n, _, c = y.shape
        return self.nsa(y.reshape(b * n * n, 2, c // 2), seq_lens)


def recording_backend(graphs):
    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def gradops_ops_in(gm):
    return {str(node.target).split(".")[1] for node in gm.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("gradops.")}


def triton_kernels_in(gm):
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return {kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__ for node in gm.graph.nodes
            if node.op == "call_function" and "triton_kernel_wrapper" in str(node.target)}


def run_and_grads(model, *args):
    for p in model.parameters():
        p.grad = None
    x = args[0].clone().requires_grad_(True)
    y = model(x, *args[1:])
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def assert_same(eager, compiled, atol=1e-6, rtol=1e-5):
    torch.testing.assert_close(compiled[0], eager[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(compiled[1], eager[1], atol=atol, rtol=rtol)
    for name in eager[2]:
        torch.testing.assert_close(compiled[2][name], eager[2][name], atol=atol, rtol=rtol, msg=name)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_fullgraph_keeps_the_custom_ops_and_their_backwards(backend):
    torch.manual_seed(0)
    model = PairModel()
    x = torch.randn(2, 4, 4, 8)
    mask = torch.rand(2, 1, 4, 1, 4) < 0.3
    eager = run_and_grads(model, x, [10, 32], mask)
    graphs = []
    compiled_model = torch.compile(model, fullgraph=True, backend=recording_backend(graphs))
    compiled = run_and_grads(compiled_model, x, [10, 32], mask)
    assert_same(eager, compiled)
    assert len(graphs) == 2  # one forward graph, one backward graph: no graph break
    forward_ops, backward_ops = gradops_ops_in(graphs[0]), gradops_ops_in(graphs[1])
    if backend == "triton" and TEST_DEVICE == "cuda":
        # on a GPU the norm forwards are Triton ops, traced into calls of their kernels, which
        # Inductor compiles itself (docs/nn.md, "torch.compile"); their backwards stay opaque
        assert forward_ops == {"floyd_attention", "nsa_compress"}
        assert triton_kernels_in(graphs[0]) == {"_ln_fwd_fused_kernel", "_rms_fwd_fused_kernel"}
    else:
        assert forward_ops == {"layer_norm", "floyd_attention", "rms_norm", "nsa_compress"}
    assert backward_ops == {"layer_norm_backward", "floyd_attention_backward", "rms_norm_backward",
                            "nsa_compress_backward"}


def test_nsa_seq_lens_tensor_compiles_without_recompiling(backend):
    """seq_lens as a tensor: the output length is data-dependent (an unbacked size), so one
    graph serves every seq_lens of the same length."""
    torch.manual_seed(0)
    nsa = gnn.NsaCompress(4, 2, 2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def f(x, seq_lens):
        return nsa(x, seq_lens).square().sum()

    cf = torch.compile(f, fullgraph=True, backend=counter)
    x = torch.randn(30, 2, 4)
    for ends in ([10, 30], [14, 30], [4, 30]):
        xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        f(xe, torch.tensor(ends)).backward()
        cf(xc, torch.tensor(ends)).backward()
        torch.testing.assert_close(xc.grad, xe.grad)
    assert counter.frame_count == 1


def test_chunked_pivotal_path_compiles(backend):
    """Dropout-free chunked path (cap + additive mask, checkpointed tiles) under fullgraph."""
    torch.manual_seed(0)
    ins = [torch.randn(1, 2, 3, 4, 4) for _ in range(5)]
    ins[1], ins[3] = torch.randn(1, 2, 3, 5, 4), torch.randn(1, 2, 3, 5, 4)  # k_ij, v_ij: L_j = 5
    ins[2], ins[4] = torch.randn(1, 2, 5, 4, 4), torch.randn(1, 2, 5, 4, 4)  # k_jk, v_jk
    mask = torch.randn(4, 5)

    def f(*t):
        return pivotal_attention(*t, attn_mask=mask, softmax_cap=2.0)

    eager_in = [t.clone().requires_grad_(True) for t in ins]
    comp_in = [t.clone().requires_grad_(True) for t in ins]
    ye = f(*eager_in)
    yc = torch.compile(f, fullgraph=True, backend="aot_eager")(*comp_in)
    torch.testing.assert_close(yc, ye)
    ye.sum().backward()
    yc.sum().backward()
    for a, b in zip(comp_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad)


def test_autocast_under_compile_matches_eager_autocast(backend):
    torch.manual_seed(0)
    model = PairModel()
    x = torch.randn(1, 4, 4, 8)
    with autocast():
        eager = run_and_grads(model, x, [16])
        compiled = run_and_grads(torch.compile(model, fullgraph=True, backend="aot_eager"), x, [16])
    assert compiled[0].dtype == eager[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in compiled[2].values())
    assert_same(eager, compiled, atol=1e-2, rtol=1e-2)  # bf16 casts may round differently in fused code


def test_inductor_end_to_end(backend):
    """The default backend (inductor, CPU code generation) around the opaque gradops ops."""
    torch.manual_seed(0)
    model = PairModel()
    x = torch.randn(2, 4, 4, 8)
    eager = run_and_grads(model, x, [32])
    compiled = run_and_grads(torch.compile(model, fullgraph=True), x, [32])
    assert_same(eager, compiled, atol=1e-5, rtol=1e-4)
