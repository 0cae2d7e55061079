"""Past one machine: ``python benchmarks/scale.py [--faults] [--throughput] [--quick] [--json PATH]``.

A thin wrapper around :func:`fedsdk_bench.scale.main`; the guard below is required: the swarm's processes
start with ``spawn``, which imports this file again.
"""

from __future__ import annotations

from fedsdk_bench.scale import main

if __name__ == "__main__":
    raise SystemExit(main())
