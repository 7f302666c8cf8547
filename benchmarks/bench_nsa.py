"""NSA compression benchmark: a thin entry point to ``gradops bench nsa``.

    python benchmarks/bench_nsa.py              # NSA training shapes on the GPU
    python benchmarks/bench_nsa.py --quick      # smoke run (CPU: under a minute)
    python benchmarks/bench_nsa.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradops.bench.nsa import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
