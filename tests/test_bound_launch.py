"""Bound launches (gradops.kernels._launch, issue 44): after the first call of a signature a
kernel launches its compiled specialisation directly, with what JITFunction.run would pass.

On the CPU, with the real JITFunction.run of this Triton and two stand-ins for the GPU: a driver
(current device and stream) and ``triton.compiler.compile``, which returns a CompiledKernel
that records what it was compiled for and each launch it is given. The JIT path's launches
carry that kernel's launch metadata, a bound launch ``None``: so each test sees which path a
launch took and compares a bound launch with the JIT's launch of the same call.

On a GPU (GRADOPS_TEST_DEVICE=cuda), gradops' kernels compiled: every launch of a second call
bound, and the results bitwise those of the JIT path.
"""
import ast
import collections
import glob
import os

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.compiler  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime import interpreter, jit  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from conftest import TEST_DEVICE  # noqa: E402
from gradops import _versions  # noqa: E402
from gradops.kernels import _launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_read_triton = pytest.mark.skipif(not _launch.VERSION_OK, reason=(
    f"bound launches are written for triton {_launch.TRITON_READ}, this is {triton.__version__}"))

JIT_METADATA = object()  # the stand-in kernel's launch metadata: a launch carrying it took the JIT path


# ---------------------------------------------------------------------------- the stand-ins
class StandInDriver:
    def __init__(self):
        self.device, self.stream = 0, 1000

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.stream + device

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class StandInKernel(CompiledKernel):
    """What ``triton.compiler.compile`` returns here: no binary; records its launches."""
    module = None  # (triton 3.9's __del__ reads it)

    def __init__(self, src, options, launches):
        self.src, self.options, self.launches = src, options, launches
        self.function = object()  # one per compile: which specialisation a launch ran
        self.packed_metadata = (options["num_warps"], 1, 0)
        src.fn.cache_key  # what a compile computes: the globals the kernel reads

    def launch_metadata(self, grid, stream, *args):
        return JIT_METADATA

    def run(self, *launch):
        self.launches.append((self, launch))


class StandIns:
    def __init__(self):
        self.driver = StandInDriver()
        self.compiled = []  # every StandInKernel, in the order compiled
        self.launches = []  # (kernel, the launcher's arguments)

    def compile(self, src, target=None, options=None, **kwargs):
        kernel = StandInKernel(src, options, self.launches)
        self.compiled.append(kernel)
        return kernel

    def last(self):
        """(compiled kernel, path, grid, stream, the arguments after the hooks) of the last launch."""
        kernel, launch = self.launches[-1]
        grid, stream, function, metadata = launch[:3], launch[3], launch[4], launch[5]
        assert function is kernel.function and metadata == kernel.packed_metadata
        path = {JIT_METADATA: "jit", None: "bound"}[launch[6]]
        if path == "bound":
            assert launch[7] is None and launch[8] is None  # no hook: the launcher calls none
        return kernel, path, grid, stream, launch[9:]


@pytest.fixture
def stand_ins(monkeypatch):
    s = StandIns()
    monkeypatch.setattr(triton.compiler, "compile", s.compile)
    monkeypatch.setattr(driver, "_active", s.driver)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # (triton 3.9 warns when a compile leaves it unset)
    return s


def _toy(X, Y, n, m, scale_high, scale_low, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


_TOY_GLOBAL = tl.constexpr(3)


def _toy_reading_a_global(X, n, BLOCK: tl.constexpr):
    x = _TOY_GLOBAL  # noqa: F841


def toy_kernel(fn=_toy, **jit_kwargs):
    """A compiled (not interpreted) JITFunction of ``fn``, its launches bound."""
    return _launch.bind_launches(jit.JITFunction(fn, **jit_kwargs))


def toy():
    return toy_kernel(do_not_specialize=["scale_high", "scale_low"])


def args(x=None, y=None, n=64, m=48, scale=(7, -3)):
    x = torch.zeros(64) if x is None else x
    y = torch.zeros(64) if y is None else y
    return (x, y, n, m, *scale)


# ---------------------------------------------------------------------------- on the CPU
@needs_read_triton
def test_first_call_goes_through_the_jit_later_ones_bound_with_its_arguments(stand_ins, monkeypatch):
    kernel = toy()
    kernel[(4,)](*args(), BLOCK=16, num_warps=4)
    assert len(stand_ins.compiled) == 1 and stand_ins.last()[1] == "jit"

    # a later call of the signature: new tensors, other integers of the same classes, other
    # float64 words (do_not_specialize)
    later = args(n=32, m=80, scale=(-5, 11))
    kernel[(3, 2)](*later, BLOCK=16, num_warps=4)
    compiled, path, grid, stream, launched = stand_ins.last()
    assert path == "bound" and len(stand_ins.compiled) == 1
    assert compiled is stand_ins.compiled[0] and grid == (3, 2, 1) and stream == 1000

    monkeypatch.setattr(_launch, "ENABLED", False)  # the JIT's launch of the same call
    kernel[(3, 2)](*later, BLOCK=16, num_warps=4)
    jit_compiled, jit_path, jit_grid, jit_stream, jit_launched = stand_ins.last()
    assert jit_path == "jit" and (jit_compiled, jit_grid, jit_stream) == (compiled, grid, stream)
    assert len(launched) == len(jit_launched) == 8  # every parameter, the default FLAG too
    assert all(a is b for a, b in zip(launched, jit_launched)), (launched, jit_launched)
    assert _launch.DECLARED[_toy].bound == 1

    from gradops.bench.overhead import bound_launches_of

    monkeypatch.setattr(_launch, "ENABLED", True)
    assert bound_launches_of(lambda: kernel[(3, 2)](*later, BLOCK=16, num_warps=4)) == 1


# Each change of what the JIT specialises on, and the call it changes (BLOCK=16, num_warps=4 else)
CHANGES = {
    "dtype": lambda: (args(x=torch.zeros(64, dtype=torch.float16)), {}),
    "constexpr": lambda: (args(), {"BLOCK": 32}),
    "constexpr default": lambda: (args(), {"FLAG": True}),
    "launch option": lambda: (args(), {"num_warps": 8}),
    "pointer alignment": lambda: (args(y=torch.zeros(65)[1:]), {}),  # data_ptr 4 bytes past 16-aligned
    "integer not divisible by 16": lambda: (args(n=65), {}),
    "integer equal to 1": lambda: (args(m=1), {}),
    "integer past int32": lambda: (args(m=2 ** 33), {}),
}


@needs_read_triton
@pytest.mark.parametrize("change", CHANGES)
def test_each_specialisation_change_gets_its_own_kernel(stand_ins, monkeypatch, change):
    kernel = toy()
    kernel[(1,)](*args(), BLOCK=16, num_warps=4)
    kernel[(1,)](*args(), BLOCK=16, num_warps=4)
    base = stand_ins.last()
    assert base[1] == "bound"

    call_args, kwargs = CHANGES[change]()
    kwargs = {"BLOCK": 16, "num_warps": 4, **kwargs}
    kernel[(1,)](*call_args, **kwargs)
    first = stand_ins.last()
    assert first[1] == "jit" and len(stand_ins.compiled) == 2  # the JIT compiled the change
    kernel[(1,)](*call_args, **kwargs)
    again = stand_ins.last()
    assert again[1] == "bound" and again[0] is first[0] is not base[0]
    assert all(a is b for a, b in zip(again[4], first[4]))

    kernel[(1,)](*args(), BLOCK=16, num_warps=4)  # the first signature keeps its own
    assert stand_ins.last()[1] == "bound" and stand_ins.last()[0] is base[0]


@needs_read_triton
def test_a_constexpr_of_another_type_is_a_signature_of_its_own(stand_ins):
    # FLAG=1 and FLAG=True are one dict key but two JIT keys (str of the options): a bound
    # launch of one is never the other's
    kernel = toy()
    for flag in (True, True, 1, 1):
        kernel[(1,)](*args(), BLOCK=16, FLAG=flag)
    paths = [stand_ins.launches[i][1][6] for i in range(4)]
    assert paths == [JIT_METADATA, None, JIT_METADATA, None]
    assert len(_launch.DECLARED[_toy].bindings) == 2


@needs_read_triton
def test_another_device_binds_its_own_and_the_stream_is_read_per_launch(stand_ins):
    kernel = toy()
    kernel[(1,)](*args(), BLOCK=16)
    kernel[(1,)](*args(), BLOCK=16)
    on_0 = stand_ins.last()
    stand_ins.driver.stream = 2000
    kernel[(1,)](*args(), BLOCK=16)
    assert stand_ins.last()[1] == "bound" and stand_ins.last()[3] == 2000
    stand_ins.driver.device = 1
    kernel[(1,)](*args(), BLOCK=16)
    on_1 = stand_ins.last()
    assert on_1[1] == "jit" and on_1[0] is not on_0[0] and on_1[3] == 2001
    kernel[(1,)](*args(), BLOCK=16)
    assert stand_ins.last()[1] == "bound" and stand_ins.last()[0] is on_1[0]


@needs_read_triton
def test_switch_off_is_the_jit_every_launch(stand_ins, monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", False)
    kernel = toy()
    for _ in range(3):
        kernel[(1,)](*args(), BLOCK=16)
        assert stand_ins.last()[1] == "jit"
    assert not _launch.DECLARED[_toy].bindings


@needs_read_triton
@pytest.mark.parametrize("shape", ["runtime argument by keyword", "constexpr by position", "float constexpr",
                                   "callable grid", "warmup"])
def test_calls_whose_key_would_not_stand_for_the_jits_stay_on_the_jit(stand_ins, shape):
    kernel = toy()
    x, y, n, m, hi, lo = args()
    calls = {
        "runtime argument by keyword": lambda: kernel[(1,)](x, y, n, m, hi, scale_low=lo, BLOCK=16),
        "constexpr by position": lambda: kernel[(1,)](x, y, n, m, hi, lo, 16),
        "float constexpr": lambda: kernel[(1,)](x, y, n, m, hi, lo, BLOCK=16, FLAG=0.5),
        "callable grid": lambda: kernel[lambda meta: (1,)](x, y, n, m, hi, lo, BLOCK=16),
        "warmup": lambda: kernel.warmup(x, y, n, m, hi, lo, BLOCK=16, grid=(1,)),
    }
    for _ in range(3):
        calls[shape]()
        if shape != "warmup":
            assert stand_ins.last()[1] == "jit"
    assert not _launch.DECLARED[_toy].bindings and stand_ins.compiled


@needs_read_triton
def test_the_options_the_jit_takes_from_knobs_are_part_of_the_key(stand_ins, monkeypatch):
    from triton import knobs

    kernel = toy()
    kernel[(1,)](*args(), BLOCK=16)
    kernel[(1,)](*args(), BLOCK=16)
    plain = stand_ins.last()
    monkeypatch.setattr(knobs.runtime, "debug", True)  # JITFunction.run puts it in the options
    kernel[(1,)](*args(), BLOCK=16)
    debug = stand_ins.last()
    assert debug[1] == "jit" and debug[0] is not plain[0] and debug[0].options["debug"] is True
    kernel[(1,)](*args(), BLOCK=16)
    assert stand_ins.last()[1] == "bound" and stand_ins.last()[0] is debug[0]


@needs_read_triton
def test_launch_and_pre_run_hooks_send_launches_to_the_jit(stand_ins):
    from triton import knobs

    kernel = toy()
    kernel[(1,)](*args(), BLOCK=16)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        kernel[(1,)](*args(), BLOCK=16)
        assert stand_ins.last()[1] == "jit"
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    kernel.add_pre_run_hook(lambda *a, **k: seen.append("pre-run"))
    kernel[(1,)](*args(), BLOCK=16)
    assert stand_ins.last()[1] == "jit" and seen == ["pre-run"]


@needs_read_triton
def test_a_changed_global_raises_as_the_jit_does(stand_ins, monkeypatch):
    kernel = toy_kernel(_toy_reading_a_global)
    x = torch.zeros(16)
    kernel[(1,)](x, 16, BLOCK=16)
    kernel[(1,)](x, 16, BLOCK=16)
    assert stand_ins.last()[1] == "bound"
    monkeypatch.setitem(globals(), "_TOY_GLOBAL", tl.constexpr(4))
    with pytest.raises(RuntimeError, match="_TOY_GLOBAL has changed"):
        kernel[(1,)](x, 16, BLOCK=16)


@needs_read_triton
def test_stubbed_and_recorded_launches_see_every_launch_and_bind_nothing(stand_ins, monkeypatch):
    from gradops.bench.overhead import stubbed_launches
    from helpers import record_launches

    kernel = toy()
    with stubbed_launches() as log:  # a stubbed launch compiles nothing: nothing to bind
        kernel[(1,)](*args(), BLOCK=16)
    assert log == ["_toy"] and not stand_ins.launches and not _launch.DECLARED[_toy].bindings
    kernel[(1,)](*args(), BLOCK=16)
    kernel[(1,)](*args(), BLOCK=16)
    assert stand_ins.last()[1] == "bound"
    with stubbed_launches() as log:  # bound or not, a launch is the stub's
        kernel[(1,)](*args(), BLOCK=16)
    assert log == ["_toy"] and len(stand_ins.launches) == 2
    recorded = record_launches(monkeypatch)
    kernel[(1,)](*args(), BLOCK=16)
    assert [fn for fn, _, _ in recorded] == [_toy] and stand_ins.last()[1] == "jit"


@needs_read_triton
def test_the_kernel_stays_a_plain_jit_function():
    # torch's wrap_triton and Inductor take it (gradops.kernels._traceable)
    kernel = toy()
    assert type(kernel) is jit.JITFunction and vars(kernel)["run"] == _launch.DECLARED[_toy].run


def test_unsupported_triton_versions_keep_the_jit(monkeypatch):
    assert _launch.version_supported("3.6.0") and _launch.version_supported("3.9.1+git")
    for version in ("3.5.1", "3.7.0", "3.8.0", "3.10.0", "4.0.0"):
        assert not _launch.version_supported(version)
    monkeypatch.setattr(_launch, "VERSION_OK", False)
    kernel = toy()
    assert "run" not in vars(kernel) and _launch.DECLARED[_toy] is None


def test_the_tested_triton_releases_are_the_ones_read():
    # a new tested release (gradops/_versions.py) needs its jit.py and compiler.py read, and
    # TRITON_READ extended, before bound launches are allowed on it
    for version in (_versions.TRITON_OLDEST, _versions.TRITON_NEWEST):
        assert _launch.version_supported(version), version


def test_interpreted_kernels_are_left_as_they_are():
    kernel = _launch.bind_launches(interpreter.InterpretedFunction(_toy))
    assert type(kernel) is interpreter.InterpretedFunction and "run" not in vars(kernel)
    assert _launch.DECLARED[_toy] is None
    if TEST_DEVICE == "cpu":  # gradops' own, under the suite's interpreter
        from gradops.kernels import rms_norm

        assert type(rms_norm._rms_fwd_fused_kernel) is interpreter.InterpretedFunction
        assert "run" not in vars(rms_norm._rms_fwd_fused_kernel)


@needs_read_triton
def test_gradops_own_launches_bind_with_a_stand_in_gpu():
    # benchmarks/launch_cost.py launches gradops' kernels, compiled JITFunctions (in a process
    # without the interpreter), with the arguments gradops' calls give them: each launch of a
    # norm, NSA and each Floyd strategy's kernels must bind (the script checks each), and it
    # measures both paths (the figures in docs/backends.md)
    import subprocess
    import sys

    if TEST_DEVICE != "cpu":
        pytest.skip("the stand-in GPU is for a CPU run; on a GPU test_bound_launches_on_cuda_... runs the real one")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "launch_cost.py"), "--number", "2",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split(":")[1].split()[0] for line in proc.stdout.splitlines() if ": _" in line]
    assert {"_rms_fwd_fused_kernel", "_ln_bwd_fused_kernel", "_sum_rows_kernel", "_nsa_compress_bwd_kernel",
            "_fwd_kernel", "_bwd_dkv_kernel", "_gemm_kernel", "_rows_backward", "_grad_rows"} <= set(rows), proc.stdout


def _is_triton_jit(decorator) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", "") == "triton"


def test_every_kernel_gradops_launches_binds_its_launches():
    # A kernel is launched when host code (outside every @triton.jit body) subscripts it,
    # kernel[grid], or passes it on (fused_launch(kernel, ...)); the others are device functions.
    jit_defs, host_uses = {}, set()
    for path in sorted(glob.glob(os.path.join(ROOT, "gradops", "kernels", "*.py"))):
        tree = ast.parse(open(path).read())
        device_code = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
                jit_defs[(os.path.basename(path), node.name)] = [ast.unparse(d) for d in node.decorator_list]
                device_code.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in device_code:
                continue
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                host_uses.add(node.value.id)
            if isinstance(node, ast.Call):
                passed = [*node.args, *(k.value for k in node.keywords)]
                host_uses.update(a.id for a in passed if isinstance(a, ast.Name))
    launched = {key: decorators for key, decorators in jit_defs.items() if key[1] in host_uses}
    assert len(launched) >= 20, launched  # (the rule still finds the kernels)
    unbound = [key for key, decorators in launched.items() if decorators[0] != "bind_launches"]
    assert not unbound, f"launched kernels without @bind_launches above @triton.jit: {unbound}"


# ---------------------------------------------------------------------------- on a GPU
def _bits(t):
    return t.detach().contiguous().view(torch.uint8)


def _calls(device):
    """(name, call returning its result tensors): a norm forward + backward (both norms), NSA,
    and a Floyd forward + backward with each strategy forced."""
    import gradops
    import gradops.nn.functional as GF
    from gradops.kernels import floyd_config

    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    x, w, b, dy = rnd(64, 512), rnd(512), rnd(512), rnd(64, 512)
    leaves = [t.requires_grad_() for t in (x, w, b)]

    def layer_norm():
        y = GF.layer_norm(x, (512,), w, b, 1e-5)
        return (y, *torch.autograd.grad(y, leaves, dy))

    def rms_norm():
        y = GF.rms_norm(x, (512,), w, 1e-6)
        return (y, *torch.autograd.grad(y, leaves[:2], dy))

    xs, nw = rnd(200, 4, 64).requires_grad_(), rnd(32, 4).requires_grad_()
    ends = [0, 70, 200]

    def nsa():
        out = GF.nsa_compress(xs, nw, 32, 16, ends)
        return (out, *torch.autograd.grad(out, (xs, nw), torch.ones_like(out)))

    yield "layer_norm", layer_norm
    yield "rms_norm", rms_norm
    yield "nsa", nsa
    b, h, n, m, k, d = 1, 2, 48, 40, 56, 32
    q, fdy = rnd(b, h, n, m, d), rnd(b, h, n, m, d)
    k1, v1 = rnd(b, h, n, k, d), rnd(b, h, n, k, d)
    k2, v2 = rnd(b, h, k, m, d), rnd(b, h, k, m, d)
    for strategy in ("fused", "chunked", "hybrid"):
        def floyd(strategy=strategy):
            saved, floyd_config.STRATEGY = floyd_config.STRATEGY, strategy
            try:
                out, mx, sm = gradops.floyd_attention(q, k1, v1, k2, v2, None, 0.17, backend="triton")
                return (out, mx, sm, *gradops.floyd_attention_grad(fdy, q, k1, v1, k2, v2, out, mx, sm, None, 0.17,
                                                                   backend="triton"))
            finally:
                floyd_config.STRATEGY = saved
        yield f"floyd {strategy}", floyd


@needs_read_triton
def test_bound_launches_on_cuda_match_the_jit_bitwise(monkeypatch):
    if TEST_DEVICE != "cuda":
        pytest.skip("compiled kernels on a GPU (GRADOPS_TEST_DEVICE=cuda)")
    import gradops
    from gradops.bench.overhead import kernels_launched

    with gradops.use_backend("triton"):
        for name, call in _calls(TEST_DEVICE):
            monkeypatch.setattr(_launch, "ENABLED", False)
            expected = call()
            declared = {fn.__name__ for fn in _launch.DECLARED}  # (the kernel modules are imported by now)
            launched = collections.Counter(k for k in kernels_launched(call) if k in declared)
            assert launched, name
            monkeypatch.setattr(_launch, "ENABLED", True)
            call()  # binds each signature
            before = _launch.bound_launch_counts()
            got = call()
            after = _launch.bound_launch_counts()
            bound = collections.Counter({k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)})
            assert bound == launched, f"{name}: every launch of a repeated call bound: {bound} != {launched}"
            assert len(got) == len(expected)
            for i, (a, e) in enumerate(zip(got, expected)):
                assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(_bits(a), _bits(e)), (name, i)

def test_gradops_info_says_whether_bound_launches_are_on(monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", False)
    assert "off" in _launch.describe() and _launch.ENV in _launch.describe()
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "VERSION_OK", False)
    assert "off" in _launch.describe() and triton.__version__ in _launch.describe()
    monkeypatch.setattr(_launch, "VERSION_OK", True)
    assert " on " in _launch.describe()


def test_bench_overhead_times_the_other_launch_path_on_a_gpu(monkeypatch):
    from argparse import Namespace

    from gradops.bench import overhead

    assert overhead.other_launch_path("cpu") is None  # (launches stubbed: nothing to compare)
    assert overhead.impl_names(Namespace(device="cpu")) == ["gradops", "torch", "floor"]
    monkeypatch.setattr(_launch, "VERSION_OK", True)
    monkeypatch.setattr(_launch, "ENABLED", False)
    assert overhead.other_launch_path("cuda") == ("bound", True)
    assert overhead.impl_names(Namespace(device="cuda")) == ["gradops", "torch", "floor", "bound"]
    seen = []
    switched = overhead._launching(lambda: seen.append(_launch.ENABLED), True)
    switched()
    assert seen == [True] and _launch.ENABLED is False
    monkeypatch.setattr(_launch, "ENABLED", True)
    assert overhead.other_launch_path("cuda") == ("jit", False)
    monkeypatch.setattr(_launch, "VERSION_OK", False)
    assert overhead.other_launch_path("cuda") is None
