"""``gradops.patch`` on FloydNet models (PyPI ``floydnet`` 1.1.0): every
``floydnet.PivotalAttentionBlock`` is adopted in place (its class swapped for a subclass whose
``attn`` runs :func:`gradops.pivotal_attention`), against FloydNet's own unpatched blocks.

- dropout 0: outputs and every gradient (input and all parameters) equal FloydNet's in float64
  (1e-10), per block over the block's switches and for a stack run as FloydNet's example
  model runs it (``x = block(x, attn_mask); x = x * pair_mask.unsqueeze(-1)``);
- dropout > 0: gradops draws its own masks; inputs that reveal each attention weight show the
  rate, the scaling, the reproducibility, and that the backward uses the forward's mask;
- what adoption keeps (the object, its parameters, hooks, state_dict, training flag), what is
  left and why, unpatch, copies, pickling, DDP;
- torch.compile(dynamic=True) on fake CUDA tensors (no graph break, no recompile for L from 20
  to 100), compiled equals eager, and no host data on repeated training steps.
"""
import copy
import importlib.util
import os
import pickle
import sys
import types

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

floydnet = pytest.importorskip("floydnet")
import floydnet.transformer as floyd_transformer  # noqa: E402
from floydnet.transformer import PivotalAttentionBlock  # noqa: E402

import gradops  # noqa: E402
import gradops.nn.pivotal as pivotal_mod  # noqa: E402
from gradops.errors import ACLNN_ERR_PARAM_INVALID  # noqa: E402
from helpers import TEST_DEVICE, raises_status  # noqa: E402
from test_no_host_sync import _HostData  # noqa: E402

patch_module = sys.modules["gradops.patch"]  # (gradops.patch is the function)
f64 = torch.float64
F64_TOL = dict(rtol=1e-10, atol=1e-10)
C, HEADS = 8, 2


def _randomised(module, seed=0, scale=0.3):
    """``module`` with every parameter drawn anew: FloydNet zero-initialises c_mix, c_proj and
    ffn[2], which would hide their paths' gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype, device="cpu").to(p.device) * scale)
    return module


def _pair_mask(valid, n, dtype=f64):
    """FloydNet's pair_mask [B, N, N]: 1 where both nodes of the pair are real, 0 on padding."""
    nodes = torch.arange(n)[None, :] < torch.tensor(valid)[:, None]
    return (nodes[:, :, None] & nodes[:, None, :]).to(dtype)


def _attn_mask(pair_mask):
    return ~(pair_mask[:, None, :, None, :].bool())  # as FloydNet's TSP and graph models build it


def _run(fn, module, x):
    """(output, x's gradient, every parameter's gradient) of ``fn(x)`` under a fixed upstream
    gradient."""
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = fn(xi)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
    return y.detach(), xi.grad, {k: None if p.grad is None else p.grad.clone() for k, p in module.named_parameters()}


def _assert_same_run(ours, theirs, **tol):
    torch.testing.assert_close(ours[0], theirs[0], **tol, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(ours[1], theirs[1], **tol, msg=lambda m: f"grad x: {m}")
    assert ours[2].keys() == theirs[2].keys()
    for k in theirs[2]:
        assert (ours[2][k] is None) == (theirs[2][k] is None), k
        if theirs[2][k] is not None:
            torch.testing.assert_close(ours[2][k], theirs[2][k], **tol, msg=lambda m, k=k: f"grad {k}: {m}")


@pytest.fixture
def floydnets_function_refused(monkeypatch):
    """For the whole test, counts the fused operator's calls (gradops' Floyd attention ran);
    inside ``with floydnets_function_refused() as fused_calls:`` FloydNet's own
    pivotal_attention raises."""
    import contextlib

    fused_calls = []
    fused = pivotal_mod._fused
    monkeypatch.setattr(pivotal_mod, "_fused", lambda *a, **k: fused_calls.append(1) or fused(*a, **k))

    @contextlib.contextmanager
    def refused():
        def refuse(*args, **kwargs):
            raise AssertionError("FloydNet's pivotal_attention ran in an adopted block")

        with monkeypatch.context() as m:
            m.setattr(floyd_transformer, "pivotal_attention", refuse)
            yield fused_calls

    return refused


# ---------------------------------------------------------------------------------------
# dropout 0: equal to FloydNet in float64

# Every switch of the block in a few combinations: norm position, symmetric mix, the pair mask
# (with a padded sample), train/eval, the norm (nn.LayerNorm and nn.RMSNorm are patched too;
# FloydNet's own Affine is not a norm gradops serves), bias, FFN.
BLOCK_CASES = {
    "pre-mix-masked-train-layernorm-bias": dict(norm_position="pre", enable_symmetric_mix=True, masked=True,
                                                 train=True, norm_fn="layernorm", bias=True, enable_ffn=True),
    "post-nomix-unmasked-eval-rmsnorm": dict(norm_position="post", enable_symmetric_mix=False, masked=False,
                                             train=False, norm_fn="rmsnorm", bias=False, enable_ffn=True),
    "pre-nomix-masked-eval-affine-noffn": dict(norm_position="pre", enable_symmetric_mix=False, masked=True,
                                               train=False, norm_fn="affine", bias=False, enable_ffn=False),
    "post-mix-masked-train-layernorm-noffn": dict(norm_position="post", enable_symmetric_mix=True, masked=True,
                                                  train=True, norm_fn="layernorm", bias=True, enable_ffn=False),
}


@pytest.mark.floyd_float64
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_adopted_block_matches_floydnets_in_float64(backend, case, floydnets_function_refused):
    kw = dict(BLOCK_CASES[case])
    masked, train = kw.pop("masked"), kw.pop("train")
    n = 5
    theirs = _randomised(PivotalAttentionBlock(C, HEADS, **kw).to(f64)).train(train)
    ours = copy.deepcopy(theirs)
    report = gradops.patch(ours)
    assert report.replaced[0].name == "" and type(ours).attn is not PivotalAttentionBlock.attn
    norms = {"layernorm": gradops.nn.LayerNorm, "rmsnorm": gradops.nn.RMSNorm}.get(kw["norm_fn"])
    if norms is not None:  # the norms inside the block are patched as anywhere else
        assert type(ours.norm1) is norms and len(report) == 1 + (2 if kw["enable_ffn"] else 1)
    x = torch.randn(2, n, n, C, dtype=f64)
    mask = _attn_mask(_pair_mask([5, 3], n)) if masked else None  # sample 1: nodes 3, 4 are padding
    want = _run(lambda t: theirs(t, mask), theirs, x)
    with floydnets_function_refused() as fused_calls:
        got = _run(lambda t: ours(t, mask), ours, x)
    assert fused_calls  # gradops' Floyd operator ran
    _assert_same_run(got, want, **F64_TOL)


class Stack(nn.Module):
    """Blocks run as FloydNet's example model (example/common/model.py) runs them."""

    def __init__(self, depth=3, norm_fn="layernorm", dropout=0.0, dtype=None):
        super().__init__()
        self.blocks = nn.ModuleList([PivotalAttentionBlock(C, HEADS, dropout=dropout, norm_fn=norm_fn,
                                                           activation_fn="silu") for _ in range(depth)])
        if dtype is not None:
            self.to(dtype)

    def forward(self, x, pair_mask):
        attn_mask = _attn_mask(pair_mask)
        for block in self.blocks:
            x = block(x, attn_mask)
            x = x * pair_mask.unsqueeze(-1)
        return x


@pytest.mark.floyd_float64
def test_stack_as_floydnets_example_model_runs_it(backend, floydnets_function_refused):
    theirs = _randomised(Stack(dtype=f64))
    ours = copy.deepcopy(theirs)
    report = gradops.patch(ours)
    assert [r.name for r in report.replaced if "Pivotal" in r.original] == ["blocks.0", "blocks.1", "blocks.2"]
    assert len(report) == 9 and not report.left  # and 6 LayerNorms
    n = 6
    pair_mask = _pair_mask([6, 4], n)
    x = torch.randn(2, n, n, C, dtype=f64) * pair_mask.unsqueeze(-1)
    want = _run(lambda t: theirs(t, pair_mask), theirs, x)
    with floydnets_function_refused() as fused_calls:
        got = _run(lambda t: ours(t, pair_mask), ours, x)
    assert len(fused_calls) == 3
    _assert_same_run(got, want, **F64_TOL)


# ---------------------------------------------------------------------------------------
# dropout > 0: gradops' own draws, checked through inputs that reveal every attention weight

def _revealing_block(p, n):
    """A block whose ``attn`` returns its attention weights: q = k = 0 (every weight is 1/N
    before dropout), v_ij[i, j] the one-hot of j in each head, v_jk = 0, c_proj the identity,
    the output dropout off. Returns (block, x)."""
    c = 2 * n  # two heads of n channels: one per pivot
    block = PivotalAttentionBlock(c, 2, dropout=p, enable_symmetric_mix=False, enable_ffn=False).to(f64)
    with torch.no_grad():
        block.c_qkv.weight.zero_()
        block.c_qkv.weight[3 * c:4 * c] = torch.eye(c, dtype=f64)  # v_ij = x
        block.c_proj.weight.copy_(torch.eye(c, dtype=f64))
    block.train()
    block.dropout_fn.eval()  # only the attention weights are dropped
    one_hot = torch.eye(n, dtype=f64)  # x[b, i, j] = one-hot of j, in both heads
    x = torch.cat([one_hot, one_hot], dim=-1).expand(4, n, n, c).contiguous()
    return block, x


def _weights(y, n):
    """y [B, L, L, 2n] of the revealing block -> its attention weights [B, H, L_i, L_k, L_j]."""
    return y.view(y.shape[0], n, n, 2, n).permute(0, 3, 1, 2, 4)


def test_dropout_rate_scaling_and_seed(backend, monkeypatch):
    p, n = 0.25, 8
    block, x = _revealing_block(p, n)
    gradops.patch(block)
    # one tile per row i (8 tiles, each its own draw), so a tile that repeated another's
    # numbers would show
    monkeypatch.setattr(pivotal_mod, "TILE_ELEMENTS", 4 * 2 * n * n)
    torch.manual_seed(7)
    w = _weights(block.attn(x, None), n)
    survivor = 1.0 / (n * (1 - p))
    kept = w != 0
    torch.testing.assert_close(w[kept], torch.full_like(w[kept], survivor), rtol=1e-12, atol=0)
    # 4096 independent Bernoulli(p) drops: the dropped fraction's standard deviation is
    # sqrt(p (1 - p) / 4096) = 0.0068; 5 of them (a false failure once in ~1.7 million draws)
    dropped = 1 - kept.double().mean().item()
    assert abs(dropped - p) <= 5 * (p * (1 - p) / kept.numel()) ** 0.5, dropped
    tiles = kept.transpose(0, 2).reshape(n, -1)  # [row i, everything else]
    assert all(not torch.equal(tiles[0], tiles[i]) for i in range(1, n))
    # the same seed, the same draws; another seed, others
    torch.manual_seed(7)
    assert torch.equal(_weights(block.attn(x, None), n), w)
    torch.manual_seed(8)
    assert not torch.equal(_weights(block.attn(x, None), n), w)


def test_dropout_backward_uses_the_forwards_mask(backend, monkeypatch):
    """The chunked path recomputes each tile in the backward: its dropout mask must be the
    forward's. The revealing block's output is the dropped weights W themselves; the oracle
    is FloydNet's block with its F.dropout replaced by that mask, and the value projection's
    gradient is also written out from W: dW_v[h d + t, c] = sum_{b,i,k,j} W[b,h,i,k,j] dy[b,i,k,h d + t] x[b,i,j,c]."""
    p, n = 0.3, 6
    theirs, x = _revealing_block(p, n)
    ours = copy.deepcopy(theirs)
    gradops.patch(ours)
    monkeypatch.setattr(pivotal_mod, "TILE_ELEMENTS", 4 * 2 * n * n)  # several tiles
    torch.manual_seed(3)
    got = _run(lambda t: ours.attn(t, None), ours, x)
    w = _weights(got[0], n)
    keep = w != 0
    assert 0 < int(keep.sum()) < keep.numel()
    real_dropout = torch.nn.functional.dropout

    def revealed(t, p=0.5, training=True, inplace=False):
        return t * keep / (1 - p) if training and t.shape == keep.shape else real_dropout(t, p, training, inplace)

    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "dropout", revealed)
        want = _run(lambda t: theirs.attn(t, None), theirs, x)
    _assert_same_run(got, want, **F64_TOL)
    c = 2 * n
    dy = torch.cos(torch.arange(got[0].numel(), dtype=f64)).view_as(got[0]).view(4, n, n, 2, n)
    d_v = torch.einsum("bhikj,bikht,bijc->htc", w, dy, x).reshape(c, c)
    torch.testing.assert_close(got[2]["c_qkv.weight"][3 * c:4 * c], d_v, **F64_TOL)


# ---------------------------------------------------------------------------------------
# What adoption keeps; patch twice; unpatch; what is left and why

def test_adoption_keeps_the_block_and_unpatch_gives_floydnets_back(floydnets_function_refused):
    model = _randomised(Stack(depth=2))
    block = model.blocks[0]
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    seen = []
    handle = block.register_forward_hook(lambda m, args, out: seen.append(m))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before patching
    model.eval()
    report = gradops.patch(model)
    assert model.blocks[0] is block and isinstance(block, PivotalAttentionBlock) and not block.training
    assert type(block).__name__ == "GradopsPivotalAttentionBlock" and type(block).__module__ == "gradops.patch"
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys
    assert all(model.get_parameter(k) is v for k, v in params.items())
    r = report.replaced[0]
    assert (r.name, r.original) == ("blocks.0", "floydnet.transformer.PivotalAttentionBlock")
    assert "gradops.pivotal_attention" in r.replacement and "GradopsPivotalAttentionBlock" in str(report)
    x, pair_mask = torch.randn(1, 4, 4, C), _pair_mask([4], 4, torch.float32)
    with floydnets_function_refused():
        before = block.c_qkv.weight.detach().clone()
        model(x, pair_mask).square().sum().backward()
        opt.step()
    assert seen == [block] and not torch.equal(block.c_qkv.weight, before)  # the hook fired; SGD stepped
    again = gradops.patch(model)  # changes nothing
    assert len(again) == 0 and set(again.already) >= {"blocks.0", "blocks.1"}
    restored = gradops.unpatch(model)
    assert type(block) is PivotalAttentionBlock and model.blocks[0] is block
    assert [r.name for r in restored.restored] == [r.name for r in report.replaced]
    assert "restored   2 x PivotalAttentionBlock" in str(restored)
    assert all(model.get_parameter(k) is v for k, v in params.items())
    handle.remove()
    with pytest.raises(AssertionError, match="FloydNet's pivotal_attention ran"):
        with floydnets_function_refused():
            model(x, pair_mask)  # FloydNet's attention again
    assert seen == [block]


def test_shared_block_is_adopted_once_under_every_name():
    block = PivotalAttentionBlock(C, HEADS)
    model = nn.ModuleDict({"a": block, "b": nn.Sequential(block)})
    report = gradops.patch(model, layer_norm=False)
    assert [(r.name, r.aliases) for r in report.replaced] == [("a", ("b.0",))]
    assert model["b"][0] is block and type(block).__name__ == "GradopsPivotalAttentionBlock"
    assert [(r.name, r.aliases) for r in gradops.unpatch(model).restored] == [("a", ("b.0",))]
    assert type(block) is PivotalAttentionBlock


class OwnBlock(PivotalAttentionBlock):
    pass


def _floydnet_variant(tmp_path, edit, from_file=True):
    """FloydNet's transformer module as another FloydNet version would define it (its
    source with ``edit`` applied, under the name floydnet.transformer), from a file, or
    from a string (no source to read back)."""
    source = open(floyd_transformer.__file__).read().replace("from .functional import",
                                                             "from floydnet.functional import")
    source = edit(source)
    if not from_file:
        module = types.ModuleType("floydnet.transformer")
        exec(compile(source, "<floydnet variant>", "exec"), module.__dict__)
        return module
    path = os.path.join(tmp_path, "transformer.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("floydnet.transformer", path)
    module = importlib.util.module_from_spec(spec)  # not put in sys.modules: FloydNet's own stays
    spec.loader.exec_module(module)
    return module


def test_blocks_someone_else_changed_are_left_with_the_reason(tmp_path, monkeypatch):
    rebound_attn, rebound_forward = PivotalAttentionBlock(C, HEADS), PivotalAttentionBlock(C, HEADS)
    rebound_attn.attn = types.MethodType(lambda self, x, mask: x, rebound_attn)
    rebound_forward.forward = types.MethodType(lambda self, x, mask=None: x, rebound_forward)
    odd_heads = PivotalAttentionBlock(C, HEADS)
    odd_heads.num_heads = 2.0
    capped = _floydnet_variant(tmp_path, lambda s: s.replace("dropout=self.dropout if self.training else 0.0,",
                                                             "dropout=self.dropout if self.training else 0.0, "
                                                             "softmax_cap=5.0,"))
    unreadable = _floydnet_variant(tmp_path, lambda s: s, from_file=False)
    model = nn.ModuleDict({
        "own": OwnBlock(C, HEADS), "rebound_attn": rebound_attn, "rebound_forward": rebound_forward,
        "odd_heads": odd_heads, "capped": capped.PivotalAttentionBlock(C, HEADS),
        "unreadable": unreadable.PivotalAttentionBlock(C, HEADS), "fine": PivotalAttentionBlock(C, HEADS),
    })
    report = gradops.patch(model)
    left = {r.name: r.reason for r in report.left}
    assert set(left) == {"own", "rebound_attn", "rebound_forward", "odd_heads", "capped", "unreadable"}
    assert "subclass of floydnet's PivotalAttentionBlock" in left["own"]
    assert "attn is overridden on the instance" in left["rebound_attn"]
    assert "forward is overridden on the instance" in left["rebound_forward"]
    assert "num_heads is 2.0" in left["odd_heads"]
    assert "not the one gradops verified" in left["capped"] and "differs" in left["capped"]
    assert "cannot be read" in left["unreadable"]
    assert [r.name for r in report.replaced if "Pivotal" in r.original] == ["fine"]
    # the norms inside the left blocks are still patched
    assert all(type(model[k].norm1) is gradops.nn.LayerNorm for k in left)
    assert type(model["capped"]) is capped.PivotalAttentionBlock

    # monkeypatched class methods: every FloydNet block is left
    for name in ("attn", "forward"):
        with monkeypatch.context() as m:
            m.setattr(PivotalAttentionBlock, name, lambda self, x, mask=None: x)
            report = gradops.patch(PivotalAttentionBlock(C, HEADS))
            assert f"class's {name} has been replaced (by {__name__})" in report.left[0].reason
            assert report.left[0].name == "" and not any("Pivotal" in r.original for r in report.replaced)


def test_keyword_leaves_the_blocks_and_its_argument_is_checked():
    model = nn.Sequential(PivotalAttentionBlock(C, HEADS))
    report = gradops.patch(model, floyd_attention=False)
    assert [(r.name, r.reason) for r in report.left] == [("0", "floyd_attention=False")]
    assert type(model[0]) is PivotalAttentionBlock and type(model[0].norm1) is gradops.nn.LayerNorm
    with raises_status(ACLNN_ERR_PARAM_INVALID, "patch", "floyd_attention", "expected True or False"):
        gradops.patch(model, floyd_attention=1)


def test_gradops_imports_floydnet_only_inside_functions():
    """Importing gradops never imports floydnet: no module of the package imports it at
    module level (gradops.patch recognises FloydNet's class by name and module)."""
    import ast
    import pathlib

    package = pathlib.Path(gradops.__file__).parent
    at_module_level = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if "floydnet" not in text:
            continue
        tree = ast.parse(text)
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "floydnet" for n in names) and id(node) not in inside:
                at_module_level.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not at_module_level, at_module_level
    assert "floydnet" in (package / "patch.py").read_text()  # (the scan reads the module that names it)


# ---------------------------------------------------------------------------------------
# Copies, pickling, DDP

def test_deepcopy_and_pickle_keep_the_adoption(monkeypatch):
    model = _randomised(Stack(depth=2))
    gradops.patch(model)
    x, pair_mask = torch.randn(2, 4, 4, C), _pair_mask([4, 3], 4, torch.float32)
    want = model(x, pair_mask)
    clone = copy.deepcopy(model)
    assert type(clone.blocks[0]) is type(model.blocks[0]) and clone.blocks[0].c_qkv.weight is not \
        model.blocks[0].c_qkv.weight
    torch.testing.assert_close(clone(x, pair_mask), want, rtol=0, atol=0)
    assert len(gradops.unpatch(clone)) == 6 and type(model.blocks[0]).__name__ == "GradopsPivotalAttentionBlock"
    data = pickle.dumps(model)
    torch.testing.assert_close(pickle.loads(data)(x, pair_mask), want, rtol=0, atol=0)
    # in a fresh process the adopted class does not exist yet: unpickling builds it
    monkeypatch.setattr(patch_module, "_floyd_classes", {})
    loaded = pickle.loads(data)
    cls = type(loaded.blocks[0])
    assert cls is not type(model.blocks[0]) and cls.__name__ == "GradopsPivotalAttentionBlock"
    assert cls.__bases__ == (PivotalAttentionBlock,)
    torch.testing.assert_close(loaded(x, pair_mask), want, rtol=0, atol=0)
    assert len(gradops.unpatch(loaded)) == 6 and type(loaded.blocks[0]) is PivotalAttentionBlock


def test_ddp_trains_an_adopted_stack(backend):
    """DistributedDataParallel (one gloo process) over a patched stack: its gradients are the
    stack's own (the adopted blocks are ordinary modules to DDP)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group exists in this process already")
    model = _randomised(Stack(depth=1))
    gradops.patch(model)
    plain = copy.deepcopy(model)
    x, pair_mask = torch.randn(2, 4, 4, C), _pair_mask([4, 3], 4, torch.float32)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        got = _run(lambda t: ddp(t, pair_mask), model, x)
    finally:
        dist.destroy_process_group()
    want = _run(lambda t: plain(t, pair_mask), plain, x)
    _assert_same_run(got, want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------
# torch.compile; no host synchronisation

def test_compiled_adopted_block_trains_as_eager(backend):
    """fullgraph compiled forward and backward (gradops' Floyd operator and its backward in
    AOTAutograd's graphs) equal eager on the test device."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _randomised(Stack(depth=1, norm_fn="affine"))
    gradops.patch(model)
    graphs = []

    def compiler(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    counter = CompileCounterWithBackend(aot_autograd(fw_compiler=compiler, bw_compiler=compiler))
    pair_mask = _pair_mask([4, 3], 4, torch.float32)
    x = torch.randn(2, 4, 4, C)
    torch._dynamo.reset()
    try:
        got = _run(lambda t: torch.compile(model, backend=counter, fullgraph=True)(t, pair_mask), model, x)
    finally:
        torch._dynamo.reset()
    _assert_same_run(got, _run(lambda t: model(t, pair_mask), model, x), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1 and len(graphs) == 2
    ops = [{str(node.target) for node in g.graph.nodes if node.op == "call_function"} for g in graphs]
    assert "gradops.floyd_attention.default" in ops[0] and "gradops.floyd_attention_backward.default" in ops[1]


def test_compile_dynamic_on_fake_cuda_keeps_the_floyd_op_and_does_not_recompile():
    """A patched stack (FloydNet's example's Affine norm: the Floyd op is what is traced here;
    the norms' Triton ops have their own test) on fake CUDA tensors under
    torch.compile(dynamic=True, fullgraph=True): one graph, which calls gradops' Floyd
    operator, serves every L from 20 to 100. A counting backend (dynamo's graphs, no
    AOTAutograd) keeps it cheap; the test above runs AOTAutograd's forward and backward
    graphs. (The pair mask's ``~`` and ``[:, None]`` are built outside: a CPU build of torch
    cannot run them on fake CUDA tensors, nor record autograd on them.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class FakeStack(Stack):
        def forward(self, x, pair_mask, attn_mask):
            for block in self.blocks:
                x = block(x, attn_mask)
                x = x * pair_mask.unsqueeze(-1)
            return x

    graphs = []

    def counting(gm, example_inputs):  # dynamo's graphs, run as they are
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            with torch.device("meta"):
                model = FakeStack(depth=1, norm_fn="affine")
            for module in model.modules():  # fake CUDA parameters
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[name] = nn.Parameter(torch.empty(p.shape, device="cuda"),
                                                                requires_grad=False)
            gradops.patch(model)
            compiled = torch.compile(model, backend=counting, dynamic=True, fullgraph=True)
            for n in (20, 37, 64, 100):
                y = compiled(torch.empty(2, n, n, C, device="cuda"), torch.empty(2, n, n, device="cuda"),
                             torch.empty(2, 1, n, 1, n, dtype=torch.bool, device="cuda"))
                assert y.shape == (2, n, n, C) and y.device.type == "cuda"
                assert len(graphs) == 1, n  # no recompile
    finally:
        torch._dynamo.reset()
    ops = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert ops.count("gradops.floyd_attention") == 1, ops  # (dynamo names the op packet)


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["fused", "chunked"])
def test_repeated_training_steps_bring_no_host_data(backend, dropout):
    """Forward and backward of a patched stack, FloydNet's mask building included: after the
    first step no tensor is made from host data, read back, or copied across devices (the CPU
    proxy of tests/test_no_host_sync.py; on a GPU the next test checks the synchronisation)."""
    model = _randomised(Stack(depth=1, dropout=dropout)).train()
    gradops.patch(model)
    pair_mask = _pair_mask([4, 3], 4, torch.float32)
    x = torch.randn(2, 4, 4, C)
    model(x, pair_mask).square().mean().backward()  # first step: kernels compiled
    with _HostData() as watch:
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            model(x, pair_mask).square().mean().backward()
    assert not watch.seen, f"host data brought in by a repeated step: {dict(watch.seen)}"


@pytest.mark.skipif(TEST_DEVICE != "cuda" or not torch.cuda.is_available(), reason="needs a GPU")
def test_adopted_stack_training_step_does_not_synchronise(backend):
    model = _randomised(Stack(depth=2)).cuda()
    gradops.patch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    pair_mask = _pair_mask([4, 3], 4, torch.float32).cuda()
    x = torch.randn(2, 4, 4, C, device="cuda")
    for sync_mode in ("default", "error"):  # the first step may compile kernels
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            opt.zero_grad(set_to_none=False)
            model(x, pair_mask).square().mean().backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
