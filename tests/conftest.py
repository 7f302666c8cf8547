"""Test configuration.

By default every test runs on CPU tensors, and the Triton kernels run through the Triton
interpreter, which must be switched on before triton is first imported. Set
GRADOPS_TEST_DEVICE=cuda to run the same tests on a GPU with compiled kernels.
"""
import os

TEST_DEVICE = os.environ.get("GRADOPS_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device():
    return TEST_DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
