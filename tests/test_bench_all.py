"""`gradops bench all` and the flags every `gradops bench FAMILY` shares: the wiring, on a
CPU (tiny shapes, kernels through the Triton interpreter); the GPU plan only as a dry run."""
import json
import os
import subprocess
import sys

import pytest

from gradops.bench import all as bench_all
from gradops.bench import floyd, harness, norm, nsa
from gradops.bench.harness import OURS, Goal, Record, Run


def test_dry_run_lists_the_gpu_plan_within_its_budget(capsys):
    assert bench_all.main(["--dry-run", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    for part in bench_all.GPU_PLAN:
        assert f"gradops bench {part.family} {' '.join(part.argv)}" in out
    assert f"budget {bench_all.GPU_BUDGET:.0f} s" in out
    # the shares are the budget: docs/gpu.md's arithmetic adds them up
    assert sum(p.share for p in bench_all.GPU_PLAN) == bench_all.GPU_BUDGET
    assert bench_all.GPU_BUDGET < 8 * 60


def test_dry_run_on_cpu_is_the_quick_plan(capsys):
    assert bench_all.main(["--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert all(p.name in out for p in bench_all.CPU_QUICK_PLAN) and "--interpret" in out


# The CPU runs switch the Triton interpreter on for their process: not in a suite whose other
# tests run compiled kernels on a GPU.
cpu_suite_only = pytest.mark.skipif(os.environ.get("GRADOPS_TEST_DEVICE", "cpu") != "cpu",
                                    reason="a CPU run (it would switch the Triton interpreter on)")
QUICK = ["--device", "cpu", "--quick", "--reps", "1", "--warmup", "1", "--max-seconds", "0.05"]


@cpu_suite_only
def test_quick_run_on_cpu_writes_one_folder_and_a_summary(tmp_path, capsys):
    rc = bench_all.main(QUICK + ["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "not GPU numbers" in out and "result: ok" in out
    names = {p.name for p in tmp_path.iterdir()}
    assert {"summary.json", "summary.txt", "norm.json", "nsa.json", "floyd.json"} <= names
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and set(summary["families"]) == {"norm", "nsa", "floyd"}
    for fam in summary["families"].values():
        assert fam["ours_measured"] > 0 and not fam["ours_failed"] and fam["peers"]
        assert all(g["status"].startswith("not evaluated") for g in fam["goals"])  # GPU goals, CPU run
    assert "liger" in summary["peers_not_usable"]["norm"]  # GPU only, and named as such
    data = json.loads((tmp_path / "norm.json").read_text())
    assert data["meta"]["backend_ours"] == "triton"  # the interpreter
    assert "not GPU numbers" in data["meta"]["note"]


def test_without_triton_ours_is_the_reference_and_says_why(tmp_path):
    code = ("import sys; sys.modules['triton'] = None; from gradops.bench.all import main; "
            f"raise SystemExit(main({QUICK + ['--only', 'norm', '--out', str(tmp_path)]!r}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "our Triton kernels are skipped: triton is not installed" in proc.stdout
    assert json.loads((tmp_path / "norm.json").read_text())["meta"]["backend_ours"] == "reference"


@cpu_suite_only
def test_a_spent_budget_skips_and_fails(tmp_path, capsys):
    rc = bench_all.main(["--device", "cpu", "--budget-seconds", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "SKIPPED norm" in out and "result: FAILED" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["ok"] and all(f["ours_measured"] == 0 for f in summary["families"].values())


@pytest.mark.parametrize("module", [norm, nsa, floyd], ids=["norm", "nsa", "floyd"])
def test_families_share_the_flags(module, tmp_path):
    args = module.parse_args(["--quick", "--dtype", "float32", "--out", str(tmp_path), "--tag", "t", "--no-plot",
                              "--interpret", "--budget-seconds", "5", "--max-seconds", "0.1"])
    args = module.prepare(args)
    assert args.dtypes == ["float32"] and args.out == str(tmp_path) and args.deadline is not None
    assert harness.output_dir(args) == (str(tmp_path), "")
    args.out = None
    folder, why = harness.output_dir(args)
    assert folder == harness.scratch_dir() and "not a result to commit" in why


@cpu_suite_only
def test_quick_without_out_writes_to_the_scratch_folder(capsys, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = norm.main(["--quick", "--device", "cpu", "--ops", "rms_bwd", "--dtype", "fp32", "--widths", "64",
                    "--numel", "256", "--peers", "autograd", "--reps", "1", "--tag", "t", "--no-plot"])
    out = capsys.readouterr().out
    path = tmp_path / "gradops-bench" / "t.json"
    assert rc == 0 and f"wrote {path}" in out and "not GPU numbers" in out
    assert json.loads(path.read_text())["meta"]["options"]["dtypes"] == ["float32"]


def _run(device_name, records):
    run = Run("t", "cpu")
    run.meta.update(device="cuda", device_name=device_name)
    for op, case, impl, ms, nbytes in records:
        run.add(Record(op, case, impl, [ms], nbytes))
    return run


def test_goals_are_read_off_the_records():
    case = {"dtype": "bf16", "M": 32768, "N": 4096}
    records = [("rms_bwd", case, OURS, 0.3, 3000e9 * 0.3e-3), ("rms_bwd", case, "torch.compile", 0.9, None)]
    h100 = _run("NVIDIA H100 80GB HBM3", records)
    fast = Goal("bw", ("rms_bwd",), "gbps", 2900.0).evaluate([h100])
    assert fast["status"] == "met" and fast["worst"] == pytest.approx(3000.0)
    assert Goal("bw", ("rms_bwd",), "gbps", 3100.0).evaluate([h100])["status"] == "missed"
    ratio = Goal("2x", ("rms_bwd",), "speedup:torch.compile", 2.0, gpu=None).evaluate([h100])
    assert ratio["status"] == "met" and ratio["worst"] == pytest.approx(3.0)
    assert Goal("x", ("ln_bwd",), "gbps", 1.0).evaluate([h100])["status"] == "not measured"
    assert Goal("x", ("rms_bwd",), "hbm_fraction", 0.8, gpu=None).evaluate([h100])["status"] == "met"  # 3000/3350
    h200 = _run("NVIDIA H200", records)
    assert Goal("bw", ("rms_bwd",), "gbps", 2900.0).evaluate([h200])["status"].startswith("not evaluated")
    assert Goal("x", ("rms_bwd",), "hbm_fraction", 0.8, gpu=None).evaluate([h200])["status"] == "missed"  # /4800
