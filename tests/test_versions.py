"""The versions promised are the versions tested: pyproject.toml's minimums, the pins of
.ci/run, gradops/_versions.py (which `gradops info` prints) and the README agree, and
.ci/oldest.txt names tests that exist."""
import os
import re

import pytest
import torch

from gradops import _versions, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def minor(version):
    return ".".join(version.split(".")[:2])


def test_pyproject_minimums_are_the_oldest_tested():
    text = read("pyproject.toml")
    assert re.findall(r'"torch>=([\d.]+)"', text) == [minor(_versions.TORCH_OLDEST)], text
    # the `triton` and `test` extras
    assert re.findall(r'"triton>=([\d.]+)"', text) == [minor(_versions.TRITON_OLDEST)] * 2, text


def test_ci_pins_are_the_tested_range():
    text = read(".ci/run")
    assert re.search(r"^OLDEST=\(torch==(\S+) triton==(\S+)\)$", text, re.M).groups() == (
        _versions.TORCH_OLDEST, _versions.TRITON_OLDEST)
    assert re.search(r"^NEWEST=\(torch==(\S+) triton==(\S+)\)$", text, re.M).groups() == (
        _versions.TORCH_NEWEST, _versions.TRITON_NEWEST)
    # and the README's install commands pin the newest torch
    first_screen = read("README.md").split("## The Python API", 1)[0]
    assert set(re.findall(r"torch==([\d.]*\d)", first_screen)) == {_versions.TORCH_NEWEST}


def test_readme_names_the_tested_range():
    first_screen = read("README.md").split("## The Python API", 1)[0]
    expected = (f"torch {minor(_versions.TORCH_OLDEST)} to {minor(_versions.TORCH_NEWEST)} and triton "
                f"{minor(_versions.TRITON_OLDEST)} to {minor(_versions.TRITON_NEWEST)}")
    assert expected in " ".join(first_screen.split()), expected


def test_oldest_selection_names_tests_that_exist():
    lines = [line for line in read(".ci/oldest.txt").splitlines() if line.strip() and not line.startswith("#")]
    assert lines
    for line in lines:
        target = line.removeprefix("--deselect=")
        path, _, rest = target.partition("::")
        assert os.path.isfile(os.path.join(ROOT, path)), line
        if rest:  # a deselected test that was renamed would run again, unnoticed
            name = rest.split("[")[0]
            assert re.search(rf"^def {re.escape(name)}\(", read(path), re.M), line


def test_info_prints_the_tested_range(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert (f"tested: torch {_versions.TORCH_OLDEST} to {_versions.TORCH_NEWEST}, "
            f"triton {_versions.TRITON_OLDEST} to {_versions.TRITON_NEWEST}") in out, out


@pytest.mark.parametrize("installed,says", [
    ("2.10.2", "older than the oldest tested"),
    ("2.99.0+cu130", "newer than the newest tested"),
])
def test_info_says_when_torch_is_outside_the_tested_range(capsys, monkeypatch, installed, says):
    monkeypatch.setattr(torch, "__version__", installed)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"untested: torch {installed} is {says}" in out, out


@pytest.mark.parametrize("version,outside", [
    (_versions.TORCH_OLDEST, None),
    (_versions.TORCH_OLDEST + "+cu130", None),
    (minor(_versions.TORCH_NEWEST) + ".9", None),  # a later patch release of the newest
    ("2.10.0", "older"),
    ("3.0.0", "newer"),
])
def test_outside_tested(version, outside):
    why = _versions.outside_tested("torch", version)
    assert (why is None) if outside is None else why.startswith(outside)
