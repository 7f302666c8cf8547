"""gradops.bench.traffic: the memory traffic of Triton launches, counted through the Triton
interpreter, checked against what tiny kernels written here must move (derived by hand from
their loads and stores, not from the counter's output), the torch operations around the
launches, and Floyd attention's first chunked GEMM, whose float32 scores are 4 bytes each.

The counter runs the kernels in the interpreter: CPU runs only, at tiny shapes."""
import os
import subprocess
import sys

import pytest

if os.environ.get("GRADOPS_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("the traffic counter runs the kernels through the Triton interpreter: a CPU run",
                allow_module_level=True)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gradops.bench import floyd, traffic  # noqa: E402
from gradops.bench.traffic import count_traffic  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _load_twice_store_once(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(x_ptr + offs, mask=inside)
    b = tl.load(x_ptr + offs, mask=inside)
    tl.store(y_ptr + offs, a + b, mask=inside)


@triton.jit
def _store_only(y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.full([BLOCK], 1.0, tl.float32).to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _atomic_add(x_ptr, total_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(x_ptr + offs, 1.0, mask=offs < n)  # each element once
    tl.atomic_add(total_ptr, 1.0)  # one element, once per program


@triton.jit
def _reread_row(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """Every program loads the same row of x and stores its own row of y."""
    cols = tl.arange(0, BLOCK)
    tl.store(y_ptr + tl.program_id(0) * BLOCK + cols, tl.load(x_ptr + cols))


@triton.jit
def _load_range(p_ptr, first, count, BLOCK: tl.constexpr):
    """Loads elements [first, first + count) of p (count <= BLOCK); stores nothing."""
    offs = first + tl.arange(0, BLOCK)
    tl.load(p_ptr + offs, mask=offs < first + count)


@triton.jit
def _two_views(a_ptr, b_ptr, a_first, a_count, b_first, b_count, BLOCK: tl.constexpr):
    """Loads elements [a_first, +a_count) through a, then [b_first, +b_count) through b."""
    _load_range(a_ptr, a_first, a_count, BLOCK)
    _load_range(b_ptr, b_first, b_count, BLOCK)


@triton.jit
def _load_shifted(x_ptr, BLOCK: tl.constexpr):
    """Loads x's BLOCK float32 elements, then BLOCK - 1 float32 values 2 bytes further on."""
    offs = tl.arange(0, BLOCK)
    tl.load(x_ptr + offs)
    shifted = (x_ptr.to(tl.pointer_type(tl.int8)) + 2).to(tl.pointer_type(tl.float32))
    tl.load(shifted + offs, mask=offs < BLOCK - 1)


def _one(t: traffic.Traffic) -> traffic.LaunchTraffic:
    assert len(t.launches) == 1, t.launches
    return t.launches[0]


# ---------------------------------------------------------------------------------------------
# Tiny kernels: what each must move
# ---------------------------------------------------------------------------------------------
def test_two_loads_of_a_tensor_count_once_distinct_and_twice_issued():
    x, y = torch.randn(100), torch.empty(100)
    _, t = count_traffic(lambda: _load_twice_store_once[(4,)](x, y, 100, BLOCK=32))  # 128 lanes, 100 in
    launch = _one(t)
    assert launch.kernel == "_load_twice_store_once"
    assert (launch.distinct_load, launch.issued_load) == (400, 800)
    assert (launch.distinct_store, launch.issued_store) == (400, 400)
    assert launch.by_arg == {"x_ptr": traffic.ArgTraffic(400, 0, 800, 0), "y_ptr": traffic.ArgTraffic(0, 400, 0, 400)}
    assert torch.equal(y, 2 * x)  # the kernel ran as without the counter
    assert (t.distinct, t.issued) == (800, 1200) and t.torch_ops == []


def test_masked_out_lanes_are_not_counted():
    x, y = torch.randn(100), torch.zeros(100)
    _, t = count_traffic(lambda: _load_twice_store_once[(4,)](x, y, 50, BLOCK=32))  # half of x's lanes
    launch = _one(t)
    assert (launch.distinct_load, launch.issued_load, launch.distinct_store) == (200, 400, 200)


def test_a_store_only_kernel_loads_nothing():
    y = torch.empty(70, dtype=torch.float16)
    _, t = count_traffic(lambda: _store_only[(3,)](y, 70, BLOCK=32))
    launch = _one(t)
    assert (launch.distinct_load, launch.issued_load) == (0, 0)
    assert (launch.distinct_store, launch.issued_store) == (140, 140)  # float16: 2 bytes an element
    assert list(launch.by_arg) == ["y_ptr"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_element_size_comes_from_the_pointer_type(dtype):
    x, y = torch.randn(64).to(dtype), torch.empty(64, dtype=dtype)
    _, t = count_traffic(lambda: _load_twice_store_once[(2,)](x, y, 64, BLOCK=32))
    size = torch.finfo(dtype).bits // 8
    assert _one(t).distinct_load == 64 * size and _one(t).issued_store == 64 * size


def test_an_atomic_counts_as_a_load_and_a_store_of_its_lanes():
    x, total = torch.zeros(40), torch.zeros(1)
    _, t = count_traffic(lambda: _atomic_add[(3,)](x, total, 40, BLOCK=16))  # 48 lanes, 40 in; 3 programs
    launch = _one(t)
    assert torch.equal(x, torch.ones(40)) and total.item() == 3
    assert launch.by_arg["x_ptr"] == traffic.ArgTraffic(160, 160, 160, 160)
    # the one element of total: 4 bytes distinct, each of the 3 programs issues it
    assert launch.by_arg["total_ptr"] == traffic.ArgTraffic(4, 4, 12, 12)
    assert (launch.distinct_load, launch.issued_store) == (164, 172)


def test_a_row_reread_by_every_program_counts_once_distinct():
    x, y = torch.randn(32), torch.empty(5, 32)
    _, t = count_traffic(lambda: _reread_row[(5,)](x, y, BLOCK=32))
    launch = _one(t)
    assert (launch.distinct_load, launch.issued_load) == (128, 5 * 128)
    assert (launch.distinct_store, launch.issued_store) == (5 * 128, 5 * 128)


def test_overlapping_views_go_to_the_first_argument_and_strays_to_other():
    buf = torch.zeros(96)
    a, b = buf[0:64], buf[32:96]  # elements 32..63 lie in both
    # through b: buf[32:96], of which buf[32:64] is also in a (first in argument order)
    _, t = count_traffic(lambda: _two_views[(1,)](a, b, 0, 0, 0, 64, BLOCK=64))
    assert _one(t).by_arg == {"a_ptr": traffic.ArgTraffic(128, 0, 128, 0), "b_ptr": traffic.ArgTraffic(128, 0, 128, 0)}
    # a = buf[0:16] alone: reading buf[16:48] through it reads past its extent
    small = buf[0:16]
    _, t = count_traffic(lambda: _two_views[(1,)](small, small, 0, 16, 16, 32, BLOCK=32))
    assert _one(t).by_arg == {"a_ptr": traffic.ArgTraffic(64, 0, 64, 0), traffic.OTHER: traffic.ArgTraffic(128, 0, 128, 0)}
    assert _one(t).distinct_load == 192


def test_a_views_extent_follows_its_strides():
    buf = torch.zeros(4, 8)
    col = buf[:, 2]  # stride 8: its range runs from buf[0, 2] to buf[3, 2]
    assert traffic.extent_bytes(col) == (3 * 8 + 1) * 4
    _, t = count_traffic(lambda: _two_views[(1,)](col, col, 0, 0, 8, 8, BLOCK=8))  # buf[1, 2:10]: inside col's range
    assert _one(t).by_arg == {"a_ptr": traffic.ArgTraffic(32, 0, 32, 0)}


def test_overlapping_ranges_of_mixed_element_sizes_count_their_union():
    x = torch.zeros(64)  # 256 bytes
    halves = x.view(torch.float16)
    # through the float16 view: halves 0..63, bytes [0, 128); through x: floats 16..47, bytes [64, 192)
    _, t = count_traffic(lambda: _two_views[(1,)](halves, x, 0, 64, 16, 32, BLOCK=64))
    launch = _one(t)
    assert launch.issued_load == 128 + 128
    assert launch.distinct_load == 192  # the union [0, 192)
    assert sum(a.distinct_load for a in launch.by_arg.values()) == 192


def test_overlapping_ranges_of_one_element_size_count_their_union():
    x = torch.zeros(16)
    _, t = count_traffic(lambda: _load_shifted[(1,)](x, BLOCK=16))
    launch = _one(t)
    # x's 16 floats, then 15 floats 2 bytes further: the second range lies inside the first
    assert (launch.distinct_load, launch.issued_load) == (64, 64 + 60)


# ---------------------------------------------------------------------------------------------
# Torch operations outside the launches
# ---------------------------------------------------------------------------------------------
def test_a_copy_outside_a_launch_counts_its_read_and_write():
    x = torch.randn(8, 16)
    out, t = count_traffic(lambda: x.t().contiguous())
    assert out.is_contiguous()
    assert [(op.read, op.write) for op in t.torch_ops] == [(512, 512)]
    assert (t.distinct, t.issued) == (1024, 1024) and t.launches == []


def test_allocations_and_views_move_nothing():
    x = torch.randn(8, 16)
    _, t = count_traffic(lambda: (torch.empty(100), x.view(16, 8), x.t(), x[1:3], x.unsqueeze(0), x.reshape(128),
                                  x.detach(), x.expand(2, 8, 16), torch.empty_like(x)))
    assert t.torch_ops == []


def test_fills_and_conversions_count_what_they_write_and_read():
    x = torch.randn(8, 16)
    y = torch.empty(8, 16)
    _, t = count_traffic(lambda: (y.fill_(1.0), y.copy_(x.t().t()), x.to(torch.float16)))
    assert [(op.read, op.write) for op in t.torch_ops] == [(0, 512), (512, 512), (512, 256)]


def test_the_interpreters_own_copies_inside_a_launch_are_not_counted():
    x, y = torch.randn(100), torch.empty(100)
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen():  # the interpreter copies each argument's storage in and out of a launch
        _load_twice_store_once[(4,)](x, y, 100, BLOCK=32)
    assert "copy_" in seen
    _, t = count_traffic(lambda: _load_twice_store_once[(4,)](x, y, 100, BLOCK=32))
    assert t.torch_ops == [] and len(t.launches) == 1


# ---------------------------------------------------------------------------------------------
# The hooks come off; the interpreter is required
# ---------------------------------------------------------------------------------------------
def _hooked_state():
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    patched = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    builder = vars(interpreter.interpreter_builder)  # its methods are its class's unless patched
    return ({name: builder.get(name) for name in patched}, interpreter.GridExecutor.__call__, interpreter.GridExecutor._init_args_hst,
            JITFunction.run)


def test_the_interpreter_is_restored_after_a_count_and_after_an_error():
    before = _hooked_state()
    x, y = torch.randn(10), torch.empty(10)
    count_traffic(lambda: _load_twice_store_once[(1,)](x, y, 10, BLOCK=16))
    assert _hooked_state() == before

    def fails():
        _load_twice_store_once[(1,)](x, y, 10, BLOCK=16)
        raise KeyError("in the counted call")

    with pytest.raises(KeyError):
        count_traffic(fails)
    assert _hooked_state() == before
    with pytest.raises(RuntimeError, match="do not nest"):
        count_traffic(lambda: count_traffic(lambda: None))
    assert _hooked_state() == before


def test_the_counter_refuses_to_run_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        count_traffic(lambda: None)


# ---------------------------------------------------------------------------------------------
# Floyd attention
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chunked_small():
    """The chunked strategy's forward and backward at a shape the interpreter runs in seconds."""
    return traffic.floyd_traffic((1, 2, 16, 16, 16, 16), torch.float16, "chunked")


def test_the_first_chunked_gemm_writes_the_float32_scores_once(chunked_small):
    b, h, n, m, k, d = 1, 2, 16, 16, 16, 16
    r = chunked_small
    assert r["strategy_run"] == "chunked" and r["scores"] == b * h * n * m * k
    first = r["fwd"]["launches"][0]  # S = Q K1^T: reads q and k1, writes every score in float32
    assert first["distinct_store"] == b * h * n * m * k * 4
    assert first["distinct_load"] == (b * h * n * m * d + b * h * n * k * d) * 2
    assert first["distinct_store_per_score"] == 4.0


def test_per_launch_numbers_add_up_to_the_totals(chunked_small):
    import json

    r = chunked_small
    json.dumps(r)  # JSON-able
    total = {"distinct": 0, "issued": 0}
    for key in ("fwd", "bwd"):
        part = r[key]
        launches, totals = part["launches"], part["totals"]
        assert launches
        for name in ("distinct_load", "distinct_store", "issued_load", "issued_store"):
            assert totals[name] == sum(launch[name] for launch in launches)
            for launch in launches:  # and each launch's arguments add up to it
                assert launch[name] == sum(a[name] for a in launch["by_arg"].values())
                assert launch[f"{name}_per_score"] == launch[name] / r["scores"]
        torch_bytes = sum(op["read"] + op["write"] for op in part["torch_ops"])
        assert totals["distinct"] == totals["distinct_load"] + totals["distinct_store"] + torch_bytes
        assert totals["issued"] == totals["issued_load"] + totals["issued_store"] + torch_bytes
        assert totals["issued"] >= totals["distinct"]
        total["distinct"] += totals["distinct"]
        total["issued"] += totals["issued"]
    assert r["total"]["distinct"] == total["distinct"] and r["total"]["issued"] == total["issued"]
    assert r["total"]["distinct_per_score"] == total["distinct"] / r["scores"]
    assert "forward+backward per score" in traffic.floyd_report(r)


def test_floyd_traffic_restores_the_strategy(monkeypatch):
    from gradops.kernels import floyd_config

    import gradops

    before = floyd_config.STRATEGY
    with pytest.raises(ValueError, match="unknown Floyd strategy"):
        traffic.floyd_traffic((1, 1, 2, 2, 2, 16), torch.float16, "no-such-strategy")

    def fails(*args, **kwargs):
        assert floyd_config.STRATEGY == floyd_config.STRATEGIES[-1]  # forced during the call
        raise KeyError("forward")

    monkeypatch.setattr(gradops, "floyd_attention", fails)
    with pytest.raises(KeyError):
        traffic.floyd_traffic((1, 1, 2, 2, 2, 16), torch.float16, floyd_config.STRATEGIES[-1])
    assert floyd_config.STRATEGY == before


def test_the_bench_cli_counts_every_strategy_and_writes_json(tmp_path, capsys):
    import json

    from gradops.kernels import floyd_config

    argv = ["--traffic", "--shape", "1,1,4,4,4,16", "--dtype", "fp16", "--mask", "--out", str(tmp_path), "--tag", "t"]
    assert floyd.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "t.json").read_text())
    assert [r["strategy"] for r in data["results"]] == list(floyd_config.STRATEGIES)
    assert all(r["masked"] and r["dtype"] == "float16" for r in data["results"])
    assert out.count("forward+backward per score") == len(floyd_config.STRATEGIES)
    assert floyd.main(["--traffic", "--strategy", "no-such-strategy"]) == 2


def test_the_cli_switches_the_interpreter_on_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    child = subprocess.run([sys.executable, "-m", "gradops", "bench", "floyd", "--traffic", "--shape", "1,1,2,2,2,16",
                            "--strategy", "fused", "--out", str(tmp_path), "--tag", "c"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    assert "forward+backward per score" in child.stdout and (tmp_path / "c.json").exists()
