"""``fedsdk bench <what> [options]``: the benchmarks that ship with the SDK.

``crypto``  HE backends against python-paillier (tables + JSON)
``load``    many simulated devices against a loopback mosquitto (coordinator extra)
``fleet``   the papers' scenarios with emulated heterogeneity, every strategy side by side (coordinator extra)
``clustering``  clustered federations and personal models against one global model and training alone
            (coordinator extra)

Options after ``<what>`` go to that benchmark; ``fedsdk bench <what> --help`` lists them.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from fedsdk.cli._progress import step
from fedsdk.errors import ConfigError

BENCHMARKS = {
    "crypto": "fedsdk.crypto.bench",
    "load": "fedsdk_bench.load",
    "fleet": "fedsdk_bench.fleet",
    "clustering": "fedsdk_bench.clustering",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("what", choices=sorted(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (see --help after it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(BENCHMARKS[args.what])
    except ImportError as exc:  # a device install: the harnesses ship with the coordinator side
        raise ConfigError(
            f"'fedsdk bench {args.what}' needs the benchmark harness and the coordinator side, which are not "
            f"installed here ({exc}): pip install 'fedsdk[coordinator]'"
        ) from exc
    with step(f"benchmark {args.what}"):
        return int(module.main(list(args.rest)))
