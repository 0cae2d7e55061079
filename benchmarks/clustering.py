"""Clustering benchmark: ``python benchmarks/clustering.py [--quick] [--scenarios ...] [--out DIR]``.

A thin wrapper around :func:`fedsdk_bench.clustering.main`, the same code ``fedsdk bench clustering`` runs
(see ``docs/results/clustering.md``). The guard matters: the coordinator's process pool starts workers with
``forkserver``, which imports this script again in each worker.
"""

from __future__ import annotations

from fedsdk_bench.clustering import main

if __name__ == "__main__":
    raise SystemExit(main())
