"""Small helpers shared by the tests."""
import pytest
import torch

import gradops
from gradops.oracles import TOLERANCE, rel_error

from conftest import TEST_DEVICE

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def rand(shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype).to(device)


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
