"""The protection a `fedsdk` task asks for, done by real devices end to end (mosquitto, the coordinator
application, FedClients with packed Paillier): the leakage check runs on every update, the budget cap holds,
and opt-in noise on the clear part is applied and accounted, while the encrypted aggregate still decrypts
and every device applies it."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from brokers import require_mosquitto, start_mosquitto
from engines import coordinator, digit_devices
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.noise import rdp_epsilon
from fedsdk_coordinator import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


async def test_devices_check_their_rows_hold_the_cap_and_noise_the_clear_part(tmp_path: Path) -> None:
    with generate_backend("packed", key_bits=1024) as he:
        public = save_he(tmp_path / "he-public", he, include_secret=False)
        secret = save_he(tmp_path / "he-device", he, include_secret=True)
    digits = load_digits(shape="flat")
    part = partition_label_skew(digits.y_train, 2, n_groups=1, seed=0)
    rounds = RoundConfig(
        federation=f"pr{secrets.token_hex(3)}", rounds=2, min_clients=2, start_clients=2, strategy="fedsdk",
        clustering=False, budget_cap=0.3, mask_noise=0.03, mask_clip=1.0, farewell_s=5.0, min_aggregate=2,
    )  # fmt: skip
    with start_mosquitto(tmp_path / "mosq") as broker:
        async with coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
            clients = digit_devices(broker, engine, digits, part, he_dir=secret)
            async with clients[0], clients[1]:
                summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 200)
            results: dict[int, list[dict[str, Any]]] = {r: engine.store.results(r) for r in (1, 2)}
            budgets = [rec.metrics for rec in engine.store.rounds()]
            assert all(s.state == "finished" and s.applied_rounds == [1, 2] for s in summaries)
    for r, rows in results.items():
        assert len(rows) == 2
        for row in rows:
            m = row["metrics"]
            assert row["status"] == "update"
            assert m["leak_rows"] >= 0 and "leak_packs" in m  # the check ran on the device
            assert m["noise_sigma"] == pytest.approx(0.03)
            assert m["dp_epsilon_round"] == pytest.approx(rdp_epsilon(0.03, 1))
            assert m["dp_epsilon"] == pytest.approx(rdp_epsilon(0.03, r))  # the device's own count
            assert 0 < m["clip_factor"] <= 1
    assert all(v <= 0.3 for b in budgets for k, v in b.items() if k.startswith("budget_"))
    # the two devices hold the same model: the aggregate of encrypted and noised clear parts decrypted alike
    for a, b in zip(clients[0].weights or [], clients[1].weights or [], strict=True):
        np.testing.assert_array_equal(a, b)
