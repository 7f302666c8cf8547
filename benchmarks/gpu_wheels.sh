#!/usr/bin/env bash
# Fetch, on a machine with network access, the wheels of the packages gradops' tests and
# benchmarks use that the lent GPU machines' image lacks (or has in another version): floydnet,
# liger-kernel, transformers 5.23 (the tests' pin; the image has 5.17) and the regex it needs
# (about 15 MB). No other dependency is fetched: theirs (torch, triton, huggingface-hub >= 1.31,
# tokenizers 0.23, safetensors, typer, pyyaml, tqdm) are on that image
# (/work/.library/device/KINDS.md lists them); elsewhere install them first.
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
    -d .whl floydnet==1.1.0 liger-kernel==0.8.5 transformers==5.23.0 'regex>=2025.10.22'
ls -l .whl
