"""A device sizes its obfuscator pool for the federation's model when it joins (the coordinator's status names
the parameter count), so that obfuscators are made from then on, not from the first task."""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
from test_client_restart import Upstream

from brokers import MosquittoProcess
from fedsdk.client import FedClient
from fedsdk.crypto import generate_backend, load_backend
from fedsdk.crypto.pool import auto_capacity
from fedsdk.model import OnnxModel
from fedsdk.protocol import Hello, Status, encode
from fedsdk.protocol import topics as T
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.engine.tasks import make_status
from fedsdk_coordinator.models import build_graphs, preset

PARAMS = 999_985  # the preset mlp13333


def test_the_coordinators_status_names_the_models_parameter_count() -> None:
    bundle = build_graphs(preset("mlp"))
    status = make_status(bundle, OnnxModel.from_bundle(bundle), "running", "e1", 0)
    assert status.model["params"] == sum(int(np.prod(s)) for s in bundle.param_shapes) == 4_810


async def test_a_device_sizes_its_pool_from_the_status_before_any_task(mosquitto: MosquittoProcess) -> None:
    fed = f"pj{secrets.token_hex(3)}"
    keys = generate_backend("packed", key_bits=1024)
    he = load_backend("packed", keys.params, keys.public_bytes(), keys.secret_bytes(), parallel=False)
    x = np.random.default_rng(0).normal(size=(20, 64)).astype(np.float32)
    client = FedClient(
        mosquitto.url, client_id="d1", federation=fed, data=(x, np.arange(20) % 10), he=he, insecure=True,
        timeout=5.0, probe_bytes=0,
    )  # fmt: skip
    async with MqttTransport.from_url(
        mosquitto.url, client_id="coordinator", insecure=True, timeout=5.0
    ) as co:
        await co.subscribe(T.up_filter(fed))
        up = Upstream(co)
        try:
            async with client:
                run = asyncio.create_task(client.run(timeout=60))
                assert he.pool is None  # nothing made before the device knows the model's size
                model = {
                    "input_shape": "64",
                    "output_shape": "10",
                    "task": "classification",
                    "params": PARAMS,
                }
                await co.publish(T.status(fed), encode(Status("running", "e1", model=model)), retain=True)
                hello, _ = await up.next(T.HELLO)
                assert isinstance(hello, Hello)
                for _ in range(100):
                    if he.pool is not None:
                        break
                    await asyncio.sleep(0.05)
                assert he.pool is not None and he.pool.capacity == auto_capacity(he.num_packs(PARAMS), 1024)
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
        finally:
            await up.close()
            he.close()
