"""Run conditions against a real mosquitto and the real coordinator application: three devices, one of them
on battery with ``only_charging`` (``fedsdk join --only-charging``), its power read by the real sysfs reader
from a folder the test writes (``BAT0`` discharging, ``AC`` offline).

* round 1: the device on battery declines; the round completes with the other two as soon as they
  answered, far below its deadline; the decline is in ``/api/clients`` (``declines``), in the round's
  metrics and results (``/api/rounds``), in ``/api/health`` and ``/metrics``, and is no failure;
* the folder then says charging (``AC`` online), and in round 2 the device takes part: it trains from the
  model of round 1, whose aggregate it applied although it declined the round; at the end the three
  devices hold the same model, which under HE (the ``fedsdk`` strategy, where only the devices hold the
  model) shows the device that declined did not fall behind.

The two other devices take a second to train (their fit waits first), so the folder changes while round 1
still collects their updates: the device's check of round 2 sees the new folder, whatever the scheduling.

With two devices and a quorum of two, the decline leaves round 1 short of its quorum: the round fails at
once (the status says one device declined) and waits for a device to come back. The device on battery
checks its conditions again after a decline (``recheck_s``), says hello once the folder says charging, and
round 1 runs again with both devices; the declines stay counted though the failed attempt's results are
replaced.
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
from engines import device, http_coordinator, until
from fedsdk.conditions import DECLINED_CHARGING, RunConditions, SysfsPower
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import load_he, save_he
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import Task
from fedsdk_coordinator import CoordinatorConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.rounds import RoundConfig
from promtext import samples
from webui import Page, require_chromium, start_chromium

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


def on_battery_conditions(power: Path, **options: Any) -> RunConditions:
    return RunConditions(only_charging=True, readers=(SysfsPower(power),), **options)


@pytest.mark.parametrize("strategy", ["plaintext", "fedsdk"])
async def test_a_device_on_battery_declines_and_takes_part_once_charging(
    tmp_path: Path, broker: MosquittoProcess, strategy: str
) -> None:
    he_dir = secret = None
    if strategy == "fedsdk":  # under HE only the devices hold the model (1024-bit keys keep it short);
        # not clustered: round 1 is the first round, as in plaintext
        with generate_backend("packed", key_bits=1024) as full:
            he_dir = save_he(tmp_path / "he-public", full, include_secret=False)
            secret = save_he(tmp_path / "he-device", full, include_secret=True)
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 3, seed=0)
    shards = [(digits.x_train[idx], digits.y_train[idx]) for idx in part.indices]
    power = power_supply(tmp_path / "power_supply", charging=False)
    assert not on_battery_conditions(power).check().holds
    rounds = RoundConfig(
        federation=f"runcond{strategy}", strategy=strategy, rounds=2, min_clients=2, start_clients=3,
        deadline_s=DEADLINE_S, seed=1, clustering=False,
        farewell_s=5.0, min_aggregate=2,
    )  # fmt: skip
    async with http_coordinator(tmp_path, broker, rounds, he_dir=he_dir) as http:
        engine = http.app[ENGINE]

        def he() -> Any:
            return load_he(secret) if secret is not None else None

        devices = [device(broker, engine, f"d{i}", shards[i], he=he()) for i in range(2)]
        devices.append(
            device(broker, engine, "d2", shards[2], he=he(), conditions=on_battery_conditions(power))
        )
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
        models = [d.weights for d in devices]
        if strategy == "plaintext":  # the dashboard's device table shows the decline (headless Chromium)
            require_chromium()
            driver = await asyncio.to_thread(start_chromium, tmp_path / "chromium-profile")
            try:
                page = Page(driver)
                await asyncio.to_thread(driver.get, str(http.make_url("/")))
                cell = 'tr[data-device="d2"] td[data-field="declines"]'
                shown = await page.until("d2's decline", lambda: page.text(cell))
                assert shown == f"{DECLINED_CHARGING}×1", shown
                assert await page.text('tr[data-device="d0"] td[data-field="declines"]') == ""
            finally:
                await asyncio.to_thread(driver.quit)
        clients = {c["client_id"]: c for c in await (await http.get("/api/clients")).json()}
        rounds_done = {r["round_id"]: r for r in await (await http.get("/api/rounds")).json()}
        health = await (await http.get("/api/health")).json()
        scrape = samples(await (await http.get("/metrics")).text())

    assert engine.state == "finished" and engine.completed_round == 2, engine.detail
    assert scrape["fedsdk_device_declines_total", (("code", DECLINED_CHARGING),)] == 1
    on_battery = summaries[2]
    assert on_battery.declined == {DECLINED_CHARGING: 1}
    assert [r.round_id for r in on_battery.rounds] == [2]  # trained in round 2 only
    assert on_battery.applied_rounds == [1, 2], (
        on_battery.rejected,
        on_battery.reason,
    )  # round 1's aggregate applied all the same
    # ... so it trained round 2 from round 1's model and holds the federation's model: under HE a device that
    # skipped round 1's aggregate would have sent an update against the initial model and hold another one.
    for held in models[1:]:
        assert held is not None and models[0] is not None
        for a, b in zip(models[0], held, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
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


async def test_a_round_short_of_its_quorum_runs_again_when_the_device_is_charging(
    tmp_path: Path, broker: MosquittoProcess
) -> None:
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, 2, seed=0)
    power = power_supply(tmp_path / "power_supply", charging=False)
    rounds = RoundConfig(
        federation="runcond2", rounds=1, min_clients=2, start_clients=2, deadline_s=DEADLINE_S, seed=1,
        farewell_s=5.0, min_aggregate=2,
    )  # fmt: skip
    config = CoordinatorConfig(
        rounds=rounds, state_dir=tmp_path / "state", model="mlp", broker_url=broker.url, insecure=True
    )
    async with TestClient(TestServer(create_app(config))) as http:
        engine = http.app[ENGINE]
        conditions = on_battery_conditions(power, recheck_s=0.3)
        devices = [
            device(broker, engine, "d0", (digits.x_train[part.indices[0]], digits.y_train[part.indices[0]])),
            device(
                broker, engine, "d1", (digits.x_train[part.indices[1]], digits.y_train[part.indices[1]]),
                conditions=conditions,
            ),
        ]  # fmt: skip
        async with devices[0], devices[1]:
            t0 = time.monotonic()
            runs = asyncio.gather(*(d.run(timeout=90) for d in devices))
            await until(lambda: engine.detail.startswith("round 1 failed"), "round 1 to fail", 60)
            assert "1 declined (d1)" in engine.detail and "device errors" not in engine.detail, engine.detail
            await asyncio.sleep(1.0)  # it rechecks meanwhile, still on battery: no hello, no new attempt
            assert engine.detail.startswith("round 1 failed")
            power_supply(power, charging=True)
            summaries = await asyncio.wait_for(runs, 100)
            took = time.monotonic() - t0
        clients = {c["client_id"]: c for c in await (await http.get("/api/clients")).json()}
        health = await (await http.get("/api/health")).json()
    assert engine.state == "finished" and engine.completed_round == 1, engine.detail
    assert took < DEADLINE_S / 2, took  # no deadline was waited out
    assert summaries[1].declined == {DECLINED_CHARGING: 1} and [r.round_id for r in summaries[1].rounds] == [
        1
    ]
    assert summaries[0].applied_rounds == summaries[1].applied_rounds == [1]
    assert clients["d1"]["declines"] == {DECLINED_CHARGING: 1}
    assert health["device_declines"] == {DECLINED_CHARGING: 1} and health["device_failures"] == {}
