"""Every snippet of the README runs as pasted: each ```python block in a fresh interpreter of
its own (so it may use only what it imports and defines itself), and the cheap commands of
its ```bash blocks (`gradops ... --help`, `gradops info`, `--quick` benchmark runs on a CPU).
The setup block (venvs, pip installs, the whole suite) is not cheap and is not run here: it
is what CI runs."""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# Fresh interpreters see neither pytest's TRITON_INTERPRET (conftest) nor the test device.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GRADOPS_TEST_DEVICE")}


def blocks(language: str):
    text = open(README).read()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(rf"^```{language}\n(.*?)^```", text, re.M | re.S)]


def cheap_commands():
    """(line, command) for each `gradops` command of the bash blocks that is cheap to run."""
    found = []
    for first, block in blocks("bash"):
        for i, line in enumerate(block.splitlines()):
            command = line.split("#", 1)[0].strip()
            if not command.startswith("gradops"):
                continue
            argv = shlex.split(command)
            if "--help" in argv or argv[1:] == ["info"] or ("--quick" in argv and "--device" in argv
                                                            and argv[argv.index("--device") + 1] == "cpu"):
                found.append((first + i, command))
    return found


def test_the_readme_has_snippets_and_keeps_its_setup_commands():
    assert len(blocks("python")) >= 4
    text = open(README).read()
    first_screen = text[:text.index("## The Python API")]
    for setup in (".venv/bin/pip install -q torch==2.13.0 -e . && .venv/bin/gradops\n",
                  ".venv/bin/pip install -q torch==2.13.0 -e '.[test]' && .venv/bin/python -m pytest -q -n auto\n"):
        assert "python3 -m venv .venv && " + setup in first_screen
    assert cheap_commands()


@pytest.mark.parametrize("line,code", blocks("python"), ids=[f"README.md:{n}" for n, _ in blocks("python")])
def test_python_block_runs_as_pasted(line, code, tmp_path):
    if "from transformers" in code or "import transformers" in code:
        pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=CLEAN_ENV)
    assert proc.returncode == 0, f"README.md:{line}\n{code}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("line,command", cheap_commands(), ids=[f"README.md:{n}" for n, _ in cheap_commands()])
def test_bash_command_runs_as_pasted(line, command, tmp_path):
    argv = [sys.executable, "-m", "gradops"] + shlex.split(command)[1:]  # the `gradops` of this interpreter
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**CLEAN_ENV, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, f"README.md:{line}: {command}\n{proc.stdout}\n{proc.stderr}"
    if "--quick" in command:  # a smoke run writes its JSON and says where
        assert re.search(rf"^wrote {re.escape(str(tmp_path))}/gradops-bench/\S+\.json", proc.stdout, re.M), proc.stdout
