"""`gradops bench floyd3` (gradops/bench/floyd3.py): a CPU quick run writes valid JSON with ours and
FloydNet side by side (time and error per case), the goals are read off records as on a GPU,
argument errors, and the --memory harness sees FloydNet's quartic memory. CPU runs of ours on the
reference backend (no interpreter): the file stays under half a minute."""
import json

import pytest
import torch

from gradops import cli
from gradops.bench import floyd3, floyd3_accuracy
from gradops.bench.harness import OURS, Record, Run

pytest.importorskip("floydnet")

FAST = ["--device", "cpu", "--reps", "1", "--warmup", "1", "--max-seconds", "0.05", "--no-plot"]


def test_quick_cpu_run_writes_both_peers_side_by_side(tmp_path, capsys):
    assert cli.main(["bench", "floyd3", "--quick", *FAST, "--out", str(tmp_path), "--tag", "t"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert "not GPU numbers" in out and f"wrote {tmp_path / 't.json'}" in out
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["benchmark"] == "floyd3" and data["meta"]["backend_ours"] == "reference"
    assert data["meta"]["cpu_threads"] == 1  # --quick on a CPU: one intra-op thread
    cases = {(length, h) for length in floyd3.QUICK_LENGTHS for h in floyd3.HEADS}
    seen = set()
    for r in data["records"]:
        c = r["case"]
        seen.add((c["L"], c["H"]))
        assert c["B"] == 1 and c["D"] == floyd3.HEAD_DIM and c["dtype"] == "float32" and c["compiled"] is False
        assert r["impl"] in (OURS, floyd3.PEER) and r["error"] is None and r["times_ms"], r
        assert r["flops"] == floyd3.FLOPS[r["op"].split("_")[1]](1, c["H"], c["L"], c["D"])
        assert r["peak_bytes"] is None  # peak memory on a GPU only (--memory measures the CPU's)
        tensors = ["Y"] if r["op"] == "floyd3_fwd" else list(floyd3_accuracy.TENSORS)
        assert list(r["extra"]["rel_errors"]) == tensors
        assert 0 < r["extra"]["max_rel_error"] < 1e-5  # float32 against float64
        if r["impl"] == OURS:
            assert 0 < r["extra"]["error_over_floydnet"] < 10 and r["extra"]["tensor_error_over_floydnet"] > 0
    assert seen == cases
    assert len(data["records"]) == len(cases) * 2 * len(floyd3.DIRECTIONS)
    ratios = [r for r in data["ratios"] if r["impl"] == floyd3.PEER]
    assert len(ratios) == len(cases) * 2 and all(r["speedup_of_ours"] > 0 for r in ratios)
    # the GPU goals are listed, not evaluated on a CPU run
    assert [g["goal"] for g in data["goals"]] == [g.text for g in floyd3.GOALS]
    assert all(g["status"].startswith("not evaluated") for g in data["goals"])
    assert "err x" in out and "floyd3_fwdbwd" in out


def _gpu_run(records):
    run = Run("floyd3", "cpu")
    run.meta.update(device="cuda", device_name="NVIDIA H200")
    for rec in records:
        run.add(rec)
    return run


def _case(length=32, compiled=False, dtype="bfloat16"):
    return {"B": 1, "H": 8, "L": length, "D": 32, "dtype": dtype, "compiled": compiled}


def test_goals_are_read_off_the_records():
    speed, memory, error = floyd3.GOALS
    fast = _gpu_run([Record("floyd3_fwdbwd", _case(), OURS, [1.0], peak_bytes=10,
                            extra={"peak_over_floydnet": 0.1, "error_over_floydnet": 0.3}),
                     Record("floyd3_fwdbwd", _case(), floyd3.PEER, [2.5], peak_bytes=100)])
    assert speed.evaluate([fast])["status"] == "met" and speed.evaluate([fast])["worst"] == pytest.approx(2.5)
    assert memory.evaluate([fast])["status"] == "met" and error.evaluate([fast])["status"] == "met"
    slow = _gpu_run([Record("floyd3_fwd", _case(48), OURS, [1.0], extra={"peak_over_floydnet": 0.3}),
                     Record("floyd3_fwd", _case(48), floyd3.PEER, [1.5])])
    assert speed.evaluate([slow])["status"] == "missed" and memory.evaluate([slow])["status"] == "missed"
    # out of the goals: L past BREC's, compiled cases for the eager speed goal, float32 for the error
    other = _gpu_run([Record("floyd3_fwd", _case(96), OURS, [1.0], extra={"peak_over_floydnet": 0.9}),
                      Record("floyd3_fwd", _case(96), floyd3.PEER, [1.1]),
                      Record("floyd3_fwd", _case(compiled=True), OURS, [1.0]),
                      Record("floyd3_fwd", _case(compiled=True), floyd3.COMPILED_PEER, [1.1]),
                      Record("floyd3_fwdbwd", _case(dtype="float32"), OURS, [1.0], extra={"error_over_floydnet": 1})])
    assert speed.evaluate([other])["status"] == "not measured"
    assert memory.evaluate([other])["status"] == "not measured"
    assert error.evaluate([other])["status"] == "not measured"
    # FloydNet out of memory: excused from the speed goal
    oom = _gpu_run([Record("floyd3_fwd", _case(64), OURS, [1.0]),
                    Record("floyd3_fwd", _case(64), floyd3.PEER, [], error="OutOfMemoryError: CUDA out of memory")])
    assert speed.evaluate([oom])["excused"] == 1


def test_cases_and_defaults():
    args = floyd3.prepare(floyd3.parse_args(["--device", "cpu"]), need_device=False)
    assert args.dtypes == ["float32"] and not args.compile and args.threads is None
    assert [c[:2] for c in floyd3.cases(args)] == [(length, h) for h in floyd3.HEADS for length in floyd3.LENGTHS]
    args = floyd3.prepare(floyd3.parse_args(["--device", "cuda"]), need_device=False)
    assert args.dtypes == ["bfloat16", "float16"] and args.compile
    assert floyd3.impl_names(args) == [OURS, floyd3.PEER, floyd3.COMPILED_PEER]
    compiled = [c for c in floyd3.cases(args) if c[3]]
    assert len(compiled) == len(floyd3.cases(args)) // 2 and floyd3.cases(args)[-1][3]  # compiled after eager
    args = floyd3.prepare(floyd3.parse_args(["--device", "cuda", "--no-compile", "--lengths", "24", "--heads", "2"]),
                          need_device=False)
    assert not args.compile and floyd3.cases(args) == [(24, 2, "bfloat16", False), (24, 2, "float16", False)]
    assert floyd3.fwdbwd_flops(1, 2, 3, 4) == 3 * floyd3.fwd_flops(1, 2, 3, 4) == 36 * 2 * 81 * 4


@pytest.mark.parametrize("argv", [["--lengths", "0"], ["--heads", "two"], ["--head-dim", "-1"], ["--batch", "0"],
                                  ["--dtype", "half"], ["--direction", "bwd"], ["--memory-lengths", "0"],
                                  ["--accuracy", "--shape", "1,2,3,4,5,6"], ["--accuracy", "--backend", "cuda"]])
def test_argument_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        floyd3.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_modes_that_cannot_run_exit_2(tmp_path, monkeypatch, capsys):
    assert floyd3.main(["--accuracy", "--seeds", "0", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "--seeds must be at least 1" in capsys.readouterr().err
    assert floyd3.main(["--memory", "--device", "cuda"]) == 2
    assert "on the CPU" in capsys.readouterr().err
    from gradops.bench import traffic

    monkeypatch.delattr(traffic, "floyd3_main", raising=False)
    assert floyd3.main(["--traffic", "--quick"]) == 2
    assert "no floyd3_main" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(traffic, "floyd3_main", lambda argv: seen.append(argv) or 0, raising=False)
    # handed over whole, before our parser (its --shape takes B,H,L,D too)
    assert floyd3.main(["--traffic", "--shape", "1,1,8,16", "--json", "x"]) == 0
    assert seen == [["--traffic", "--shape", "1,1,8,16", "--json", "x"]]


def test_memory_harness_sees_floydnets_quartic_memory_and_ours_bounded():
    if not floyd3.peak_can_be_reset():
        pytest.skip("needs Linux's /proc/self/clear_refs and VmHWM")
    length = 48
    quartic = length ** 4 * 4  # one float32 [1, 1, L, L, L, L] tensor: 20 MiB
    ours = floyd3.measure_memory(OURS, "fwd", 1, 1, length, 4, timeout=120)
    theirs = floyd3.measure_memory(floyd3.PEER, "fwd", 1, 1, length, 4, timeout=120)
    assert "error" not in ours and "error" not in theirs, (ours, theirs)
    assert ours["returned"] == theirs["returned"] == length ** 3 * 4 * 4  # Y
    # FloydNet holds its scores and their softmax (measured: 66.6 MiB); ours a few tiles (8.2 MiB)
    assert theirs["held"] > 2 * quartic and ours["held"] < quartic / 2, (ours["held"], theirs["held"])
    lines = floyd3.memory_lines([ours, theirs])
    assert lines[1].split()[:2] == ["fwd", str(length)] and lines[1].split()[-1] == f"{quartic / 2**20:.1f}"


def test_memory_lines_name_a_failed_measurement():
    row = {"impl": floyd3.PEER, "direction": "fwdbwd", "B": 1, "H": 1, "L": 96, "D": 4, "dtype": "float32",
           "error": "exit -9 (killed: out of memory?)"}
    ours = dict(row, impl=OURS, held=2**20)
    del ours["error"]
    lines = floyd3.memory_lines([ours, row])
    assert "error" in lines[1] and lines[-1].endswith("exit -9 (killed: out of memory?)")


def test_the_bench_calls_both_with_floydnets_signature():
    inputs, dy = floyd3.make_inputs(1, 2, 3, 4, torch.float64, "cpu")
    ours = floyd3.makers(floyd3.pivotal(OURS, "reference", False), inputs, dy)
    theirs = floyd3.makers(floyd3.pivotal(floyd3.PEER, "reference", False), inputs, dy)
    expected = floyd3_accuracy.oracle(inputs, dy, None, floyd3_accuracy.default_scale((1, 2, 3, 3, 3, 3, 4)))
    for fns in (ours, theirs):
        assert floyd3_accuracy.relative_errors([fns["fwd"]()], expected[:1])[0] < 1e-12
        got = fns["fwdbwd"]()
        assert len(got) == 8 and max(floyd3_accuracy.relative_errors(got, expected)) < 1e-12


def test_takes_the_options_every_bench_takes(tmp_path):
    args = floyd3.prepare(floyd3.parse_args(["--quick", "--dtype", "fp16", "torch.bfloat16", "--out", str(tmp_path),
                                             "--tag", "t", "--no-plot", "--interpret", "--budget-seconds", "5",
                                             "--max-seconds", "0.1", "--reps", "2", "--warmup", "0", "--device",
                                             "cpu"]), need_device=False)
    assert args.dtypes == ["float16", "bfloat16"] and args.deadline is not None and args.threads == 1
    assert (args.reps, args.warmup, args.max_seconds, args.tag, args.out) == (2, 0, 0.1, "t", str(tmp_path))


def test_a_spent_budget_records_every_case_as_skipped(tmp_path, capsys):
    argv = [*FAST, "--quick", "--lengths", "4", "--heads", "1", "--budget-seconds", "0", "--out", str(tmp_path),
            "--tag", "t"]
    assert floyd3.main(argv) == 1
    assert "measurements skipped" in capsys.readouterr().err
    records = json.loads((tmp_path / "t.json").read_text())["records"]
    assert len(records) == 4 and all(r["skipped"] for r in records)
