"""`gradops bench model`: a training step of tiny HF models, unpatched, gradops-patched and
Liger-patched, on a CPU (Liger recorded as skipped, with the reason); the JSON it writes."""
import json
import os

import pytest

pytest.importorskip("transformers")

from gradops import cli  # noqa: E402
from gradops.bench import model as bench_model  # noqa: E402
from gradops.bench.harness import OURS  # noqa: E402

QUICK = ["--device", "cpu", "--quick", "--reps", "1", "--warmup", "1", "--max-seconds", "0.05", "--no-plot"]
# --interpret switches the Triton interpreter on for the process: not in a suite that runs compiled kernels
cpu_suite_only = pytest.mark.skipif(os.environ.get("GRADOPS_TEST_DEVICE", "cpu") != "cpu",
                                    reason="a CPU run (it would switch the Triton interpreter on)")


def test_quick_run_writes_its_json_and_says_where(tmp_path, capsys):
    rc = cli.main(["bench", "model"] + QUICK + ["--out", str(tmp_path), "--tag", "t"])
    out = capsys.readouterr().out
    path = tmp_path / "t.json"
    assert rc == 0, out
    assert f"wrote {path}" in out and "not GPU numbers" in out
    data = json.loads(path.read_text())
    assert data["benchmark"] == "model" and data["meta"]["backend_ours"] == "reference"
    assert data["meta"]["transformers"] and data["meta"]["loss_disagreements"] == []
    records = {(r["case"]["model"], r["impl"]): r for r in data["records"]}
    assert set(records) == {(m, i) for m in bench_model.MODELS for i in ("unpatched", OURS) + bench_model.LIGER}
    for m in bench_model.MODELS:
        ours, theirs = records[(m, OURS)], records[(m, "unpatched")]
        assert ours["times_ms"] and theirs["times_ms"] and not ours["error"] and not theirs["error"]
        assert ours["extra"]["patched"] == 5 and ours["extra"]["left"] == []  # 2 layers x 2 norms + the final one
        assert ours["extra"]["first_loss"] == pytest.approx(theirs["extra"]["first_loss"], rel=1e-5)
        assert ours["case"] == theirs["case"] and ours["case"]["hidden"] == bench_model.QUICK_SIZE[0]
        for impl in bench_model.LIGER:  # never faked: skipped, with the reason, no time
            liger = records[(m, impl)]
            assert not liger["times_ms"] and liger["error"] == "skipped: " + bench_model.liger_unusable(m, "cpu")
    ratios = {(r["case"]["model"], r["impl"]): r["speedup_of_ours"] for r in data["ratios"]}
    assert all(ratios[(m, "unpatched")] > 0 for m in bench_model.MODELS)


def test_without_out_it_writes_to_the_scratch_folder_and_says_so(capsys, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert bench_model.main(QUICK + ["--models", "llama", "--tag", "t"]) == 0
    path = tmp_path / "gradops-bench" / "t.json"
    assert f"wrote {path}" in capsys.readouterr().out and path.exists()


@cpu_suite_only
def test_interpret_runs_our_triton_kernels(tmp_path):
    assert bench_model.main(QUICK + ["--models", "gpt2", "--interpret", "--out", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["meta"]["backend_ours"] == "triton"
    assert next(r for r in data["records"] if r["impl"] == OURS)["times_ms"]


def test_registered_with_the_common_flags(capsys):
    assert "model" in cli.BENCH_FAMILIES
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "model", "--help"])
    assert e.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--device", "--dtype", "--quick", "--interpret", "--reps", "--budget-seconds", "--out", "--models"):
        assert flag in usage
    args = bench_model.prepare(bench_model.parse_args(["--device", "cpu"]))
    assert args.dtypes == ["float32"] and bench_model._size(args) == bench_model.CPU_SIZE


def test_liger_reasons(monkeypatch):
    """Each reason, whether or not liger_kernel is installed here (it is a bench extra, not a
    test one): its patch table is stood in for by a module that has Liger's name and table."""
    import sys
    import types

    table = types.ModuleType("liger_kernel.transformers.monkey_patch")
    table.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None}
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", table)
    assert "no patch for gpt2" in bench_model.liger_unusable("gpt2", "cuda")
    assert "need a GPU" in bench_model.liger_unusable("llama", "cpu")
    assert bench_model.liger_unusable("llama", "cuda") is None
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    assert "not importable" in bench_model.liger_unusable("llama", "cuda")


def test_compile_times_both_under_torch_compile_as_cases_of_their_own(tmp_path, monkeypatch):
    # --compile adds the unpatched and the gradops-patched model under torch.compile, as cases
    # with compiled=True (so each is compared with the other, not with an eager run). What
    # compiles here is not the point (a real compile of even the tiny model takes ~30 s on this
    # machine; `gradops bench model --quick --compile` runs it): torch.compile is recorded.
    import torch

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model: compiled.append(model) or model)
    assert bench_model.main(QUICK + ["--models", "gpt2", "--compile", "--out", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    cases = {(r["impl"], r["case"].get("compiled", False)) for r in data["records"] if r["times_ms"]}
    assert cases == {("unpatched", False), (OURS, False), ("unpatched", True), (OURS, True)}
    assert len(compiled) == 2 and sum(1 for r in data["ratios"] if r["case"].get("compiled")
                                      and r["speedup_of_ours"]) == 1


def test_first_losses_are_compared_eager_and_compiled_apart():
    # (the compiled records once overwrote the eager ones: an eager disagreement went unseen)
    from gradops.bench.harness import Record, Run

    run = Run("model", "cpu", None)
    for compiled, ours in ((False, 2.5), (True, 2.0)):
        case = {"model": "llama", "dtype": "float32", **({"compiled": True} if compiled else {})}
        for impl, loss in (("unpatched", 2.0), (OURS, ours)):
            rec = Record("train_step", case, impl, [1.0])
            rec.extra["first_loss"] = loss
            run.add(rec)
    assert bench_model.check_losses(run) == ["llama float32: gradops first loss 2.5 != unpatched 2"]
