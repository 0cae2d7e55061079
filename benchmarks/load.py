"""Load test: ``python benchmarks/load.py [--devices 200] [--per-process 25] [--tls] [--json PATH]``.

A thin wrapper around :func:`fedsdk_bench.load.main`, the same code ``fedsdk bench load`` runs. The guard
below is required: worker processes start with ``spawn``, which imports this file again.
"""

from __future__ import annotations

from fedsdk_bench.load import main

if __name__ == "__main__":
    raise SystemExit(main())
