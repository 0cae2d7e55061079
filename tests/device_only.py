"""The device's test subset: with ``FEDSDK_DEVICE_ONLY=1``, the suite runs in an environment that holds only
the device's dependencies (numpy, onnxruntime, phe, paho-mqtt, psutil, cryptography; what Termux and a
Raspberry Pi install) plus the test tools; ``scripts/test_pythons.sh`` makes such environments for each
Python it finds and runs ``tests/sdk`` in them.

The subset is what can run there: a test (or a test module, at collection) that stops on importing one of
:data:`NOT_ON_A_DEVICE` (the coordinator's, the benchmarks' and the optional extras' packages: building a
model graph needs ``onnx``, the CKKS backend ``tenseal``...) is reported as skipped, naming the package. Any
other failure, a missing *device* dependency included, stays a failure. The mode refuses to start when one
of those packages is importable: the environment would not be a device's.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Generator
from typing import Any

import pytest

NOT_ON_A_DEVICE = (
    "aiohttp", "sklearn", "scipy", "onnx", "torch", "amqtt", "tenseal", "matplotlib", "gmpy2",
    "prometheus_client",
)  # fmt: skip


def device_only() -> bool:
    return os.environ.get("FEDSDK_DEVICE_ONLY", "").strip().lower() not in ("", "0", "false", "no")


def _missing_package(excinfo: Any) -> str | None:
    """The non-device package whose absence raised ``excinfo`` (anywhere in its chain of causes)."""
    exc = getattr(excinfo, "value", None)
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] in NOT_ON_A_DEVICE:
            return (exc.name or "").partition(".")[0]
        exc = exc.__cause__ or exc.__context__
        seen += 1
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
    if not device_only() or call.excinfo is None:
        return
    package = _missing_package(call.excinfo)
    if package is not None:
        report = outcome.get_result()
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"not a device test: needs {package}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    if not device_only():
        return
    report = outcome.get_result()
    if report.failed and isinstance(collector, pytest.Module):
        text = str(report.longrepr)
        package = next((m for m in NOT_ON_A_DEVICE if f"No module named '{m}" in text), None)
        if package is not None:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"not a device test module: needs {package}")
