"""The norm forwards as ``torch.library.triton_op``s (issue 24, item 3): under torch.compile
on a GPU, Inductor compiles and launches gradops' forward kernels itself.

On a CPU the interpreter's kernels cannot be traced, so the trace runs in a child process
with the interpreter off, on fake CUDA tensors, with a driver that names an H100 target
(torch asks it while it reads which tensors a traced kernel writes): what Inductor would be
given is checked without a GPU. The eager behaviour of the Triton ops (the same results and
gradients as the custom ops, launches that leave out the options Inductor does not take)
runs on the test device. On a GPU, ``test_compiled_norms_launch_gradops_kernels`` compiles
them with Inductor for real.
"""
import json

import pytest
import torch

import gradops.nn.functional as GF
from gradops.nn import _triton_ops as TO
from gradops.kernels import _traceable
from gradops.kernels import layer_norm as KLN
from gradops.kernels import norm_config
from helpers import TEST_DEVICE, run_sm90_compile

# (registered on first use; here, for the tests that call the ops themselves)
pytestmark = pytest.mark.skipif(not TO._register_triton_ops(), reason="this torch has no torch.library.triton_op, or triton is not installed")

_TRACE = r'''
import json
import torch, triton
from triton.backends.compiler import GPUTarget


class _Sm90Driver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def is_active(self):
        return True


triton.runtime.driver.set_active(_Sm90Driver())
import gradops.nn.functional as GF
from gradops.nn import _triton_ops as TO
from gradops.kernels import norm_config
from torch._functorch.aot_autograd import aot_function
from torch._subclasses.fake_tensor import FakeTensorMode

# a fresh process: the first CUDA call that would take a Triton op registers them, also
# where dynamo meets it (run at trace time, a constant of the graph, no graph break)
assert not TO._TRITON_OPS
out = {}
assert torch.compile(lambda t: t + 1 if TO._triton_ops_usable() else t - 1, backend="eager",
                     fullgraph=True)(torch.zeros(2)).tolist() == [1.0, 1.0]
assert TO._TRITON_OPS
# the kernels each op launches are part of AOTAutograd's cache key
for op, kernels in (("gradops::triton_layer_norm", ["_ln_fwd_fused_kernel", "_ln_fwd_wide_kernel"]),
                    ("gradops::triton_rms_norm", ["_rms_fwd_fused_kernel", "_rms_fwd_wide_kernel"])):
    assert [k.fn.__name__ for k in torch._library.triton.get_triton_kernels_for_op(op)] == kernels

# fake CUDA tensors outside a compile get the Triton ops' fake implementations: shapes only,
# nothing that needs a GPU to plan (this machine has none)
with FakeTensorMode():
    x = torch.empty(2, 3, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(1024, device="cuda", dtype=torch.bfloat16)
    assert GF.layer_norm(x, (1024,), w, w).shape == x.shape
    y, h = GF.fused_add_rms_norm(x, x, (1024,), w, 1e-6)
    assert y.shape == h.shape == x.shape and y.device.type == "cuda"

# dynamo on fake CUDA tensors: torch.compile's graph calls the Triton ops, torch.export's
# (strict and not) the custom ops
def dynamo_ops(fn, *args):
    seen = []

    def capture(gm, example_inputs):
        seen.append(sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"}))
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return seen[0]


class Block(torch.nn.Module):
    def forward(self, x, w):
        y, h = GF.fused_add_rms_norm(GF.layer_norm(x, (1024,), w, w), x, (1024,), w, 1e-6)
        return y + h


with FakeTensorMode(allow_non_fake_inputs=True):
    x = torch.empty(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(1024, device="cuda", dtype=torch.bfloat16)
    out["dynamo"] = dynamo_ops(Block(), x, w)
    for strict in (True, False):
        program = torch.export.export(Block(), (x, w), strict=strict)
        out[f"export strict={strict}"] = sorted({str(n.target) for n in program.graph.nodes
                                                 if n.op == "call_function"})

# AOTAutograd's trace plans the launch: with an H100's SM count
norm_config._sm_count = lambda index: 132
# torch reads which tensors a traced kernel writes from its TTIR; where that fails it warns and
# takes every input as written (the GPU run of 2026-11-28: the float64 scalars' unpacking)
import logging

mutation_analysis_failures = []


class _Failures(logging.Handler):
    def emit(self, record):
        if "identify_mutated_tensors" in record.getMessage():
            mutation_analysis_failures.append(record.getMessage()[:200])


logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(_Failures())
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode


def graph_of(fn, *args):
    graphs = []
    aot_function(fn, fw_compiler=lambda gm, _: graphs.append(gm) or gm)(*args)
    nodes = []
    for node in graphs[0].graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if "triton_kernel_wrapper" not in name:
            nodes.append({"op": name})
            continue
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        configs = getattr(kernel, "configs", [])  # an autotuner of one config holds num_warps
        kernel = getattr(kernel, "fn", kernel)
        nodes.append({"op": name, "kernel": kernel.fn.__name__, "kwargs": sorted(node.kwargs["kwargs"]),
                      "constants": sorted(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])),
                      "num_warps": [c.num_warps for c in configs],
                      "clone": sorted(node.kwargs.get("tensors_to_clone", []))})
    return nodes


with FakeTensorMode():
    for m, n in ((64, 1024), (4, 65536)):
        x, r = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w, b = (torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out[f"layer_norm {n}"] = graph_of(lambda x, w, b: GF.layer_norm(x, (n,), w, b), x, w, b)
        out[f"rms_norm {n}"] = graph_of(lambda x, w: GF.rms_norm(x, (n,), w, 1e-6), x, w)
        out[f"fused_add_layer_norm {n}"] = graph_of(
            lambda x, r, w, b: GF.fused_add_layer_norm(x, r, (n,), w, b), x, r, w, b)
        out[f"fused_add_rms_norm {n}"] = graph_of(
            lambda x, r, w: GF.fused_add_rms_norm(x, r, (n,), w, 1e-6, casting_mode="llama"), x, r, w)
    out["layer_norm reference"] = graph_of(lambda x, w, b: GF.layer_norm(x, (n,), w, b, backend="reference"),
                                           x, w, b)

# torch.compile with dynamic shapes: the row count reaches the ops' bodies as a symbol (the GPU
# run of 2026-11-28 failed there); one graph must serve every row count, narrow and wide rows
from torch._dynamo.backends.common import aot_autograd

for n in (1024, 65536):
    for name, fn in (("layer_norm", lambda x, w: GF.layer_norm(x, (n,), w, w)),
                     ("rms_norm", lambda x, w: GF.rms_norm(x, (n,), w, 1e-6))):
        torch._dynamo.reset()
        graphs = []
        compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm),
                                 dynamic=True, fullgraph=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            w = torch.empty(n, device="cuda", dtype=torch.bfloat16)
            for m in (48, 80, 1000):
                compiled(torch.empty(m, n, device="cuda", dtype=torch.bfloat16), w)
        out[f"dynamic {name} {n}"] = {"graphs": len(graphs), "kernels": [
            kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
            for gm in graphs for node in gm.graph.nodes if "triton_kernel_wrapper" in str(node.target)]}
out["mutation analysis failures"] = mutation_analysis_failures
print(json.dumps(out))
'''

# kernel of each traced case, and the tensors it writes (all of them outputs)
_EXPECTED = {
    "layer_norm 1024": ("_ln_fwd_fused_kernel", ["Mean", "Rstd", "Y"]),
    "rms_norm 1024": ("_rms_fwd_fused_kernel", ["Rstd", "Y"]),
    "fused_add_layer_norm 1024": ("_ln_fwd_fused_kernel", ["H", "Mean", "Rstd", "Y"]),
    "fused_add_rms_norm 1024": ("_rms_fwd_fused_kernel", ["H", "Rstd", "Y"]),
    "layer_norm 65536": ("_ln_fwd_wide_kernel", ["Mean", "Rstd", "Y"]),
    "rms_norm 65536": ("_rms_fwd_wide_kernel", ["Rstd", "Y"]),
    "fused_add_layer_norm 65536": ("_ln_fwd_wide_kernel", ["H", "Mean", "Rstd", "Y"]),
    "fused_add_rms_norm 65536": ("_rms_fwd_wide_kernel", ["H", "Rstd", "Y"]),
}


@pytest.mark.parametrize("triton_version", ["installed", "3.6"])
def test_traced_norm_forwards_are_kernel_calls_inductor_compiles(triton_version):
    graphs = json.loads(run_sm90_compile(_TRACE, triton_version=triton_version).splitlines()[-1])
    for case, (kernel, written) in _EXPECTED.items():
        nodes = graphs[case]
        calls = [node for node in nodes if "kernel" in node]
        assert [c["kernel"] for c in calls] == [kernel], (case, nodes)
        call = calls[0]
        # nothing of gradops runs at run time: allocations, the kernel, its results
        assert {node["op"] for node in nodes} <= {"aten.empty.memory_format", "triton_kernel_wrapper_functional",
                                                   "<built-in function getitem>"}, (case, nodes)
        assert call["clone"] == written, (case, call)  # the kernel writes its outputs, never an input
        assert not set(call["kwargs"]) & set(_traceable.NOT_TRACED_OPTIONS), (case, call)
        assert call["constants"] == ["ACC"] and len(call["num_warps"]) == 1, (case, call)
    # dynamo's graph (what torch.compile hands Inductor) holds the Triton ops; export's the custom ops
    def norm_ops(graph):  # (dynamo names an op's packet, export its overload)
        return {op.removesuffix(".default") for op in graph if op.startswith("gradops.")}

    assert norm_ops(graphs["dynamo"]) == {"gradops.triton_layer_norm", "gradops.triton_rms_norm"}, graphs["dynamo"]
    for strict in (True, False):
        assert norm_ops(graphs[f"export strict={strict}"]) == {"gradops.layer_norm", "gradops.rms_norm"}, strict
    # torch reads what each kernel writes from its code, and every row count is one graph
    assert graphs["mutation analysis failures"] == [], graphs["mutation analysis failures"]
    for n, suffix in ((1024, "fwd_fused_kernel"), (65536, "fwd_wide_kernel")):
        for name, prefix in (("layer_norm", "_ln_"), ("rms_norm", "_rms_")):
            assert graphs[f"dynamic {name} {n}"] == {"graphs": 1, "kernels": [prefix + suffix]}, (name, n)
    # the reference is never traced into the graph: its custom op stays opaque
    assert [node["op"] for node in graphs["layer_norm reference"]] == ["gradops.layer_norm.default",
                                                                       "<built-in function getitem>"]


_RACE = r'''
import threading
from types import SimpleNamespace
import torch
import gradops.nn.functional as GF
from gradops.nn import _triton_ops as TO

# A CUDA tensor as the first call's decision sees it (its device and shape): fake tensors in
# several threads at once crash torch 2.11 (FakeTensorMode's dispatch, gradops or not).
x = SimpleNamespace(device=torch.device("cuda", 0), shape=(4, 256))
start, errors, took = threading.Barrier(8), [], []


def call(i):
    start.wait()
    try:
        took.append(TO.takes_triton_op(x, "auto"))
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")


threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors and took == [True] * 8 and TO._TRITON_OPS, (errors, took)
print("ok")
'''


def test_first_calls_in_several_threads_register_the_triton_ops_once():
    # (before the lock, 3 runs in 3: "already has a __torch_dispatch__ rule registered", and the
    # process stayed broken)
    assert run_sm90_compile(_RACE).splitlines()[-1] == "ok"


def _norm_calls(x, r, w, b):
    n = x.shape[-1]
    return {
        "layer_norm": (torch.ops.gradops.layer_norm, torch.ops.gradops.triton_layer_norm,
                       (x, None, [n], w, b, 1e-5, "triton")),
        "fused_add_layer_norm": (torch.ops.gradops.layer_norm, torch.ops.gradops.triton_layer_norm,
                                 (x, r, [n], w, b, 1e-5, "triton")),
        "rms_norm": (torch.ops.gradops.rms_norm, torch.ops.gradops.triton_rms_norm,
                     (x, None, w, 1e-6, 0.0, "gemma", "triton")),
        "fused_add_rms_norm": (torch.ops.gradops.rms_norm, torch.ops.gradops.triton_rms_norm,
                               (x, r, w, 1e-6, 1.0, "llama", "triton")),
    }


def test_the_constant_mark_is_torchs():
    # _triton_ops_usable carries the mark torch.compiler.assume_constant_result sets
    def probe():
        return True

    torch.compiler.assume_constant_result(probe)
    assert probe.__dict__ == {"_dynamo_marked_constant": True} == TO._triton_ops_usable.__dict__


@pytest.mark.parametrize("n", [48, 3000])  # whole rows, and (on a CPU, past 1024) the wide forward
def test_triton_ops_run_eagerly_as_the_custom_ops(device, n, monkeypatch):
    # Called eagerly (a torch.func transform, a tensor subclass on a GPU), a Triton op runs its
    # body: every launch goes through the traced path's helper (wrap_triton, which torch turns
    # off here, and only the options Inductor takes). Results and gradients are the custom op's.
    from gradops.kernels import _norm_common

    traced_kernels = []
    real = _traceable.traced

    def spy(kernel, grid, options):
        launch, kept = real(kernel, grid, options)
        assert not set(kept) & set(_traceable.NOT_TRACED_OPTIONS) and "num_warps" in kept
        traced_kernels.append(kernel.fn.__name__)
        return launch, kept

    monkeypatch.setattr(_traceable, "traced", spy)
    monkeypatch.setattr(_norm_common, "traced", spy)
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, n, generator=gen, device="cpu").to(device) for _ in range(2))
    w, b = (torch.randn(n, generator=gen, device="cpu").to(device) for _ in range(2))
    dy = torch.randn(5, n, generator=gen, device="cpu").to(device)
    for name, (custom, traced, args) in _norm_calls(x, r, w, b).items():
        results = []
        for op in (custom, traced):
            leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            out = op(*leaves)
            grads = torch.autograd.grad(out[0], [a for a in leaves if isinstance(a, torch.Tensor)], dy)
            results.append([t for t in out if t.numel()] + list(grads))
        for got, want in zip(results[1], results[0]):
            assert torch.equal(got, want), name
    wide = n > norm_config.max_fused_n(torch.device(device), "fwd")
    assert traced_kernels == [f"_{family}_fwd_{'wide' if wide else 'fused'}_kernel"
                              for family in ("ln", "ln", "rms", "rms")]


def test_a_traced_launch_refuses_a_kernel_that_needs_contraction_off(device):
    # The backwards' exact results need contraction off, which Inductor's compile of a user
    # kernel cannot ask for: traced, their launch raises rather than compile into other bits.
    x = torch.ones(4, 16, device=device)
    stat = torch.ones(4, device=device)
    with _traceable.traced_launches(), pytest.raises(RuntimeError, match="contraction"):
        KLN.layer_norm_backward(x, x, stat, stat, stat.new_ones(16), (True, True, True))


def test_only_static_cuda_calls_take_the_triton_ops(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cuda = torch.empty(4, 8, device="cuda")
        cpu, meta = torch.empty(4, 8, device="cpu"), torch.empty(4, 8, device="meta")
    # under the interpreter (a CPU test run) no call does: its kernels cannot be traced
    monkeypatch.setattr(TO, "triton_interpreter_on", lambda: True)
    assert not TO.takes_triton_op(cuda, "auto")
    monkeypatch.setattr(TO, "triton_interpreter_on", lambda: False)
    assert TO.takes_triton_op(cuda, "auto") and TO.takes_triton_op(cuda, "triton")
    assert not TO.takes_triton_op(cuda, "reference")
    assert not TO.takes_triton_op(cpu, "triton")
    assert not TO.takes_triton_op(meta, "auto")
    # torch.export keeps the custom op: a program that loads wherever gradops imports
    monkeypatch.setattr(TO, "_is_exporting", lambda: True)
    assert not TO.takes_triton_op(cuda, "auto")
    monkeypatch.setattr(TO, "_is_exporting", lambda: False)
    # symbolic sizes (torch.compile(dynamic=True)) keep the custom op: the launch is planned from sizes
    from types import SimpleNamespace

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    rows = ShapeEnv().create_unbacked_symint()
    assert not TO.takes_triton_op(SimpleNamespace(device=torch.device("cuda", 0), shape=(rows, 8)), "auto")


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="Inductor compiles the Triton ops' kernels on a GPU only")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_norms_launch_gradops_kernels(mode):
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(256, 1024, generator=gen, device="cpu").to("cuda", torch.bfloat16) for _ in range(2))
    w, b = (torch.randn(1024, generator=gen, device="cpu").to("cuda", torch.bfloat16) for _ in range(2))
    dy = torch.randn(256, 1024, generator=gen, device="cpu").to("cuda", torch.bfloat16)

    def step(x, r, w, b):
        y1, h = GF.fused_add_rms_norm(x, r, (1024,), w, 1e-6, casting_mode="llama")
        return GF.layer_norm(y1 + h, (1024,), w, b)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
        out = fn(*leaves)
        return [out] + list(torch.autograd.grad(out, leaves, dy))

    want = grads(step)
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    got, code = run_and_get_code(grads, compiled)
    for _ in range(2):  # (reduce-overhead records its CUDA graph on a later call, then replays it)
        got = grads(compiled)
    source = "\n".join(code)
    assert "_rms_fwd_fused_kernel" in source and "_ln_fwd_fused_kernel" in source
    # Inductor compiles the forward with Triton's default contraction, the eager launch asks
    # for contraction on (norm_config.fp_fusion("fwd")): the same bits where they agree
    import triton

    language = getattr(getattr(triton, "knobs", None), "language", None)
    if hasattr(language, "fp_fusion_enabled"):  # Triton 3.9
        default_fusion = language.fp_fusion_enabled(None)
    else:  # Triton 3.6: on unless TRITON_DEFAULT_FP_FUSION says otherwise
        default_fusion = bool(getattr(language, "default_fp_fusion", True))
    if not default_fusion:
        pytest.skip("this Triton compiles without contraction by default (TRITON_DEFAULT_FP_FUSION=0, or "
                    "Triton >= 3.10): the compiled forward rounds otherwise than the eager one")
    for g, e in zip(got, want):
        assert torch.equal(g, e)
