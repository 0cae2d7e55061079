"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from brokers import MosquittoProcess, start_mosquitto


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[MosquittoProcess]:
    """A mosquitto of the test's own on a free loopback port, stopped afterwards."""
    with start_mosquitto(tmp_path / "mosq") as b:
        yield b
