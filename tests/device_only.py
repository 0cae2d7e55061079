"""The device's test subset: with ``FEDSDK_DEVICE_ONLY=1``, the suite runs in an environment that holds only
the device's dependencies (numpy, onnxruntime, phe, paho-mqtt, psutil, cryptography; what Termux and a
Raspberry Pi install) plus the test tools; ``scripts/test_pythons.sh`` makes such environments for each
Python it finds and runs ``tests/sdk`` in them.

The subset is what can run there: a test (or a test module, at collection) that fails because one of
:data:`NOT_ON_A_DEVICE` is missing (the coordinator's, the benchmarks' and the optional extras' packages:
building a model graph needs ``onnx``, the CKKS backend ``tenseal``...; also in a subprocess's traceback),
or because fedsdk said an extra is needed (``pip install 'fedsdk[fast]'``), is reported as skipped, naming
what it needs. Any other failure, a missing *device* dependency included, stays a failure. The mode refuses
to start when one of those packages is importable: the environment would not be a device's.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Generator
from typing import Any

import pytest

NOT_ON_A_DEVICE = (
    "aiohttp", "sklearn", "scipy", "onnx", "torch", "amqtt", "tenseal", "matplotlib", "gmpy2",
    "prometheus_client",
)  # fmt: skip


EXTRAS = ("coordinator", "ckks", "fast", "attacks", "plots")
MISSING = re.compile(r"No module named \\?'(\w+)")  # a traceback's text, or its repr inside another message


def device_only() -> bool:
    return os.environ.get("FEDSDK_DEVICE_ONLY", "").strip().lower() not in ("", "0", "false", "no")


def _needs(text: str) -> str | None:
    """What a failure's text says is missing that a device does not install: a non-device package
    (``No module named 'onnx'``, also from a subprocess's traceback) or an extra (``pip install
    'fedsdk[ckks]'``, the message fedsdk raises when an optional part is asked for)."""
    for name in MISSING.findall(text):
        if name in NOT_ON_A_DEVICE:
            return str(name)
    for extra in EXTRAS:
        if f"pip install 'fedsdk[{extra}]'" in text:
            return f"fedsdk[{extra}]"
    return None


def pytest_configure(config: pytest.Config) -> None:
    if not device_only():
        return
    present = [m for m in NOT_ON_A_DEVICE if importlib.util.find_spec(m) is not None]
    if present:
        pytest.exit(f"FEDSDK_DEVICE_ONLY is set but {', '.join(present)} can be imported here", returncode=4)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if not device_only() or not report.failed:
        return
    package = _needs(str(report.longrepr))
    if package is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"not a device test: needs {package}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    if not device_only():
        return
    report = outcome.get_result()
    if report.failed and isinstance(collector, pytest.Module):
        package = _needs(str(report.longrepr))
        if package is not None:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"not a device test module: needs {package}")
