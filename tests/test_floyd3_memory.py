"""3-Floyd's bounded-memory requirement (issue 46): no path holds an L^4 tensor.

At B = 1, H = 1, L = 64, D = 4, float32 on a CPU, a forward + backward of
``gradops.pivotal_attention3`` (the call users make, through autograd) holds at most 32 MiB
beyond its inputs, its output and the seven gradients; one ``[B,H,L,L,L,L]`` float32 tensor is
64 MiB. Measured as ``test_floyd_memory`` measures the 2-pivot operator, by the code of
``gradops bench floyd3 --memory``: a fresh interpreter, the inputs made first, Linux's peak
resident set (``VmHWM``) reset to what is resident then, the call, the peak read again. glibc's
allocator returns large blocks to the system at its own threshold, which moves as a process
frees blocks; fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) every block of a score tile is
mapped and unmapped as it is made and freed, so the peak is what the call held at once. The
same harness must see FloydNet's quartic memory, which shows the measurement can fail. The
default backend on a CPU is the reference; the Triton path runs through the interpreter, whose
own copies are not a GPU's memory (``bench floyd3`` measures a GPU's peak).
"""
import pytest

from gradops.bench.floyd3 import measure_memory, peak_can_be_reset

MIB = 1 << 20
B, H, L, D = 1, 1, 64, 4
QUARTIC_BYTES = B * H * L ** 4 * 4  # one float32 [B,H,L,L,L,L] tensor: 64 MiB
LIMIT_BYTES = 32 * MIB


def held_beyond_results(impl):
    """Bytes a forward + backward of ``impl`` held at its peak beyond its inputs, output and
    gradients, in a fresh process with glibc's mmap threshold fixed (``bench floyd3 --memory``'s
    measurement, ``gradops.bench.floyd3.measure_memory``)."""
    if not peak_can_be_reset():
        pytest.skip("needs Linux's /proc/self/clear_refs and VmHWM to measure a peak from a known start")
    row = measure_memory(impl, "fwdbwd", B, H, L, D, "float32", timeout=300)
    assert "error" not in row, row
    print(f"{impl}: peak grew by {row['grew'] / MIB:.1f} MiB, output and gradients {row['returned'] / MIB:.1f} MiB, "
          f"held {row['held'] / MIB:.1f} MiB")
    return row["held"]


def test_harness_sees_floydnets_quartic_memory():
    pytest.importorskip("floydnet")
    assert held_beyond_results("floydnet") > QUARTIC_BYTES


def test_forward_and_backward_hold_at_most_32_mib():
    held = held_beyond_results("gradops")
    assert held <= LIMIT_BYTES, f"held {held / MIB:.1f} MiB, limit {LIMIT_BYTES / MIB:.0f} MiB"
