"""The gradops command: selftest (the README's main job) and info.

`info` and `selftest` follow one rule of what runs where (gradops.selftest.backends_here):
the tests that check they agree run each command in a fresh interpreter, as a user would,
since the interpreter state of a process is what they once disagreed on.
"""
import os
import re
import subprocess
import sys

import pytest

from gradops import cli, selftest
from gradops._backend import FAMILIES

from conftest import TEST_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fresh interpreters see neither pytest's TRITON_INTERPRET (conftest) nor the test device.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GRADOPS_TEST_DEVICE")}
# Triton made unimportable, as on a machine without it.
NO_TRITON = "import sys; sys.modules['triton'] = None; "


def gradops(*argv, env=None, prelude=""):
    """Run the gradops command in a fresh interpreter; returns (exit status, stdout, stderr)."""
    code = prelude + f"from gradops.cli import main; raise SystemExit(main({list(argv)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170,
                          cwd=ROOT, env={**CLEAN_ENV, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


def listed_backends(text: str, device: str = "cpu") -> dict:
    """family -> backends, from the '  <family> backends: a, b (how)' lines under a device."""
    block = text.split(f"device {device}:", 1)[1] if f"device {device}:" in text else text
    found = {}
    for family, names in re.findall(r"^  (\w+)\s+backends: (.*)$", block, re.M):
        found.setdefault(family, [n.split(" (")[0].strip() for n in names.split(", ") if n != "none"])
    return found


def ran_backends(text: str) -> set:
    """The backends of the result rows a selftest printed."""
    return set(re.findall(r"^\S.*?\s{2,}(reference|triton)\s{2,}", text, re.M))


def test_selftest_passes_on_reference_backend(capsys):
    # on the test device (selftest's own default is cuda wherever one is visible)
    rc = cli.main(["selftest", "--device", TEST_DEVICE, "--backend", "reference", "--dtype", "float64",
                   "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 failed" in out and "FAIL" not in out
    for op in ("layer_norm", "layer_norm_grad", "rms_norm", "nsa_compress", "floyd_attention"):
        assert op in out
    # a backend left out is named in the output and in the summary line
    assert f"triton: skipped on {TEST_DEVICE}: not selected" in out
    assert re.search(rf"^\d+ passed, 0 failed in .*; skipped: triton on {TEST_DEVICE}", out, re.M), out


def test_selftest_reports_failure_with_nonzero_exit(capsys, monkeypatch):
    def broken(dtype, device, backend):
        import torch
        return [("y", torch.ones(3), torch.zeros(3))]
    monkeypatch.setattr(selftest, "CASES", {**selftest.CASES, "rms_norm": [("rms_norm fwd+bwd", "(3,)", broken)]})
    rc = cli.main(["selftest", "--backend", "reference", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out


def test_info_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "gradops", "info"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=CLEAN_ENV)
    assert proc.returncode == 0, proc.stderr
    assert "gradops" in proc.stdout and "torch" in proc.stdout and "reference" in proc.stdout


@pytest.mark.parametrize("env", [{}, {"TRITON_INTERPRET": "0"}], ids=["default", "TRITON_INTERPRET=0"])
def test_info_and_selftest_list_the_same_backends(env):
    rc, info, err = gradops("info", env=env)
    assert rc == 0, err
    rc, test, err = gradops("selftest", "--device", "cpu", "--dtype", "float32", env=env)
    assert rc == 0, test + err
    listed = listed_backends(info)
    assert set(listed) == set(FAMILIES), info
    assert listed == listed_backends(test), (info, test)
    # and the selftest ran exactly what it listed
    assert ran_backends(test) == {b for names in listed.values() for b in names}, test
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    if env.get("TRITON_INTERPRET") == "0":
        assert all(names == ["reference"] for names in listed.values()), info
        assert "the Triton interpreter is off (TRITON_INTERPRET=0 is set" in info
        assert "skipped: triton on cpu: the Triton interpreter is off" in test
    else:  # the rule: the CPU runs the kernels through the interpreter
        assert all(names == ["reference", "triton"] for names in listed.values()), info


def test_selftest_without_triton_reports_the_skip_and_passes():
    # on the CPU, whose message this checks (selftest's default is cuda wherever one is visible)
    rc, out, err = gradops("selftest", "--device", "cpu", "--dtype", "float32", prelude=NO_TRITON)
    assert rc == 0, out + err
    hint = "triton is not installed (pip install 'gradops[triton]' / pip install triton)"
    assert f"triton: skipped on cpu: {hint}" in out
    summary = out.strip().splitlines()[-1]
    assert re.match(r"\d+ passed, 0 failed in .*; skipped: triton on cpu: triton is not installed", summary), summary
    assert ran_backends(out) == {"reference"}
    rc, info, err = gradops("info", prelude=NO_TRITON)
    assert rc == 0 and hint in info, info + err
    assert listed_backends(info) == listed_backends(out)


def test_selftest_fails_when_nothing_runs():
    rc, out, err = gradops("selftest", "--backend", "triton", "--dtype", "float32", prelude=NO_TRITON)
    assert rc == 1 and "0 passed, 0 failed" in out and "nothing ran" in err, out + err


def test_triton_3_6_interpreter_runs_with_this_numpy():
    """The GPU image's Triton (3.6) runs the kernels on the CPU with the NumPy installed here:
    its interpreter converts scalars with int() of a one-element array, which NumPy 2.4 refuses
    (every triton row of selftest and bench failed so on the GPU machine, 2026-11-25), and
    gradops takes the element instead (gradops/kernels/_interpreter.py), saying so in info."""
    import numpy as np

    from helpers import TRITON_3_6_ENV, triton_3_6_path

    old = triton_3_6_path()
    if not os.path.isdir(os.path.join(old, "triton")):
        pytest.skip(f"Triton 3.6 is not installed at {old} (.ci/run installs it; or set {TRITON_3_6_ENV})")
    env = {"PYTHONPATH": os.pathsep.join([old, ROOT])}
    rc, out, err = gradops("selftest", "--device", "cpu", "--dtype", "float32", env=env)
    assert rc == 0, out + err
    assert ran_backends(out) == {"reference", "triton"}, out
    rc, info, err = gradops("info", env=env)
    assert rc == 0 and "triton 3.6" in info, info + err
    try:
        int(np.ones(1))
        refused = False
    except TypeError:
        refused = True
    assert ("Triton interpreter: the interpreter of triton 3.6" in info) == refused, info
