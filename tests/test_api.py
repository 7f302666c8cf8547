"""The package surface: exports, status codes, backend choice."""
import types

import pytest
import torch

import gradops
from gradops import _backend
from gradops.errors import ACLNN_ERR_PARAM_INVALID as INVALID

from helpers import raises_status, rand


def test_status_constants_and_error_type():
    assert gradops.ACLNN_SUCCESS == 0
    assert gradops.ACLNN_ERR_PARAM_NULLPTR == 161001
    assert gradops.ACLNN_ERR_PARAM_INVALID == 161002
    assert gradops.ACLNN_ERR_RUNTIME_ERROR == 361001
    assert gradops.ACLNN_ERR_INNER == 561000
    assert gradops.ACLNN_ERR_INNER_TILING_ERROR == 561002
    err = gradops.AclnnError(161002, "op: x is bad")
    assert isinstance(err, ValueError) and err.status == 161002 and "161002" in str(err)


def test_unknown_backend_is_rejected_by_name():
    x = rand((2, 4))
    with raises_status(INVALID, "backend", "'cuda'"):
        gradops.rms_norm(x, torch.ones(4), backend="cuda")


def test_reference_backend_is_the_cpu_default():
    impl = _backend.implementation("op", "rms_norm", None, torch.device("cpu"))
    assert impl.__name__ == "gradops.reference.rms_norm"
    assert _backend.implementation("op", "rms_norm", "auto", torch.device("cpu")) is impl


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(_backend, "has_triton_kernels", lambda family: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with raises_status(INVALID, "backend='triton'", "TRITON_INTERPRET=1"):
        _backend.implementation("rms_norm", "rms_norm", "triton", torch.device("cpu"))


def test_triton_without_kernels_is_rejected(monkeypatch):
    monkeypatch.setattr(_backend, "has_triton_kernels", lambda family: False)
    with raises_status(INVALID, "backend='triton'"):
        _backend.implementation("op", "floyd_attention", "triton", torch.device("cpu"))
    # and "auto" quietly falls back to the reference on CUDA too
    impl = _backend.implementation("op", "floyd_attention", "auto", torch.device("cuda"))
    assert impl.__name__ == "gradops.reference.floyd_attention"


def test_prepare_validates_without_running():
    from gradops.ops.rms_norm import prepare_rms_norm_grad

    x, dy, g = rand((3, 8)), rand((3, 8)), rand((8,))
    _, rstd = gradops.rms_norm(x, g)
    plan = prepare_rms_norm_grad(dy, x, rstd, g)
    assert plan.outputs == (((3, 8), torch.float32), ((8,), torch.float32))
    assert plan.backend_name == "reference" and plan.device == torch.device("cpu")
    dx, dgamma = plan.run()
    assert dx.shape == (3, 8)


def test_kernel_limits_route_auto_to_the_reference_and_refuse_explicit_triton(monkeypatch):
    if not _backend.has_triton_kernels("floyd_attention"):
        pytest.skip("triton is not installed")
    # float64 runs on the fused kernels alone, which tile D <= 128 in float64 (the chunked
    # strategy takes any head dim of the other dtypes)
    q = rand((1, 1, 2, 2, 300), torch.float64)
    limit = lambda kernels: kernels.unsupported(q)  # noqa: E731
    monkeypatch.setattr(_backend, "_triton_usable_on", lambda device: True)  # as on a GPU
    impl = _backend.implementation("floyd_attention", "floyd_attention", "auto", torch.device("cuda"),
                                   kernel_limit=limit)
    assert impl.__name__ == "gradops.reference.floyd_attention"
    with raises_status(INVALID, "backend='triton'", "D = 300"):
        _backend.implementation("floyd_attention", "floyd_attention", "triton", torch.device("cpu"),
                                kernel_limit=limit)
    q = rand((1, 1, 2, 2, 64))
    impl = _backend.implementation("floyd_attention", "floyd_attention", "auto", torch.device("cuda"),
                                   kernel_limit=lambda kernels: kernels.unsupported(q))
    assert impl.__name__ == "gradops.kernels.floyd_attention"


@pytest.mark.parametrize("version,on_gpu", [("3.6.0", False), ("3.9.0", True), ("3.10.1+git0abc", True)])
def test_float64_floyd_on_a_gpu_needs_triton_3_9(monkeypatch, version, on_gpu):
    """Triton 3.6 fails to compile the float64 Floyd kernels for sm_90 (its LLVM lowering of
    the batched float64 dots; seen with gradops.bench.floyd.compile_check): with such a
    Triton, "auto" sends float64 CUDA calls to the reference. The interpreter runs them."""
    if not _backend.has_triton_kernels("floyd_attention"):
        pytest.skip("triton is not installed")
    import triton

    from gradops.kernels import floyd_attention as kernels
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(_backend, "_triton_usable_on", lambda device: True)  # as on a GPU
    on_cuda = types.SimpleNamespace(shape=(1, 1, 2, 2, 64), dtype=torch.float64, device=torch.device("cuda"))
    impl = _backend.implementation("floyd_attention", "floyd_attention", "auto", torch.device("cuda"),
                                   kernel_limit=lambda k: k.unsupported(on_cuda))
    assert impl.__name__ == f"gradops.{'kernels' if on_gpu else 'reference'}.floyd_attention"
    if not on_gpu:
        with raises_status(INVALID, "backend='triton'", "float64", "triton >= 3.9", version):
            _backend.implementation("floyd_attention", "floyd_attention", "triton", torch.device("cuda"),
                                    kernel_limit=lambda k: k.unsupported(on_cuda))
    assert kernels.unsupported(rand((1, 1, 2, 2, 64), torch.float64)) is None  # CPU: the interpreter
    assert kernels.unsupported(types.SimpleNamespace(shape=(1, 1, 2, 2, 64), dtype=torch.float32,
                                                     device=torch.device("cuda"))) is None


def test_operators_build_no_autograd_graph_and_write_in_place_into_grad_tensors():
    x = rand((4, 8)).requires_grad_()
    g = torch.ones(8, requires_grad=True)
    y, rstd = gradops.rms_norm(x, g)
    assert y.grad_fn is None and not y.requires_grad
    dy = rand((4, 8)).requires_grad_()
    want = gradops.rms_norm_grad(dy.detach(), x.detach(), rstd, g.detach())[0]
    dx, _ = gradops.rms_norm_grad(dy, x, rstd, g, in_place=True)
    assert dx is dy and torch.equal(dy.detach(), want)


def test_use_backend_sets_the_default_and_restores_it():
    assert gradops.default_backend() == "auto"
    with gradops.use_backend("reference") as name:
        assert name == "reference" == gradops.default_backend()
        impl = _backend.implementation("op", "rms_norm", None, torch.device("cpu"))
        assert impl.__name__ == "gradops.reference.rms_norm"
        with pytest.raises(RuntimeError, match="inner"):
            with gradops.use_backend("auto"):
                raise RuntimeError("inner")
        assert gradops.default_backend() == "reference"  # restored after an exception too
    assert gradops.default_backend() == "auto"
    previous = gradops.set_default_backend(None)
    assert previous == "auto" and gradops.default_backend() == "auto"
    with raises_status(INVALID, "set_default_backend", "'cuda'"):
        gradops.set_default_backend("cuda")
    assert gradops.default_backend() == "auto"


@pytest.mark.skipif(not _backend.has_triton_kernels("rms_norm"), reason="triton is not installed")
def test_an_argument_wins_over_the_default_and_meta_plans_on_the_reference(monkeypatch):
    monkeypatch.setattr(_backend, "_triton_usable_on", lambda device: True)
    with gradops.use_backend("triton"):
        impl = _backend.implementation("op", "rms_norm", None, torch.device("cuda"))
        assert impl.__name__ == "gradops.kernels.rms_norm"
        impl = _backend.implementation("op", "rms_norm", "reference", torch.device("cuda"))
        assert impl.__name__ == "gradops.reference.rms_norm"
        # meta tensors carry no data to compute on: shapes are planned by the reference
        impl = _backend.implementation("op", "rms_norm", None, torch.device("meta"))
        assert impl.__name__ == "gradops.reference.rms_norm"


def test_nn_backward_runs_on_the_forwards_backend(monkeypatch):
    """A default set around the forward only still decides the backward: the backend is
    resolved when the forward runs and saved for the backward."""
    from gradops.nn import functional as F
    from gradops.ops import rms_norm as rms_ops
    seen = []
    real = rms_ops.run_planned_rms_norm_grad

    def spy(plan, *args, **kwargs):
        seen.append(plan.impl.__name__)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(rms_ops, "run_planned_rms_norm_grad", spy)
    x = torch.randn(3, 8, requires_grad=True)
    with gradops.use_backend("reference"):
        y = F.rms_norm(x, [8], torch.ones(8, requires_grad=True))
    with gradops.use_backend("auto"):
        y.sum().backward()
    assert seen == ["gradops.reference.rms_norm"]
