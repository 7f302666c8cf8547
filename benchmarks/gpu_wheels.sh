#!/usr/bin/env bash
# Fetch, on a machine with network access, the wheels of the packages gradops' tests and
# benchmarks use beyond torch, triton, pytest, numpy, matplotlib and tqdm: floydnet and
# liger-kernel (no dependencies fetched: theirs are torch, triton and typing-extensions), and
# transformers with its dependencies (about 28 MB; numpy left out: the machine has its own).
# Copy the resulting .whl/ into the checkout on a GPU machine without network, where
# benchmarks/gpu_validate.sh installs them (docs/gpu.md).
#
#   PY_VERSION=3.12 bash benchmarks/gpu_wheels.sh   # the GPU machine's Python (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
$PY -m pip download --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl floydnet==1.1.0 liger-kernel==0.8.5
$PY -m pip download --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl transformers==5.23.0
rm -f .whl/numpy-*.whl
ls -l .whl
