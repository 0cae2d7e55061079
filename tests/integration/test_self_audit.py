"""``fedsdk join --self-audit`` against a real mosquitto and the real coordinator application.

A device with two local digits trains one step a round: rows of its first-layer update that one sample
alone activated are that sample times a factor, so its update copies its samples.

* plaintext strategy: ``fedsdk join --self-audit`` (a process) withholds both rounds' updates and answers
  with errors of code ``self_audit``, which the coordinator counts (``/api/health``, ``/metrics``); the
  rounds go on with another device's update; the process's summary counts the withheld updates and it
  exits 1 saying the self-audit withheld every update;
* ``fedsdk`` strategy at budget 1 (everything encrypted): the same device, self-audit on, sends its updates,
  with the check's metrics, and applies the aggregates;
* the ``cnn`` preset (a convolution first): the self-audit does not apply, is skipped with one log line,
  and the updates are sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from brokers import MosquittoProcess, require_mosquitto
from engines import device
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import load_he, save_he
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.rounds import RoundEngine
from promtext import samples

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

WITHHELD = re.compile(
    r"update withheld: the self-audit recovered [12] of 2 local samples at >= 25 dB \(max [0-9.]+ dB\)"
)


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


@pytest.fixture(scope="module")
def digits() -> Any:
    return load_digits(shape="flat")


def tiny(digits: Any) -> tuple[np.ndarray, np.ndarray]:
    """Two local digits: one training step a round (batch 32)."""
    return digits.x_train[:2], digits.y_train[:2]


@contextlib.asynccontextmanager
async def coordinator(
    tmp_path: Path,
    broker: MosquittoProcess,
    *,
    model: str = "mlp16",
    he_dir: Path | None = None,
    **rounds: Any,
) -> AsyncIterator[tuple[TestClient[Any, Any], RoundEngine]]:
    config = CoordinatorConfig(
        # the self-audit attacks what one update shows: unmasked (under secure aggregation nothing of one
        # update is visible, tests/sdk/test_selfaudit.py), and rounds of one device have no sum to mask
        rounds=RoundConfig(
            federation=f"sa{secrets.token_hex(3)}", seed=1, farewell_s=5.0, secagg=False, **rounds
        ),
        state_dir=tmp_path / "state",
        model=model,
        broker_url=broker.url,
        insecure=True,
        he_dir=he_dir,
    )
    async with TestClient(TestServer(create_app(config))) as http:
        yield http, http.app[ENGINE]


async def test_plaintext_a_leaking_update_is_withheld_and_counted(
    tmp_path: Path, broker: MosquittoProcess, digits: Any
) -> None:
    data = tmp_path / "tiny.npz"
    save_npz(data, *tiny(digits))
    summary_file = tmp_path / "leaky.json"
    other = partition_iid(digits.y_train, 4, seed=1).indices[0]
    async with coordinator(tmp_path, broker, rounds=2, min_clients=1, start_clients=2) as (http, engine):
        fed = engine.config.federation
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fedsdk", "-v", "join", broker.url, "--insecure", "--client-id", "leaky",
            "--federation", fed, "--data", str(data), "--timeout", "120", "--self-audit",
            "--json", str(summary_file), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        honest = device(broker, engine, "honest", (digits.x_train[other], digits.y_train[other]))
        async with honest:
            summary = await asyncio.wait_for(honest.run(), 120)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        health = await (await http.get("/api/health")).json()
        metrics = await (await http.get("/metrics")).text()
        results = {r: engine.store.results(r) for r in (1, 2)}
    assert engine.state == "finished" and engine.completed_round == 2
    assert summary.state == "finished" and summary.applied_rounds == [1, 2]
    assert health["device_failures"] == {"self_audit": 2}
    assert samples(metrics)["fedsdk_device_failures_total", (("code", "self_audit"),)] == 2
    for rows in results.values():
        by_id = {row["client_id"]: row for row in rows}
        assert by_id["honest"]["status"] == "update"
        assert by_id["leaky"]["status"] == "error:self_audit"
        assert WITHHELD.fullmatch(by_id["leaky"]["metrics"]["reason"]), by_id["leaky"]["metrics"]["reason"]
    text = (out + err).decode()
    assert proc.returncode == 1, text[-3000:]
    last = err.decode().strip().splitlines()[-1]
    assert "(0 updates sent, 2 updates withheld by the self-audit)" in last, last
    assert "the self-audit withheld every update it made" in last, last
    leaky = json.loads(summary_file.read_text())
    assert leaky["withheld"] == 2 and leaky["rounds"] == [] and leaky["state"] == "finished"
    assert text.count("WARNING") >= 2 and len(WITHHELD.findall(text)) >= 2  # logged at warning level


async def test_fully_encrypted_the_same_device_passes_its_self_audit(
    tmp_path: Path, broker: MosquittoProcess, digits: Any
) -> None:
    with generate_backend("packed", key_bits=1024) as he:
        public = save_he(tmp_path / "he-public", he, include_secret=False)
        secret = save_he(tmp_path / "he-device", he, include_secret=True)
    async with coordinator(
        tmp_path, broker, he_dir=public, rounds=2, min_clients=1, start_clients=1, strategy="fedsdk",
        clustering=False, budget_floor=1.0,
    ) as (http, engine):  # fmt: skip
        client = device(broker, engine, "leaky", tiny(digits), he=load_he(secret), self_audit=True)
        async with client:
            summary = await asyncio.wait_for(client.run(), 120)
        health = await (await http.get("/api/health")).json()
        results = {r: engine.store.results(r) for r in (1, 2)}
    assert engine.state == "finished"
    assert summary.state == "finished" and summary.applied_rounds == [1, 2] and summary.withheld == 0
    assert health["device_failures"] == {}
    for rows in results.values():
        (row,) = rows
        m = row["metrics"]
        assert row["status"] == "update" and m["encrypted_ratio"] == 1.0
        assert m["self_audit_max_db"] < 25 and m["self_audit_s"] > 0
    assert all("self_audit_s" in r.timings for r in summary.rounds)


async def test_the_self_audit_is_skipped_for_a_convolution(
    tmp_path: Path, broker: MosquittoProcess, digits: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsdk.client")
    options = {"model": "cnn", "rounds": 2, "min_clients": 1, "start_clients": 1}
    async with coordinator(tmp_path, broker, **options) as (_, engine):
        client = device(broker, engine, "conv", tiny(digits), self_audit=True)
        async with client:
            summary = await asyncio.wait_for(client.run(), 120)
        results = {r: engine.store.results(r) for r in (1, 2)}
    assert summary.state == "finished" and summary.applied_rounds == [1, 2] and summary.withheld == 0
    assert all(rows[0]["status"] == "update" for rows in results.values())
    assert all("self_audit_max_db" not in rows[0]["metrics"] for rows in results.values())
    skipped = [r for r in caplog.records if "self-audit skipped" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.INFO
    assert "not a fully connected layer" in skipped[0].getMessage()
