"""The gradops command: selftest (the README's main job) and info."""
import subprocess
import sys

from gradops import cli, selftest


def test_selftest_passes_on_reference_backend(capsys):
    rc = cli.main(["selftest", "--backend", "reference", "--dtype", "float64", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 failed" in out and "FAIL" not in out
    for op in ("layer_norm", "layer_norm_grad", "rms_norm", "nsa_compress", "floyd_attention"):
        assert op in out


def test_selftest_reports_failure_with_nonzero_exit(capsys, monkeypatch):
    def broken(dtype, device, backend):
        import torch
        return [("y", torch.ones(3), torch.zeros(3))]
    monkeypatch.setattr(selftest, "CASES", {**selftest.CASES, "rms_norm": [("rms_norm fwd+bwd", "(3,)", broken)]})
    rc = cli.main(["selftest", "--backend", "reference", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out


def test_info_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "gradops", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gradops" in proc.stdout and "torch" in proc.stdout and "reference" in proc.stdout
