"""3-Floyd's bounded-memory requirement (issue 46): no path holds an L^4 tensor.

At B = 1, H = 1, L = 64, D = 4, float32 on a CPU, a forward + backward of
``gradops.pivotal_attention3`` (the call users make, through autograd) holds at most 32 MiB
beyond its inputs, its output and the seven gradients; one ``[B,H,L,L,L,L]`` float32 tensor is
64 MiB. It is measured as ``test_floyd_memory`` measures the 2-pivot operator: a fresh
interpreter, the inputs made first, Linux's peak resident set (``VmHWM``) reset to what is
resident then, the call, the peak read again. glibc's allocator returns large blocks to the
system at its own threshold, which moves as a process frees blocks; fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``) every block of a score tile is mapped and unmapped as it is made
and freed, so the peak is what the call held at once. The same harness must see FloydNet's
quartic memory, which shows the measurement can fail. The default backend on a CPU is the
reference; the Triton path runs through the interpreter, whose own copies are not a GPU's
memory (``bench floyd3`` measures a GPU's peak).
"""
import json
import os
import subprocess
import sys

import pytest

from test_floyd_memory import _peak_can_be_reset

MIB = 1 << 20
B, H, L, D = 1, 1, 64, 4
QUARTIC_BYTES = B * H * L ** 4 * 4  # one float32 [B,H,L,L,L,L] tensor: 64 MiB
LIMIT_BYTES = 32 * MIB

HARNESS = r"""
import json, sys
import torch
import gradops

impl = sys.argv[1]
B, H, L, D = (int(v) for v in sys.argv[2:6])
if impl == "floydnet":
    from floydnet import pivotal_attention3
else:
    pivotal_attention3 = gradops.pivotal_attention3


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak():  # the peak resident set size reset to what is resident now (Linux: clear_refs 5)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmHWM")


def inputs(length, gen):
    return [torch.randn(B, H, length, length, length, D, generator=gen).requires_grad_() for _ in range(7)]


def step(tensors, dy):
    y = pivotal_attention3(*tensors)
    return [y.detach()] + list(torch.autograd.grad(y, tensors, dy))


# One-time library set-up (thread pools, BLAS buffers, autograd's engine) is not the call's memory.
gen = torch.Generator().manual_seed(0)
tiny = inputs(2, gen)
step(tiny, torch.randn(B, H, 2, 2, 2, D, generator=gen))

tensors = inputs(L, gen)
dy = torch.randn(B, H, L, L, L, D, generator=gen)
before = reset_peak()
results = step(tensors, dy)
after = status_bytes("VmHWM")
print(json.dumps({"delta": after - before, "results": sum(t.numel() * t.element_size() for t in results)}))
"""


def held_beyond_results(impl):
    """Bytes a forward + backward of ``impl`` held at its peak beyond its inputs, output and
    gradients, in a fresh process with glibc's mmap threshold fixed."""
    if not _peak_can_be_reset():
        pytest.skip("needs Linux's /proc/self/clear_refs and VmHWM to measure a peak from a known start")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run([sys.executable, "-c", HARNESS, impl, str(B), str(H), str(L), str(D)],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    held = report["delta"] - report["results"]
    print(f"{impl}: peak grew by {report['delta'] / MIB:.1f} MiB, output and gradients "
          f"{report['results'] / MIB:.1f} MiB, held {held / MIB:.1f} MiB")
    return held


def test_harness_sees_floydnets_quartic_memory():
    pytest.importorskip("floydnet")
    assert held_beyond_results("floydnet") > QUARTIC_BYTES


def test_forward_and_backward_hold_at_most_32_mib():
    held = held_beyond_results("gradops")
    assert held <= LIMIT_BYTES, f"held {held / MIB:.1f} MiB, limit {LIMIT_BYTES / MIB:.0f} MiB"
