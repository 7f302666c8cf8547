"""Floyd attention benchmark: a thin entry point to ``gradops.bench.floyd`` (same as
``gradops bench floyd``). Examples::

    python benchmarks/bench_floyd.py                  # CUDA: the issue's grid, bf16, JSON in benchmarks/results/
    python benchmarks/bench_floyd.py --quick          # CPU: tiny shapes, reference vs einsum, < 1 minute
    python benchmarks/bench_floyd.py --shape 1,8,512,512,512,128 --direction bwd
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from gradops.bench.floyd import main

    raise SystemExit(main(sys.argv[1:]))
