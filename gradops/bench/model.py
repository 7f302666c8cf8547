"""``gradops bench model``: one training step of a HuggingFace model, unpatched, patched by
gradops and patched by Liger-Kernel.

A step is what a training loop does per batch: forward with labels, backward, AdamW step,
``zero_grad``. For every (model, dtype) case the implementations run side by side in this
process, each on its own deep copy of one randomly initialised model (same weights, same
batch):

* ``unpatched``: transformers' own modules;
* ``gradops``: the same model after ``gradops.patch(model)`` (its norms on gradops; the rest
  unchanged), with ``backend="triton"`` on a GPU and the reference backend on a CPU (the
  Triton kernels through the interpreter with ``--interpret``);
* ``liger norms``: Liger-Kernel's ``_apply_liger_kernel_to_instance(model, rms_norm=True,
  everything else False)``, its RMSNorm only, what gradops.patch replaces;
* ``liger all``: the same with Liger's defaults (RMSNorm, RoPE, SwiGLU, fused linear
  cross-entropy), for scale;
* with ``--compile``: ``unpatched`` and ``gradops`` again under ``torch.compile`` (their cases
  say ``compiled=True``), the ratio a torch.compile user sees.

Liger needs ``liger_kernel`` and a GPU (its Triton kernels would run on a CPU only through the
Triton interpreter, whose times mean nothing) and has no patch for GPT-2: where it cannot
run, its records say why and hold no time. Liger patches transformers' modules for the whole
process (``modeling_llama.LlamaRMSNorm``, ``LlamaForCausalLM.forward``, ...), so every liger
measurement runs after every other one. Each record keeps the first step's loss
(``extra["loss"]``), which must agree across implementations. Models: a Llama (RMSNorm) and
a GPT-2 (LayerNorm), sized by ``--hidden/--layers/--seq/--batch/--vocab`` (defaults below:
a small model on a GPU, a tiny one on a CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import harness
from .harness import DTYPES, OURS, Run

FAMILY = "model"
OP = "train_step"
MODELS = ("llama", "gpt2")
LIGER = ("liger norms", "liger all")
PLOT = dict(x_key="hidden", metric="median_ms", group_keys=("model", "dtype"))
# (hidden, layers, seq, batch, vocab)
GPU_SIZE = (2048, 4, 1024, 4, 32000)
CPU_SIZE = (256, 2, 128, 2, 1024)
QUICK_SIZE = (64, 2, 32, 2, 128)
LR = 1e-4
# No goal of docs/benchmarks.md is set on a whole step: its ratios (a peer's step over the patched
# one) are reported, in `gradops bench all`'s summary too.
GOALS = ()


def _size(args) -> Tuple[int, int, int, int, int]:
    default = QUICK_SIZE if args.quick else (GPU_SIZE if args.device == "cuda" else CPU_SIZE)
    given = (args.hidden, args.layers, args.seq, args.batch, args.vocab)
    return tuple(g if g is not None else d for g, d in zip(given, default))


def build(name: str, hidden: int, layers: int, seq: int, vocab: int, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``name`` model in training mode (no download)."""
    import transformers as tf

    torch.manual_seed(seed)
    heads = max(1, hidden // 64) if hidden >= 64 else 2
    if name == "llama":
        config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 32 * 32
                                or 4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                num_key_value_heads=max(1, heads // 4) if heads % 4 == 0 else heads,
                                max_position_embeddings=max(seq, 64))
        model = tf.LlamaForCausalLM(config)
    elif name == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                               n_positions=max(seq, 64), bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # transformers does not recognise GPT-2's and warns at every step
    else:
        raise ValueError(name)
    return model.train()


def liger_unusable(name: str, device: str) -> Optional[str]:
    """Why Liger-Kernel cannot be measured on ``name`` here (None: it can)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as e:
        return f"liger_kernel is not importable ({type(e).__name__}: {e})"[:200]
    if name not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"Liger-Kernel has no patch for {name} models"
    if device != "cuda":
        return ("Liger-Kernel's Triton kernels need a GPU (on a CPU they would run only through the Triton "
                "interpreter, whose times mean nothing)")
    return None


def _apply_liger(impl: str, model: torch.nn.Module) -> None:
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    if impl == "liger norms":
        _apply_liger_kernel_to_instance(model, rms_norm=True, rope=False, swiglu=False, cross_entropy=False,
                                        fused_linear_cross_entropy=False, layer_norm=False)
    else:
        _apply_liger_kernel_to_instance(model)


def training_step(model: torch.nn.Module, inputs: dict, backend: Optional[str]) -> Callable[[], torch.Tensor]:
    """A zero-argument training step of ``model`` with its own AdamW, gradops' default
    backend set to ``backend`` while it runs (None: left as it is)."""
    import gradops

    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> torch.Tensor:
        with gradops.use_backend(backend) if backend else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            loss = model(**inputs).loss
            loss.backward()
            opt.step()
        return loss

    return step


def cases(args) -> List[Tuple[str, str]]:
    return [(m, dt) for m in args.models for dt in args.dtypes]


def impl_names(args) -> List[str]:
    return ["unpatched", OURS, *LIGER]


def optional_peers(device: str) -> Dict[str, Optional[str]]:
    why = liger_unusable("llama", device)
    return {name: why for name in LIGER}


def run(args) -> Run:
    import gradops

    device = args.device
    backend = args.backend or harness.ours_backend(args)
    hidden, layers, seq, batch, vocab = _size(args)
    result = Run(FAMILY, device, args.deadline)
    result.meta.update(backend_ours=backend, hidden=hidden, layers=layers, seq=seq, batch=batch, vocab=vocab,
                       optimizer=f"AdamW(lr={LR})")
    try:
        import transformers

        result.meta["transformers"] = transformers.__version__
    except Exception:  # the harness records the failure of each case
        result.meta["transformers"] = None
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        result.meta["liger_kernel"] = version("liger-kernel")
    except Exception:
        result.meta["liger_kernel"] = None
    measure_kw = dict(reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds, flush_l2=False,
                      memory=device == "cuda")

    def case_of(name, dt, compiled=False):
        case = {"model": name, "dtype": dt, "hidden": hidden, "layers": layers, "batch": batch, "seq": seq}
        return dict(case, compiled=True) if compiled else case

    def make_inputs():
        gen = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
        return {"input_ids": ids, "labels": ids}

    def measure(case, impl, model, impl_backend, extra):
        """Time a training step of ``model`` (after its first loss, kept in the record)."""
        inputs = make_inputs()
        try:
            first = _first_loss(model, inputs, impl_backend)
        except Exception as e:  # a failing implementation is a result, not a crash
            return result.add(harness.Record(OP, case, impl, [], error=f"{type(e).__name__}: {e}"[:300]))
        rec = result.time(OP, case, impl, training_step(model, inputs, impl_backend), **measure_kw)
        rec.extra.update(extra, first_loss=first)
        if device == "cuda":
            torch.cuda.empty_cache()
        return rec

    # Phase 1: unpatched and gradops, eagerly, for every case; phase 2 (--compile): both again under
    # torch.compile; phase 3: Liger, which patches transformers process-wide (nothing measured after
    # it could be one it changed). A spent budget cuts the phases from the end.
    bases: Dict[Tuple[str, str], torch.nn.Module] = {}
    reports: Dict[Tuple[str, str], dict] = {}
    for name, dt in harness.progress(cases(args), "bench model"):
        case = case_of(name, dt)
        if result.out_of_time():
            result.skip([OP], case, "unpatched")
            result.skip([OP], case)
            continue
        try:
            base = bases[(name, dt)] = build(name, hidden, layers, seq, vocab).to(device=device, dtype=DTYPES[dt])
        except Exception as e:
            result.add(harness.Record(OP, case, OURS, [], error=f"{type(e).__name__}: {e}"[:300]))
            continue
        measure(case, "unpatched", copy.deepcopy(base), None, {})
        model = copy.deepcopy(base)
        report = gradops.patch(model)
        reports[(name, dt)] = {"patched": len(report.replaced), "left": [f"{r.name}: {r.reason}" for r in report.left]}
        measure(case, OURS, model, backend, reports[(name, dt)])
        del model
    if args.compile:
        # torch.compile of each: gradops' norm forwards reach Inductor as Triton ops, their backwards as
        # custom ops (issue 24)
        for name, dt in cases(args):
            case = case_of(name, dt, compiled=True)
            if (name, dt) not in bases:
                continue  # its eager record holds why it could not be built
            if result.out_of_time():
                result.skip([OP], case, "unpatched")
                result.skip([OP], case)
                continue
            measure(case, "unpatched", torch.compile(copy.deepcopy(bases[(name, dt)])), None, {})
            model = copy.deepcopy(bases[(name, dt)])
            gradops.patch(model)
            measure(case, OURS, torch.compile(model), backend, reports[(name, dt)])
            del model
    for impl in LIGER:
        for name, dt in cases(args):
            case = case_of(name, dt)
            why = liger_unusable(name, device)
            if why is not None:
                result.add(harness.Record(OP, case, impl, [], error=f"skipped: {why}"))
                continue
            if (name, dt) not in bases:
                continue
            if result.out_of_time():
                result.skip([OP], case, impl)
                continue
            model = copy.deepcopy(bases[(name, dt)])
            try:
                _apply_liger(impl, model)
            except Exception as e:
                result.add(harness.Record(OP, case, impl, [], error=f"{type(e).__name__}: {e}"[:300]))
                continue
            measure(case, impl, model, None, {})
            del model
    result.meta["loss_disagreements"] = check_losses(result)
    return result


def _first_loss(model, inputs, backend) -> float:
    """The loss of the model as built (no step taken), in eval mode (no dropout), on
    ``backend``: the same for every implementation of a case, up to rounding."""
    import gradops

    model.eval()
    try:
        with torch.no_grad(), (gradops.use_backend(backend) if backend else contextlib.nullcontext()):
            return float(model(**inputs).loss)
    finally:
        model.train()


def check_losses(result: Run) -> List[str]:
    """Cases whose implementations disagree on the first loss by more than the dtype allows."""
    from ..oracles import TOLERANCE

    by_case: Dict[Tuple[str, str, bool], Dict[str, float]] = {}
    for r in result.records:
        if "first_loss" in r.extra:
            key = (r.case["model"], r.case["dtype"], bool(r.case.get("compiled")))
            by_case.setdefault(key, {})[r.impl] = r.extra["first_loss"]
    problems = []
    for (model, dt, compiled), losses in by_case.items():
        want = losses.get("unpatched")
        dtype = DTYPES[dt]
        case = f"{model} {dt}" + (" compiled" if compiled else "")
        for impl, got in losses.items():
            if want is not None and abs(got - want) > 4 * TOLERANCE[dtype] * abs(want):
                problems.append(f"{case}: {impl} first loss {got:.6g} != unpatched {want:.6g}")
    return problems


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gradops bench model", description=__doc__.split("\n\n")[0])
    harness.add_common_args(p, dtypes=("bfloat16", "float16", "float32"),
                            dtype_help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--hidden", type=int, default=None,
                   help=f"hidden size (default {GPU_SIZE[0]} on a GPU, {CPU_SIZE[0]} on a CPU, {QUICK_SIZE[0]} "
                        f"with --quick)")
    p.add_argument("--layers", type=int, default=None, help=f"layers (default {GPU_SIZE[1]})")
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (default {GPU_SIZE[2]} on a GPU)")
    p.add_argument("--batch", type=int, default=None, help=f"batch size (default {GPU_SIZE[3]} on a GPU)")
    p.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {GPU_SIZE[4]} on a GPU)")
    p.add_argument("--backend", choices=("triton", "reference"), default=None,
                   help="gradops' backend (default: triton on a GPU or with --interpret, reference on a CPU)")
    p.add_argument("--compile", action="store_true",
                   help="also time both under torch.compile (unpatched and gradops-patched; cases with compiled=True)")
    return p.parse_args(argv)


def prepare(args, need_device: bool = True):
    return harness.prepare(args, reps=20, warmup=3, max_seconds=10.0, quick_reps=3, quick_warmup=1,
                           quick_max_seconds=2.0, need_device=need_device, gpu_dtypes=("bfloat16",),
                           cpu_dtypes=("float32",))


def main(argv=None) -> int:
    args = prepare(parse_args(sys.argv[1:] if argv is None else list(argv)))
    harness.announce(args, FAMILY)
    result = run(args)
    problems = result.meta["loss_disagreements"]
    harness.finish(result, args, FAMILY, PLOT, GOALS)
    for p in problems:
        print(f"gradops bench model: {p}", file=sys.stderr)
    return max(result.exit_status(), 1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
