"""Every benchmark at its GPU shapes, one folder of results and a summary: a thin entry point
to ``gradops bench all`` (see docs/gpu.md)::

    python benchmarks/bench_all.py              # GPU: about 7 minutes, benchmarks/results/<device>-<date>/
    python benchmarks/bench_all.py --quick      # CPU: tiny shapes through the Triton interpreter, ~1 minute
    python benchmarks/bench_all.py --dry-run    # the plan and its time budget
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradops.bench.all import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
