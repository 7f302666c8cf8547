"""One face for every `gradops bench` command (norm, nsa, floyd, model, overhead, floydnet, all): the same options
(gradops.bench.harness.add_common_args), one set of dtype names (torch's, with the short
aliases), the JSON always written and its path printed, the CPU caveat printed on a CPU;
and every `gradops bench` command line the docs and scripts show still parses.

The runs are CPU smoke runs at the smallest shapes the families take (a few seconds in all)."""
import glob
import json
import os
import re
import shlex
import tempfile

import pytest

from gradops import cli
from gradops.bench import all as bench_all
from gradops.bench import floyd, floydnet, harness, model, norm, nsa, overhead

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {"norm": norm, "nsa": nsa, "floyd": floyd, "model": model, "overhead": overhead, "floydnet": floydnet,
           "all": bench_all}
FAST = ["--device", "cpu", "--quick", "--reps", "1", "--warmup", "1", "--max-seconds", "0.05", "--no-plot"]
# the smallest case of each family (model: the quick GPT-2, the smaller of the two)
TINY = {
    "norm": ["--ops", "rms_bwd", "--widths", "64", "--numel", "256", "--peers", "autograd"],
    "nsa": ["--ops", "nsa_compress", "--peers", "reference"],
    "floyd": ["--shape", "1,1,4,5,6,8", "--impl", "reference", "einsum"],
    "model": ["--models", "gpt2"],
    "overhead": [],
    "floydnet": ["--tasks", "count"],
    "all": ["--only", "nsa"],
}
# nsa --quick, overhead, floydnet and bench all on a CPU switch the Triton interpreter on for the
# process: not in a suite whose other tests run compiled kernels on a GPU
INTERPRETS = {"nsa", "overhead", "floydnet", "all"}
on_cpu_suite = os.environ.get("GRADOPS_TEST_DEVICE", "cpu") == "cpu"


def _family(name):
    marks = []
    if name in INTERPRETS:
        marks.append(pytest.mark.skipif(not on_cpu_suite, reason="a CPU run (it switches the Triton interpreter on)"))
    if name == "model":
        try:
            import transformers  # noqa: F401
        except ImportError:
            marks.append(pytest.mark.skip(reason="gradops bench model needs transformers"))
    if name == "floydnet":
        try:
            import floydnet as _  # noqa: F401
        except ImportError:
            marks.append(pytest.mark.skip(reason="gradops bench floydnet needs floydnet"))
    return pytest.param(name, marks=marks, id=name)


FAMILIES = [_family(n) for n in MODULES]


def _written(out: str, family: str, folder) -> str:
    """The JSON a run wrote, by the 'wrote PATH' line it printed (bench all: its summary)."""
    if family == "all":
        assert f"wrote {folder}/ (summary.json" in out, out
        return os.path.join(folder, "summary.json")
    paths = re.findall(r"^wrote (\S+\.json)", out, re.M)
    assert len(paths) == 1, out
    assert os.path.dirname(paths[0]) == str(folder), out
    return paths[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_out_dtype_quick_write_the_json_and_print_the_caveat(family, tmp_path, capsys):
    rc = cli.main(["bench", family, *FAST, "--dtype", "fp32", "--out", str(tmp_path), *TINY[family]])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "note: timed on a CPU" in out or "note: CPU timings" in out, out
    assert harness.CPU_NOTE in out
    data = json.loads(open(_written(out, family, tmp_path)).read())
    if family == "all":
        data = json.loads((tmp_path / "nsa.json").read_text())
        assert data["meta"]["options"]["quick"] is True
    # the alias was parsed into the canonical (torch) name, which is what the records hold
    assert data["meta"]["options"]["dtypes"] == ["float32"]
    # (bench overhead's Floyd rows are FloydNet's block under bf16 autocast whatever the dtypes)
    fixed = overhead.FLOYD_OPS if family == "overhead" else ()
    assert {r["case"]["dtype"] for r in data["records"] if r["op"] not in fixed} == {"float32"}
    assert {r["case"]["dtype"] for r in data["records"] if r["op"] in fixed} <= {"bfloat16"}
    assert data["meta"]["note"] == harness.CPU_NOTE


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.id in ("nsa", "floyd", "all")])
def test_without_out_the_json_goes_to_the_scratch_folder(family, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = cli.main(["bench", family, *FAST, "--dtype", "float32", *TINY[family]])
    out = capsys.readouterr().out
    assert rc == 0, out
    scratch = tmp_path / "gradops-bench"
    if family == "all":
        (folder,) = scratch.iterdir()  # <device>-<date>/
        assert (folder / "summary.json").exists() and (folder / "nsa.json").exists()
        assert f"wrote {folder}/" in out and "not results to commit" in out
    else:
        path = _written(out, family, scratch)
        assert os.path.exists(path) and "a CPU run: not a result to commit" in out


SHARED = ["--device", "cpu", "--dtype", "bf16", "--dtype", "float32", "--quick", "--out", "d", "--no-plot",
          "--reps", "2", "--warmup", "1", "--max-seconds", "0.5", "--budget-seconds", "9"]


@pytest.mark.parametrize("family", list(MODULES))
def test_every_command_takes_the_same_options(family, capsys):
    args = MODULES[family].parse_args(SHARED)
    assert args.dtypes == ["bfloat16", "float32"]  # repeatable, aliases canonicalised
    assert (args.device, args.quick, args.out, args.no_plot) == ("cpu", True, "d", True)
    assert (args.reps, args.warmup, args.max_seconds, args.budget_seconds) == (2, 1, 0.5, 9.0)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", family, "--help"])
    assert e.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--device", "--dtype", "--quick", "--out", "--no-plot", "--reps", "--warmup", "--max-seconds",
                 "--budget-seconds"):
        assert flag in usage, (family, flag)
    assert "bfloat16 (bf16)" in usage


def test_bench_help_lists_the_families_and_the_shared_options(capsys):
    assert cli.main(["bench", "--help"]) == 0
    usage = capsys.readouterr().out
    assert "norm,nsa,floyd,floyd3,model,overhead,floydnet,all" in usage and "--out DIR" in usage and "float32 (fp32)" in usage
    assert cli.main(["bench"]) == 2  # no family: the same text, and a usage error


@pytest.mark.parametrize("family", list(MODULES))
@pytest.mark.parametrize("names,want", [(["bf16"], ["bfloat16"]), (["bfloat16"], ["bfloat16"]),
                                        (["FP32", "torch.float16"], ["float32", "float16"])])
def test_dtype_aliases_are_accepted_everywhere(family, names, want):
    assert MODULES[family].parse_args(["--dtype", *names]).dtypes == want


@pytest.mark.parametrize("family", list(MODULES))
@pytest.mark.parametrize("name", ["half", "float", "bfloat8", "f32"])
def test_other_dtype_names_are_rejected_everywhere(family, name, capsys):
    with pytest.raises(SystemExit) as e:
        MODULES[family].parse_args(["--dtype", name])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["nsa", "model"])
def test_a_dtype_a_family_does_not_take_is_refused_by_either_name(family, capsys):
    for name in ("fp64", "float64"):
        with pytest.raises(SystemExit):
            MODULES[family].parse_args(["--dtype", name])
        assert "'float64'" in capsys.readouterr().err


def test_selftest_takes_the_same_dtype_names(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "cmd_selftest", lambda args: seen.append(args.dtype) or 0)
    assert cli.main(["selftest", "--dtype", "fp32", "--dtype", "bfloat16", "fp64"]) == 0
    assert seen == [["float32", "bfloat16", "float64"]]
    with pytest.raises(SystemExit):
        cli.main(["selftest", "--dtype", "half"])


def test_bench_all_dtype_keeps_only_those_cases(capsys):
    assert bench_all.main(["--dry-run", "--device", "cpu", "--quick", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "--dtype bfloat16 leaves out floyd" in out  # the quick CPU plan's Floyd part is float32 only
    assert "gradops bench norm --quick --interpret --dtype bfloat16 --widths" in out
    assert bench_all.main(["--dry-run", "--device", "cpu", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "gradops bench norm --ops rms_bwd ln_bwd rms_fwd ln_fwd --dtype bfloat16 --widths" in out
    with pytest.raises(SystemExit, match="no part of the plan runs in float64"):
        bench_all.main(["--dry-run", "--device", "cpu", "--dtype", "float64"])
    part = bench_all.Part("p", "norm", ("--ops", "rms_bwd"), 1.0, "")
    assert bench_all.restrict_dtypes(part, ["float32"]).argv == ("--ops", "rms_bwd", "--dtype", "float32")


# ---------------------------------------------------------------------------------------------
# The command lines the docs and scripts show
# ---------------------------------------------------------------------------------------------
DOCS = ([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "README.md")]
        + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
        + sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.sh"))))
COMMAND = re.compile(r"(?:gradops bench |python3? benchmarks/bench_)"
                     r"(norm|nsa|floydnet|floyd|model|overhead|all)(?:\.py)?"
                     r"((?: +[-\w.,=/:]+)*)")


def documented_commands():
    found = set()
    for path in DOCS:
        text = open(path).read()
        for line in text.splitlines():
            for family, rest in COMMAND.findall(line):
                if "..." not in rest:  # a placeholder, not a command line
                    found.add((os.path.relpath(path, ROOT), family, rest.strip()))
    return sorted(found)


def test_the_docs_show_commands_with_options():
    commands = documented_commands()
    assert len(commands) > 15 and any(rest for _, _, rest in commands)


@pytest.mark.parametrize("where,family,rest", documented_commands(),
                         ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_every_documented_command_line_parses(where, family, rest):
    argv = shlex.split(rest)
    if "--help" in argv:
        return
    MODULES[family].parse_args(argv)  # SystemExit (2) on an option it does not take
