"""Small helpers shared by the tests."""
import pytest
import torch

import gradops
from gradops.oracles import TOLERANCE, rel_error

from conftest import TEST_DEVICE

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def rand(shape, dtype=torch.float32, device=None, scale=1.0):
    """Normal draws rounded to ``dtype``, on ``device`` (torch's default device when None)."""
    return (torch.randn(shape, dtype=torch.float64, device=device) * scale).to(dtype)


def autocast(dtype=torch.bfloat16, enabled=True):
    """``torch.autocast`` for the device tests create tensors on (the backend fixture makes the
    test device torch's default): CPU autocast would leave CUDA tensors alone."""
    return torch.autocast(torch.get_default_device().type, dtype=dtype, enabled=enabled)


def skip_if_floyd_float64_refused(backend, device, dtype=torch.float64):
    """Skip a triton run of float64 Floyd attention where the Floyd kernels refuse float64
    (a GPU with triton < 3.9, which cannot compile them: gradops.kernels.floyd_attention.
    unsupported says so, and "auto" runs such calls on the reference)."""
    if backend != "triton" or dtype != torch.float64:
        return
    from gradops.kernels import floyd_attention as kernels

    reason = kernels.unsupported(torch.empty((1, 1, 1, 1, 16), dtype=dtype, device=device))
    if reason is not None:
        pytest.skip(f"the Triton Floyd kernels refuse this call here: {reason}")


def assert_close(actual, expected, dtype=None, tol=None, what=""):
    """Relative error (to expected's largest magnitude) within the dtype's tolerance."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = TOLERANCE[dtype or actual.dtype] if tol is None else tol
    err = rel_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def raises_status(status, *words):
    """Context manager: an AclnnError with this status whose message contains every word."""
    class _Ctx:
        def __enter__(self):
            self._ctx = pytest.raises(gradops.AclnnError)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            if handled:
                err = self.info.value
                assert err.status == status, f"status {err.status} != {status}: {err}"
                for w in words:
                    assert w in str(err), f"{w!r} not in message: {err}"
            return handled
    return _Ctx()


def interpreted(backend) -> bool:
    """True when ``backend`` runs Triton kernels under the interpreter (CPU), which is slow:
    gradcheck them in fast mode there (a random directional derivative per input instead of
    the whole Jacobian); the full Jacobian is checked on the reference backend and on a GPU."""
    return backend == "triton" and TEST_DEVICE == "cpu"


# Triton 3.6, the GPU image's version, installed beside the newest (which the venv has) by
# .ci/run: pip install --no-deps --target .ci/triton-3.6 triton==3.6.0. GRADOPS_TRITON_3_6
# names another folder holding it.
TRITON_3_6_ENV = "GRADOPS_TRITON_3_6"


def triton_3_6_path() -> str:
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.environ.get(TRITON_3_6_ENV) or os.path.join(root, ".ci", "triton-3.6")


# The head of a compile script that reads the compiled kernels: every triton.compile, in order, is
# kept in ``compiled`` (None where it raised); the script clears it before each check.
RECORD_COMPILES = r"""
import triton

compiled = []  # every triton.compile of the script, in order (None where it raised)
real_compile = triton.compile


def recording_compile(*args, **kwargs):
    try:
        result = real_compile(*args, **kwargs)
    except Exception:
        compiled.append(None)
        raise
    compiled.append(result)
    return result


triton.compile = recording_compile
"""


def run_sm90_compile(script: str, *args: str, timeout: int = 600, triton_version: str = "installed") -> str:
    """Run ``script`` (Python that compiles kernels for an H100, sm_90, with Triton's bundled
    tools: no GPU needed) in a child process, with the Triton interpreter off and this checkout
    importable; returns its stdout. Skips on a GPU run (every test compiles the kernels there)
    and where this Triton cannot cross-compile.

    ``triton_version``: "installed" (the venv's, the newest), or "3.6" (the GPU image's, from
    :func:`triton_3_6_path`; skipped, saying how to install it, where it is absent)."""
    import os
    import subprocess
    import sys

    if TEST_DEVICE != "cpu":
        pytest.skip("on a GPU every other test compiles the kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root]
    if triton_version == "3.6":
        old = triton_3_6_path()
        if not os.path.isdir(os.path.join(old, "triton")):
            pytest.skip(f"Triton 3.6 is not installed at {old}: pip install --no-deps --target {old} "
                        f"triton==3.6.0 (as .ci/run does), or set {TRITON_3_6_ENV}")
        paths.append(old)
    elif triton_version != "installed":
        raise ValueError(triton_version)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    if out.returncode != 0 and ("GPUTarget" in out.stderr or "ASTSource" in out.stderr):
        pytest.skip(f"this triton cannot cross-compile: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def nsa_problem(lengths, heads, dims, block_size, stride, dtype, device="cpu", generator=None):
    """A packed NSA problem: (cumulative ends, x [T, heads, dims], weight [block_size, heads],
    dout [C, heads, dims]), drawn from ``generator`` (torch's global one when None)."""
    import itertools

    from gradops import oracles

    ends = list(itertools.accumulate(lengths))
    t = ends[-1] if ends else 0
    x = torch.randn(t, heads, dims, generator=generator, device=device).to(dtype)
    weight = torch.randn(block_size, heads, generator=generator, device=device).to(dtype)
    blocks = len(oracles.nsa_blocks(ends, block_size, stride))
    dout = torch.randn(blocks, heads, dims, generator=generator, device=device).to(dtype)
    return ends, x, weight, dout


def promoted_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm of a half ``x`` beside a float32 ``weight``/``bias``, as the tests' oracle:
    float32 math on x's half values, y rounded once to x's dtype; its autograd rounds dx once to
    x's dtype and keeps the parameter gradients in float32.

    torch's CUDA LayerNorm refuses this mix, so torch has no such call on a GPU. Its CPU
    mixed-type kernel takes it but is not this computation: some elements of y and dx differ,
    and its float32 dweight and dbias are far less accurate (measured on 64 rows of width 203:
    0.9e-3 to 1.6e-3 of the largest element away from the float64 value in float16, 7.8e-3 to
    1.2e-2 in bfloat16, where this computation's are within 1.5e-7). It is the more accurate of
    the two, which is why it is the oracle on both devices."""
    return torch.nn.functional.layer_norm(x.float(), normalized_shape, weight, bias, eps).to(x.dtype)


def record_launches(monkeypatch):
    """Every Triton kernel launch from now on, compiled or through the interpreter, as
    (the kernel's Python function, {parameter: value} of its arguments, the keyword arguments
    of the launch: constexprs and launch options)."""
    from triton.runtime import interpreter, jit

    launches = []
    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        def run(self, *args, grid, warmup, _real=cls.run, **kwargs):
            bound = dict(zip(self.arg_names, args), **{k: v for k, v in kwargs.items() if k in self.arg_names})
            launches.append((self.fn, bound, kwargs))
            return _real(self, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    return launches
