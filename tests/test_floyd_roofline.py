"""The roofline of the Floyd attention strategies (gradops/kernels/floyd_roofline.py) and the rule
that ranks them by it (floyd_config.strategy).

The roofline's bytes are checked against the bytes the Triton interpreter counts
(gradops.bench.traffic: every masked-in lane of every load and store), launch by launch, for
every strategy, at shapes with tails, masks, several tiles along every axis and many chunks:
the model is the count, at shapes the interpreter cannot reach. Then the issue-32 traffic goal
at its shape, counted; and the rule: the shortest roofline among the strategies that can take
a call, a float64 call always fused, overrides.
"""
import os

import pytest
import torch

from gradops.kernels import floyd_config as config
from gradops.kernels import floyd_strategy
from gradops.kernels import floyd_roofline as roofline

ON_CPU = os.environ.get("GRADOPS_TEST_DEVICE", "cpu") == "cpu"
needs_interpreter = pytest.mark.skipif(not ON_CPU, reason="the traffic is counted through the Triton interpreter")


@pytest.fixture
def rule(monkeypatch):
    """floyd_config's rule alone: no override, from the environment either."""
    monkeypatch.setattr(config, "STRATEGY", None)
    monkeypatch.setattr(config, "HALF_BITS", None)
    monkeypatch.delenv("GRADOPS_FLOYD_STRATEGY", raising=False)
    monkeypatch.delenv("GRADOPS_FLOYD_HALF_BITS", raising=False)


# ---------------------------------------------------------------------------------------------
# The model is the count
# ---------------------------------------------------------------------------------------------
# (strategy, shape, dtype, masked, chunk budget or None): tails on every axis, K past the row
# kernels' and the fused kernels' steps, N past a GEMM block (128), many chunks splitting n and
# m; each strategy where its launches differ (the chunked GEMMs are the hybrid's kernel).
COUNTED = [
    ("hybrid", (2, 1, 17, 20, 40, 20), torch.float16, True, None),
    ("fused", (2, 1, 17, 20, 40, 20), torch.float16, True, None),
    ("hybrid", (1, 2, 9, 13, 70, 8), torch.float32, True, None),
    ("fused", (1, 2, 9, 13, 70, 8), torch.float32, True, None),
    ("hybrid", (2, 2, 13, 11, 9, 8), torch.bfloat16, True, 30000),
    ("chunked", (2, 2, 13, 11, 9, 8), torch.bfloat16, True, 30000),
    ("hybrid", (1, 1, 130, 2, 65, 16), torch.float16, True, None),
]


@needs_interpreter
@pytest.mark.parametrize("strategy,shape,dtype,masked,budget", COUNTED, ids=lambda x: str(x).replace(" ", ""))
def test_the_model_is_the_count(monkeypatch, strategy, shape, dtype, masked, budget):
    """Every launch of a forward and of a backward: the same kernel, and the same distinct and
    issued bytes loaded and stored, as the interpreter counts (no torch op moves data outside
    the launches)."""
    from gradops.bench import traffic

    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", budget)
    counted = traffic.floyd_traffic(shape, dtype, strategy, masked=masked)
    model = roofline.launches(strategy, shape, dtype, masked, config.total_memory(torch.device("cpu")))
    for key, direction in (("fwd", "forward"), ("bwd", "backward")):
        assert counted[key]["torch_ops"] == []
        got = [(c["kernel"], c["distinct_load"], c["distinct_store"], c["issued_load"], c["issued_store"])
               for c in counted[key]["launches"]]
        want = [(x.kernel, x.distinct_load, x.distinct_store, x.issued_load, x.issued_store)
                for x in model[direction]]
        assert got == want, (direction, got, want)


@needs_interpreter
@pytest.mark.parametrize("bits", [24])
def test_the_model_is_the_count_with_narrower_halves(monkeypatch, bits):
    """24-bit halves, a 16-bit and an 8-bit plane: the model's bytes per half follow HALF_BITS
    (16-bit halves are the top plane alone)."""
    from gradops.bench import traffic

    monkeypatch.setattr(config, "HALF_BITS", bits)
    shape, dtype = (1, 1, 20, 17, 12, 16), torch.bfloat16  # 16-bit halves: bfloat16 inputs only
    monkeypatch.setattr(config, "CHUNK_BUDGET_BYTES", config.hybrid_pair_bytes(12, 16, dtype) * 60)
    counted = traffic.floyd_traffic(shape, dtype, "hybrid", masked=True)
    model = roofline.launches("hybrid", shape, dtype, True)
    for key, direction in (("fwd", "forward"), ("bwd", "backward")):
        got = [(c["distinct_load"], c["distinct_store"], c["issued_load"], c["issued_store"])
               for c in counted[key]["launches"]]
        assert got == [(x.distinct_load, x.distinct_store, x.issued_load, x.issued_store) for x in model[direction]]


# ---------------------------------------------------------------------------------------------
# Issue 32's traffic goal, counted
# ---------------------------------------------------------------------------------------------
GOAL_SHAPE = (1, 2, 64, 64, 64, 16)  # D / L = 1/4, as at L = 512, D = 128


@needs_interpreter
@pytest.mark.slow
def test_the_strategy_the_rule_picks_at_l512_d128_moves_at_most_58_bytes_per_score(rule):
    """The rule gives bf16 B = 1, H = 8, N = M = K = 512, D = 128 to the hybrid strategy; its
    forward + backward, counted at the issue's shape in float16 (bf16 moves the same bytes),
    moves <= 58 distinct bytes per score (the chunked strategy of issue 25: 87.2)."""
    from gradops.bench import traffic

    assert floyd_strategy.strategy(1, 8, 512, 512, 512, 128, 2) == "hybrid"
    counted = traffic.floyd_traffic(GOAL_SHAPE, torch.float16, "hybrid")
    assert counted["total"]["distinct_per_score"] <= 58.0, counted["total"]
    scores = counted["scores"]
    model = roofline.launches("hybrid", GOAL_SHAPE, torch.float16)
    assert sum(x.distinct for d in model.values() for x in d) == counted["total"]["distinct"]
    chunked = roofline.launches("chunked", GOAL_SHAPE, torch.float16)
    assert sum(x.distinct for d in chunked.values() for x in d) / scores > 87.0


# ---------------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------------
GRID = [(b, 8, s, s, s, d) for d in (16, 32, 64, 128, 256) for s, b in ((64, 4), (128, 4), (256, 2), (512, 1), (1024, 1))]


def once(name, shape, dtype):
    """Whether ``name`` runs in one chunk at ``shape`` on the reference device: its launches, as
    the roofline lists them, are one chunk's (fused 4, hybrid 7, chunked 16)."""
    model = roofline.launches(name, shape, dtype, override=False)
    return sum(len(x) for x in model.values()) == {"fused": 4, "hybrid": 7, "chunked": 16}[name]


def test_rule_is_the_shortest_roofline_of_those_that_can_take_the_call(rule):
    """Past a small grid, among every strategy that can take the call; on a small grid, among
    those that run in one chunk where there is one."""
    small = [(1, 6, s, s, s, 64) for s in (20, 64, 100, 128)] + [(64, 6, s, s, s, 64) for s in (50, 128)]
    for shape in GRID + small + [(1, 1, 1, 1, 1, 8), (1, 1, 3, 1000, 7, 64), (2, 3, 200, 20, 2000, 96)]:
        for es, dtype in ((2, torch.bfloat16), (4, torch.float32)):
            candidates = config.runnable(shape[5], es)
            if config.small_grid(*shape[2:5]):
                candidates = [name for name in candidates if once(name, shape, dtype)] or candidates
            times = {name: roofline.roofline(name, shape, dtype, override=False).seconds for name in candidates}
            assert floyd_strategy.strategy(*shape, es) == min(candidates, key=lambda name: times[name]), (shape, es, times)


def test_launches_once_agrees_with_the_roofline_launches(rule):
    for shape in [(1, 6, 100, 100, 100, 64), (64, 6, 128, 128, 128, 64), (1, 1, 128, 128, 128, 256),
                  (512, 12, 128, 128, 128, 64), (1, 6, 129, 20, 20, 64)]:
        for dtype in (torch.bfloat16, torch.float32):
            for name in config.runnable(shape[5], dtype.itemsize):
                assert floyd_strategy.launches_once(name, shape, dtype, roofline.H100.memory) == once(name, shape, dtype)


def test_rule_at_the_headline_shapes(rule):
    """What the rule gives the shapes of the benchmark grid (bf16): the fused kernels at
    D = 16 and wherever the launches dominate; the hybrid strategy at D >= 32 past that; the
    chunked strategy only past the hybrid row kernels' widest head (and float32, where the
    FMA units bind and it executes fewer FLOP)."""
    assert floyd_strategy.strategy(1, 8, 512, 512, 512, 128, 2) == "hybrid"
    assert floyd_strategy.strategy(1, 8, 512, 512, 512, 64, 2) == "hybrid"
    assert floyd_strategy.strategy(1, 8, 512, 512, 512, 32, 2) == "hybrid"
    assert floyd_strategy.strategy(1, 8, 512, 512, 512, 16, 2) == "fused"
    assert floyd_strategy.strategy(1, 8, 256, 256, 256, 128, 2) == "hybrid"
    assert floyd_strategy.strategy(1, 1, 16, 16, 16, 32, 2) == "fused"
    assert floyd_strategy.strategy(1, 1, 2, 2, 2, 300, 2) == "chunked"


def test_hybrid_beats_chunked_wherever_both_take_a_16_bit_call_up_to_d128(rule):
    """For 16-bit inputs up to D = 128 the chunked strategy's roofline is never the shorter (the
    hybrid one moves fewer bytes in fewer launches). At D = 256 the row kernels' tiles are 64
    rows of m, their K1/V1 re-reads from L2 grow with D, and the chunked strategy can be the
    shorter: the rule weighs them there; and for float32, where the FMA units bind and the
    chunked strategy executes fewer FLOP."""
    for shape in GRID:
        hybrid = roofline.roofline("hybrid", shape, torch.bfloat16, override=False)
        chunked = roofline.roofline("chunked", shape, torch.bfloat16, override=False)
        assert hybrid.hbm_bytes < chunked.hbm_bytes, shape
        if shape[5] <= 128:
            assert hybrid.seconds < chunked.seconds, shape


def test_the_fused_roofline_is_under_its_measured_times(rule):
    """A roofline bounds a time from below: the fused kernels' roofline on an H100 is under what
    that H100 measured (floyd_config.MEASURED, forward + backward, 2026-11-25)."""
    for (b, h, n, d, es), (fused_ms, _) in config.MEASURED.items():
        estimate = roofline.roofline("fused", (b, h, n, n, n, d), torch.bfloat16, override=False)
        assert estimate.seconds * 1e3 < fused_ms, (b, h, n, d, estimate, fused_ms)


def test_rule_float64_is_always_fused(monkeypatch, rule):
    for d in (8, 64, 129, 512):
        assert floyd_strategy.strategy(64, 16, 256, 256, 256, d, 8) == "fused"
    for forced in ("chunked", "hybrid", "fused"):
        monkeypatch.setattr(config, "STRATEGY", forced)
        assert floyd_strategy.strategy(64, 16, 256, 256, 256, 300, 8) == "fused"
    monkeypatch.setattr(config, "STRATEGY", None)
    monkeypatch.setenv("GRADOPS_FLOYD_STRATEGY", "chunked")
    assert floyd_strategy.strategy(1, 1, 2, 2, 2, 300, 8) == "fused"


def test_runnable():
    """The fused kernels up to FUSED_MAX_WIDTH (16-bit D <= 64, float32 D <= 16), the hybrid
    strategy up to HYBRID_MAX_HEAD_DIM, the chunked one at any head dim."""
    assert config.runnable(64, 2) == ("fused", "hybrid", "chunked")
    assert config.runnable(65, 2) == config.runnable(256, 2) == config.runnable(17, 4) == ("hybrid", "chunked")
    assert config.runnable(16, 4) == ("fused", "hybrid", "chunked")
    assert config.runnable(257, 2) == config.runnable(1000, 4) == ("chunked",)


def test_rule_overrides(monkeypatch, rule):
    big, small = (4, 8, 512, 512, 512, 128, 2), (1, 1, 2, 2, 2, 8, 2)
    assert floyd_strategy.strategy(*big) == "hybrid" and floyd_strategy.strategy(*small) == "fused"
    monkeypatch.setenv("GRADOPS_FLOYD_STRATEGY", "chunked")
    assert config.forced_strategy() == "chunked" and floyd_strategy.strategy(*small) == "chunked"
    monkeypatch.setenv("GRADOPS_FLOYD_STRATEGY", "fused")
    assert floyd_strategy.strategy(*big) == "fused"
    monkeypatch.setattr(config, "STRATEGY", "hybrid")  # the attribute wins over the environment
    assert floyd_strategy.strategy(*small) == "hybrid"
    assert floyd_strategy.strategy(1, 1, 2, 2, 2, 300, 2) == "chunked"  # past the hybrid kernels' widest head
    monkeypatch.setattr(config, "STRATEGY", "fused")
    assert floyd_strategy.strategy(1, 1, 1, 1, 1, 128, 2) == "fused"  # forced means forced
    monkeypatch.setattr(config, "STRATEGY", None)
    monkeypatch.setenv("GRADOPS_FLOYD_STRATEGY", "")  # empty: not set
    assert config.forced_strategy() is None and floyd_strategy.strategy(*small) == "fused"


@pytest.mark.parametrize("where", ["attribute", "environment"])
def test_rule_bad_override_raises(monkeypatch, rule, where, device):
    from gradops.kernels import floyd_attention as kernels

    if where == "attribute":
        monkeypatch.setattr(config, "STRATEGY", "Chunked")
    else:
        monkeypatch.setenv("GRADOPS_FLOYD_STRATEGY", "tiled")
    with pytest.raises(ValueError, match="unknown Floyd strategy"):
        config.forced_strategy()
    with pytest.raises(ValueError, match="unknown Floyd strategy"):
        floyd_strategy.strategy(1, 1, 2, 2, 2, 8, 2)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=gen, device="cpu").to(torch.float16).to(device)
              for shape in [(1, 1, 2, 3, 8), (1, 1, 2, 4, 8), (1, 1, 2, 4, 8), (1, 1, 4, 3, 8), (1, 1, 4, 3, 8)]]
    with pytest.raises(ValueError, match="unknown Floyd strategy"):
        kernels.floyd_attention(*inputs, None, 1.0)
    assert floyd_strategy.strategy(1, 1, 2, 2, 2, 8, 8) == "fused"  # float64 never asks


def test_h100_plan_and_launches_at_the_headline_shape(rule):
    """bf16 B = 1, H = 8, N = M = K = 512, D = 128 on an H100: the hybrid strategy walks one
    slice per chunk, 8 chunks: 56 launches per forward + backward (<= 64)."""
    estimate = roofline.roofline("hybrid", (1, 8, 512, 512, 512, 128), torch.bfloat16, override=False)
    assert estimate.launches == 56


def test_the_roofline_command_prints_each_strategy_and_the_rules_pick(rule, capsys):
    from gradops.bench import floyd

    assert floyd.main(["--roofline", "--shape", "1,8,512,512,512,128", "--shape", "1,1,2,2,2,300"]) == 0
    lines = capsys.readouterr().out.splitlines()
    picked = [line for line in lines if " * " in line]
    assert len(picked) == 2 and "hybrid" in picked[0] and "chunked" in picked[1]
    assert any("chunked" in line and "256 launches" in line for line in lines)
    assert "56 launches" in picked[0]


def test_the_launch_term_is_the_h200_runs_floors():
    """LAUNCH_SECONDS: the median over the floors of the H200 run's ``bench overhead`` of each
    floor's median time over its launches; BOUND_LAUNCH_SECONDS takes off the binder's share of
    a JIT launch, read off that run's cProfile of 600 launches (JITFunction.run's cumulative time
    against the compiled launcher's within it)."""
    import json
    import pathlib
    import re
    import statistics

    run = pathlib.Path(__file__).parents[1] / "benchmarks" / "results" / "nvidia-h200-2026-11-28"
    floors = [r["median_ms"] * 1e-3 / len(r["extra"]["launches"])
              for r in json.loads((run / "overhead.json").read_text())["records"] if r["impl"] == "floor"]
    assert len(floors) == 6 and roofline.LAUNCH_SECONDS == pytest.approx(statistics.median(floors), abs=0.05e-6)
    assert roofline.H100.launch == roofline.LAUNCH_SECONDS
    profile = (run / "profile.txt").read_text()

    def cumulative(where):
        return float(re.search(r"\s600\s+\S+\s+\S+\s+(\S+)\s+\S+\s+\S*" + re.escape(where), profile).group(1))

    jit, launcher = cumulative("jit.py:370(<lambda>)"), cumulative("driver.py:700(__call__)")
    assert (jit, launcher) == (0.059, 0.018)
    assert roofline.BOUND_LAUNCH_SECONDS == pytest.approx(roofline.LAUNCH_SECONDS - (1 - launcher / jit) * 23.2e-6)
