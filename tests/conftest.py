"""Test configuration.

By default every test runs on CPU tensors, and the Triton kernels run through the Triton
interpreter, which must be switched on before triton is first imported. Set
GRADOPS_TEST_DEVICE=cuda to run the same tests on a GPU with compiled kernels.

Tests of the layers users call (gradops.nn, the modules, pivotal_attention, aclnn, ascendc,
torch_npu) take the ``backend`` fixture: they run once per backend, with that backend as
the default of every gradops call that does not name one, and (on a GPU) with the test
device as torch's default device (so a test drawing from a CPU ``torch.Generator`` passes
``device="cpu"`` and moves the result). On CPU the "triton" run goes through the interpreter, so
those tests keep their shapes small. Tests of Floyd attention in 16-bit or float32 take
``floyd_backend`` instead: the Triton run once per strategy the rule gives such calls (fused,
hybrid; the chunked strategy, past the hybrid kernels' widest head, has its own tests).

On CPU every test runs under ``device_guard``, which tags each tensor as on the test device or
on the host and raises where a GPU run would (a CPU generator drawing onto the test device,
two devices in one call, a host tensor passed beside test-device ones); tensors inside
``parametrize`` arguments (made at collection, on the CPU whatever the test device) fail the
test on every device. ``GRADOPS_DEVICE_GUARD=0`` turns the guard off.

``GRADOPS_NO_SKIPS=1`` (.ci/run's oldest-version step) makes every skip a failure: there a
skip would hide what broke (an import, a torch feature a test checks for), so the selection
(.ci/oldest.txt) holds only tests that run on the CPU.
"""
import contextlib
import os

import device_guard  # noqa: E402

# A str equal to "cpu" or "cuda", which the device guard tells apart from a literal "cpu".
TEST_DEVICE = device_guard.DeviceName(os.environ.get("GRADOPS_TEST_DEVICE", "cpu"))
GUARDED = TEST_DEVICE == "cpu" and os.environ.get("GRADOPS_DEVICE_GUARD", "1") != "0"
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import gradops  # noqa: E402
from gradops._backend import triton_available  # noqa: E402

if TEST_DEVICE == "cpu":
    import interpreter_fixes  # noqa: E402

    interpreter_fixes.install()  # float32 -> bfloat16 rounds to nearest even, as on a GPU

from helpers import skip_if_floyd_float64_refused  # noqa: E402

BACKENDS = ("reference", "triton")


@pytest.fixture
def device():
    return TEST_DEVICE


@contextlib.contextmanager
def as_default_backend(request, name):
    """``name`` as gradops' default backend (and the test device as torch's) for a test."""
    if name == "triton" and not triton_available():
        pytest.skip("triton is not installed: pip install -e '.[test]'")
    if request.node.get_closest_marker("floyd_float64"):
        skip_if_floyd_float64_refused(name, TEST_DEVICE)
    with contextlib.ExitStack() as stack:
        stack.enter_context(gradops.use_backend(name))
        if TEST_DEVICE != "cpu":  # factory calls without a device create tensors on the test device
            stack.enter_context(torch.device(TEST_DEVICE))
        else:  # the same, as the device guard sees it
            stack.enter_context(device_guard.default_to_test_device())
        yield name


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each backend in turn, as gradops' default backend for the test."""
    with as_default_backend(request, request.param) as name:
        yield name


# The Triton backend of Floyd attention has three strategies (gradops/kernels/floyd_config.py);
# its rule gives calls of the test shapes to "fused" or "hybrid" by their roofline, so
# user-level Floyd tests force each of the two in turn ("chunked" takes only heads past the
# hybrid kernels' widest and float32 calls where it executes fewer FLOP: tests/test_floyd_chunked.py).
FLOYD_BACKENDS = ("reference", "triton-fused", "triton-hybrid")


@pytest.fixture(params=FLOYD_BACKENDS)
def floyd_backend(request, monkeypatch):
    """``backend`` for tests that call Floyd attention with float16, bfloat16 or float32
    inputs: "reference", then "triton" once with each strategy forced
    (``floyd_config.STRATEGY``; float64 calls always run the fused kernels, so float64-only
    tests keep ``backend``). Yields the backend's name, "reference" or "triton"; the strategy
    is ``gradops.kernels.floyd_config.STRATEGY`` (None for "reference")."""
    name, _, strategy = request.param.partition("-")
    with as_default_backend(request, name) as backend:
        if strategy:
            from gradops.kernels import floyd_config

            monkeypatch.setattr(floyd_config, "STRATEGY", strategy)
        yield backend


@pytest.fixture(params=["device", "off-cpu"])
def statistics(request, monkeypatch):
    """The reference LayerNorm forward's statistics as the test device decides them, then as
    off the CPU (gradops/reference/layer_norm.py ``_aten_statistics``: its own statistics, y
    in one pass), which a CPU run reaches no other way; a GPU run takes that path anyway, and
    a Triton run never. The off-CPU run fails if it never reached that forward."""
    if request.param == "device":
        yield request.param
        return
    if TEST_DEVICE != "cpu":
        pytest.skip("the test device is off the CPU: the test's other run takes this path")
    for name in ("backend", "row_path"):  # the fixtures that choose gradops' default backend
        if name in request.fixturenames and request.getfixturevalue(name).split("-")[0] != "reference":
            pytest.skip("the path is the reference backend's: the test's run with that backend takes it")
    from gradops.reference import layer_norm

    reached = []
    monkeypatch.setattr(layer_norm, "_aten_statistics", lambda device: reached.append(device) or False)
    yield request.param
    assert reached, "the reference LayerNorm forward was not reached"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(items):
    """A tensor in a ``parametrize`` argument is made at collection, on the CPU, whatever the
    test device: such a test mixes devices on a GPU. It fails, on every device, saying so."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        found = [path for name, value in params.items() for path, _ in device_guard.tensors_in(value, name)]
        if found:
            item.add_marker(pytest.mark.tensor_made_at_collection(found))


@pytest.fixture(autouse=True)
def _device_guard(request):
    """The device guard (module docstring) over the test: an autouse fixture, so it is set up
    before the fixtures a test asks for (the backend fixture's default device included)."""
    marker = request.node.get_closest_marker("tensor_made_at_collection")
    if marker is not None:
        pytest.fail(f"parametrize argument(s) {', '.join(marker.args[0])} hold tensors made at collection (on the "
                    f"CPU, whatever GRADOPS_TEST_DEVICE is): build them inside the test, on the test device")
    if not GUARDED:
        yield
        return
    with device_guard.guarding():
        yield


NO_SKIPS = os.environ.get("GRADOPS_NO_SKIPS") == "1"


def _fail_a_skip(report):
    if NO_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and GRADOPS_NO_SKIPS=1 makes a skip a failure: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_a_skip(outcome.get_result())
