"""Shared fixtures: real brokers and a development PKI (see ``tests/brokers.py`` for the helpers).

Fixtures
--------
``mosquitto``        a plain-TCP mosquitto on a free 127.0.0.1 port, anonymous access (function scope).
                     Attributes: ``.host``, ``.port``, ``.url`` (``mqtt://127.0.0.1:PORT``), ``.stop()``,
                     ``.restart()``, ``.kill()``, ``.log_text()``.
``dev_pki``          a :class:`fedsdk_coordinator.pki.DevPki` in a temporary directory with client ids
``dev1``,
                     ``dev2``, ``dev3`` and ``coordinator``. ``dev_pki.tls_for("dev1")`` -> ``TlsConfig``.
``mosquitto_tls``    mosquitto with a TLS listener that requires a client certificate from ``dev_pki``'s CA
                     (CN becomes the username); ``.url`` is ``mqtts://127.0.0.1:PORT``.
``unique_topic``     a topic prefix unique to the test (``test/<random>``), so tests never see each
                     other's retained messages.

When mosquitto is not installed the broker fixtures *skip* with a clear message, unless the environment
variable ``CI`` is set (to anything but empty/0/false): then a missing broker is a failure, so CI can never
pass by skipping its integration tests. The embedded amqtt broker is started with ``brokers.start_amqtt``
directly inside an async test (it runs in the test's event loop).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokers import MosquittoProcess, find_mosquitto, start_mosquitto
from fedsdk_coordinator.pki import DevPki, make_dev_pki

pytest_plugins = ["device_only"]  # FEDSDK_DEVICE_ONLY=1: the device's test subset (tests/device_only.py)

DEV_CLIENT_IDS = ("dev1", "dev2", "dev3")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _require_mosquitto() -> None:
    if find_mosquitto() is not None:
        return
    message = "mosquitto is not installed (apt-get install mosquitto); broker tests need a real broker"
    if _in_ci():
        pytest.fail(f"CI is set and {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def dev_pki(tmp_path: Path) -> DevPki:
    """A fresh development PKI (CA, broker certificate, dev1..dev3 and coordinator) in a temporary dir."""
    return make_dev_pki(tmp_path / "pki", client_ids=DEV_CLIENT_IDS)


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[MosquittoProcess]:
    """A plain-TCP mosquitto for one test, stopped afterwards."""
    _require_mosquitto()
    with start_mosquitto(tmp_path / "mosquitto") as broker:
        yield broker


@pytest.fixture
def mosquitto_tls(tmp_path: Path, dev_pki: DevPki) -> Iterator[MosquittoProcess]:
    """A mosquitto that requires client certificates from ``dev_pki``'s CA, stopped afterwards."""
    _require_mosquitto()
    with start_mosquitto(tmp_path / "mosquitto-tls", tls=dev_pki) as broker:
        yield broker


@pytest.fixture
def unique_topic() -> str:
    return f"test/{secrets.token_hex(4)}"
