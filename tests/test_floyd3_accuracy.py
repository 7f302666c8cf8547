"""gradops.bench.floyd3_accuracy: 3-Floyd's error against float64, gradops' operator against FloydNet's
``pivotal_attention3``, float16, on 5 seeds, at floyd3_accuracy.DEFAULT_SHAPE (B,H,I,J,K,P,D =
1,2,6,5,7,48,32: I, J, K, P all different).

The goal: ours' error <= 0.5x FloydNet's on Y and on each of the seven gradients, on each seed.
It is asserted as such without a mask, for the reference backend and for the Triton backend (through
the interpreter on a CPU: about 25 s a seed). With FloydNet's padding mask the per-tensor goal is
out of reach of any float16 output at this shape (seed 4: FloydNet's own dQ error is at the
float16 rounding floor; floyd3_accuracy's docstring has the numbers): there the tests assert issue
32's reading (ours' largest error over the eight tensors <= 0.5x FloydNet's largest) and, for the
reference, that every tensor is correctly rounded (error <= 2^-11 of its largest element: the
floor itself).

The oracle is checked apart: float64, no gradops operator, and equal to gradops' own full-L^4
float64 oracle. Inputs are drawn from CPU generators and moved to the test device."""
import json

import pytest
import torch

import gradops
from gradops import oracles
from gradops._backend import has_triton_kernels
from gradops.bench import floyd3, floyd3_accuracy

pytest.importorskip("floydnet")

SHAPE = floyd3_accuracy.DEFAULT_SHAPE
TINY = (1, 2, 3, 4, 5, 6, 8)
FLOAT16_FLOOR = 2.0 ** -11  # half an ulp of float16, relative to a tensor's largest element

needs_kernels = pytest.mark.skipif(not has_triton_kernels("floyd3_attention"),
                                   reason="gradops/kernels/floyd3_attention.py does not exist (or triton does not import)")


def test_default_shape_has_four_different_lengths():
    b, h, i, j, k, p, d = SHAPE
    assert len({i, j, k, p}) == 4 and (b, d) == (1, 32)


def test_oracle_is_float64_equals_gradops_full_oracle_and_runs_no_gradops_operator(device, monkeypatch):
    inputs, dy, mask = floyd3_accuracy.draw(TINY, torch.float16, 3, masked=True, device=device)
    scale = floyd3_accuracy.default_scale(TINY)
    wide = [t.double() for t in inputs]
    expected = [oracles.floyd3_attention(*wide, mask, scale)[0],
                *oracles.floyd3_attention_backward(dy.double(), *wide, mask, scale)]

    def refuse(*args, **kwargs):
        raise AssertionError("the oracle called a gradops operator")

    monkeypatch.setattr(gradops, "floyd3_attention", refuse)
    monkeypatch.setattr(gradops, "floyd3_attention_grad", refuse)
    got = floyd3_accuracy.oracle(inputs, dy, mask, scale)
    assert [t.dtype for t in got] == [torch.float64] * 8
    assert [t.shape for t in got] == [t.shape for t in (dy, *inputs)]
    # two float64 formulations: autograd of FloydNet's formula and oracles' full scores
    assert max(floyd3_accuracy.relative_errors(got, expected)) < 1e-12


def test_draw_rounds_the_float32_draws_once():
    inputs, dy, mask = floyd3_accuracy.draw(TINY, torch.float16, 5, masked=True)
    b, h, i, j, k, p, d = TINY
    assert [tuple(t.shape) for t in inputs] == [(b, h, i, j, k, d), (b, h, p, j, k, d), (b, h, p, j, k, d),
                                                (b, h, i, p, k, d), (b, h, i, p, k, d), (b, h, i, j, p, d),
                                                (b, h, i, j, p, d)]
    wide, dy32, _ = floyd3_accuracy.draw(TINY, torch.float32, 5)
    assert all(torch.equal(a, w.to(torch.float16)) for a, w in zip(inputs, wide))
    assert torch.equal(dy, dy32.to(torch.float16))
    assert mask.shape == (b, 1, i, j, k, p) and mask.dtype == torch.bool


@pytest.mark.parametrize("impl", floyd3_accuracy.IMPLS)
def test_float64_runs_are_float64_roundoff(impl, device):
    found = floyd3_accuracy.measure([impl], TINY, torch.float64, 1, "reference", masked=True, device=device)[impl]
    assert list(found["rel_errors"]) == list(floyd3_accuracy.TENSORS)
    assert found["max_rel_error"] == max(found["rel_errors"].values()) < 1e-12


def test_run_impl_rejects_an_unknown_implementation():
    with pytest.raises(ValueError, match="unknown implementation"):
        floyd3_accuracy.run_impl("einsum", (), None, None, 1.0)


def test_floydnet_gets_a_finite_inf_in_float16():
    assert floyd3_accuracy.floydnet_inf(torch.float16) == 1e4 and floyd3_accuracy.floydnet_inf("bfloat16") == 1e9


def _check_goal(row):
    assert row["ratio_tensor"] in floyd3_accuracy.TENSORS and set(row["ratios"]) == set(floyd3_accuracy.TENSORS)
    assert all(e > 0 for e in row["ours_rel_errors"].values()), row
    assert row["ratio"] == max(row["ratios"].values())
    assert row["ratio"] <= floyd3_accuracy.GOAL_RATIO and not floyd3_accuracy.fails(row), row


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_float16_reference_error_per_tensor_is_at_most_half_floydnets(seed, device):
    (row,) = floyd3_accuracy.compare(SHAPE, torch.float16, [seed], "reference", device=device)
    _check_goal(row)
    assert max(row["ours_rel_errors"].values()) <= FLOAT16_FLOOR * 1.01  # correctly rounded


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_float16_reference_with_a_padding_mask_is_correctly_rounded_and_half_floydnets_largest(seed, device):
    (row,) = floyd3_accuracy.compare(SHAPE, torch.float16, [seed], "reference", masked=True, device=device)
    assert row["inf"] == 1e4 and row["masked"]
    assert max(row["ours_rel_errors"].values()) <= FLOAT16_FLOOR * 1.01
    assert 0 < row["max_ratio"] <= floyd3_accuracy.GOAL_RATIO, row


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_float16_triton_error_per_tensor_is_at_most_half_floydnets(seed, device):
    (row,) = floyd3_accuracy.compare(SHAPE, torch.float16, [seed], "triton", device=device)
    _check_goal(row)


@needs_kernels
@pytest.mark.slow
def test_float16_triton_with_a_padding_mask_is_at_most_half_floydnets_largest(device):
    (row,) = floyd3_accuracy.compare(SHAPE, torch.float16, [0], "triton", masked=True, device=device)
    assert 0 < row["max_ratio"] <= floyd3_accuracy.GOAL_RATIO, row


def test_fails_names_each_tensor_over_the_goal():
    errors = dict.fromkeys(floyd3_accuracy.TENSORS, 1e-4)
    row = {"ours_rel_errors": dict(errors, dQ=2e-4, dV3=1e-5),
           "ratios": floyd3_accuracy.tensor_ratios(dict(errors, dQ=2e-4, dV3=1e-5), dict(errors, dV3=0.0))}
    assert row["ratios"]["dV3"] is None and row["ratios"]["Y"] == 1.0
    assert floyd3_accuracy.fails(row) == ["Y", "dQ", "dK1", "dV1", "dK2", "dV2", "dK3", "dV3"]
    ok = {"ours_rel_errors": dict(errors, dV3=0.0),
          "ratios": floyd3_accuracy.tensor_ratios(dict(errors, dV3=0.0), dict.fromkeys(errors, 4e-4) | {"dV3": 0.0})}
    assert floyd3_accuracy.fails(ok) == []


def test_cli_prints_a_line_per_seed_writes_json_and_fails_over_the_goal(tmp_path, device, monkeypatch, capsys):
    argv = ["--accuracy", "--device", str(device), "--shape", ",".join(map(str, TINY)), "--dtype", "fp16",
            "--seeds", "2", "--backend", "reference", "--mask", "--out", str(tmp_path), "--tag", "t"]
    monkeypatch.setattr(floyd3_accuracy, "GOAL_RATIO", 10.0)  # the CLI's wiring, not the goal at a tiny shape
    assert floyd3.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "seed 0: ours" in out and "seed 1: ours" in out and "worst per-tensor ratio" in out and "dV3" in out
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["backend"] == "reference" and [r["seed"] for r in data["rows"]] == [0, 1]
    assert all(r["masked"] and r["inf"] == 1e4 and r["ratio"] > 0 and r["max_ratio"] > 0 for r in data["rows"])

    monkeypatch.setattr(floyd3_accuracy, "GOAL_RATIO", 0.0)  # every tensor over the goal
    assert floyd3.main(argv + ["--seeds", "1"]) == 1
    assert "over the goal: seed 0" in capsys.readouterr().err
