"""benchmarks/gpu_validate.sh's pieces that can be checked without a GPU: the one-screen test
summary it prints, and its list of CPU-only test files (left out of `all`)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = os.path.join(ROOT, "benchmarks", "test_summary.py")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6" time="9.0">
<testcase classname="tests.test_a" name="test_ok[triton]" time="0.5"/>
<testcase classname="tests.test_a" name="test_ok[reference]" time="7.25"/>
<testcase classname="tests.test_b" name="test_bad" time="0.1"><failure message="AssertionError: dk2 1.7e-06 != 0
more text">trace</failure></testcase>
<testcase classname="tests.test_b.TestGroup" name="test_err" time="0.1"><error message="fixture failed">x</error></testcase>
<testcase classname="tests.test_c" name="test_skip1" time="0"><skipped message="needs a GPU">s</skipped></testcase>
<testcase classname="tests.test_c" name="test_skip2" time="0"><skipped message="needs a GPU">s</skipped></testcase>
</testsuite></testsuites>
"""


def test_summary_fits_a_screen_and_names_each_failure(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    proc = subprocess.run([sys.executable, SUMMARY, str(path)], capture_output=True, text=True, timeout=60)
    out = proc.stdout
    assert proc.returncode == 1, out  # a failure and an error
    assert out.splitlines()[0].startswith("2 passed, 1 failed, 1 error, 2 skipped (6 tests"), out
    assert "1 of 3 files passed whole" in out
    assert "tests/test_b.py: 1 failed, 1 error" in out and "tests/test_c.py: 2 skipped" in out
    assert "FAILED tests/test_b.py::test_bad: AssertionError: dk2 1.7e-06 != 0" in out
    assert "ERROR tests/test_b.py::TestGroup::test_err: fixture failed" in out  # the class kept
    assert re.search(r"^\s+2\s+needs a GPU$", out, re.M), out
    assert "7.2 s  tests/test_a.py::test_ok[reference]" in out.split("slowest:")[1].splitlines()[1]
    assert len(out.splitlines()) <= 50


def test_summary_of_a_clean_run_exits_0(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="t" time="1"/>'
                    '</testsuite></testsuites>')
    proc = subprocess.run([sys.executable, SUMMARY, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("1 passed"), proc.stdout


def test_a_run_killed_before_its_junit_is_read_from_its_verbose_log(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("bringing up nodes...\n"
                   "[gw0] [ 33%] PASSED tests/test_a.py::test_ok[triton] \n"
                   "[gw1] [ 66%] FAILED tests/test_b.py::test_bad[x-[0, 0]-1.5] \n"
                   "[gw1] [ 70%] PASSED tests/test_b.py::test_bad[x-[0, 0]-2.5] \n"
                   "tests/test_c.py::test_skip[a b] SKIPPED (needs a GPU)                    [100%]\n")
    proc = subprocess.run([sys.executable, SUMMARY, str(tmp_path / "junit.xml"), "--log", str(log)],
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout
    assert proc.returncode == 1 and "the outcomes printed in" in out, out
    assert "2 passed, 1 failed, 1 skipped (4 tests" in out  # ids with spaces kept apart
    assert "FAILED tests/test_b.py::test_bad[x-[0, 0]-1.5]" in out
    proc = subprocess.run([sys.executable, SUMMARY, str(tmp_path / "junit.xml")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout.startswith("no test results"), proc.stdout


def test_the_profiles_run_end_to_end_on_the_cpu():
    # a wiring check of benchmarks/gpu_profile.py (the reference backend on the CPU): a broken
    # script would cost a lent GPU call its profiles
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_profile.py"), "--device", "cpu",
                           "--floyd-shape", "1,1,8,8,8,16"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-2000:]
    assert "--- gradops: forward + backward" in out and "--- floydnet: forward + backward" in out
    assert "gradops.nn.functional.rms_norm forward + backward at (8, 64)" in out and "cProfile of 200" in out


def test_cpu_only_files_exist():
    script = open(os.path.join(ROOT, "benchmarks", "gpu_validate.sh")).read()
    names = re.search(r'CPU_ONLY="([^"]*)"', script).group(1).split()
    assert names and all(os.path.exists(os.path.join(ROOT, "tests", name)) for name in names), names


def test_the_files_run_first_exist_and_run_on_the_gpu():
    script = open(os.path.join(ROOT, "benchmarks", "gpu_validate.sh")).read()
    first = re.search(r'GPU_FIRST="([^"]*)"', script).group(1).split()
    cpu_only = set(re.search(r'CPU_ONLY="([^"]*)"', script).group(1).split())
    assert first and len(set(first)) == len(first) and not cpu_only & set(first)
    assert all(os.path.exists(os.path.join(ROOT, "tests", name)) for name in first), first
