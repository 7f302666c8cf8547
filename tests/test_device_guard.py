"""The device guard (tests/device_guard.py) catches, on the CPU, what failed on the first GPU
run of this suite (/work/shared/gpu/h100-2026-11-25/cuda-failures.md, category B): each test
below is the pattern of one group of that run, reduced, and shows the guard raising where the
GPU raised; the last ones show that the right way to write each passes.

The groups the guard cannot see on a CPU (they need a GPU's own behaviour: its SM count, its
RNG under torch.compile, a CUDA mesh, a CUDA stream, the text "cuda" in a message) are fixed
in their tests and listed in docs/gpu.md.
"""
import numpy as np
import pytest
import torch

import device_guard
import gradops
from conftest import GUARDED, TEST_DEVICE, pytest_collection_modifyitems
from device_guard import DeviceGuardError, default_to_test_device
from helpers import raises_status

pytestmark = pytest.mark.skipif(not GUARDED, reason="the guard stands in for a GPU on CPU runs only "
                                                    "(GRADOPS_TEST_DEVICE=cpu, GRADOPS_DEVICE_GUARD unset)")


def test_cpu_generator_drawing_onto_the_default_device():
    # groups 1-5, 10, 11 (130 failures): `torch.randint(..., generator=g)` under the backend
    # fixture, which makes the test device torch's default on a GPU
    g = torch.Generator().manual_seed(0)
    with default_to_test_device():
        with pytest.raises(DeviceGuardError, match="CPU torch.Generator onto the test device"):
            torch.randint(0, 100, (2, 8), generator=g)
        with pytest.raises(DeviceGuardError, match="CPU torch.Generator"):
            torch.randn(4, 4, generator=g)


def test_cpu_generator_drawing_onto_the_named_test_device():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(DeviceGuardError, match="CPU torch.Generator"):
        torch.randn(4, generator=g, device=TEST_DEVICE)


def test_expectation_on_the_default_device_compared_with_a_cpu_result():
    # groups 11, 12 (48): a mask made with torch.zeros under the backend fixture, compared
    # with `got.cpu()`
    with default_to_test_device():
        x = torch.randn(5, 3)
        expected = torch.zeros(5, 3, dtype=torch.bool)
        got = gradops.rms_norm(x, torch.ones(3))[0].cpu()
        with pytest.raises(DeviceGuardError, match="mixes tensors on the test device with a host tensor"):
            torch.equal(got.isnan(), expected)


def test_tensors_made_at_collection_in_parametrize_fail_the_test():
    # groups 14-18 (12): tensors in @parametrize dicts live on the CPU whatever the test device
    class Item:
        def __init__(self, params):
            self.callspec = type("CallSpec", (), {"params": params})()
            self.markers = []

        def add_marker(self, marker):
            self.markers.append(marker)

    bad = Item({"change": {"gamma": torch.ones(4)}, "dtype": torch.float32})
    good = Item({"change": {"gamma": (4,)}, "dtype": torch.float32})
    pytest_collection_modifyitems([bad, good])
    assert [m.name for m in bad.markers] == ["tensor_made_at_collection"]
    assert bad.markers[0].args[0] == ["change['gamma']"]
    assert good.markers == []


def test_numpy_backed_host_tensors_beside_test_device_tensors():
    # groups 21, 22 (4): numpy-backed x and dy beside a gamma made on the default device;
    # gradops' device rule (161002) fires, as on a GPU, before the rule the test meant
    base = np.zeros(64, dtype=np.float32)
    with default_to_test_device():
        x = torch.from_numpy(base[:32]).view(4, 8)
        dy = torch.from_numpy(base[32:]).view(4, 8)
        rstd = torch.ones(4, 1)
        with raises_status(161002, "expected the device of"):
            gradops.rms_norm_grad(dy, x, rstd, torch.ones(8))


def test_cpu_only_layer_norm_oracles():
    # groups 6-9 (44): torch's CUDA LayerNorm refuses half input with float32 weight, and half
    # statistics in its backward; its CPU kernel takes both
    with default_to_test_device():
        x = torch.randn(4, 8).to(torch.bfloat16)
        ln = torch.nn.LayerNorm(8)
        with pytest.raises(DeviceGuardError, match="refuses torch.bfloat16 input with torch.float32 weight"):
            ln(x)
        xh = torch.randn(4, 8).half()
        stats = torch.zeros(4, 1, dtype=torch.float16), torch.ones(4, 1, dtype=torch.float16)
        with pytest.raises(DeviceGuardError, match="refuses torch.float16 statistics"):
            torch.ops.aten.native_layer_norm_backward(xh, xh, [8], *stats, None, None, [True, False, False])


def test_numpy_of_a_test_device_tensor():
    with pytest.raises(DeviceGuardError, match="numpy"):
        torch.ones(3, device=TEST_DEVICE).numpy()


def test_the_right_ways_pass():
    g = torch.Generator().manual_seed(0)
    with default_to_test_device():
        # drawn on the CPU, then moved; compared on one device, or both moved to the CPU
        x = torch.randn(4, 8, generator=g, device="cpu").to(TEST_DEVICE)
        y, _ = gradops.rms_norm(x, torch.ones(8))
        assert torch.equal(y.isnan(), torch.zeros(4, 8, dtype=torch.bool))
        assert torch.equal(y.cpu().isnan(), torch.zeros(4, 8, dtype=torch.bool, device="cpu"))
        torch.testing.assert_close(y.cpu(), y.detach().cpu())
        # a host scalar beside test-device tensors is what CUDA allows too
        assert (y * torch.tensor(2.0, device="cpu")).shape == y.shape
        # a test-device tensor indexed with host indices
        assert y[torch.tensor([0, 2], device="cpu")].shape == (2, 8)
        # the same LayerNorm oracle with the weight in the input's dtype
        torch.nn.LayerNorm(8).to(torch.bfloat16)(x.to(torch.bfloat16))


def test_a_moved_tensor_is_another_tensor_as_on_a_gpu():
    host = torch.zeros(3, device="cpu")
    moved = host.to(TEST_DEVICE)
    assert moved is not host
    moved.add_(1)
    assert torch.equal(host, torch.zeros(3, device="cpu"))
    assert device_guard.tag_of(moved) == device_guard.TEST and device_guard.tag_of(host) == device_guard.HOST


def test_a_module_on_the_test_device_fed_a_host_input():
    # the parameters are where their data was made, and Module.to(device) moves them
    with default_to_test_device():
        linear = torch.nn.Linear(4, 2)
    with pytest.raises(DeviceGuardError, match="mixes tensors on the test device"):
        linear(torch.ones(3, 4, device="cpu"))
    host = torch.nn.Linear(4, 2)  # made outside the backend fixture: on the CPU on a GPU run too
    with pytest.raises(DeviceGuardError, match="mixes tensors on the test device"):
        host(torch.ones(3, 4, device=TEST_DEVICE))
    moved = host.to(TEST_DEVICE)
    assert device_guard.tag_of(moved.weight) == device_guard.TEST
    moved(torch.ones(3, 4, device=TEST_DEVICE))


def test_what_a_gpu_allows_is_not_reported():
    with default_to_test_device():
        x = torch.randn(4, 8)
        # autocast runs torch's LayerNorm in float32 on a GPU: no dtype rule applies
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LayerNorm(8)(x.to(torch.bfloat16))
        # a tensor written in place (copy_) stays where it is
        buf = torch.empty(4, 8)
        buf.copy_(torch.ones(4, 8, device="cpu"))
        assert device_guard.tag_of(buf) == device_guard.TEST
    # device= places the result whatever it reads
    host = torch.ones(3, device="cpu")
    assert device_guard.tag_of(torch.as_tensor(host, device=TEST_DEVICE)) == device_guard.TEST
    assert device_guard.tag_of(torch.zeros_like(torch.ones(3, device=TEST_DEVICE), device="cpu")) == device_guard.HOST
    # a place the guard cannot tell (a plain torch.device) leaves the moved tensor untagged
    assert device_guard.tag_of(host.to(torch.device("cpu"))) is None
