"""gradops.patch on real clients: tiny, randomly initialised HuggingFace models of every family
patch knows (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma2, Gemma3, GPT-2, BERT, T5),
built from configs in code (no download), patched on a deep copy and checked against the
unpatched model: logits, loss and every parameter gradient, AdamW steps, torch.compile,
save_pretrained/from_pretrained, unpatch, the report. transformers==5.23.0 is in the `test`
extra (pyproject.toml); its norm classes' forwards are what docs/patch.md quotes.

float64: transformers' RMSNorm classes cast their input to float32 whatever its dtype
(``hidden_states.to(torch.float32)``, ``x.float()``), so an unpatched float64 model computes
its RMSNorms in float32 while gradops computes them in float64. The float64 checks therefore
compare the patched model with the unpatched one whose HF RMSNorms evaluate their own formula
in float64 (``hf_formula_in_input_dtype``), and ``test_hf_rms_norms_are_float32_accurate_in_float64``
pins down that HF difference.
"""
import copy
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

tf = pytest.importorskip("transformers")

import gradops  # noqa: E402
from gradops.errors import ACLNN_ERR_PARAM_INVALID  # noqa: E402
from gradops.oracles import TOLERANCE, rel_error  # noqa: E402
from gradops.patch import T5RMSNorm  # noqa: E402

from conftest import TEST_DEVICE  # noqa: E402
from helpers import promoted_layer_norm, raises_status  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 64, 32, 2, 2, 8
f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16

# family -> (model class, config class, config arguments, the HF norm kind: "llama", "gemma",
# "t5", or "torch" for torch.nn.LayerNorm). Every dropout is 0, so the runs are deterministic.
# Weights are drawn with std 0.05 rather than transformers' 0.02 (T5 keeps its own scheme):
# at 0.02 the attention of a 32-wide model is nearly uniform, and the query gradients are
# then a cancellation of nearly equal terms whose float32 rounding is 1e-5 of their size.
_INIT = 0.05
_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0,
                initializer_range=_INIT)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_DECODER), "llama"),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_DECODER), "llama"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(_DECODER), "llama"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_DECODER, head_dim=8), "llama"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                                   resid_pdrop=0.0, embd_pdrop=0.0), "llama"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_DECODER, head_dim=8), "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(_DECODER, head_dim=8), "gemma"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(_DECODER, head_dim=8), "gemma"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                                                   n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                   bos_token_id=1, eos_token_id=1, initializer_range=_INIT),
             "torch"),
    "bert": ("BertForMaskedLM", "BertConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                                   num_attention_heads=4, intermediate_size=64,
                                                   max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0, initializer_range=_INIT),
             "torch"),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64,
                                                          num_layers=LAYERS, num_heads=4, dropout_rate=0.0,
                                                          decoder_start_token_id=0), "t5"),
}
# The norm classes of each kind, as transformers names them (the test's own list, independent
# of gradops.patch's table).
HF_NORMS = {"LlamaRMSNorm": "llama", "MistralRMSNorm": "llama", "Qwen2RMSNorm": "llama", "Qwen3RMSNorm": "llama",
            "Phi3RMSNorm": "llama", "GemmaRMSNorm": "gemma", "Gemma2RMSNorm": "gemma", "Gemma3RMSNorm": "gemma",
            "T5LayerNorm": "t5"}
REPLACEMENT = {"llama": gradops.nn.RMSNorm, "gemma": gradops.nn.RMSNorm, "t5": T5RMSNorm, "torch": gradops.nn.LayerNorm}


def is_norm(module) -> bool:
    return type(module) is nn.LayerNorm or type(module).__name__ in HF_NORMS


def build(family, dtype=f32, seed=0):
    """A tiny model of ``family`` in training mode, 1-D parameters (norm weights, biases)
    moved off their initial values so that offsets and weights matter."""
    model_cls, config_cls, kwargs, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(getattr(tf, config_cls)(**kwargs)).to(dtype).train()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def batch(family, seed=1):
    # drawn on the CPU (a CPU generator cannot draw onto a GPU), then moved where the model is
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g, device="cpu").to(torch.get_default_device())
    return {"input_ids": ids, "labels": ids}


def run(model, inputs):
    """(logits, loss, {name: grad}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    # (a torch.compile'd model names its parameters under _orig_mod.)
    return out.logits.detach(), out.loss.detach(), {n.removeprefix("_orig_mod."): p.grad
                                                    for n, p in model.named_parameters()}


# Gradients that are zero in exact arithmetic: BERT's attention key bias adds the same q.b to
# every score of a row, which softmax ignores. Both models give rounding noise there
# (~1e-6 of the key weight's gradient in float32), so relative to its own largest value the
# noise is O(1); it is checked against the key weight's gradient instead.
ZERO_GRADIENT = ("attention.self.key.bias",)


def assert_same_run(got, want, tol, what):
    (lg, sg, gg), (lw, sw, gw) = got, want
    assert lg.dtype == lw.dtype, f"{what}: logits dtype {lg.dtype} != {lw.dtype}"
    errors = {"logits": rel_error(lg, lw), "loss": rel_error(sg, sw)}
    assert gg.keys() == gw.keys()
    for name in gw:
        assert gg[name] is not None and gg[name].dtype == gw[name].dtype, f"{what}: {name}"
        if name.endswith(ZERO_GRADIENT):
            # zero in exact arithmetic: rounding noise, measured against the key weight's gradient
            scale = gw[name[:-len("bias")] + "weight"].abs().max().item()
            errors[name] = max(gg[name].abs().max().item(), gw[name].abs().max().item()) / scale
        else:
            errors[name] = rel_error(gg[name], gw[name])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{what}: {worst} relative error {errors[worst]:.3e} > {tol:.1e}"


def hf_formula_in_input_dtype(model):
    """``model`` with each HF RMSNorm computing its own formula in its input's dtype (its
    float32 casts taken out): the float64 oracle for those modules."""
    def llama(self, x):  # LlamaRMSNorm & co, T5LayerNorm (weight of the input's dtype)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def gemma(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    for m in model.modules():
        kind = HF_NORMS.get(type(m).__name__)
        if kind is not None:
            m.forward = types.MethodType(gemma if kind == "gemma" else llama, m)
    return model


# ---------------------------------------------------------------------------------------
# Every family: logits, loss and gradients against the unpatched model

@pytest.mark.parametrize("dtype", [f32, f64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_model_matches_unpatched(backend, family, dtype):
    base = build(family, dtype)
    patched = copy.deepcopy(base)
    norms = [n for n, m in base.named_modules() if is_norm(m)]
    report = gradops.patch(patched)
    assert [r.name for r in report.replaced] == norms and not report.left and not report.already
    kind = FAMILIES[family][3]
    for name in norms:
        m = patched.get_submodule(name)
        assert type(m) is REPLACEMENT[kind] and m.training
    assert not any(is_norm(m) for m in patched.modules())
    reference = hf_formula_in_input_dtype(copy.deepcopy(base)) if dtype == f64 and kind != "torch" else base
    inputs = batch(family)
    assert_same_run(run(patched, inputs), run(reference, inputs), TOLERANCE[dtype], f"{family} {dtype}")


def test_hf_rms_norms_are_float32_accurate_in_float64():
    """Why the float64 checks use the formula in float64: HF's RMSNorms cast a float64 input
    to float32 (llama, gemma) or compute its variance in float32 (t5), so they agree with
    their own formula only to float32's precision. gradops computes float64 in float64."""
    for family in ("llama", "gemma", "t5"):
        model = build(family, f64)
        norm = next(m for m in model.modules() if is_norm(m))
        x = torch.randn(4, HIDDEN, dtype=f64)
        exact = hf_formula_in_input_dtype(copy.deepcopy(nn.ModuleList([norm])))[0](x)
        err = rel_error(norm(x), exact)
        assert 1e-9 < err < 1e-6, f"{family}: {err:.2e}"


# ---------------------------------------------------------------------------------------
# Module by module: each class's forward for every dtype pair HF models meet

PAIRS = [(f32, f32), (bf16, bf16), (torch.float16, torch.float16), (bf16, f32), (f32, bf16)]


def _norm_instance(kind):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {"llama": LlamaRMSNorm(64), "gemma": GemmaRMSNorm(64), "t5": T5LayerNorm(64),
            "torch_rms": nn.RMSNorm(64, eps=1e-6), "torch_ln": nn.LayerNorm(64)}[kind]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, for bf16 x, fp32 w
@pytest.mark.parametrize("kind", ["llama", "gemma", "t5", "torch_rms", "torch_ln"])
def test_each_norm_class_rounds_as_its_forward(backend, kind):
    """Output dtype and rounding of every class against its own forward, for the dtype pairs
    of pure and mixed precision (a bf16 weight beside float32 input is T5's: its ``wo`` stays
    float32 in half-precision checkpoints). Half-precision outputs round the same way: at most
    1% of the elements one rounding step apart (the wrong casting mode gives ~25%; the CPU
    runs measured 0); gradients within the dtype's tolerance."""
    for x_dtype, w_dtype in PAIRS:
        if kind == "torch_ln" and x_dtype != w_dtype and x_dtype == f32:
            continue  # torch's own CPU LayerNorm refuses a half weight beside float32 input
        original = _norm_instance(kind)
        with torch.no_grad():
            original.weight.copy_(0.5 * torch.randn(64) + (0.0 if kind == "gemma" else 1.0))
        original = nn.ModuleList([original.to(w_dtype)])
        patched = copy.deepcopy(original)
        assert len(gradops.patch(patched)) == 1
        x = (3 * torch.randn(16, 64)).to(x_dtype)
        xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        if kind == "torch_ln" and x_dtype != w_dtype:
            # no torch LayerNorm call for this mix exists on both devices (promoted_layer_norm says why)
            ln = original[0]
            yo = promoted_layer_norm(xo, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        else:
            yo = original[0](xo)
        yp = patched[0](xp)
        what = f"{kind} x={x_dtype} w={w_dtype}"
        assert yp.dtype == yo.dtype, f"{what}: {yp.dtype} != {yo.dtype}"
        if yo.dtype in (bf16, torch.float16):
            assert (yp != yo).float().mean().item() <= 0.01, what
        assert rel_error(yp, yo) <= TOLERANCE[yo.dtype], what
        dy = torch.randn(yo.shape).to(yo.dtype)
        yo.backward(dy)
        yp.backward(dy)
        assert xp.grad.dtype == xo.grad.dtype and rel_error(xp.grad, xo.grad) <= TOLERANCE[x_dtype], what
        wo, wp = original[0].weight.grad, patched[0].weight.grad
        assert wp.dtype == wo.dtype
        assert rel_error(wp, wo) <= TOLERANCE[w_dtype], what


# ---------------------------------------------------------------------------------------
# Training, compile, checkpoints, unpatch

@pytest.mark.parametrize("dtype", [f32, f64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", ["llama", "gemma", "t5", "gpt2"])
def test_adamw_steps_stay_close(backend, family, dtype):
    """An optimizer built before patching keeps updating the parameters (the same objects);
    three AdamW steps of the patched and unpatched models give the same losses, and in
    float64 the same parameters. Not the parameters in float32: AdamW divides each gradient
    element by its own running RMS, so float32 rounding differences (1e-7 of a tensor's
    largest gradient) in elements with small gradients become update differences of up to
    ~1% of the learning rate (measured), whichever two float32 implementations are compared."""
    base = build(family, dtype)
    reference = hf_formula_in_input_dtype(base) if dtype == f64 and FAMILIES[family][3] != "torch" else base
    patched = copy.deepcopy(base)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt_pat = torch.optim.AdamW(patched.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in patched.named_parameters()}
    gradops.patch(patched)
    for step in range(3):
        inputs = batch(family, seed=10 + step)
        losses = []
        for model, opt in ((reference, opt_ref), (patched, opt_pat)):
            opt.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert rel_error(losses[1], losses[0]) <= TOLERANCE[dtype], f"step {step}"
    ref = dict(reference.named_parameters())
    for name, p in patched.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not move"
        if dtype == f64:
            assert rel_error(p, ref[name]) <= TOLERANCE[f64], name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patched_model_compiles_fullgraph(backend, family):
    """torch.compile(fullgraph=True) of the patched model (no graph break: the gradops norms are
    custom ops) gives the unpatched eager model's logits, loss and gradients. GPT-2 needs its
    ``loss_type`` named: transformers does not recognise GPT2LMHeadModel's and logs a warning
    inside forward, which dynamo cannot trace (a transformers matter, the same unpatched)."""
    base = build(family)
    patched = copy.deepcopy(base)
    patched.loss_type = "ForCausalLM"
    gradops.patch(patched)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
        inputs = batch(family)
        assert_same_run(run(compiled, inputs), run(base, inputs), TOLERANCE[f32], f"compiled {family}")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "gemma", "t5"])
def test_checkpoints_round_trip(family, tmp_path):
    """save_pretrained of a patched model writes the unpatched model's files (same keys, same
    values: a Gemma weight stays zero-centred); from_pretrained gives the HF model back, and
    patching it gives the patched model's outputs; load_state_dict works both ways."""
    from safetensors.torch import load_file

    base = build(family)
    patched = copy.deepcopy(base)
    gradops.patch(patched)
    base.save_pretrained(tmp_path / "base")
    patched.save_pretrained(tmp_path / "patched")
    saved_base = load_file(tmp_path / "base" / "model.safetensors")
    saved_patched = load_file(tmp_path / "patched" / "model.safetensors")
    assert saved_patched.keys() == saved_base.keys()
    for k in saved_base:
        assert torch.equal(saved_patched[k], saved_base[k]), k
    loaded = getattr(tf, FAMILIES[family][0]).from_pretrained(tmp_path / "patched").train()
    assert any(type(m).__name__ in HF_NORMS for m in loaded.modules())  # transformers' own classes
    report = gradops.patch(loaded)
    assert [r.name for r in report.replaced] == [n for n, m in base.named_modules() if is_norm(m)]
    inputs = batch(family)
    assert torch.equal(loaded(**inputs).logits, patched(**inputs).logits)
    base.load_state_dict(patched.state_dict(), strict=True)
    patched.load_state_dict(base.state_dict(), strict=True)


def test_unpatch_restores_the_original_modules():
    base = build("llama")
    originals = {n: m for n, m in base.named_modules() if is_norm(m)}
    weights = {n: m.weight for n, m in originals.items()}
    out_before = base(**batch("llama")).logits
    report = gradops.patch(base)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
    base(**batch("llama")).loss.backward()
    opt.step()
    base.eval()
    base.model.norm.eps = 1e-5
    out_patched = base(**batch("llama")).logits
    restored = gradops.unpatch(base)
    assert [r.name for r in restored.restored] == [r.name for r in report.replaced]
    assert "restored   5 x LlamaRMSNorm" in str(restored)
    for name, m in originals.items():
        assert base.get_submodule(name) is m  # the same object
        assert m.weight is weights[name] and not m.training  # the same (trained) parameter, the mode set since
    assert base.model.norm.variance_epsilon == 1e-5
    assert not torch.equal(out_before, out_patched)
    assert rel_error(base(**batch("llama")).logits, out_patched) <= TOLERANCE[f32]
    assert len(gradops.unpatch(base)) == 0  # nothing left to restore
    assert len(gradops.patch(base)) == len(originals)  # and it patches again


def test_activation_checkpointing_and_copies_of_a_patched_model(backend):
    """transformers' activation checkpointing (each decoder layer recomputed in backward) gives
    the same gradients patched; a deep copy of a patched model unpatches to copies of the
    originals holding the copy's parameters."""
    base = build("llama")
    patched = copy.deepcopy(base)
    gradops.patch(patched)
    for model in (base, patched):
        model.activation_checkpointing_enable()
    assert_same_run(run(patched, batch("llama")), run(base, batch("llama")), TOLERANCE[f32], "checkpointed")
    clone = copy.deepcopy(patched)
    assert len(gradops.unpatch(clone)) == 5
    norm = clone.model.norm
    assert type(norm).__name__ == "LlamaRMSNorm" and norm is not base.model.norm
    assert norm.weight is dict(clone.named_parameters())["model.norm.weight"]
    assert type(patched.model.norm) is gradops.nn.RMSNorm  # the copy's unpatch left the original alone


# ---------------------------------------------------------------------------------------
# bf16 models: logits to bf16 rounding

def _bf16_t5():
    """A T5 as transformers loads one in bf16: everything bf16 but the float32 ``wo``
    projections (T5's _keep_in_fp32_modules), so some norms see float32 input beside a bf16
    weight: T5RMSNorm's mixed path."""
    model = build("t5", bf16)
    for name, m in model.named_modules():
        if name.endswith(".wo"):
            m.float()
    return model


@pytest.mark.parametrize("family", ["llama", "gemma", "t5"])
def test_bf16_logits_match_to_bf16_rounding(backend, family):
    base = _bf16_t5() if family == "t5" else build(family, bf16)
    patched = copy.deepcopy(base)
    gradops.patch(patched)
    inputs = batch(family)
    with torch.no_grad():
        want, got = base(**inputs), patched(**inputs)
    assert got.logits.dtype == want.logits.dtype
    assert rel_error(got.logits, want.logits) <= TOLERANCE[bf16]
    assert rel_error(got.loss, want.loss) <= TOLERANCE[bf16]


# ---------------------------------------------------------------------------------------
# The report, what is left and why, hooks, arguments

class OwnLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 2


def test_report_lists_what_it_replaced_and_what_it_left():
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    shared = nn.LayerNorm(8)
    rebound = LlamaRMSNorm(8)
    rebound.forward = types.MethodType(lambda self, x: x, rebound)  # as Liger's instance patching does
    model = nn.ModuleDict({
        "a": shared, "b": nn.Sequential(shared, nn.RMSNorm(8)),
        "gemma3n": Gemma3nRMSNorm(8, with_scale=False), "group": nn.GroupNorm(2, 8), "own": OwnLayerNorm(8),
        "rebound": rebound, "mine": gradops.nn.RMSNorm(8), "linear": nn.Linear(8, 8),
    })
    report = gradops.patch(model)
    assert [(r.name, r.aliases) for r in report.replaced] == [("a", ("b.0",)), ("b.1", ())]
    assert model["a"] is model["b"][0] and type(model["a"]) is gradops.nn.LayerNorm
    assert model["b"][1].casting_mode == "gemma" and model["b"][1].offset == 0.0
    left = {r.name: r.reason for r in report.left}
    assert set(left) == {"gemma3n", "group", "own", "rebound"}
    assert "not verified" in left["gemma3n"] and "no GroupNorm" in left["group"]
    assert "subclass of torch.nn.LayerNorm" in left["own"] and "overridden on the instance" in left["rebound"]
    assert report.already == ["mine"]
    text = str(report)
    assert "replaced 2 module(s), left 4" in text and "gemma3n (Gemma3nRMSNorm)" in text
    assert report.as_dict()["replaced"][0]["replacement"] == "gradops.nn.LayerNorm"
    again = gradops.patch(model)  # a no-op on what it patched
    assert len(again) == 0 and set(again.already) == {"a", "b.1", "mine"}


def test_keyword_filters_and_argument_errors():
    model = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8))
    report = gradops.patch(model, layer_norm=False)
    assert [r.name for r in report.replaced] == ["1"] and report.left[0].reason == "layer_norm=False"
    with raises_status(ACLNN_ERR_PARAM_INVALID, "patch", "model", "list"):
        gradops.patch([model])
    with raises_status(ACLNN_ERR_PARAM_INVALID, "patch", "rms_norm"):
        gradops.patch(model, rms_norm="no")
    with raises_status(ACLNN_ERR_PARAM_INVALID, "unpatch", "model"):
        gradops.unpatch(None)
    assert gradops.patch(nn.LayerNorm(8)).left[0].name == ""  # the model itself: nothing to replace it in


def test_sharded_or_flattened_norms_are_left():
    """Patching after sharding would leave the sharder holding the original modules: a norm
    whose weight is a sharded DTensor (FSDP2) or was flattened away (FSDP1 with
    use_orig_params=False puts a plain tensor in the Parameter's place) is left, saying so.
    (A replicated DTensor weight, tensor parallelism's, is replaced: test_distributed_dtensor.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    flattened = nn.LayerNorm(8)
    weight = flattened._parameters.pop("weight").detach()
    flattened.weight = weight
    if dist.is_initialized():
        pytest.skip("a process group exists in this process already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = nn.LayerNorm(8)
        sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), init_device_mesh("cpu", (1,)),
                                                        [Shard(0)]))
        report = gradops.patch(nn.ModuleList([sharded, flattened]))
    finally:
        dist.destroy_process_group()
    assert len(report) == 0
    assert "sharded DTensors" in report.left[0].reason and "FSDP" in report.left[1].reason


def test_hooks_are_carried_over():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    seen = []
    handle = model[1].register_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    model[1].register_forward_pre_hook(lambda m, args: seen.append("pre"))
    gradops.patch(model)
    model(torch.randn(2, 8))
    assert seen == ["pre", "LayerNorm"] and type(model[1]) is gradops.nn.LayerNorm
    handle.remove()  # a handle made before patching removes the hook from the replacement
    model(torch.randn(2, 8))
    assert seen == ["pre", "LayerNorm", "pre"]


# ---------------------------------------------------------------------------------------
# The example

@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the example runs on CPU")
def test_example_runs():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GRADOPS_TEST_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "patch_hf_model.py")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gradops.patch: replaced 5 module(s), left 0" in proc.stdout
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) >= 3 and losses[-1] < losses[0]
