"""Fleet benchmark: ``python benchmarks/fleet.py [--quick] [--scenarios ...] [--arms ...] [--out DIR]``.

A thin wrapper around :func:`fedsdk_bench.fleet.main`, the same code ``fedsdk bench fleet`` runs (see
``docs/results/fleet.md``). The guard matters: the coordinator's process pool starts workers with
``forkserver``, which imports this script again in each worker.
"""

from __future__ import annotations

from fedsdk_bench.fleet import main

if __name__ == "__main__":
    raise SystemExit(main())
