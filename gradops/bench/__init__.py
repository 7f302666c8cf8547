"""Benchmarks: ``gradops bench <family>`` runs ``gradops.bench.<family>.main(argv)``.

``harness`` holds the shared machinery (timing, records, ratios to peers, JSON, plots);
each family module builds its cases and peers on top of it; ``all`` runs the three at their
GPU shapes within one time budget and summarises them (docs/gpu.md). The scripts in the repository's
``benchmarks/`` folder are thin entry points to the same modules, and committed results live
in ``benchmarks/results/``.
"""
