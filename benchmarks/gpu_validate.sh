#!/usr/bin/env bash
# Validate gradops on a CUDA machine (docs/gpu.md):
#
#   bash benchmarks/gpu_validate.sh tests   # install, the whole test suite on CUDA (one 10-minute call)
#   bash benchmarks/gpu_validate.sh bench   # install, `gradops bench all` (194 s on an H100, 2026-11-25)
#   bash benchmarks/gpu_validate.sh all     # in one call of CALL_SECONDS (480 s): the tests a GPU
#                                           # changes most (GPU_TESTS, GPU_FIRST's files first, at most
#                                           # TESTS_SECONDS), the profiles, then the sweep in order of
#                                           # priority in what is left (the rest recorded as cut)
#
# Run from the repository root. Installs, without network, the wheels found in .whl/
# (benchmarks/gpu_wheels.sh fetches them) and the checkout, then leaves in $OUT (8 files, what a
# lent machine sends back): info.txt, tests.log, junit.xml, tests-summary.txt (one screen:
# benchmarks/test_summary.py), profile.txt (benchmarks/gpu_profile.py), bench.log, summary.txt,
# results.tar.gz (the results folder, to unpack into benchmarks/results/ elsewhere). Exit
# status: non-zero when a step failed.
# Optional: TESTS (pytest paths, default tests), TEST_WORKERS (xdist workers, default 12),
# BENCH_ARGS (more flags for `gradops bench all`), PYTHON (default python3).
set -uo pipefail
step=${1:-all}
case "$step" in tests|bench|all) ;; *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;; esac
OUT=${OUT:-$PWD/gpu-out}
# `all` mode's limit: a lent machine's one call (issue 33: 480 s, inside a 15-minute lease with the
# machine's start); `tests` mode runs the whole suite within it too
CALL_SECONDS=${CALL_SECONDS:-480}
TESTS_SECONDS=${TESTS_SECONDS:-240}  # the tests' share of an `all` call
# `all`'s tests: every case of the Triton backend, and the kernel, compile, CUDA-graph and
# host-sync tests (bound launches' among them: test_bound_launch.py's cuda test), the Floyd memory
# strategies' own, the launch budgets, the HuggingFace patching, the exact-zero and non-finite
# checks of docs/gpu.md and the kernels' float64 scalars (a pytest
# -k expression over the test ids); `tests` runs the whole suite.
GPU_TESTS=${GPU_TESTS:-"triton or kernels or compile or cuda or host_sync or hybrid or chunked or roofline
or launch_budget or patch_hf or single_pivot or one_hot or non_finite or double_benchmark or width_one
or constant_rows or scalar_args"}
# `all` runs these files first (pytest keeps the order of the paths it is given; xdist hands the
# tests out in it), so that a run cut at TESTS_SECONDS loses the least: what never ran on a GPU,
# then the rest in name order
GPU_FIRST="test_bound_launch.py test_floyd_hybrid.py test_floyd_memory_strategies.py test_floyd_attention.py test_floydnet_real.py
test_floyd_chunked.py test_triton_ops.py test_compile.py test_launch_budget.py test_no_host_sync.py test_patch_hf.py
test_kernels_norm.py test_layer_norm.py test_precision.py test_nsa_compress.py test_kernels_floyd.py
test_kernels_nsa.py test_floyd_roofline.py test_pivotal.py test_bench_cuda.py"
# Files whose tests run on the CPU whatever the test device (the CPU path, the CLI and the
# benchmarks' faces in fresh interpreters, gloo processes, the CPU memory harness, the CPU
# guard): `all` leaves them out too.
CPU_ONLY="test_cpu_path.py test_nsa_cpu_path.py test_bench_face.py test_bench_all.py test_bench_floyd.py
test_bench_model.py test_cli.py test_ddp.py test_floyd_memory.py test_readme_snippets.py test_interpreter_fixes.py
test_device_guard.py test_gpu_validate.py"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
status=0

# 1. Packages: torch, triton, pytest (+xdist, timeout when present), matplotlib and tqdm are
#    expected on the machine; floydnet and liger-kernel come from .whl/ when it exists.
{
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && echo "installed from .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')"
    else
        echo "no .whl/: floydnet and liger-kernel are used only if already installed"
    fi
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        || echo "pip install -e . failed: using the checkout through PYTHONPATH"
} >"$OUT/info.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    $PY -c 'from importlib import metadata as m
for n in ("torch", "triton", "pytest", "pytest-xdist", "floydnet", "liger-kernel", "matplotlib"):
    try: print(n, m.version(n))
    except m.PackageNotFoundError: print(n, "not installed")'
    $PY -m gradops info
} >>"$OUT/info.txt" 2>&1
cat "$OUT/info.txt"

# 2. The test suite, compiled on the GPU.
if [ "$step" != bench ]; then
    limit=$([ "$step" = all ] && echo "$TESTS_SECONDS" || echo $((CALL_SECONDS - SECONDS)))
    plugins=()
    $PY -c "import xdist" 2>/dev/null && [ "${TEST_WORKERS:-12}" != 0 ] && plugins+=(-n "${TEST_WORKERS:-12}")
    # One hung test must not eat the call; a test's first call compiles its kernels (the Floyd
    # kernels take up to tens of seconds each when 12 workers compile at once), so the limit
    # leaves room for that.
    $PY -c "import pytest_timeout" 2>/dev/null && plugins+=(--timeout 300)
    select=()
    paths=(${TESTS:-tests})
    if [ "$step" = all ]; then
        select+=(-k "$(echo $GPU_TESTS)")
        if [ -z "${TESTS:-}" ]; then
            paths=()
            for f in $GPU_FIRST; do paths+=("tests/$f"); done
            for f in tests/test_*.py; do
                case " $(echo $GPU_FIRST $CPU_ONLY) " in *" ${f#tests/} "*) ;; *) paths+=("$f") ;; esac
            done
        fi
    fi
    echo "== tests: GRADOPS_TEST_DEVICE=cuda pytest ${plugins[*]} ${select:+-k \"$(echo $GPU_TESTS)\" on ${#paths[@]} files, those of GPU_FIRST first, the CPU-only ones left out} (at most ${limit} s)"
    # SIGINT at the limit: pytest stops as on Ctrl-C and still writes junit.xml (SIGTERM would not)
    # shellcheck disable=SC2086
    # -v: one line per test as it ends, which names the failures even where pytest is killed before
    # it writes junit.xml (xdist's workers may outlast the grace after SIGINT)
    GRADOPS_TEST_DEVICE=cuda timeout -s INT -k 60 "$limit" $PY -m pytest -v -p no:cacheprovider "${plugins[@]}" \
        "${select[@]}" --junitxml="$OUT/junit.xml" "${paths[@]}" >"$OUT/tests.log" 2>&1
    rc=$?
    [ "$rc" = 124 ] && echo "the tests were stopped at ${limit} s: the summary counts those that ran; run the 'tests' step alone" \
        >>"$OUT/tests.log"
    tail -n 1 "$OUT/tests.log"
    $PY benchmarks/test_summary.py "$OUT/junit.xml" --log "$OUT/tests.log" >"$OUT/tests-summary.txt" 2>&1
    cat "$OUT/tests-summary.txt"
    [ "$rc" = 0 ] || status=1
fi

# 3. Where the time of the calls furthest from their goals goes (kernels by GPU time, the host
#    path by function): at most PROFILE_SECONDS; it compiles what the sweep's Floyd part reuses.
if [ "$step" != tests ]; then
    echo "== profiles: benchmarks/gpu_profile.py (at most ${PROFILE_SECONDS:=45} s)"
    timeout -s INT -k 10 "$PROFILE_SECONDS" $PY benchmarks/gpu_profile.py >"$OUT/profile.txt" 2>&1 || status=1
    grep -E "^(the rule|---|[a-z.]+ forward \+ backward at|\()" "$OUT/profile.txt"
fi

# 4. The benchmark sweep: results in benchmarks/results/<device>-<date>/ and a tarball in $OUT.
if [ "$step" != tests ]; then
    budget=()
    stop=()
    if [ "$step" = all ]; then
        # the sweep starts no measurement after its budget, CALL_SECONDS less 25 s; one begun
        # before it (at worst a torch.compile) is stopped by SIGINT 15 s later, and bench all still
        # writes its summary and plots; 10 s are left for those and the packing
        left=$((CALL_SECONDS - SECONDS - 25))
        budget=(--budget-seconds "$((left > 0 ? left : 0))")
        stop=(timeout -s INT -k 10 "$((left + 15 > 20 ? left + 15 : 20))")
    fi
    echo "== gradops bench all ${budget[*]} ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    "${stop[@]}" $PY -m gradops bench all "${budget[@]}" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1 || status=1
    # the folder it printed ("wrote FOLDER/ (summary.json, ..."), else the newest under benchmarks/results/
    folder=$(sed -n 's|^wrote \(.*\)/ (summary.json.*|\1|p' "$OUT/bench.log" | tail -n 1)
    [ -n "$folder" ] || folder=$(ls -td benchmarks/results/*/ 2>/dev/null | head -n 1)
    folder=${folder%/}
    if [ -n "$folder" ] && [ -f "$folder/summary.txt" ]; then
        cp "$folder/summary.txt" "$OUT/summary.txt"
        tar -czf "$OUT/results.tar.gz" -C "$(dirname "$folder")" "$(basename "$folder")"
        cat "$OUT/summary.txt"
    else
        tail -n 40 "$OUT/bench.log"
        status=1
    fi
fi
echo "== gpu_validate $step: $([ $status = 0 ] && echo ok || echo FAILED) after ${SECONDS} s; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
