"""gradops.bench.harness on a GPU: what its CUDA-graph measurement leaves behind for the
measurements after it (CUDA only: skipped on a CPU run)."""
import pytest
import torch

from conftest import TEST_DEVICE
from gradops.bench import harness

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU")


def test_a_capture_that_fails_leaves_the_random_numbers_working():
    # A peer that cannot be captured is a result (its record keeps its eager time). On the GPU
    # run of 2026-11-28 (torch 2.11) such a capture left the device's RNG in capture mode, and
    # every random op after it raised "Offset increment outside graph capture".
    x = torch.ones(4, device="cuda")
    with pytest.raises(Exception):
        harness.graph_times(lambda: (x * 2).sum().item(), "cuda", reps=3)  # a host sync: not capturable
    torch.randn(8, device="cuda")
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)


def test_a_capturable_call_is_timed_from_its_replays():
    x = torch.ones(1 << 20, device="cuda")
    times = harness.graph_times(lambda: x * 2, "cuda", reps=3, flush_l2=False, max_seconds=1.0)
    assert len(times) >= 3 and all(t > 0 for t in times)
