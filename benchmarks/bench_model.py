#!/usr/bin/env python
"""Training step of a patched HuggingFace model: ``python benchmarks/bench_model.py [--quick] [...]``,
the same as ``gradops bench model``; see ``--help`` and gradops/bench/model.py."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from gradops.bench.model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
