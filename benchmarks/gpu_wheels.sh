#!/usr/bin/env bash
# Prepare .whl/ on the CPU machine (it has PyPI; the lent GPU machine has no network): the
# Python packages gradops' tests and benchmarks use that the GPU machine's image lacks
# (/work/.library/device/KINDS.md lists what it holds: torch, triton, pytest and its xdist
# and timeout plugins, matplotlib, tqdm, numpy, typing-extensions are there). Both are
# pure-Python wheels whose own needs (torch, triton, typing-extensions) are already there.
#
#   bash benchmarks/gpu_wheels.sh     # then carry .whl in the device tool's `run`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
# .whl/ is in .gitignore, so it travels only when named in `carry`.
$PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl floydnet==1.1.0 liger-kernel==0.8.5
ls -l .whl
