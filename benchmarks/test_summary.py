"""One screen on a pytest run, from its JUnit XML (benchmarks/gpu_validate.sh writes it):

    python3 benchmarks/test_summary.py junit.xml [--log tests.log] [--lines 50]

the totals; per file, the tests that failed, errored or were skipped (files that only passed
are counted in one line); each failure with the first line of its message; the skip reasons,
counted; the slowest tests. Where pytest was killed before it wrote the XML (a second call of
the 2026-11-28 GPU run lost its results so), ``--log``: the outcome of each test from the lines
``pytest -v`` printed as they ran (no messages, no times). Exit status: 1 when a test failed or
errored, or no result was found, else 0.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET


def read(path):
    """(file, test name, outcome, first line of the message, seconds) per test case."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # a run stopped midway leaves empty entries
            continue
        parts = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        file = case.get("file") or "/".join(parts[:module + 1]) + ".py"
        name = "::".join(parts[module + 1:] + [case.get("name")])  # Class::test, or test
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = child.get("message") or (child.text or "")
                message = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
                if outcome != "skipped":
                    break
        cases.append((file, name, outcome, message, float(case.get("time") or 0)))
    return cases


_OUTCOMES = {"PASSED": "passed", "XFAIL": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "error",
             "SKIPPED": "skipped"}
# "[gw3] [ 12%] PASSED tests/test_a.py::test_b[x]" (pytest-xdist -v), "tests/test_a.py::test_b PASSED [ 12%]";
# a parametrize id may hold spaces ("test_c[triton-[0, 0]-2]"): the name runs to the line's end, or
# to the outcome word
_WORDS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_LOG_LINE = re.compile(rf"\b({_WORDS}) (tests/\S+?\.py)::(.+?)\s*$|^(tests/\S+?\.py)::(.+?) ({_WORDS})\b")


def read_log(path):
    """The cases of :func:`read` from a ``pytest -v`` log: outcomes only (the last one a test
    printed), no messages or times."""
    seen = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = _LOG_LINE.search(line)
            if m:
                word, file, name = (m.group(1), m.group(2), m.group(3)) if m.group(1) else (m.group(6), m.group(4),
                                                                                             m.group(5))
                seen[(file, name)] = _OUTCOMES[word]
    return [(file, name, outcome, "", 0.0) for (file, name), outcome in seen.items()]


def summary(cases, lines: int = 50) -> str:
    out = []
    totals = collections.Counter(outcome for _, _, outcome, _, _ in cases)
    out.append(", ".join(f"{totals[k]} {k}" for k in ("passed", "failed", "error", "skipped") if totals[k])
               + f" ({len(cases)} tests, {sum(c[4] for c in cases):.0f} s of test time)")
    per_file = collections.defaultdict(collections.Counter)
    for file, _, outcome, _, _ in cases:
        per_file[file][outcome] += 1
    clean = [f for f, c in per_file.items() if set(c) == {"passed"}]
    out.append(f"{len(clean)} of {len(per_file)} files passed whole")
    # the files with failures first, then those with skips; at most a third of the screen
    others = sorted((f for f in per_file if f not in clean),
                    key=lambda f: (-(per_file[f]["failed"] + per_file[f]["error"]), f))
    for file in others[:max(5, lines // 3)]:
        c = per_file[file]
        out.append(f"  {file}: " + ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped") if c[k]))
    if len(others) > max(5, lines // 3):
        out.append(f"  ... {len(others) - max(5, lines // 3)} more files")
    bad = [c for c in cases if c[2] in ("failed", "error")]
    if bad:
        out.append(f"failures ({len(bad)}):")
        room = max(5, lines // 3)
        for file, name, outcome, message, _ in bad[:room]:
            out.append(f"  {outcome.upper()} {file}::{name}: {message[:160]}")
        if len(bad) > room:
            out.append(f"  ... {len(bad) - room} more (junit.xml)")
    skips = collections.Counter(c[3][:140] for c in cases if c[2] == "skipped")
    if skips:
        out.append("skip reasons:")
        for reason, n in skips.most_common(8):
            out.append(f"  {n:5d}  {reason}")
    out.append("slowest:")
    for file, name, _, _, seconds in sorted(cases, key=lambda c: -c[4])[:6]:
        out.append(f"  {seconds:7.1f} s  {file}::{name}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--log", help="the run's pytest -v output, read where the JUnit XML is missing or broken")
    parser.add_argument("--lines", type=int, default=50, help="about how many lines (the failures' share)")
    args = parser.parse_args(argv)
    try:
        cases = read(args.junit)
    except (OSError, ET.ParseError) as e:
        cases = read_log(args.log) if args.log else []
        print(f"no test results in {args.junit} ({e})" + (f"; the outcomes printed in {args.log}:" if cases else ""))
        if not cases:
            return 1
    print(summary(cases, args.lines))
    return 1 if any(c[2] in ("failed", "error") for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
