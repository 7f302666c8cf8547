"""A CPU stand-in for the test device: catches, in a CPU run (CI has no GPU), a test that
would build or compare its data off the test device when GRADOPS_TEST_DEVICE=cuda.

On a GPU run the tensors a test means to put on the test device (``device=device``,
``.to(device)``, or no device at all under the ``backend`` fixture, which makes the test
device torch's default) are CUDA tensors, and the ones it builds on the CPU (explicitly, or
with no device outside that fixture, from NumPy, with ``.cpu()``) stay on the CPU. On a CPU
run they are all CPU tensors, so nothing fails when a test mixes them; on a GPU the same test
fails before it checks anything (the first GPU run, 2026-11-25: 234 failures of this kind).

This module tags every tensor made during a test as on the *test* device or on the *host*,
by the rules above, follows the tags through torch calls (a ``TorchFunctionMode``), and
raises :class:`DeviceGuardError` where a GPU would raise:

- a factory call drawing from a CPU ``torch.Generator`` onto the test device ("Expected a
  'cuda' device type for generator");
- a call mixing a test-device tensor with a host tensor that is not a 0-dim scalar
  ("Expected all tensors to be on the same device"), except the calls that move data
  (``copy_``, ``to``, indexing a test-device tensor with host indices);
- ``.numpy()`` of a test-device tensor;
- torch's LayerNorm on the test device with what only its CPU kernel accepts (CUDA refuses
  half input with float32 weight or bias, and half statistics in the backward: torch 2.11).

and a host tensor reports ``cpu:0`` as its device while the test device is the default, so
every device rule (gradops' 161002, ``torch.testing.assert_close``) sees two devices as it
would on a GPU.

What it cannot place it leaves untagged, and an untagged tensor is never blamed: tensors made
before the test (module constants, module- or session-scoped fixtures), by torch's C++
(autograd's outputs, saved tensors), or moved to a device given as a plain ``torch.device``
or a string made from the test device's name (``torch.device(device)``, ``str(device)``).
So it can miss a mix; it aims never to report one a GPU would not. Its other limits: a CUDA
generator drawing onto the host, values written into a test-device tensor from a host one
(``index_put_``), and anything a GPU does differently for reasons other than placement (its
SM count, its rounding, its RNG under torch.compile) are not modelled.

``tests/conftest.py`` installs it for CPU runs (``GRADOPS_DEVICE_GUARD=0`` turns it off);
``tests/test_device_guard.py`` shows what it catches.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

TEST, HOST = "test device", "host"
_TAG = "_gradops_device_guard"
_HOST_DEVICE = torch.device("cpu", 0)  # what a host tensor reports while the test device is the default

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# found, not imported: conftest sets TRITON_INTERPRET before triton is first imported
_TRITON_SPEC = importlib.util.find_spec("triton")
_TRITON_DIR = os.path.dirname(_TRITON_SPEC.origin) + os.sep if _TRITON_SPEC and _TRITON_SPEC.origin else None


class DeviceGuardError(RuntimeError):
    """What a GPU run would raise, found on the CPU."""


class DeviceName(str):
    """The test device's name (``conftest.TEST_DEVICE``, the ``device`` fixture): a ``str``
    equal to "cpu" or "cuda", which the guard tells apart from a literal "cpu"."""


def tag_of(t):
    return getattr(t, _TAG, None)


def _set_tag(t, tag):
    if tag is not None and isinstance(t, torch.Tensor):
        try:
            setattr(t, _TAG, tag)
        except (AttributeError, RuntimeError):  # a tensor type without a __dict__
            pass


_T = torch.Tensor
# calls a GPU allows across devices: the moves, and Module._apply's type query
_MOVES = {_T.copy_, _T.to, _T.cpu, _T.cuda, _T.set_, _T.__setitem__, torch._has_compatible_shallow_copy_type}
_LN_FORWARD = {torch.nn.functional.layer_norm, torch.layer_norm, torch.native_layer_norm}
_HALF = (torch.float16, torch.bfloat16)


def _descriptor(func):
    """The Tensor property behind ``func`` (``device``, ``grad``, ``data``), else None."""
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) if type(owner).__name__ == "getset_descriptor" else None


def _tensors(args, kwargs):
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for u in v:
                if isinstance(u, torch.Tensor):
                    yield u


def _origin(depth: int = 2) -> str:
    """Who made the torch call: "test", "triton" (the interpreter's own bookkeeping, which a
    GPU run never does) or "library" (gradops, transformers, floydnet, ...); torch's own
    Python frames (nn modules, F.*, testing) are looked through."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
        f = f.f_back
    name = f.f_code.co_filename if f is not None else ""
    if name.startswith(_TESTS_DIR):
        return "test"
    if _TRITON_DIR and name.startswith(_TRITON_DIR):
        return "triton"
    return "library"


class DeviceGuard(TorchFunctionMode):
    """The mode; one per test. ``default_is_test_device`` is set by the ``backend`` fixture
    where a GPU run enters ``torch.device(TEST_DEVICE)``."""

    def __init__(self):
        super().__init__()
        self.default_is_test_device = False
        self._devices = {}  # id(torch.device) -> (the object, kept alive; its tensor's tag)

    # ---------------------------------------------------------------- where a tensor is
    def device_tag(self, device):
        """The tag a ``device=`` argument gives (None: cannot tell)."""
        if device is None:
            return None
        if isinstance(device, DeviceName):
            return TEST
        if isinstance(device, str):
            return TEST if device.startswith("cuda") else HOST if device.startswith("cpu") else None
        if isinstance(device, torch.device):
            known = self._devices.get(id(device))
            if known is not None and known[0] is device:
                return known[1]
            if device.type == "cuda":
                return TEST
            if device == _HOST_DEVICE:
                return HOST
        return None

    def _default_tag(self):
        return TEST if self.default_is_test_device else HOST

    def _target_of_move(self, func, args, kwargs):
        """(whether ``t.to(...)``, ``t.cpu()``, ``t.cuda()`` names a place, the tag of that
        place: None where the guard cannot tell)."""
        if func is _T.cpu:
            return True, HOST
        if func is _T.cuda:
            return True, TEST
        for v in (*args[1:], *kwargs.values()):
            if isinstance(v, torch.Tensor):
                return True, tag_of(v)
            if isinstance(v, (str, torch.device)):
                return True, self.device_tag(v)
        return False, None

    # ---------------------------------------------------------------------------- the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        prop = _descriptor(func)
        if prop is not None:
            return self._property(prop, func, args)
        origin = _origin()
        if origin == "triton":
            return func(*args, **kwargs)
        tensors = list(_tensors(args, kwargs))
        tags = {tag_of(t) for t in tensors}
        if func in (_T.to, _T.cpu, _T.cuda):
            return self._move(func, args, kwargs)
        if kwargs.get("device") is not None:  # where the call puts its result, whatever it reads
            tag = self.device_tag(kwargs["device"])
        elif not tensors:  # a factory on the default device
            tag = self._default_tag()
        elif TEST in tags:
            tag = TEST
        else:
            tag = HOST if HOST in tags else None
        self._check(func, args, kwargs, tensors, tags, tag, origin)
        out = func(*args, **kwargs)
        if kwargs.get("device") is not None and any(out is u for u in tensors) and tag_of(out) != tag:
            out = out.clone()  # as_tensor(t, device=...) of another device makes another tensor on a GPU
            _set_tag(out, tag)
        if tag is not None:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                # a result that is one of the inputs (in place, out=) stays where it was
                if isinstance(t, torch.Tensor) and tag_of(t) is None and not any(t is u for u in tensors):
                    _set_tag(t, tag)
        return out

    def _property(self, prop, func, args):
        t = args[0]
        if prop == "data" and func.__name__ == "__set__":  # param.data = moved (Module.to)
            func(*args)
            _set_tag(t, tag_of(args[1]))
            return None
        out = func(*args)
        tag = tag_of(t)
        if prop == "device" and tag is not None:
            if tag == HOST and self.default_is_test_device and out.type == "cpu":
                out = _HOST_DEVICE
            self._devices[id(out)] = (out, tag)
        elif prop in ("grad", "data") and isinstance(out, torch.Tensor) and tag_of(out) is None:
            _set_tag(out, tag)
        return out

    def _move(self, func, args, kwargs):
        t = args[0]
        named, target = self._target_of_move(func, args, kwargs)
        out = func(*args, **kwargs)
        if not named:  # a dtype or layout change stays where it is
            target = tag_of(t)
        if out is t:
            if tag_of(t) == target:
                return out
            out = out.clone()  # on a GPU the moved tensor is another tensor; the original stays
        _set_tag(out, target)  # a place the guard cannot tell leaves it untagged: never blamed
        return out

    def _check(self, func, args, kwargs, tensors, tags, tag, origin):
        where = f"{getattr(func, '__qualname__', func)} (called from {'the test' if origin == 'test' else 'a library'})"
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu" and tag == TEST:
            raise DeviceGuardError(
                f"{where} draws from a CPU torch.Generator onto the test device: with GRADOPS_TEST_DEVICE=cuda "
                f"this raises (\"Expected a 'cuda' device type for generator\"). Draw on the CPU "
                f"(device=\"cpu\") and move the result to the test device.")
        if TEST in tags and HOST in tags and func not in _MOVES:
            hosts = [t for t in tensors if tag_of(t) == HOST and t.dim() > 0]
            if func is _T.__getitem__:  # a test-device tensor indexed with host indices is fine
                hosts = hosts if tag_of(args[0]) == HOST else []
            if hosts:
                raise DeviceGuardError(
                    f"{where} mixes tensors on the test device with a host tensor of shape "
                    f"{tuple(hosts[0].shape)}: with GRADOPS_TEST_DEVICE=cuda this raises (\"Expected all tensors "
                    f"to be on the same device\"). Build both on the test device, or move both to the CPU.")
        if func is _T.numpy and tag_of(args[0]) == TEST and origin == "test":
            raise DeviceGuardError(f"{where}: .numpy() of a tensor on the test device raises on a GPU; "
                                   f"call .cpu() first")
        self._check_cuda_layer_norm(func, args, kwargs, where)

    def _on_test_device(self, t):
        tag = tag_of(t)
        return tag == TEST or (tag is None and self.default_is_test_device)

    def _check_cuda_layer_norm(self, func, args, kwargs, where):
        """torch's CUDA LayerNorm takes weight and bias in the input's dtype and, backward,
        statistics in its accumulation dtype; its CPU kernel also takes float32 weights and
        half statistics beside half input (torch 2.11, the GPU image's)."""
        name = getattr(func, "__name__", "")
        if func in _LN_FORWARD or name == "native_layer_norm":
            x = args[0] if args else kwargs.get("input")
            rest = list(args[2:4]) + [kwargs.get("weight"), kwargs.get("bias")]
            stats = []
        elif name == "native_layer_norm_backward":
            x = args[1]
            rest = list(args[5:7])
            stats = list(args[3:5])
        else:
            return
        if not isinstance(x, torch.Tensor) or not self._on_test_device(x):
            return
        if any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda")):
            return  # autocast runs layer_norm in float32: the inputs arrive cast
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        for t in rest:
            if isinstance(t, torch.Tensor) and t.dtype != x.dtype:
                raise DeviceGuardError(
                    f"{where}: torch's CUDA LayerNorm refuses {x.dtype} input with {t.dtype} weight or bias "
                    f"(only its CPU kernel takes them): use an oracle that exists on both devices")
        for t in stats:
            if isinstance(t, torch.Tensor) and t.dtype != acc:
                raise DeviceGuardError(
                    f"{where}: torch's CUDA LayerNorm backward refuses {t.dtype} statistics (it needs {acc}; only "
                    f"its CPU kernel takes x's dtype): use an oracle that exists on both devices")


_active: "DeviceGuard | None" = None


def _made_on_the_host(factory):
    """``torch.from_numpy`` / ``torch.frombuffer`` (which no TorchFunctionMode sees): a tensor
    a test makes from NumPy or bytes is on the host on every device."""
    def wrapper(*args, **kwargs):
        out = factory(*args, **kwargs)
        if _active is not None and _origin() == "test":
            _set_tag(out, HOST)
        return out

    return wrapper


def _default_device(get_default_device):
    """``torch.get_default_device``, which no TorchFunctionMode sees either: the test device
    while it is the default."""
    def wrapper():
        device = get_default_device()
        if _active is not None and _active.default_is_test_device:
            _active._devices[id(device)] = (device, TEST)
        return device

    return wrapper


def _parse_to(parse_to):
    """``torch._C._nn._parse_to`` (how ``Module.to`` reads its arguments), which turns the test
    device's name into a plain ``torch.device``: that device is the test device."""
    def wrapper(*args, **kwargs):
        out = parse_to(*args, **kwargs)
        named = [v for v in (*args, kwargs.get("device")) if isinstance(v, DeviceName)]
        if _active is not None and named and isinstance(out[0], torch.device):
            _active._devices[id(out[0])] = (out[0], _active.device_tag(named[0]))
        return out

    return wrapper


def _parameter_new(new):
    """``nn.Parameter(data)`` makes another tensor object over ``data``: it is where data is."""
    def wrapper(cls, data=None, requires_grad=True):
        p = new(cls, data, requires_grad)
        if data is not None:
            _set_tag(p, tag_of(data))
        return p

    return wrapper


@contextlib.contextmanager
def guarding():
    """The guard over one test; what no TorchFunctionMode sees (tensors from NumPy or bytes,
    the default device, ``Module.to``'s arguments, ``nn.Parameter``) is wrapped for its time."""
    global _active
    guard = DeviceGuard()
    patched = [(torch, "from_numpy", _made_on_the_host(torch.from_numpy)),
               (torch, "frombuffer", _made_on_the_host(torch.frombuffer)),
               (torch, "get_default_device", _default_device(torch.get_default_device)),
               (torch._C._nn, "_parse_to", _parse_to(torch._C._nn._parse_to)),
               (torch.nn.Parameter, "__new__", staticmethod(_parameter_new(torch.nn.Parameter.__new__)))]
    originals = [(owner, name, owner.__dict__[name] if name in vars(owner) else getattr(owner, name))
                 for owner, name, _ in patched]
    _active = guard
    try:
        for owner, name, replacement in patched:
            setattr(owner, name, replacement)
        with guard:
            yield guard
    finally:
        _active = None
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextlib.contextmanager
def default_to_test_device():
    """What ``torch.device(TEST_DEVICE)`` is on a GPU run: the guard's default device becomes
    the test device for the block (no-op without an active guard)."""
    guard = _active
    if guard is None:
        yield
        return
    before = guard.default_is_test_device
    guard.default_is_test_device = True
    try:
        yield
    finally:
        guard.default_is_test_device = before


def tensors_in(value, path="value"):
    """(path, tensor) for every tensor inside ``value`` (dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensors_in(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tensors_in(v, f"{path}[{i}]")
