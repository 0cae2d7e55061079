"""Key mode ``keyserver``: the devices hold the model but not the secret key, so none can seal the model for
a device that lacks it, and the coordinator cannot read it. A device that joins after round 2 used to get
the federation's *initial* model in its task and send updates computed against it, which went into every
later aggregate of its cluster. Now it is left out of the rounds, with a warning saying why
(``fedsdk_coordinator.engine.relay``; real coordinator, key server, devices and mosquitto).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

from brokers import MosquittoProcess, require_mosquitto
from engines import coordinator, device, digit_shards, he_key_dirs, slowed, until
from fedsdk.hekeys import load_he
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.keyserver import KeyServer
from fedsdk_coordinator.rounds import RoundConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


async def test_a_late_device_is_left_out_instead_of_training_from_the_initial_model(
    tmp_path: Path, broker: MosquittoProcess, caplog: pytest.LogCaptureFixture
) -> None:
    public, secret = he_key_dirs(tmp_path)
    shards = digit_shards(3)
    rounds = RoundConfig(
        federation="kslate", strategy="fedsdk", key_mode="keyserver", rounds=5, min_clients=2,
        start_clients=2, deadline_s=30.0, seed=1, clustering=False, farewell_s=5.0, min_aggregate=2,
    )  # fmt: skip
    transport = MqttTransport.from_url(broker.url, client_id="keyserver", insecure=True)
    async with transport, coordinator(tmp_path, broker, rounds, he_dir=public) as engine:
        keyserver = asyncio.create_task(
            KeyServer(transport, load_he(secret), federation="kslate", min_aggregate=2).run()
        )
        bases: list[dict[int, list[np.ndarray]]] = [{}, {}, {}]
        first = [device(broker, engine, f"d{i}", shards[i], he=load_he(public)) for i in range(2)]
        for d, b in zip(first, bases, strict=False):
            slowed(d, 0.3, b)
        with caplog.at_level(logging.INFO, logger="fedsdk.progress.rounds"):
            async with first[0], first[1]:
                runs = [asyncio.create_task(d.run(timeout=120)) for d in first]
                await until(lambda: engine.completed_round >= 2, "round 2")
                late = device(broker, engine, "d2", shards[2], he=load_he(public))
                slowed(late, 0.3, bases[2])
                async with late:
                    summaries = await asyncio.gather(*runs, late.run(timeout=120))
        keyserver.cancel()
        await asyncio.gather(keyserver, return_exceptions=True)

    assert engine.state == "finished" and engine.completed_round == 5, engine.detail
    assert [s.state for s in summaries[:2]] == ["finished", "finished"], [s.reason for s in summaries]
    assert bases[2] == {}, sorted(bases[2])  # the late device trained no round (before: from round 3 on)
    assert sorted(bases[0]) == [1, 2, 3, 4, 5]
    for a, b in zip(first[0].weights or [], first[1].weights or [], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("device d2 lacks")]
    assert len(told) == 1 and "left out of its rounds" in told[0], told
