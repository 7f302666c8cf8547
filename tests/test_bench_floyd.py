"""`gradops bench floyd` (gradops/bench/floyd.py): both strategies measured beside the rule's
choice, the forward+backward direction, the default grid, the goals (read off synthetic
records, not timings), the memory bound, and the chunked row kernels compiled for sm_90.

The runs are CPU smoke runs at tiny shapes (ours through the Triton interpreter)."""
import json
import os

import pytest
import torch

from gradops.bench import floyd
from gradops.bench.harness import OURS, Goal, Record, Run, goal_lines

from helpers import run_sm90_compile

H100 = "NVIDIA H100 80GB HBM3"
on_cpu_suite = os.environ.get("GRADOPS_TEST_DEVICE", "cpu") == "cpu"
# --interpret switches the Triton interpreter on for the process: not in a GPU suite
cpu_suite_only = pytest.mark.skipif(not on_cpu_suite, reason="a CPU run (it switches the Triton interpreter on)")
FAST = ["--device", "cpu", "--quick", "--reps", "1", "--warmup", "1", "--max-seconds", "0.05", "--no-plot"]


def _goal(metric: str, text: str = "") -> Goal:
    return next(g for g in floyd.GOALS if g.metric == metric and text in g.text)


# ---------------------------------------------------------------------------------------------
# Both strategies, forward+backward
# ---------------------------------------------------------------------------------------------
@cpu_suite_only
def test_interpreted_quick_run_measures_both_strategies_and_names_the_rules_choice(tmp_path, capsys):
    from gradops.kernels import floyd_config, floyd_strategy

    shapes = [(1, 2, 8, 8, 8, 8), (1, 1, 4, 5, 6, 32)]  # float32: the rule picks fused, then hybrid
    argv = [*FAST, "--interpret", "--dtype", "float32", "--out", str(tmp_path), "--tag", "t",
            "--impl", *floyd.OUR_IMPLS, "einsum"]
    for shape in shapes:
        argv += ["--shape", ",".join(map(str, shape))]
    assert floyd.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert floyd_config.STRATEGY is None  # restored after every call
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["meta"]["backend_ours"] == "triton" and data["meta"]["directions"] == list(floyd.DIRECTIONS)
    assert data["meta"]["strategy_override"] is None
    rules = {shape: floyd_strategy.strategy(*shape, 4) for shape in shapes}
    assert set(rules.values()) == {"fused", "hybrid"}
    for shape, rule in rules.items():
        assert f"gradops ran {rule} (floyd_strategy's rule)" in out
        case = dict(zip("BHNMKD", shape))
        for impl, strategy in ((OURS, rule), *floyd.FORCED.items()):
            for direction in floyd.DIRECTIONS:
                (rec,) = [r for r in data["records"] if r["impl"] == impl and r["op"] == f"floyd_{direction}"
                          and all(r["case"][k] == v for k, v in case.items())]
                assert rec["error"] is None and rec["times_ms"], rec
                assert rec["extra"]["strategy"] == strategy
                assert rec["flops"] == floyd.FLOPS[direction](shape)
                assert "memory_bound_ratio" not in rec["extra"]  # no peak memory on a CPU
    assert floyd.fwdbwd_flops((1, 2, 3, 4, 5, 6)) == 28 * 720
    # the variants are compared with ours like any peer
    ratios = [r for r in data["ratios"] if r["impl"] in floyd.FORCED]
    assert len(ratios) == len(floyd.FORCED) * 3 * len(shapes) and all(r["speedup_of_ours"] for r in ratios)


def test_the_strategy_is_forced_inside_the_timed_calls_only():
    from gradops.kernels import floyd_config

    seen = []

    def call():
        seen.append(("call", floyd_config.STRATEGY))
        return 1

    def make_bwd():
        seen.append(("make", floyd_config.STRATEGY))
        return call

    def boom():
        seen.append(("boom", floyd_config.STRATEGY))
        raise RuntimeError("boom")

    makers = floyd._forcing("chunked", {"fwd": lambda: call, "bwd": make_bwd, "fwdbwd": lambda: boom})
    assert floyd_config.STRATEGY is None and not seen  # building forces nothing
    fwd, bwd, fwdbwd = makers["fwd"](), makers["bwd"](), makers["fwdbwd"]()
    assert floyd_config.STRATEGY is None and seen == [("make", "chunked")]
    assert fwd() == 1 and bwd() == 1 and floyd_config.STRATEGY is None
    with pytest.raises(RuntimeError):
        fwdbwd()
    assert floyd_config.STRATEGY is None  # restored when the call raises too
    assert seen == [("make", "chunked"), ("call", "chunked"), ("call", "chunked"), ("boom", "chunked")]
    with floyd.forced_strategy("fused"):  # what ran under a forced strategy: float64 runs fused
        assert floyd.rule_strategy((1, 1, 64, 64, 64, 64), 8, "chunked") == "fused"
        assert floyd_config.STRATEGY == "fused"
    assert floyd_config.STRATEGY is None


def test_only_the_directions_asked_for(tmp_path):
    assert floyd.main([*FAST, "--dtype", "float32", "--out", str(tmp_path), "--tag", "t", "--shape", "1,1,4,5,6,8",
                       "--impl", "reference", "einsum", "--direction", "fwdbwd"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert {r["op"] for r in data["records"]} == {"floyd_fwdbwd"}
    assert {r["impl"] for r in data["records"]} == {"reference", "einsum"} and not any(r["error"] for r in
                                                                                        data["records"])


def test_without_the_interpreter_on_a_cpu_none_of_ours_runs():
    args = floyd.prepare(floyd.parse_args(["--device", "cpu", "--quick"]), need_device=False)
    names = floyd.impl_names(args)
    assert not set(floyd.OUR_IMPLS) & set(names) and {"reference", "einsum"} <= set(names)
    args = floyd.prepare(floyd.parse_args(["--device", "cpu", "--quick", "--interpret"]), need_device=False)
    assert floyd.impl_names(args)[:len(floyd.OUR_IMPLS)] == list(floyd.OUR_IMPLS)


def test_compiled_is_floydnets_function_when_it_imports():
    fn, name = floyd.compiled_target()
    if floyd._floydnet() is None:
        assert fn is floyd.floyd_einsum and "not importable" in name
        return
    assert name == "floydnet.functional.pivotal_attention"
    (q, k1, v1, k2, v2), _, mask = floyd.make_inputs((1, 2, 3, 4, 5, 8), torch.float32, "cpu", True)
    assert torch.equal(fn(q, k1, v1, k2, v2, mask, 0.3), floyd.floydnet_pivotal(q, k1, v1, k2, v2, mask, 0.3))


# ---------------------------------------------------------------------------------------------
# The default grid and its budget
# ---------------------------------------------------------------------------------------------
def test_the_default_cuda_grid_is_the_issues():
    shapes = floyd.default_shapes(False, "cuda")
    assert len(shapes) == 12 and {s[1] for s in shapes} == {8}
    assert {s[5] for s in shapes} == {32, 64, 128} and {s[2] for s in shapes} == {128, 256, 512, 1024}
    assert all(s[2] == s[3] == s[4] and 1 <= s[0] <= 4 for s in shapes)
    assert [s[0] for s in shapes if s[5] == 128] == [4, 4, 2, 1]
    tflop = [floyd.fwd_flops(s) / 1e12 for s in shapes]
    assert 0.01 < min(tflop) and max(tflop) < 9
    args = floyd.prepare(floyd.parse_args(["--device", "cuda"]), need_device=False)
    assert args.budget_seconds == floyd.GRID_BUDGET_SECONDS and args.deadline is not None
    assert args.reps == 20 and args.max_seconds == 2.0
    args = floyd.prepare(floyd.parse_args(["--device", "cuda", "--budget-seconds", "60"]), need_device=False)
    assert args.budget_seconds == 60
    for argv in (["--shape", "1,8,512,512,512,64"], ["--quick"]):
        args = floyd.prepare(floyd.parse_args(["--device", "cuda", *argv]), need_device=False)
        assert args.budget_seconds is None and args.deadline is None


# ---------------------------------------------------------------------------------------------
# The memory bound
# ---------------------------------------------------------------------------------------------
def test_io_bytes_and_the_memory_bound_ratio(monkeypatch):
    from gradops.kernels import floyd_config

    shape = (1, 1, 2, 3, 4, 8)  # q/out/dy 2*3*8, k1/v1 2*4*8, k2/v2 4*3*8 elements
    qy, kv, stats = 48 * 2, (2 * 64 + 2 * 96) * 2, 2 * 6 * 4
    assert floyd.io_bytes("floyd_fwd", shape, 2) == (qy + kv, qy + stats)
    assert floyd.io_bytes("floyd_bwd", shape, 2) == (3 * qy + kv + stats, qy + kv)
    assert floyd.io_bytes("floyd_fwdbwd", shape, 2) == (2 * qy + kv, 2 * qy + stats + kv)
    assert floyd.io_bytes("floyd_fwd", shape, 2, masked=True)[0] == qy + kv + 2 * 4  # [B,1,N,1,K] bool
    assert floyd.io_bytes("floyd_fwd", shape, 8)[1] == 4 * qy + 2 * stats  # float64 statistics
    with pytest.raises(ValueError):
        floyd.io_bytes("floyd_x", shape, 2)
    inputs, outputs = floyd.io_bytes("floyd_bwd", shape, 2)
    assert floyd.memory_bound_ratio("floyd_bwd", shape, 2, 500, budget=1000) == (inputs + 500) / (
        inputs + outputs + 1000)
    # the default budget: the chunked strategy's on this machine (a forced one where set)
    this_machine = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_this = floyd_config.chunk_budget(floyd_config.total_memory(this_machine),
                                        floyd_config.pair_bytes(4, 8, 2) * 2 * 3, True)  # (a small grid)
    assert floyd.memory_bound("floyd_bwd", shape, 2) == (inputs, inputs + outputs + on_this)
    monkeypatch.setattr(floyd_config, "CHUNK_BUDGET_BYTES", 2 ** 31)
    assert floyd.memory_bound("floyd_bwd", shape, 2) == (inputs, inputs + outputs + 2 ** 31)
    # annotate: a record with a peak gets the ratio and the bound; one without (a CPU run) neither
    rec = floyd.annotate(Record("floyd_bwd", {}, OURS, [1.0], peak_bytes=500), shape, 2, False, "chunked",
                         budget=1000)
    assert rec.extra == {"strategy": "chunked", "memory_bound_bytes": inputs + outputs + 1000,
                         "memory_bound_ratio": pytest.approx((inputs + 500) / (inputs + outputs + 1000))}
    rec = floyd.annotate(Record("floyd_fwd", {}, OURS, [1.0]), shape, 2, False)
    assert rec.extra == {}
    # a realistic case: the chunked backward's inputs and gradients, its budget and its fp32 dK2/dV2 sums
    big = (1, 8, 1024, 1024, 1024, 128)
    inputs, outputs = floyd.io_bytes("floyd_bwd", big, 2)
    peak = outputs + 2 ** 31 + 2 * 1024 * 1024 * 128 * 4
    assert 1.0 < floyd.memory_bound_ratio("floyd_bwd", big, 2, peak) < floyd.MEMORY_BOUND


# ---------------------------------------------------------------------------------------------
# Error against float64, memory against torch.compile, compile time
# ---------------------------------------------------------------------------------------------
def relative_errors(results, reference):
    """max |x - ref| / max |ref| per whole tensor, in float64 (absolute where ref is all zero):
    the independent oracle of record_accuracy's slice-by-slice errors."""
    errors = []
    for x, ref in zip(results, reference):
        ref = ref.double()
        errors.append((x.double() - ref).abs().max().item() / (ref.abs().max().item() or 1.0))
    return errors


def test_relative_errors():
    ref = [torch.tensor([1.0, -4.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    got = [torch.tensor([1.5, -4.0]), torch.tensor([0.0, 0.5])]
    assert relative_errors(got, ref) == [0.125, 0.5]  # an all-zero reference: absolute


def test_record_accuracy_against_float64(device):
    """Ours and FloydNet's error against the float64 reference (slice by slice) on their
    fwdbwd records, and ours over FloydNet's: here ours is the float32 reference backend and
    the "FloydNet" the float16 einsum formulation, an order of magnitude apart; the errors
    are those of the whole tensors, computed here independently."""
    shape = (1, 2, 5, 6, 7, 8)
    case = {"shape": shape}
    inputs, dy, mask = floyd.make_inputs(shape, torch.float32, "cpu", True)  # drawn on the CPU, then moved
    inputs, dy, mask = [t.to(device) for t in inputs], dy.to(device), mask.to(device)
    builders = {OURS: lambda *a: floyd._gradops_fns("reference", *a),
                "floydnet": lambda i, g, mk, sc: floyd._autograd_fns(
                    lambda *t: floyd.floyd_einsum(*(x.half() for x in t[:5]), *t[5:]).float(), i, g, mk, sc)}
    bench = Run("floyd", device)
    for name in (OURS, "floydnet"):
        bench.add(Record("floyd_fwdbwd", case, name, [1.0]))
    bench.add(Record("floyd_fwd", case, OURS, [1.0]))
    floyd.record_accuracy(bench, case, builders, inputs, dy, mask, 0.3)
    ours, peer, fwd = bench.records
    assert len(ours.extra["rel_errors"]) == len(peer.extra["rel_errors"]) == 6
    import gradops
    wide = [t.double() for t in inputs]
    y, mx, sm = gradops.floyd_attention(*wide, mask, 0.3, backend="reference")
    reference = [y, *gradops.floyd_attention_grad(dy.double(), *wide, y, mx, sm, mask, 0.3, backend="reference")]
    got = floyd._forward_and_grads(builders[OURS](inputs, dy, mask, 0.3))
    assert ours.extra["rel_errors"] == pytest.approx(relative_errors(got, reference), rel=1e-9)
    assert ours.extra["max_rel_error"] < 1e-5 < 1e-4 < peer.extra["max_rel_error"] < 1e-2
    assert ours.extra["error_over_floydnet"] == ours.extra["max_rel_error"] / peer.extra["max_rel_error"] < 0.1
    assert fwd.extra == {}


def test_record_peak_over_compiled():
    case = {"N": 8}
    bench = Run("floyd", "cpu")
    bench.add(Record("floyd_fwdbwd", case, OURS, [1.0], peak_bytes=300))
    bench.add(Record("floyd_fwdbwd", case, floyd.CHUNKED, [1.0], peak_bytes=900))
    bench.add(Record("floyd_fwdbwd", case, "compiled", [1.0], peak_bytes=600))
    bench.add(Record("floyd_fwd", case, OURS, [1.0], peak_bytes=300))  # no compiled peer measured there
    floyd.record_peak_over_compiled(bench, case)
    assert [r.extra.get("peak_over_compiled") for r in bench.records] == [0.5, 1.5, None, None]


def test_compile_seconds_reports_a_failure_as_its_result():
    """The compile-time probe runs in a child process with an empty Triton cache; where it
    cannot run (CPU tensors with the interpreter off, on any machine) it returns the error,
    not a crash."""
    result = floyd.compile_seconds((1, 1, 2, 2, 2, 16), "float16", "cpu", "chunked")
    assert set(result) == {"error"} and result["error"]


@pytest.mark.skipif(on_cpu_suite, reason="compiles for the GPU (the CPU suite counts the specialisations from the "
                                         "launches: test_floyd_chunked.py::test_few_kernel_specialisations_per_step)")
def test_a_first_chunked_step_compiles_few_kernels_on_the_gpu():
    """What Triton itself compiled for a user's first chunked forward + backward (its cache
    of specialisations, in a fresh process): at most the 8 of
    test_few_kernel_specialisations_per_step, at its shape (without its mask: 8 as well)."""
    result = floyd.compile_seconds((1, 2, 36, 20, 16, 32), "float16", "cuda", "chunked")
    assert "error" not in result, result
    assert result["kernels"] is not None and 1 <= result["kernels"] <= 8, result


# ---------------------------------------------------------------------------------------------
# The goals, read off synthetic records
# ---------------------------------------------------------------------------------------------
def _case(d=128, n=512, dtype="bfloat16"):
    return {"B": 2, "H": 8, "N": n, "M": n, "K": n, "D": d, "dtype": dtype, "mask": False}


def _run(records, device_name=H100):
    run = Run("floyd", "cpu")
    run.meta.update(device="cuda", device_name=device_name, backend_ours="triton")
    for rec in records:
        run.add(rec)
    return run


def _timed(op, case, impl, ms, tflops=None, extra=None, error=None):
    shape = tuple(case[k] for k in "BHNMKD")
    flops = floyd.FLOPS[op[len("floyd_"):]](shape)
    if tflops is not None:
        ms = flops / (tflops * 1e12) * 1e3
    if error:
        return Record(op, case, impl, [], flops=flops, error=error)
    return Record(op, case, impl, [ms], flops=flops, extra=dict(extra or {}))


def test_the_tflops_goals_and_the_intermediate_bars():
    d128, d64 = _case(128), _case(64)
    run = _run([_timed("floyd_fwd", d128, OURS, None, 350.0), _timed("floyd_bwd", d128, OURS, None, 250.0),
                _timed("floyd_bwd", d64, OURS, None, 160.0), _timed("floyd_fwd", _case(128, dtype="float32"),
                                                                    OURS, None, 10.0)])
    status = {g.text: g.evaluate([run]) for g in floyd.GOALS}
    assert status["Floyd fwd >= 450 TFLOP/s bf16 at D = 128"]["status"] == "missed"
    assert status["Floyd bwd >= 300 TFLOP/s bf16 at D = 128"]["status"] == "missed"
    assert status["Floyd fwd >= 300 TFLOP/s bf16 at D = 128 (issue 11, intermediate)"]["status"] == "met"
    got = status["Floyd bwd >= 200 TFLOP/s bf16 at D = 128 (issue 11, intermediate)"]
    assert got["status"] == "met" and got["worst"] == pytest.approx(250.0) and got["cases"] == 1
    assert status["Floyd bwd >= 150 TFLOP/s bf16 at D = 32/64"]["status"] == "met"
    # read off ours (the rule's choice), not a forced strategy
    slow_forced = _run([_timed("floyd_fwd", d128, OURS, None, 350.0),
                        _timed("floyd_fwd", d128, floyd.FUSED, None, 1.0)])
    assert _goal("tflops", "fwd >= 300").evaluate([slow_forced])["status"] == "met"
    # absolute goals: an H100's; not evaluated on another GPU
    assert _goal("tflops", "fwd >= 300").evaluate([_run(run.records, "NVIDIA H200")])["status"].startswith(
        "not evaluated")


def test_the_einsum_speedup_goal_holds_where_einsum_fits_in_memory():
    goal = _goal("speedup:einsum")
    assert goal.gpu is None and set(goal.ops) == set(floyd.OPS)
    small, large, other = _case(n=256), _case(n=1024), _case(n=512)
    oom = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB. GPU 0 has a total capacity of "
           "79.10 GiB")
    records = [_timed("floyd_fwd", small, OURS, 1.0), _timed("floyd_fwd", small, "einsum", 3.0),
               _timed("floyd_fwd", large, OURS, 10.0), _timed("floyd_fwd", large, "einsum", 0, error=oom)]
    got = goal.evaluate([_run(records)])
    assert got["status"] == "met" and got["cases"] == 1 and got["excused"] == 1 and got["unevaluated"] == 0
    assert got["worst"] == pytest.approx(3.0)
    # the same goal without the excuse: the out-of-memory case leaves it incomplete
    strict = Goal(goal.text, goal.ops, goal.metric, goal.minimum, goal.applies, gpu=None)
    assert strict.evaluate([_run(records)])["status"] == "incomplete"
    # a compiler wrapping the out-of-memory error is excused too (case-insensitive text)
    wrapped = records[:3] + [_timed("floyd_fwd", large, "einsum", 0, error="BackendCompilerFailed: CUDA Out Of "
                                                                           "Memory while compiling")]
    assert goal.evaluate([_run(wrapped)])["status"] == "met"
    # any other failure of einsum, or a skip, is not
    for error in ("RuntimeError: boom", "skipped: the time budget was spent"):
        failed = records[:3] + [_timed("floyd_fwd", large, "einsum", 0, error=error)]
        assert goal.evaluate([_run(failed)])["status"] == "incomplete"
    # ours out of memory is never excused; slower than 2x einsum is missed
    ours_oom = records + [_timed("floyd_fwd", other, OURS, 0, error=oom), _timed("floyd_fwd", other, "einsum", 1.0)]
    got = goal.evaluate([_run(ours_oom)])
    assert got["status"] == "incomplete" and got["unevaluated"] == 1
    slow = records + [_timed("floyd_bwd", other, OURS, 1.0), _timed("floyd_bwd", other, "einsum", 1.5)]
    got = goal.evaluate([_run(slow)])
    assert got["status"] == "missed" and got["worst"] == pytest.approx(1.5) and got["worst_case"]["op"] == "floyd_bwd"
    # only bfloat16 cases; the other peers (the forced strategies included) are not read
    fp32 = _case(dtype="float32")
    assert goal.evaluate([_run([_timed("floyd_fwd", fp32, OURS, 1.0), _timed("floyd_fwd", fp32, "einsum", 1.0)])])[
        "status"] == "not measured"
    assert goal.evaluate([_run(records + [_timed("floyd_fwd", small, floyd.CHUNKED, 100.0)])])["status"] == "met"


def test_the_memory_goal_is_a_maximum_over_ours():
    goal = _goal("extra:memory_bound_ratio")
    assert goal.minimum is None and goal.maximum == floyd.MEMORY_BOUND
    a, b = _case(n=256), _case(n=512)
    within = [_timed("floyd_fwd", a, OURS, 1.0, extra={"memory_bound_ratio": 0.4}),
              _timed("floyd_bwd", b, OURS, 1.0, extra={"memory_bound_ratio": 1.05}),
              _timed("floyd_bwd", b, floyd.CHUNKED, 1.0, extra={"memory_bound_ratio": 5.0})]  # not ours: not read
    got = goal.evaluate([_run(within)])
    assert got["status"] == "met" and got["worst"] == pytest.approx(1.05) and got["worst_case"]["N"] == 512
    over = within + [_timed("floyd_fwdbwd", a, OURS, 1.0, extra={"memory_bound_ratio": 1.2})]
    got = goal.evaluate([_run(over)])
    assert got["status"] == "missed" and got["worst"] == pytest.approx(1.2)
    assert any("<= 1.1" in line and "missed" in line for line in goal_lines([got]))
    no_peak = within + [_timed("floyd_fwdbwd", a, OURS, 1.0)]  # a record without the value
    assert goal.evaluate([_run(no_peak)])["status"] == "incomplete"


def test_a_goal_has_a_minimum_or_a_maximum():
    for minimum, maximum in ((None, None), (1.0, 2.0)):
        with pytest.raises(ValueError):
            Goal("x", ("floyd_fwd",), "tflops", minimum, maximum=maximum)
    assert ">= 300" in goal_lines([_goal("tflops", "fwd >= 300").evaluate(
        [_run([_timed("floyd_fwd", _case(), OURS, None, 310.0)])])])[0]


# ---------------------------------------------------------------------------------------------
# The chunked strategy's row kernels and GEMM, compiled for an H100 (sm_90) without a GPU
# ---------------------------------------------------------------------------------------------
_CHUNKED_SM90 = r"""
import json, sys, torch
from gradops.bench.floyd import compile_check_gemm, compile_check_rows, ROW_CHECK_K
from gradops.kernels import floyd_config
for dtype in sys.argv[1:]:
    for k in ROW_CHECK_K:
        for row in compile_check_rows(getattr(torch, dtype), k):
            print(json.dumps(row), flush=True)
    for row in compile_check_rows(getattr(torch, dtype), 1, masked=False):
        print(json.dumps(row), flush=True)
    for row in compile_check_gemm(getattr(torch, dtype)):
        print(json.dumps(row), flush=True)
# the control: a single pivot without a mask, compiled with contraction allowed
floyd_config.ROW_FP_FUSION = True
floyd_config.row_config.cache_clear()
for row in compile_check_rows(getattr(torch, sys.argv[1]), 1, masked=False):
    print(json.dumps(dict(row, control=True)), flush=True)
"""
H100_SHARED = 227 * 1024


@pytest.mark.parametrize("triton_version", ["installed", "3.6"])
def test_chunked_kernels_compile_for_sm90_without_spills(triton_version):
    """The row kernels (no MMA) and every kind of GEMM launch (16-bit: tensor cores, which
    on sm_90 means wgmma, HGMMA in the SASS; float32: IEEE FMA), within an H100's shared
    memory and without a spill, in the GPU image's Triton and the newest. The row kernels
    round every product (no FMA in the PTX; floyd_config.ROW_FP_FUSION), which a single
    pivot's P = 1 rests on: the control, the K = 1 compile with contraction allowed, has
    FMAs, so the check can see them."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip("triton's bundled CUDA tools are not installed")
    stdout = run_sm90_compile("import triton; print(triton.__version__)\n" + _CHUNKED_SM90, "bfloat16", "float32",
                              timeout=600, triton_version=triton_version)
    version, *lines = stdout.splitlines()
    version = ".".join(version.split(".")[:2])
    rows = [json.loads(line) for line in lines]
    print("\n".join(map(json.dumps, rows)))
    control = [row for row in rows if row.get("control")]
    rows = [row for row in rows if not row.get("control")]
    assert len(control) == 2 and all("error" not in row and row["fma_f32"] > 0 for row in control), control
    gemms = [row for row in rows if row["kernel"].startswith("gemm")]
    assert len(rows) - len(gemms) == 2 * 2 * (len(floyd.ROW_CHECK_K) + 1) and len(gemms) == 2 * len(floyd.GEMM_CHECK)
    for row in rows:
        if row not in gemms:
            assert row["fma_f32"] == 0, (version, row)
        assert "error" not in row, row
        assert row["shared"] <= H100_SHARED, row
        assert row["spill_loads"] == row["spill_stores"] == 0, (version, row)
        tensor_cores = row in gemms and row["dtype"] == "bfloat16"
        assert (row["mma"] > 0) == tensor_cores, row
