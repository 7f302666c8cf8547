"""The torch and Triton releases CI tests (.ci/run). The oldest pair is pyproject.toml's
minimum, and the GPU image's pair; the newest is the main suite's. tests/test_versions.py
checks that this module, pyproject.toml and .ci/run agree."""
from __future__ import annotations

import re

TORCH_OLDEST = "2.11.0"
TRITON_OLDEST = "3.6.0"
TORCH_NEWEST = "2.13.0"
TRITON_NEWEST = "3.9.0"
TESTED = {"torch": (TORCH_OLDEST, TORCH_NEWEST), "triton": (TRITON_OLDEST, TRITON_NEWEST)}


def release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string, without local tags or pre-release suffixes
    ("2.11.0+cu130" -> (2, 11, 0))."""
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(g or 0) for g in m.groups()) if m else (0, 0, 0)


def tested_range(package: str) -> str:
    """The oldest and newest tested release of ``package`` ("torch" or "triton"): "2.11.0 to 2.13.0"."""
    return " to ".join(TESTED[package])


def outside_tested(package: str, installed: str) -> str | None:
    """Why ``installed`` lies outside the tested range of ``package`` ("older than ..."), or None.
    Patch releases newer than the newest tested one count as tested (same major.minor)."""
    oldest, newest = TESTED[package]
    have = release(installed)
    if have < release(oldest):
        return f"older than the oldest tested, {oldest}"
    if have[:2] > release(newest)[:2]:
        return f"newer than the newest tested, {newest}"
    return None
