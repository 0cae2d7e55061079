"""``python -m fedsdk_bench.clustering`` is ``fedsdk bench clustering``.

The guard matters: the coordinator's process pool starts workers with ``forkserver``, which imports the
main module again in each worker.
"""

from __future__ import annotations

import sys

from fedsdk_bench.clustering.cli import main

if __name__ == "__main__":
    sys.exit(main())
