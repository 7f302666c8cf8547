#!/usr/bin/env python
"""LayerNorm / RMSNorm benchmark: ``python benchmarks/bench_norm.py [--quick] [...]``, the same
as ``gradops bench norm``; see ``--help`` and gradops/bench/norm.py."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from gradops.bench.norm import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
