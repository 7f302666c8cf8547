"""`gradops bench floydnet`: a step of FloydNet's blocks, FloydNet eager against gradops-patched, on a
CPU (launches counted with Triton launches stubbed, host time at the stand-in shape; tiny widths,
one L, 2 blocks); its JSON, its goals on a GPU run's records, its place in `bench all`."""
import json
import os
import types

import pytest
import torch

pytest.importorskip("floydnet")

import gradops  # noqa: E402
from gradops.bench import all as bench_all  # noqa: E402
from gradops.bench import floydnet as bench  # noqa: E402
from gradops.bench.harness import OURS, Record, Run  # noqa: E402
from gradops.bench.overhead import kernels_launched  # noqa: E402
from gradops.patch import PatchReport, Replaced  # noqa: E402

QUICK = ["--device", "cpu", "--quick", "--reps", "2", "--warmup", "1", "--max-seconds", "0.05", "--no-plot"]
# A CPU run switches the Triton interpreter on for its process (ours takes its Triton path, stubbed):
# not in a suite whose other tests run compiled kernels on a GPU
cpu_suite_only = pytest.mark.skipif(os.environ.get("GRADOPS_TEST_DEVICE", "cpu") != "cpu",
                                    reason="a CPU run (it switches the Triton interpreter on)")


def _run(tmp_path, *extra):
    rc = bench.main(QUICK + ["--out", str(tmp_path), "--tag", "t", *extra])
    data = json.loads((tmp_path / "t.json").read_text())
    return rc, data, {(r["case"]["task"], r["impl"]): r for r in data["records"]}


@cpu_suite_only
def test_cpu_run_counts_launches_and_host_time_with_the_patch_as_it_is(tmp_path, capsys):
    rc, data, records = _run(tmp_path, "--tasks", "count")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert data["benchmark"] == "floydnet" and "not GPU numbers" in data["meta"]["note"]
    assert data["meta"]["blocks"] == bench.QUICK_BLOCKS and "not run on a CPU" in data["meta"]["compiled"]
    assert data["meta"]["loss_disagreements"] == []
    assert set(records) == {("count", OURS), ("count", bench.PEER)}  # no compiled case on a CPU
    task = bench.QUICK_TASKS["count"]
    for rec in records.values():
        assert rec["case"] == {"task": "count", "L": task.lengths[0], "width": task.width, "heads": task.heads,
                               "blocks": bench.QUICK_BLOCKS, "dtype": "bfloat16", "compiled": False}
        e = rec["extra"]
        assert rec["times_ms"] and not rec["error"] and e["host_ms"] > 0
        assert e["launches"] > 0 and e["host_launches"] > 0 and sum(e["launch_names"].values()) == e["launches"]
        assert e["host_shape"] == {"L": bench.HOST_L, "width": task.heads * bench.HOST_HEAD_DIM, "heads": task.heads}
    # FloydNet eager launches only ATen kernels: its einsums (bmm), softmax, masked_fill, Linear's mm, ...
    floyd = records[("count", bench.PEER)]["extra"]
    assert floyd["launches_triton"] == 0 and floyd["launches_aten"] == floyd["launches"]
    assert {"aten::bmm", "aten::_softmax", "aten::masked_fill_", "aten::mm"} <= set(floyd["launch_names"])
    assert "aten::dropout" not in floyd["launch_names"]  # FloydNet's dropouts at p = 0 launch nothing
    ours = records[("count", OURS)]["extra"]
    assert ours["blocks_patched"] in (0, bench.QUICK_BLOCKS)  # the patch adopts every block, or (before it can) none
    if ours["blocks_patched"] == 0:
        assert ours["launches"] == floyd["launches"] and "adopted no PivotalAttentionBlock of count" in out
    else:
        assert ours["launches_triton"] >= 4 * bench.QUICK_BLOCKS  # each block: a forward, a dQ, two dK/dV


def _pivotal_attn(self, x, attn_mask):
    """FloydNet's attn with gradops.pivotal_attention: the test's stand-in for what gradops.patch does
    to an adopted block, to check the benchmark's plumbing whatever the patch does today."""
    b, n, _, c = x.shape
    q, k_ij, k_jk, v_ij, v_jk = (t.view(b, n, n, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)
                                 for t in self.c_qkv(x).chunk(5, dim=-1))
    y = gradops.pivotal_attention(q, k_ij, k_jk, v_ij, v_jk, attn_mask=attn_mask)
    return self.c_proj(y.permute(0, 2, 3, 1, 4).reshape(b, n, n, c))


def _stand_in_patch(model):
    report = PatchReport()
    for name, module in model.named_modules():
        if type(module).__name__ == "PivotalAttentionBlock":
            module.attn = types.MethodType(_pivotal_attn, module)
            report.replaced.append(Replaced(name, "floydnet.transformer.PivotalAttentionBlock", "stand-in"))
    return report


@cpu_suite_only
def test_patched_rows_count_the_blocks_the_report_names_and_our_triton_launches(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gradops, "patch", _stand_in_patch)
    rc, data, records = _run(tmp_path, "--tasks", "tsp")
    assert rc == 0, capsys.readouterr().out
    # the reference backend's loss (the check on a CPU) agrees with FloydNet's within bfloat16's bound
    assert data["meta"]["loss_disagreements"] == [] and data["meta"]["first_loss_backend_ours"] == "reference"
    ours, floyd = records[("tsp", OURS)]["extra"], records[("tsp", bench.PEER)]["extra"]
    assert ours["blocks_patched"] == bench.QUICK_BLOCKS and ours["left"] == []
    assert ours["first_loss"] == pytest.approx(floyd["first_loss"], rel=0.05)
    # our Triton kernels, stubbed, are counted by name: the fused strategy at these shapes, per block
    names = ours["launch_names"]
    assert names["_fwd_kernel"] == names["_bwd_dq_kernel"] == bench.QUICK_BLOCKS
    assert names["_bwd_dkv_kernel"] == 2 * bench.QUICK_BLOCKS
    assert ours["launches_triton"] == 4 * bench.QUICK_BLOCKS and "aten::bmm" not in names
    assert ours["launches"] < floyd["launches"]  # the einsums, softmax and mask of every block are gone


def test_inductor_kernel_ranges_count_as_launches():
    # torch.compile's kernels on a GPU run through Inductor's launcher, which opens a profiler range
    # named after the kernel; the counter takes those as launches (here the range is opened by hand)
    def call():
        with torch.profiler.record_function("triton_poi_fused_add_mul_0"):
            pass
        torch.zeros(4).add_(1.0)

    assert kernels_launched(call) == ["triton_poi_fused_add_mul_0", "aten::zero_", "aten::add_"]


def _gpu_run(ms: dict, peaks: dict) -> Run:
    run = Run("floydnet", "cpu")
    run.meta.update(device="cuda", device_name="NVIDIA H200")
    for compiled in (False, True):
        case = {"task": "tsp", "L": 100, "width": 384, "heads": 6, "blocks": 8, "dtype": "bfloat16",
                "compiled": compiled}
        peer = bench.COMPILED_PEER if compiled else bench.PEER
        ours = run.add(Record(bench.OP, case, OURS, [ms[(OURS, compiled)]], peak_bytes=peaks[(OURS, compiled)]))
        theirs = run.add(Record(bench.OP, case, peer, [ms[(peer, compiled)]], peak_bytes=peaks[(peer, compiled)]))
        ours.extra["peak_over_floydnet"] = ours.peak_bytes / theirs.peak_bytes
    return run


def test_goals_read_eager_against_eager_and_compiled_against_compiled():
    eager, compiled, memory = bench.GOALS
    ms = {(OURS, False): 10.0, (bench.PEER, False): 16.0, (OURS, True): 5.0, (bench.COMPILED_PEER, True): 4.5}
    peaks = {(OURS, False): 40, (bench.PEER, False): 100, (OURS, True): 60, (bench.COMPILED_PEER, True): 100}
    run = _gpu_run(ms, peaks)
    got = eager.evaluate([run])
    assert got["status"] == "met" and got["cases"] == 1 and got["worst"] == pytest.approx(1.6)
    got = compiled.evaluate([run])
    assert got["status"] == "missed" and got["worst"] == pytest.approx(0.9)
    got = memory.evaluate([run])
    assert got["status"] == "missed" and got["cases"] == 2 and got["worst"] == pytest.approx(0.6)
    cpu = _gpu_run(ms, peaks)
    cpu.meta.update(device="cpu")
    assert all(g.evaluate([cpu])["status"].startswith("not evaluated") for g in bench.GOALS)


def test_the_gpu_plan_runs_the_papers_configurations_eager_then_compiled():
    part = next(p for p in bench_all.GPU_PLAN if p.family == "floydnet")
    names = [p.name for p in bench_all.GPU_PLAN]
    assert names.index("model") < names.index(part.name)
    args = bench.prepare(bench.parse_args(list(part.argv) + ["--device", "cuda"]), need_device=False)
    assert [(t.name, t.width, t.heads, t.lengths) for t in bench._tasks(args)] == [
        ("tsp", 384, 6, (20, 50, 100, 200)), ("count", 768, 12, (32, 64))]
    assert bench._blocks(args) == 8 and args.dtypes == ["bfloat16"] and args.compile and args.batch == 1
    cases = bench.cases(args)
    assert len(cases) == 12 and [c[3] for c in cases] == [False] * 6 + [True] * 6
    assert bench.impl_names(args) == [OURS, bench.PEER, bench.COMPILED_PEER]
    cpu = bench.prepare(bench.parse_args(["--device", "cpu"]), need_device=False)
    assert not cpu.compile and cpu.check_backend == "reference" and len(bench.cases(cpu)) == 6
    assert bench.padded(20) == 2 and bench.padded(200) == 20 and bench.padded(8) == 1


def test_pair_mask_pads_the_last_nodes_and_the_stack_keeps_them_zero():
    x, mask = bench.make_inputs(1, 10, 4, "cpu")
    assert mask[0, :9, :9].eq(1).all() and mask[0, 9].eq(0).all() and mask[0, :, 9].eq(0).all()
    stack = bench.build_stack(4, 2, 2)
    torch.randn(3)  # the weights do not depend on the global RNG's state
    assert all(torch.equal(a, b) for a, b in zip(stack.parameters(), bench.build_stack(4, 2, 2).parameters()))
    y = stack(x, mask)
    assert y[0, 9].eq(0).all() and y[0, :, 9].eq(0).all() and y[0, :9, :9].ne(0).any()
