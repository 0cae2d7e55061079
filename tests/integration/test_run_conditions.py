"""Run conditions against a real mosquitto and the real coordinator application: three devices, one of them
on battery with ``only_charging`` (``fedsdk join --only-charging``), its power read by the real sysfs reader
from a folder the test writes (``BAT0`` discharging, ``AC`` offline).

* round 1: the device on battery declines; the round completes with the other two as soon as they
  answered, far below its deadline; the decline is in ``/api/clients`` (``declines``), in the round's
  metrics and results (``/api/rounds``) and in ``/api/health``, and is no failure;
* the folder then says charging (``AC`` online), and in round 2 the device takes part: it trains from the
  model of round 1, whose aggregate it applied although it declined the round.

The two other devices take a second to train (their fit waits first), so the folder changes while round 1
still collects their updates: the device's check of round 2 sees the new folder, whatever the scheduling.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from brokers import MosquittoProcess, require_mosquitto
from engines import device
from fedsdk.conditions import DECLINED_CHARGING, RunConditions, SysfsPower
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import Task
from fedsdk_coordinator import CoordinatorConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.rounds import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(120)]

DEADLINE_S = 30.0
TRAIN_DELAY_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


def power_supply(root: Path, *, charging: bool) -> Path:
    """A ``/sys/class/power_supply`` as a laptop's kernel writes it."""
    for name, files in {
        "BAT0": {"type": "Battery", "capacity": "64", "status": "Charging" if charging else "Discharging"},
        "AC": {"type": "Mains", "online": "1" if charging else "0"},
    }.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for attr, text in files.items():
            (root / name / attr).write_text(text + "\n")
    return root


async def until(cond: Any, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_device_on_battery_declines_and_takes_part_once_charging(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 3, seed=0)
    shards = [(digits.x_train[idx], digits.y_train[idx]) for idx in part.indices]
    power = power_supply(tmp_path / "power_supply", charging=False)
    assert not RunConditions(only_charging=True, readers=(SysfsPower(power),)).check().holds
    rounds = RoundConfig(
        federation="runcond", rounds=2, min_clients=2, start_clients=3, deadline_s=DEADLINE_S, seed=1,
        farewell_s=5.0,
    )  # fmt: skip
    config = CoordinatorConfig(
        rounds=rounds, state_dir=tmp_path / "state", model="mlp", broker_url=broker.url, insecure=True
    )
    async with TestClient(TestServer(create_app(config))) as http:
        engine = http.app[ENGINE]
        conditions = RunConditions(only_charging=True, readers=(SysfsPower(power),))
        devices = [device(broker, engine, f"d{i}", shards[i]) for i in range(2)]
        devices.append(device(broker, engine, "d2", shards[2], conditions=conditions))
        for d in devices[:2]:
            fit = d._fit

            def slow_fit(task: Task, base: list[np.ndarray], fit: Any = fit) -> Any:
                time.sleep(TRAIN_DELAY_S)  # in the executor: this device trains for a second
                return fit(task, base)

            d._fit = slow_fit  # type: ignore[method-assign]
        async with devices[0], devices[1], devices[2]:
            runs = asyncio.gather(*(d.run(timeout=90) for d in devices))
            await until(lambda: engine.declines[DECLINED_CHARGING] == 1, "the decline of round 1", 60)
            assert engine.completed_round == 0  # the other two still train
            power_supply(power, charging=True)
            summaries = await asyncio.wait_for(runs, 100)
        clients = {c["client_id"]: c for c in await (await http.get("/api/clients")).json()}
        rounds_done = {r["round_id"]: r for r in await (await http.get("/api/rounds")).json()}
        health = await (await http.get("/api/health")).json()

    assert engine.state == "finished" and engine.completed_round == 2, engine.detail
    on_battery = summaries[2]
    assert on_battery.declined == {DECLINED_CHARGING: 1}
    assert [r.round_id for r in on_battery.rounds] == [2]  # trained in round 2 only
    assert on_battery.applied_rounds == [1, 2]  # round 1's aggregate applied all the same
    for s in summaries[:2]:
        assert s.declined == {} and [r.round_id for r in s.rounds] == [1, 2]
    # The round did not wait for the device that declined: it ended once the others had answered.
    r1, r2 = rounds_done[1], rounds_done[2]
    assert r1["metrics"]["declined"] == 1 and r2["metrics"]["declined"] == 0
    assert r1["num_clients"] == 2 and r2["num_clients"] == 3
    assert r1["metrics"]["round_s"] < DEADLINE_S / 5, r1["metrics"]["round_s"]
    results = {n: {x["client_id"]: x for x in r["results"]} for n, r in rounds_done.items()}
    assert results[1]["d2"]["status"] == DECLINED_CHARGING
    assert "on battery" in results[1]["d2"]["metrics"]["reason"]
    assert results[2]["d2"]["status"] == "update"
    # A decline is counted apart, never as a failure.
    assert clients["d2"]["declines"] == {DECLINED_CHARGING: 1}
    assert clients["d0"]["declines"] == {} and clients["d1"]["declines"] == {}
    assert health["device_declines"] == {DECLINED_CHARGING: 1} and health["device_failures"] == {}
