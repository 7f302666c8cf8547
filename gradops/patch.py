"""``gradops.patch(model)``: one line to run a model's norms, and FloydNet's attention, on gradops.

:func:`patch` walks a ``torch.nn.Module`` and replaces, in place, every norm module whose
semantics gradops has (the table below, docs/patch.md) by a :mod:`gradops.nn` module
holding the **same** ``Parameter`` objects: an optimizer built before patching keeps
updating them, dtypes, devices, ``requires_grad``, the training flag and the state_dict
keys are unchanged, so checkpoints (``save_pretrained``/``from_pretrained``,
``load_state_dict``) do not see the difference. :func:`unpatch` puts the original module
objects back.

=========================================================  ======================================================
class (``type(m)``)                                        replaced by
=========================================================  ======================================================
``torch.nn.LayerNorm`` (the class itself)                  ``gradops.nn.LayerNorm``
``torch.nn.RMSNorm`` (the class itself)                    ``gradops.nn.RMSNorm`` (``casting_mode="gemma"``: torch
                                                           computes x-hat and the weight product in float32 and
                                                           rounds once; ``eps`` kept, None included)
transformers ``LlamaRMSNorm``, ``MistralRMSNorm``,         ``gradops.nn.RMSNorm(casting_mode="llama")``, ``eps``
``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``Phi3RMSNorm``        from ``variance_epsilon``
transformers ``GemmaRMSNorm``, ``Gemma2RMSNorm``,          ``gradops.nn.RMSNorm(offset=1.0, casting_mode="gemma")``,
``Gemma3RMSNorm``                                          ``eps`` from ``eps``
transformers ``T5LayerNorm``                               :class:`T5RMSNorm`: ``casting_mode="llama"`` where that is
                                                           T5's forward (weight of the input's dtype, or float32
                                                           weight beside float64 input), else T5's own casts around
                                                           gradops' normalisation
=========================================================  ======================================================

GPT-2 and BERT use ``torch.nn.LayerNorm``. HuggingFace classes are recognised by name and
by ``type(m).__module__`` (``transformers.models.<family>.modeling_<family>``): this module
never imports transformers. Anything else whose class name says it is a norm (``...Norm``,
``...Norm2d``) is left as it is and listed in the report with the reason.

FloydNet's ``floydnet.PivotalAttentionBlock`` (recognised the same way: name and
``floydnet.transformer``; floydnet is imported only to unpickle an adopted block) is not
replaced but **adopted in place**: the instance's ``__class__`` becomes
``GradopsPivotalAttentionBlock``, a subclass built on first use whose only member is an
``attn`` that runs :func:`gradops.pivotal_attention` (FloydNet's signature and semantics)
where FloydNet's calls its own. The object, its parameters, submodules, hooks, state_dict and
training flag are untouched and ``isinstance`` still holds; :func:`unpatch` gives the class
back. Only FloydNet's class itself with the ``attn`` gradops verified (its source's sha256,
FloydNet 1.0.0 and 1.1.0) is adopted; docs/patch.md says what is left and why. The norms
inside a block are replaced as anywhere else.
"""
from __future__ import annotations

import hashlib
import inspect
import numbers
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from .nn import functional as GF
from .nn.modules import LayerNorm as _GLayerNorm
from .nn.modules import RMSNorm as _GRMSNorm
from .nn.modules import pair_attention as _pair_attention

__all__ = ["patch", "unpatch", "PatchReport", "UnpatchReport", "Replaced", "Left", "Restored", "T5RMSNorm"]

# The attribute (in the replacement's __dict__, so not a registered submodule: it is in no
# state_dict, named_modules or .to()) holding the module a replacement stands for.
_ORIGINAL = "_gradops_original"
_EPS_ATTR = "_gradops_eps_attr"  # the original's eps attribute name, synced back by unpatch

# Every hook table of torch.nn.Module. A replacement shares the original's tables (the same
# dict objects), so hooks registered before patching keep firing, their handles still remove
# them, and hooks registered on the replacement are on the original after unpatch.
_HOOK_TABLES = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_backward_hooks", "_backward_pre_hooks",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)
_HOOK_FLAGS = ("_is_full_backward_hook",)

_HALF = (torch.float16, torch.bfloat16)


class T5RMSNorm(_GRMSNorm):
    """transformers' ``T5LayerNorm`` on gradops (what :func:`patch` puts in its place).

    T5's forward computes ``x_hat = x * rsqrt(mean(x.float()**2) + eps)`` in
    ``promote(x.dtype, float32)``, rounds it to the **weight's** dtype when that is half,
    and returns ``weight * x_hat``. That is ``casting_mode="llama"`` (round x-hat to the
    *input's* dtype, multiply by the weight) exactly when the weight has the input's dtype,
    or is float32 beside float64 input: those calls run gradops' fused RMSNorm. Other pairs
    occur (T5 keeps its ``wo`` projections in float32 when loaded in half precision, so a
    bf16 weight meets float32 input): they get T5's casts and weight product in PyTorch
    around gradops' normalisation (weight-free RMSNorm, forward and backward), so the module
    computes T5's forward for every dtype pair.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, casting_mode="llama")

    def _fused(self, input: Tensor) -> bool:
        w = self.weight
        return w is None or w.dtype == input.dtype or (w.dtype == torch.float32 and input.dtype == torch.float64)

    def _t5(self, input: Tensor) -> Tensor:
        w = self.weight
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()  # exact
        h = GF.rms_norm(x, self.normalized_shape, None, self.eps, casting_mode="llama")
        if w.dtype in _HALF:
            h = h.to(w.dtype)
        return w * h

    def forward(self, input: Tensor, residual: Optional[Tensor] = None):
        if self._fused(input):
            return super().forward(input) if residual is None else super().forward(input, residual)
        if residual is None:
            return self._t5(input)
        summed = input + residual
        return self._t5(summed), summed


# ---------------------------------------------------------------------------------------
# What patch knows

@dataclass(frozen=True)
class _Kind:
    """How one class maps to gradops."""
    family: str          # "layer_norm" or "rms_norm" (the keyword filter that governs it)
    eps_attr: str        # the original's eps attribute
    describe: str        # the replacement, for the report
    build: Callable[[nn.Module, object], nn.Module]  # (original, eps) -> replacement (parameters on meta)


def _weight_shape(m: nn.Module) -> Tuple[int, ...]:
    return tuple(m.weight.shape)


def _meta_kwargs(m: nn.Module) -> dict:
    w = getattr(m, "weight", None)
    return {"device": "meta", "dtype": w.dtype if isinstance(w, Tensor) else None}


def _torch_layer_norm(m, eps):
    return _GLayerNorm(m.normalized_shape, eps, m.elementwise_affine, bias=m.bias is not None, **_meta_kwargs(m))


def _torch_rms_norm(m, eps):
    return _GRMSNorm(m.normalized_shape, eps, m.elementwise_affine, **_meta_kwargs(m))


def _llama_rms_norm(m, eps):
    return _GRMSNorm(_weight_shape(m), eps, True, **_meta_kwargs(m), casting_mode="llama")


def _gemma_rms_norm(m, eps):
    return _GRMSNorm(_weight_shape(m), eps, True, **_meta_kwargs(m), offset=1.0, casting_mode="gemma")


def _t5_layer_norm(m, eps):
    return T5RMSNorm(_weight_shape(m), eps, True, **_meta_kwargs(m))


_TORCH_KINDS = {
    nn.LayerNorm: _Kind("layer_norm", "eps", "gradops.nn.LayerNorm", _torch_layer_norm),
    nn.RMSNorm: _Kind("rms_norm", "eps", "gradops.nn.RMSNorm(casting_mode='gemma')", _torch_rms_norm),
}

_LLAMA = _Kind("rms_norm", "variance_epsilon", "gradops.nn.RMSNorm(casting_mode='llama')", _llama_rms_norm)
_GEMMA = _Kind("rms_norm", "eps", "gradops.nn.RMSNorm(offset=1.0, casting_mode='gemma')", _gemma_rms_norm)
_T5 = _Kind("rms_norm", "variance_epsilon", "gradops.patch.T5RMSNorm (casting_mode='llama' where it is T5's)",
            _t5_layer_norm)

# transformers class name -> (the models/ folder it must come from, kind). Read off each
# class's forward in transformers 5.23.0 (docs/patch.md quotes them).
_HF_KINDS: Dict[str, Tuple[str, _Kind]] = {
    "LlamaRMSNorm": ("llama", _LLAMA),
    "MistralRMSNorm": ("mistral", _LLAMA),
    "Qwen2RMSNorm": ("qwen2", _LLAMA),
    "Qwen3RMSNorm": ("qwen3", _LLAMA),
    "Phi3RMSNorm": ("phi3", _LLAMA),
    "GemmaRMSNorm": ("gemma", _GEMMA),
    "Gemma2RMSNorm": ("gemma2", _GEMMA),
    "Gemma3RMSNorm": ("gemma3", _GEMMA),
    "T5LayerNorm": ("t5", _T5),
}

# Class names that say "a norm": what patch lists as left when it does not replace it.
_NORM_NAME = re.compile(r"(Norm|Norm[123]d)$")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _hf_kind(cls: type) -> Optional[_Kind]:
    entry = _HF_KINDS.get(cls.__name__)
    if entry is None:
        return None
    folder, kind = entry
    return kind if cls.__module__ == f"transformers.models.{folder}.modeling_{folder}" else None


def _kind(module: nn.Module) -> Optional[_Kind]:
    cls = type(module)
    return _TORCH_KINDS.get(cls) or _hf_kind(cls)


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch build without distributed
        return False
    return isinstance(t, DTensor)


# Why a norm FSDP2 sharded is left (FSDP2 is what shards a norm's weight: tensor and sequence
# parallelism replicate it)
_FSDP2_SWAPS = ("FSDP2 keeps the module object it wraps and swaps the parameters on it at every forward, so a "
                "replacement would compute with the shards: patch before fully_shard")


def _sharded_placements(params) -> Optional[str]:
    """The placements of the first DTensor parameter that is not replicated, else None. Tensor
    and sequence parallelism replicate a norm's weight (``SequenceParallel``): such a module is
    replaced as any other, since the replacement holds the same parameters and hooks, and
    gradops' norms take DTensors (``gradops.distributed.sharding``)."""
    for p in params:
        if _is_dtensor(p) and not all(placement.is_replicate() for placement in p.placements):
            return f"placements {tuple(p.placements)}"
    return None


def _why_not(module: nn.Module, kind: _Kind) -> Optional[str]:
    """Why a module of a known class cannot be replaced as it is (None: it can)."""
    cls = type(module)
    if "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
        return ("its forward is overridden on the instance (an accelerate hook, Liger-Kernel's instance patch, "
                "...): patch before anything rebinds forward")
    fwd = getattr(cls.forward, "__module__", None)
    if fwd != cls.__module__:
        return f"its class's forward has been replaced (by {fwd}): gradops verified {cls.__name__}'s own"
    # exactly the parameters the class registers (torch: weight and bias or None; HF: weight), as
    # Parameters: FSDP1 (use_orig_params=False) removes them and sets plain tensors in their place
    expected = {"weight", "bias"} if cls is nn.LayerNorm else {"weight"}
    if set(module._parameters) != expected or module._buffers or module._modules:
        held = sorted(set(module._parameters) | set(module._buffers) | set(module._modules))
        return (f"it holds {held}, expected the parameters {sorted(expected)} only (wrapped or flattened, e.g. by "
                f"FSDP?)")
    params = [p for p in module._parameters.values() if p is not None]
    if any(not isinstance(p, nn.Parameter) for p in params):
        return "its weight is not an nn.Parameter"
    sharded = _sharded_placements(params)
    if sharded is not None:
        return f"its parameters are sharded DTensors ({sharded}): {_FSDP2_SWAPS} (or whatever sharded them)"
    if any(not p.is_floating_point() for p in params):
        return f"its parameters are {params[0].dtype}, not a floating dtype"
    if cls in _TORCH_KINDS:
        if module.elementwise_affine and module.weight is None:
            return "elementwise_affine is set but it has no weight"
        return None
    w = module._parameters["weight"]
    if w is None or w.dim() != 1:
        return "its weight is not a 1-D Parameter"
    eps = getattr(module, kind.eps_attr, None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"its {kind.eps_attr} is {eps!r}, expected a number"
    return None


def _fully_sharded_class(cls: type) -> Optional[type]:
    """The class FSDP2's ``fully_shard`` wrapped, where ``cls`` is the class it made
    (``FSDP<name>`` with the bases ``(FSDPModule, <class>)``), else None."""
    bases = cls.__bases__
    return bases[1] if len(bases) == 2 and bases[0].__name__ == "FSDPModule" else None


def _not_served(module: nn.Module) -> Optional[str]:
    """Why a module that looks like a norm is left (None: it does not look like one)."""
    cls = type(module)
    wrapped = _fully_sharded_class(cls)
    if wrapped is not None and (_TORCH_KINDS.get(wrapped) or _hf_kind(wrapped)):
        return f"FSDP2's fully_shard wrapped it (class {cls.__name__}): {_FSDP2_SWAPS}"
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        base = "torch.nn.LayerNorm" if isinstance(module, nn.LayerNorm) else "torch.nn.RMSNorm"
        return (f"a subclass of {base}, not the class itself: only torch's own class is replaced (a subclass may "
                f"change forward, or be checked for with isinstance)")
    if not _NORM_NAME.search(cls.__name__):
        return None
    if cls.__name__ in _HF_KINDS:
        return (f"its class is named like transformers' {cls.__name__} but is defined in {cls.__module__}, not "
                f"transformers.models.{_HF_KINDS[cls.__name__][0]}: its semantics are unverified")
    if cls.__module__.startswith("torch.nn."):
        return f"gradops has no {cls.__name__} (it serves LayerNorm and RMSNorm)"
    return ("a norm class gradops has not verified (its forward's casts, offset and weight handling are not in "
            "patch's table, docs/patch.md): left as it is")


# ---------------------------------------------------------------------------------------
# FloydNet's PivotalAttentionBlock: adopted in place, by swapping the instance's class

_FLOYD_MODULE = "floydnet.transformer"
_FLOYD_BLOCK = "PivotalAttentionBlock"
_FLOYD_PATCHED = "GradopsPivotalAttentionBlock"  # the adopted blocks' class, in this module (pickle finds it here)
_FLOYD_BASE = "_gradops_floydnet_base"  # in an adopted class's __dict__: the FloydNet class it derives from
_FLOYD_DESCRIBE = f"gradops.patch.{_FLOYD_PATCHED} (attn on gradops.pivotal_attention)"

# sha256 of inspect.getsource(PivotalAttentionBlock.attn) of the FloydNet releases whose attn
# gradops verified (the same source in 1.0.0 and 1.1.0): what an adopted block's attn
# (gradops.nn.modules.pair_attention) computes. Another version's attn is left until read.
_VERIFIED_FLOYD_ATTN = {
    "3ec72a0f157df30fbf09af825a214996488b6c29b730f7e2c6618cddf8b0d977": "floydnet 1.0.0, 1.1.0",
}
_floyd_attn_verdicts: Dict[object, Optional[str]] = {}  # FloydNet's attn function -> why not verified (None: it is)
_floyd_classes: Dict[type, type] = {}  # FloydNet's class -> its adopted subclass


def _gradops_attn(self, x: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
    """FloydNet's ``attn`` (c_qkv, five head views, pivotal attention with ``self.dropout``
    while training, heads merged, c_proj, dropout_fn) with :func:`gradops.pivotal_attention`."""
    return _pair_attention(self, x, attn_mask, None)


def _adopted_class(base: type) -> type:
    """The subclass of FloydNet's block class whose ``attn`` runs on gradops (built once)."""
    cls = _floyd_classes.get(base)
    if cls is None:
        cls = type(_FLOYD_PATCHED, (base,), {
            "__module__": __name__, "__qualname__": _FLOYD_PATCHED, _FLOYD_BASE: base, "attn": _gradops_attn,
            "__doc__": f"FloydNet's {base.__name__} whose attn runs gradops.pivotal_attention (gradops.patch).",
        })
        _floyd_classes[base] = cls
    return cls


def __getattr__(name: str):
    # PEP 562: unpickling an adopted block (torch.save of a patched model) finds its class
    # here; it is built on first use, so importing gradops never imports floydnet
    if name == _FLOYD_PATCHED:
        from floydnet.transformer import PivotalAttentionBlock

        return _adopted_class(PivotalAttentionBlock)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_floyd_class(cls: type) -> bool:
    return cls.__name__ == _FLOYD_BLOCK and cls.__module__ == _FLOYD_MODULE


def _floyd_adopted(module: nn.Module) -> bool:
    """An adopted block: its class is one :func:`_adopted_class` built (not a subclass of one)."""
    return _FLOYD_BASE in type(module).__dict__


def _floyd_like(module: nn.Module) -> bool:
    """FloydNet's block class, a subclass of it, or an adopted block (no import of floydnet)."""
    return any(_is_floyd_class(c) for c in type(module).__mro__)


def _floyd_attn_verdict(attn) -> Optional[str]:
    if attn not in _floyd_attn_verdicts:
        try:
            digest = hashlib.sha256(inspect.getsource(attn).encode()).hexdigest()
        except (OSError, TypeError):  # no source file (a zipped or compiled-only install)
            digest = None
        if digest in _VERIFIED_FLOYD_ATTN:
            verdict = None
        else:
            read = "its source cannot be read" if digest is None else "its source differs from"
            verdict = (f"this FloydNet's PivotalAttentionBlock.attn is not the one gradops verified ({read} "
                       f"{', '.join(sorted(_VERIFIED_FLOYD_ATTN.values()))}'s): its attention is left as it is")
        _floyd_attn_verdicts[attn] = verdict
    return _floyd_attn_verdicts[attn]


def _floyd_why_not(block: nn.Module) -> Optional[str]:
    """Why a FloydNet block (or a subclass) cannot be adopted as it is (None: it can)."""
    cls = type(block)
    if not _is_floyd_class(cls):
        adopted = any(_FLOYD_BASE in c.__dict__ for c in cls.__mro__)
        return (f"a subclass of {'gradops-adopted ' if adopted else ''}floydnet's {_FLOYD_BLOCK}, not the class "
                f"itself (yours, or FSDP2's fully_shard class: patch before sharding): a subclass may change attn "
                f"or forward")
    for name in ("attn", "forward"):
        if name in block.__dict__:
            return f"its {name} is overridden on the instance: patch before anything rebinds {name}"
    for name in ("attn", "forward"):
        fn = cls.__dict__.get(name)
        where = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
        if where != (_FLOYD_MODULE, f"{_FLOYD_BLOCK}.{name}"):
            return f"its class's {name} has been replaced (by {where[0]}): gradops verified FloydNet's own"
    verdict = _floyd_attn_verdict(cls.attn)
    if verdict is not None:
        return verdict
    # what the adopted attn reads (FloydNet's __init__ sets them; something may have changed them since)
    for name in ("num_heads", "head_dim"):
        value = getattr(block, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"its {name} is {value!r}, expected a positive int"
    dropout = getattr(block, "dropout", None)
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        return f"its dropout is {dropout!r}, expected a float"
    for name in ("c_qkv", "c_proj", "dropout_fn"):
        if not isinstance(getattr(block, name, None), nn.Module):
            return f"its {name} is not a module"
    if any(_is_dtensor(p) for p in block.parameters()):
        return ("its parameters are DTensors (sharded by FSDP2 or tensor parallelism): gradops' attention is "
                "unverified on them, patch before sharding")
    return None


# ---------------------------------------------------------------------------------------
# Reports

@dataclass(frozen=True)
class Replaced:
    """A module :func:`patch` replaced (or, a FloydNet block, adopted in place: the same
    object, its class swapped): qualified name, original class, replacement, other names the
    same module object is reachable under."""
    name: str
    original: str
    replacement: str
    aliases: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Left:
    """A norm-like module :func:`patch` left as it is, and why."""
    name: str
    cls: str
    reason: str


@dataclass(frozen=True)
class Restored:
    """A module :func:`unpatch` put back: qualified name, the gradops class it replaces, the
    original class."""
    name: str
    replacement: str
    original: str
    aliases: Tuple[str, ...] = ()


def _short(cls_name: str) -> str:
    return cls_name.rsplit(".", 1)[-1]


@dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced`` (:class:`Replaced`), ``left`` (:class:`Left`),
    and ``already`` (names of modules that were gradops modules already: patched before, or
    built as gradops.nn modules). ``print(report)`` gives a summary per class and every
    left module with its reason; :meth:`as_dict` is JSON-ready."""
    replaced: List[Replaced] = field(default_factory=list)
    left: List[Left] = field(default_factory=list)
    already: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.replaced)

    def as_dict(self) -> dict:
        return {"replaced": [asdict(r) for r in self.replaced], "left": [asdict(r) for r in self.left],
                "already": list(self.already)}

    def __str__(self) -> str:
        lines = [f"gradops.patch: replaced {len(self.replaced)} module(s), left {len(self.left)}"
                 + (f", {len(self.already)} already on gradops" if self.already else "")]
        groups: Dict[Tuple[str, str], List[str]] = {}
        for r in self.replaced:
            groups.setdefault((r.original, r.replacement), []).append(r.name)
        for (orig, repl), names in groups.items():
            names = [n or "<the model itself>" for n in names]
            shown = ", ".join(names[:4]) + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")
            lines.append(f"  replaced {len(names):>3} x {_short(orig)} -> {repl}: {shown}")
        for r in self.left:
            lines.append(f"  left     {r.name or '<the model itself>'} ({_short(r.cls)}): {r.reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<PatchReport: {len(self.replaced)} replaced, {len(self.left)} left, "
                f"{len(self.already)} already on gradops>")


@dataclass
class UnpatchReport:
    """What :func:`unpatch` put back: ``restored`` (:class:`Restored`)."""
    restored: List[Restored] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.restored)

    def as_dict(self) -> dict:
        return {"restored": [asdict(r) for r in self.restored]}

    def __str__(self) -> str:
        lines = [f"gradops.unpatch: restored {len(self.restored)} module(s)"]
        groups: Dict[str, List[str]] = {}
        for r in self.restored:
            groups.setdefault(r.original, []).append(r.name)
        for orig, names in groups.items():
            names = [n or "<the model itself>" for n in names]
            shown = ", ".join(names[:4]) + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")
            lines.append(f"  restored {len(names):>3} x {_short(orig)}: {shown}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<UnpatchReport: {len(self.restored)} restored>"


# ---------------------------------------------------------------------------------------
# The walk

def _edges(root: nn.Module) -> Iterator[Tuple[nn.Module, str, nn.Module, str]]:
    """(parent, key, child, qualified name) for every child slot, in named_modules' order,
    every slot of a shared module included; each module's children are walked once; a
    TorchScript module's children are not walked (they are compiled)."""
    seen = {id(root)}

    def walk(module: nn.Module, prefix: str):
        for key, child in list(module._modules.items()):
            if child is None:
                continue
            name = f"{prefix}.{key}" if prefix else key
            yield module, key, child, name
            if id(child) not in seen:
                seen.add(id(child))
                if not isinstance(child, torch.jit.ScriptModule):
                    yield from walk(child, name)

    if not isinstance(root, torch.jit.ScriptModule):
        yield from walk(root, "")


def _check_module(op: str, model) -> None:
    if not isinstance(model, nn.Module):
        raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                         f"{op}: model is a {type(model).__name__}, expected a torch.nn.Module")


def _replace(old: nn.Module, kind: _Kind) -> nn.Module:
    eps = getattr(old, kind.eps_attr)
    new = kind.build(old, eps)
    # the same Parameter objects (None included), not copies
    for pname in list(new._parameters):
        new._parameters[pname] = old._parameters.get(pname)
    new.training = old.training
    for table in _HOOK_TABLES + _HOOK_FLAGS:
        if table in old.__dict__:
            object.__setattr__(new, table, old.__dict__[table])
    if "_is_hf_initialized" in old.__dict__:  # transformers' "already initialised" mark
        object.__setattr__(new, "_is_hf_initialized", old.__dict__["_is_hf_initialized"])
    object.__setattr__(new, _ORIGINAL, old)
    object.__setattr__(new, _EPS_ATTR, kind.eps_attr)
    return new


def _floyd_decide(block: nn.Module, name: str, wanted: bool, report: PatchReport) -> bool:
    """Adopt a FloydNet block (or list why not, or count it as adopted already); returns
    whether it was adopted now."""
    if _floyd_adopted(block):
        report.already.append(name)
        return False
    reason = "floyd_attention=False" if not wanted else _floyd_why_not(block)
    if reason is not None:
        report.left.append(Left(name, _qualname(type(block)), reason))
        return False
    original = type(block)
    block.__class__ = _adopted_class(original)
    report.replaced.append(Replaced(name, _qualname(original), _FLOYD_DESCRIBE))
    return True


def patch(model: nn.Module, *, layer_norm: bool = True, rms_norm: bool = True,
          floyd_attention: bool = True) -> PatchReport:
    """Replace, in place, every norm module of ``model`` that gradops serves by a gradops
    module holding the same parameters; returns a :class:`PatchReport`.

    Replaced (docs/patch.md has the table and the evidence): ``torch.nn.LayerNorm`` and
    ``torch.nn.RMSNorm`` (the classes themselves, not subclasses), and transformers'
    Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma2, Gemma3 RMSNorms and T5LayerNorm
    (GPT-2 and BERT use torch.nn.LayerNorm). ``layer_norm=False`` / ``rms_norm=False`` leave
    the LayerNorms / the RMSNorms (T5LayerNorm is an RMSNorm) as they are.

    FloydNet's ``PivotalAttentionBlock``s are adopted in place (the module docstring): their
    ``attn`` then runs :func:`gradops.pivotal_attention`; the model itself may be one.
    ``floyd_attention=False`` leaves them as they are.

    The replacement keeps the original's Parameter objects (an optimizer built before keeps
    updating them), training flag, state_dict keys and hooks (the same hook tables: forward,
    pre-forward, backward, state_dict hooks keep firing, with the replacement as their
    ``module`` argument, and their handles still remove them). A module shared under several
    names is replaced by one module under all of them. Modules that are gradops modules
    already are counted in ``report.already`` (patching twice changes nothing), and a module
    whose class says it is a norm but that patch does not replace is listed in
    ``report.left`` with the reason. Patch before wrapping the model (DDP, FSDP,
    torch.compile, accelerate's device_map dispatch), as with any change of modules.
    """
    _check_module("patch", model)
    for name, value in (("layer_norm", layer_norm), ("rms_norm", rms_norm), ("floyd_attention", floyd_attention)):
        if not isinstance(value, bool):
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"patch: {name} is {value!r}, expected True or False")
    wanted = {"layer_norm": layer_norm, "rms_norm": rms_norm}
    report = PatchReport()
    if _floyd_like(model):  # adopted in place: the model itself needs no parent
        _floyd_decide(model, "", floyd_attention, report)
    elif _kind(model) is not None or _not_served(model) is not None:
        report.left.append(Left("", _qualname(type(model)),
                                "the model is itself a norm: patch replaces modules inside a model (use "
                                "gradops.nn.LayerNorm/RMSNorm directly)"))
    seen = set()  # id(module) of every module decided on
    replacement: Dict[int, Tuple[nn.Module, int]] = {}  # id(original) -> (replacement, index in report.replaced)
    for parent, key, child, name in _edges(model):
        ident = id(child)
        if ident in replacement:  # another slot of a module already replaced
            new, i = replacement[ident]
            parent._modules[key] = new
            r = report.replaced[i]
            report.replaced[i] = Replaced(r.name, r.original, r.replacement, r.aliases + (name,))
            continue
        if ident in seen:
            continue
        seen.add(ident)
        if isinstance(child, (_GLayerNorm, _GRMSNorm)):
            report.already.append(name)
            continue
        if _floyd_like(child):
            if _floyd_decide(child, name, floyd_attention, report):
                replacement[ident] = (child, len(report.replaced) - 1)  # the same object, under its other names too
            continue
        kind = _kind(child)
        reason = _not_served(child) if kind is None else (
            f"{kind.family}=False" if not wanted[kind.family] else _why_not(child, kind))
        if reason is not None:
            report.left.append(Left(name, _qualname(type(child)), reason))
            continue
        if kind is None:
            continue
        new = _replace(child, kind)
        parent._modules[key] = new
        replacement[ident] = (new, len(report.replaced))
        report.replaced.append(Replaced(name, _qualname(type(child)), kind.describe))
    return report


def _floyd_restore(block: nn.Module, name: str, report: UnpatchReport) -> bool:
    """Give an adopted FloydNet block its class back; returns whether it was one."""
    adopted = type(block)
    base = adopted.__dict__.get(_FLOYD_BASE)  # (not inherited: a class made from an adopted one since is left)
    if base is None:
        return False
    block.__class__ = base
    report.restored.append(Restored(name, _qualname(adopted), _qualname(base)))
    return True


def unpatch(model: nn.Module) -> UnpatchReport:
    """Put back every module :func:`patch` replaced in ``model``: the original objects,
    holding the replacement's current parameters (the same Parameter objects, unless
    something re-created them since, e.g. ``load_state_dict(assign=True)``), training flag,
    eps and hook tables; adopted FloydNet blocks get FloydNet's class back (the model itself
    too). Returns an :class:`UnpatchReport`; modules gradops did not patch (gradops.nn
    modules built as such included) stay as they are."""
    _check_module("unpatch", model)
    report = UnpatchReport()
    restored: Dict[int, Tuple[nn.Module, int]] = {}  # id(replacement) -> (original, index in the report)
    if _floyd_restore(model, "", report):
        restored[id(model)] = (model, len(report.restored) - 1)
    for parent, key, child, name in _edges(model):
        ident = id(child)
        if ident in restored:
            original, i = restored[ident]
            parent._modules[key] = original
            r = report.restored[i]
            report.restored[i] = Restored(r.name, r.replacement, r.original, r.aliases + (name,))
            continue
        if _floyd_restore(child, name, report):
            restored[ident] = (child, len(report.restored) - 1)
            continue
        original = child.__dict__.get(_ORIGINAL)
        if original is None:
            continue
        for pname in list(original._parameters):
            original._parameters[pname] = child._parameters.get(pname)
        original.training = child.training
        eps_attr = child.__dict__.get(_EPS_ATTR)
        if eps_attr and getattr(original, eps_attr, None) != child.eps:
            setattr(original, eps_attr, child.eps)
        for table in _HOOK_TABLES + _HOOK_FLAGS:
            if table in child.__dict__:
                object.__setattr__(original, table, child.__dict__[table])
        parent._modules[key] = original
        restored[ident] = (original, len(report.restored))
        report.restored.append(Restored(name, _qualname(type(child)), _qualname(type(original))))
    return report

