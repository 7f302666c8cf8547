#!/usr/bin/env python
"""A training step of FloydNet's blocks, FloydNet eager and compiled against gradops-patched:
``python benchmarks/bench_floydnet.py [--quick] [...]``, the same as ``gradops bench floydnet``; see
``--help`` and gradops/bench/floydnet.py."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from gradops.bench.floydnet import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
