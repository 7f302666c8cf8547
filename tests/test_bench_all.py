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


def test_the_gpu_plan_is_in_the_order_of_issue_33():
    """Norms and NSA first (host, eager, kernel time; bench overhead), then Floyd forward +
    backward at L = 512 and 256, D = 128 and 64, bfloat16, against FloydNet eager and compiled
    with memory and error, then a whole model step eager and compiled; the rest after."""
    names = [p.name for p in bench_all.GPU_PLAN]
    families = [p.family for p in bench_all.GPU_PLAN]
    first_floyd, model = families.index("floyd"), names.index("model")
    assert {"norm", "overhead", "nsa"} <= set(families[:first_floyd])
    floyd_part = bench_all.GPU_PLAN[first_floyd]
    args = floyd.prepare(floyd.parse_args(list(floyd_part.argv) + ["--device", "cuda"]), need_device=False)
    assert {(s[2], s[5]) for s, _ in floyd.cases(args)} == {(512, 128), (512, 64), (256, 128), (256, 64)}
    assert args.direction == ["fwdbwd"] and {"floydnet", "compiled"} <= set(args.impl) and args.accuracy
    assert "--compile" in bench_all.GPU_PLAN[model].argv and first_floyd < model


def test_a_short_budget_cuts_the_plan_from_its_end(capsys):
    parts = [bench_all.Part(n, "norm", (), share, "") for n, share in (("a", 10), ("b", 20), ("c", 30))]
    assert bench_all.part_deadlines(parts, 60) == [10, 30, 60]
    assert bench_all.part_deadlines(parts, 120) == [20, 60, 120]  # a longer budget stretches every share
    assert bench_all.part_deadlines(parts, 25) == [10, 25, 25]  # the first parts whole, the last ones cut
    assert bench_all.main(["--dry-run", "--device", "cuda", "--budget-seconds", "100"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["norm"][6] == "30" and rows["floyd"][6] == "100" and rows["model"][6] == "cut"


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
        # GPU goals on a CPU run, and ours through the interpreter: no goal is read off these times
        assert all(g["status"].startswith("not evaluated") or g["status"] == "not measured" for g in fam["goals"])
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
    rc = bench_all.main(["--device", "cpu", "--quick", "--budget-seconds", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "SKIPPED norm" in out and "result: FAILED" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["ok"] and all(f["ours_measured"] == 0 for f in summary["families"].values())


@cpu_suite_only
def test_an_interrupted_run_still_writes_its_summary(tmp_path, capsys, monkeypatch):
    """gpu_validate.sh stops a sweep that outlasts its call with SIGINT: the parts measured so
    far are kept, the one interrupted and the ones after are named, and the exit status is 1."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(nsa, "run", interrupted)
    rc = bench_all.main(QUICK + ["--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 1 and not summary["ok"]
    assert summary["families"]["norm"]["ours_measured"] > 0
    assert summary["crashed_parts"] == {"nsa": "interrupted (SIGINT) during part nsa",
                                        "floyd": "not run: interrupted (SIGINT) during part nsa"}
    assert "FAILED part floyd: not run: interrupted" in out


def test_dry_run_on_cpu_with_quick_is_the_interpreter_plan(capsys):
    assert bench_all.main(["--dry-run", "--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert all(p.name in out for p in bench_all.CPU_QUICK_PLAN) and "--interpret" in out


def test_dry_run_on_cpu_is_the_cpu_comparison(capsys):
    assert bench_all.main(["--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for part in bench_all.CPU_PLAN:
        assert f"gradops bench {part.family} {' '.join(part.argv)}" in out
    assert "--interpret" not in out and f"budget {bench_all.CPU_BUDGET:.0f} s" in out
    assert sum(p.share for p in bench_all.CPU_PLAN) == bench_all.CPU_BUDGET
    # the issue's CPU shapes, both dtypes, the eager and compiled peers; the call cost
    norm_part = next(p for p in bench_all.CPU_PLAN if p.name == "norm")
    args = norm.prepare(norm.parse_args(list(norm_part.argv) + ["--device", "cpu"]), need_device=False)
    assert {(m, n) for _, _, m, n in norm.cases(args)} == set(norm.CPU_SHAPES)
    assert {d for _, d, _, _ in norm.cases(args)} == {"float32", "bfloat16"}
    call = next(p for p in bench_all.CPU_PLAN if p.name == "norm-call")
    args = norm.prepare(norm.parse_args(list(call.argv) + ["--device", "cpu"]), need_device=False)
    assert {op for op, *_ in norm.cases(args)} == set(norm.CALL_OPS)
    assert norm.impl_names(args) == [OURS, norm.CALL_PEER]


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
    # a case the goal covers that gave no value (ours failed there, or no named peer ran) keeps
    # it from reading "met" on the cases that did
    other = {"dtype": "bf16", "M": 32768, "N": 8192}
    partial = _run("NVIDIA H100 80GB HBM3", records + [("rms_bwd", other, "torch.compile", 1.0, None)])
    partial.add(Record("rms_bwd", other, OURS, [], None, error="RuntimeError: boom"))
    got = Goal("2x", ("rms_bwd",), "speedup:torch.compile", 2.0, gpu=None).evaluate([partial])
    assert got["status"] == "incomplete" and got["cases"] == 1 and got["unevaluated"] == 1
    # a peer the goal reads that failed where another it reads ran: not "met" on the other alone
    two = Goal("eager", ("rms_bwd",), "speedup:torch.compile|aten bwd", 2.0, gpu=None)
    failed_peer = _run("NVIDIA H100 80GB HBM3", records)
    failed_peer.add(Record("rms_bwd", case, "aten bwd", [], None, error="RuntimeError: boom"))
    got = two.evaluate([failed_peer])
    assert got["status"] == "incomplete" and got["worst"] == pytest.approx(3.0)
    assert two.evaluate([h100])["status"] == "met"  # aten bwd did not run in that case: not read
    no_peer = _run("NVIDIA H100 80GB HBM3", records + [("rms_bwd", other, OURS, 0.3, None)])
    got = Goal("2x", ("rms_bwd",), "speedup:torch.compile", 2.0, gpu=None).evaluate([no_peer])
    assert got["status"] == "incomplete" and got["unevaluated"] == 1
    h200 = _run("NVIDIA H200", records)
    assert Goal("bw", ("rms_bwd",), "gbps", 2900.0).evaluate([h200])["status"].startswith("not evaluated")
    assert Goal("x", ("rms_bwd",), "hbm_fraction", 0.8, gpu=None).evaluate([h200])["status"] == "missed"  # /4800


def test_every_relative_goal_holds_on_any_gpu():
    # A goal relative to a peer, to the device's own peak or to our own kernel time means the same
    # on every GPU; only the absolute ones (GB/s, TFLOP/s) are set for the H100. (The overhead
    # goal was H100-only by mistake: the H200 run of 2026-11-28 left it unevaluated.)
    from gradops.bench import floydnet, model, overhead

    for module in (norm, nsa, floyd, overhead, model, floydnet):
        for goal in module.GOALS:
            if goal.metric not in ("gbps", "tflops"):
                assert goal.gpu is None, (module.__name__, goal.text)


def test_the_cpu_comparison_skips_when_the_budget_is_spent(tmp_path, capsys):
    rc = bench_all.main(["--device", "cpu", "--budget-seconds", "0", "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 1 and "the CPU comparison" in out and "SKIPPED norm" in out and "SKIPPED nsa" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["name"] for p in summary["plan"]] == [p.name for p in bench_all.CPU_PLAN]
    assert summary["kernels_skipped_on_cpu"] is None  # the interpreter was never switched on


def test_cpu_goals_are_evaluated_on_cpu_runs_only():
    case = {"dtype": "float32", "M": 8192, "N": 4096}
    records = [("rms_bwd", case, OURS, 2.0, None), ("rms_bwd", case, "torch autograd", 3.0, None),
               ("rms_bwd", case, "eager formula", 2.5, None), ("rms_bwd", case, "torch.compile", 1.0, None)]
    cpu = Run("t", "cpu")
    cpu.meta["backend_ours"] = "reference"
    for op, c, impl, ms, nbytes in records:
        cpu.add(Record(op, c, impl, [ms], nbytes))
    gpu = _run("NVIDIA H100 80GB HBM3", records)
    goal = next(g for g in norm.GOALS if g.device == "cpu" and g.ops == ("rms_bwd",))
    on_cpu = goal.evaluate([cpu])
    # the worst of the eager peers (torch.compile is not one of them): 2.5 / 2.0
    assert on_cpu["status"] == "met" and on_cpu["worst"] == pytest.approx(1.25) and on_cpu["cases"] == 1
    assert on_cpu["worst_case"] == {"op": "rms_bwd", **case}
    assert goal.evaluate([gpu])["status"] == "not evaluated (a CPU goal; this is a GPU run)"
    other = {"dtype": "float32", "M": 1024, "N": 4096}  # not one of the CPU shapes
    cpu2 = Run("t", "cpu")
    cpu2.add(Record("rms_bwd", other, OURS, [1.0]))
    cpu2.add(Record("rms_bwd", other, "torch autograd", [3.0]))
    assert goal.evaluate([cpu2])["status"] == "not measured"
    # the GPU goals stay off a CPU run; a goal on any device is read on both
    assert norm.GOALS[0].evaluate([cpu])["status"] == "not evaluated (a GPU goal; this is a CPU run)"
    anywhere = Goal("x", ("rms_bwd",), "speedup:torch autograd", 1.0, gpu=None, device="any")
    assert anywhere.evaluate([cpu])["status"] == anywhere.evaluate([gpu])["status"] == "met"
    # ours through the Triton interpreter is no timing: nothing is read off it
    cpu.meta["backend_ours"] = "triton"
    assert goal.evaluate([cpu])["status"].startswith("not evaluated (ours ran through the Triton interpreter")


# ---------------------------------------------------------------------------------------------
# The CPU comparison (without --quick): our CPU path against ATen, autograd and torch.compile
# ---------------------------------------------------------------------------------------------
def test_norm_on_cpu_defaults_to_the_cpu_shapes_and_the_call_cost():
    args = norm.prepare(norm.parse_args(["--device", "cpu"]), need_device=False)
    cases = norm.cases(args)
    assert {op for op, *_ in cases} == set(norm.CPU_OPS)
    assert {(m, n) for op, _, m, n in cases if op not in norm.CALL_OPS} == {(8192, 4096), (2048, 16384)}
    assert {(m, n) for op, _, m, n in cases if op in norm.CALL_OPS} == {(8, 64), (64, 256)}
    assert args.dtypes == ["float32", "bfloat16"] and args.peers == list(norm.PEERS)
    assert "torch.compile" in norm.impl_names(args)
    quick = norm.prepare(norm.parse_args(["--device", "cpu", "--quick"]), need_device=False)
    assert max(m * n for *_, m, n in norm.cases(quick)) <= norm.QUICK_NUMEL  # --quick stays tiny
    shapes = norm.parse_args(["--call-shapes", "2x8", "4X16"]).call_shapes
    assert shapes == [(2, 8), (4, 16)]


def test_norm_on_cpu_records_every_op_against_its_peers_with_ratios_and_goals(tmp_path):
    rc = norm.main(["--device", "cpu", "--dtype", "fp32", "--widths", "64", "--numel", "256", "--call-shapes", "2x8",
                    "--peers", "autograd", "aten", "--reps", "2", "--warmup", "1", "--max-seconds", "0.05",
                    "--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["meta"]["backend_ours"] == "reference"  # our CPU path
    peers = {(r["op"], r["impl"]) for r in data["ratios"] if r["speedup_of_ours"] is not None}
    assert {("rms_bwd", "torch autograd"), ("rms_bwd", "eager formula"), ("ln_bwd", "torch autograd"),
            ("ln_bwd", "aten bwd"), ("rms_fwd", "torch eager"), ("ln_fwd", "torch eager"), ("ln_fwd", "aten fwd"),
            ("ln_call", norm.CALL_PEER), ("rms_call", norm.CALL_PEER)} <= peers
    call = [r for r in data["records"] if r["op"] == "ln_call"]
    assert {r["case"]["M"] for r in call} == {2} and all(r["bytes"] is None for r in call)
    goals = {g["goal"]: g for g in data["goals"]}
    assert len(goals) == len(norm.GOALS)
    call_goal = goals["nn.functional fwd+bwd on tiny tensors within 1.3x of torch.nn.functional"]
    assert call_goal["status"] in ("met", "missed") and call_goal["cases"] == 2  # ln_call and rms_call
    for g in goals.values():
        if g["device"] == "cpu":
            assert g["status"] == "not measured"  # no case at the CPU shapes
        elif g["device"] == "cuda":
            assert g["status"].startswith("not evaluated")


def test_nsa_on_cpu_defaults_to_the_cpu_shape_without_the_reference_peer():
    args = nsa.prepare(nsa.parse_args(["--device", "cpu"]), need_device=False)
    assert {c[:5] for c in nsa.cases(args)} == {(16384, 8, 128, 32, 16)}
    assert args.dtypes == ["float32", "bfloat16"] and not args.interpret
    assert args.peers == ["autograd", "compile", "naive"]  # the reference is ours here
    quick = nsa.prepare(nsa.parse_args(["--device", "cpu", "--quick"]), need_device=False)
    assert "reference" in quick.peers and quick.interpret


def test_nsa_on_cpu_records_autograd_of_the_same_formula_with_ratios_and_goals(tmp_path):
    rc = nsa.main(["--device", "cpu", "--dtype", "fp32", "--tokens", "96", "--heads", "2", "--dims", "8",
                   "--blocks", "8x4", "--seqlen", "40", "--peers", "autograd", "naive", "--reps", "2",
                   "--warmup", "1", "--max-seconds", "0.05", "--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["meta"]["backend_ours"] == "reference"
    peers = {(r["op"], r["impl"]) for r in data["ratios"] if r["speedup_of_ours"] is not None}
    assert peers == {("nsa_compress_grad", "autograd(reference)"), ("nsa_compress_grad", "naive unfold (autograd)"),
                     ("nsa_compress", "naive unfold")}
    (cpu_goal,) = [g for g in data["goals"] if g["device"] == "cpu"]
    assert cpu_goal["status"] in ("met", "missed") and cpu_goal["cases"] == 2
    (gpu_goal,) = [g for g in data["goals"] if g["device"] == "cuda"]
    assert gpu_goal["status"].startswith("not evaluated")
