"""A device keeps the model it holds across a restart of its process (``FedClient(state_dir=...)``,
``fedsdk.client.saved``).

End to end: a real FedClient with packed Paillier keys (1024 bits to keep the test short; the file does
not depend on the key) against a real mosquitto; the test plays the coordinator with its own transport and
the public key only. The device trains round 1 from the task's model and applies the encrypted aggregate;
its process is then stopped and a new FedClient for the same device starts on the same state directory.
What is checked: the new process holds the same model and says so in its hello (``model_round`` 1), trains
round 2 from it on a task that carries no weights (as the coordinator sends a device that holds its
cluster's model), and its encrypted update decrypts to the update of training from that model: the base
was the kept model, not the initial one. The file is mode 0600; a file of another device or federation,
or a damaged one, is not used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import stat
from pathlib import Path

import numpy as np
import pytest
from test_client_restart import SPEC, Upstream
from test_client_restart import make_task as restart_task

from brokers import MosquittoProcess
from fedsdk.client import FedClient
from fedsdk.client.saved import MODEL_FILE, SavedModel, load_model, save_model
from fedsdk.crypto import generate_backend, load_backend
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits
from fedsdk.pipeline import contribution_from_message, message_from_he_aggregate
from fedsdk.protocol import EncryptedUpdate, Error, Hello, Report, Status, Task, Update, encode
from fedsdk.protocol import topics as T
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.models import build_graphs, init_params

pytestmark = pytest.mark.timeout(180)
WAIT = 60.0


class _Up(Upstream):
    async def first(self, kind: str) -> object:
        """The next message of ``kind``, decoded."""
        return (await self.next(kind))[0]


def make_task(fed: str, round_id: int, weights: list[np.ndarray] | None) -> Task:
    """A task whose whole update is encrypted; without ``weights`` as for a device that holds the model."""
    task = restart_task(fed, round_id, weights if weights is not None else init_params(SPEC, seed=0))
    config = {**task.config, "mask": "all"}
    if weights is None:
        return dataclasses.replace(task, config=config, weights=(), param_names=())
    return dataclasses.replace(task, config=config)


async def test_a_restarted_device_trains_on_the_model_it_kept(
    mosquitto: MosquittoProcess, tmp_path: Path
) -> None:
    fed = f"sv{secrets.token_hex(3)}"
    digits = load_digits(shape="flat")
    data = (digits.x_train[:80], digits.y_train[:80])
    w0 = [np.asarray(w, np.float32) for w in init_params(SPEC, seed=0)]
    keyholder = generate_backend("packed", key_bits=1024, encoding="weighted", frac_bits=13)  # exact compare
    params, public, secret = keyholder.params, keyholder.public_bytes(), keyholder.secret_bytes()
    coordinator_he = load_backend("packed", params, public)
    state = tmp_path / "state"

    def device() -> FedClient:
        return FedClient(
            mosquitto.url,
            client_id="dev1",
            federation=fed,
            data=data,
            he=load_backend("packed", params, public, secret, parallel=False),
            insecure=True,
            timeout=5.0,
            probe_bytes=0,
            state_dir=state,
        )

    async with MqttTransport.from_url(
        mosquitto.url, client_id="coordinator", insecure=True, timeout=5.0
    ) as co:
        await co.subscribe(T.up_filter(fed))
        up = _Up(co)
        try:
            first = device()
            assert first.weights is None  # nothing kept yet
            async with first:
                run = asyncio.create_task(first.run(timeout=120))
                await co.publish(T.status(fed), encode(Status("running", "epoch1")), retain=True)
                hello = await up.first(T.HELLO)
                assert isinstance(hello, Hello) and hello.device["model_round"] == -1
                await co.publish(T.down(fed, "dev1"), encode(make_task(fed, 1, w0)))
                update = await up.first(T.UPDATE)
                assert isinstance(update, EncryptedUpdate)
                agg = coordinator_he.aggregate([contribution_from_message(update)])
                msg = message_from_he_aggregate(agg, round_id=1, cluster_id=0, total_samples=80, metrics={})
                await co.publish(T.cluster(fed, 0), encode(msg), retain=True)
                report = await up.first(T.REPORT)
                assert isinstance(report, Report) and report.round_id == 1
                for _ in range(100):  # the model is written after the report
                    if (state / MODEL_FILE).is_file():
                        break
                    await asyncio.sleep(0.05)
                kept = [w.copy() for w in first.weights or []]
                run.cancel()  # the process stops
                await asyncio.gather(run, return_exceptions=True)
            assert stat.S_IMODE((state / MODEL_FILE).stat().st_mode) == 0o600
            np.testing.assert_allclose(
                kept[0],
                w0[0] + keyholder.decrypt_aggregate(agg)[: w0[0].size].reshape(w0[0].shape),
                atol=1e-6,
            )

            second = device()  # a new process of the same device, on the same state directory
            assert second.weights is not None
            for got, want in zip(second.weights, kept, strict=True):
                np.testing.assert_array_equal(got, want)
            async with second:
                run = asyncio.create_task(second.run(timeout=120))
                await co.publish(T.status(fed), encode(Status("running", "epoch2")), retain=True)
                hello = await up.first(T.HELLO)
                assert isinstance(hello, Hello) and hello.device["model_round"] == 1
                await co.publish(
                    T.down(fed, "dev1"), encode(make_task(fed, 2, None))
                )  # no weights: it holds one
                update = await up.first(T.UPDATE)
                assert isinstance(update, EncryptedUpdate) and update.round_id == 2
                got = coordinator_he.aggregate([contribution_from_message(update)])
                sent = keyholder.decrypt_aggregate(got)
                await co.publish(T.status(fed), encode(Status("finished", "epoch2", 2)), retain=True)
                await asyncio.wait_for(run, WAIT)
        finally:
            await up.close()
    # the update of training round 2 from the kept model, as the device's trainer does it
    bundle = build_graphs(SPEC)
    model = OnnxModel(bundle.train_graph, bundle.eval_graph, bundle.param_names, [w.shape for w in w0])
    trained = OnnxTrainer(model, *data, lr=0.05, batch_size=32, epochs=1).fit(kept, seed=2).weights
    want = np.concatenate([(t - k).ravel() for t, k in zip(trained, kept, strict=True)])
    np.testing.assert_allclose(sent, want, atol=2 * keyholder.quantisation_bound)
    from_initial = OnnxTrainer(model, *data, lr=0.05, batch_size=32, epochs=1).fit(w0, seed=2).weights
    other = np.concatenate([(t - k).ravel() for t, k in zip(from_initial, w0, strict=True)])
    assert (
        np.abs(sent - other).max() > 100 * keyholder.quantisation_bound
    )  # not trained from the initial model


def test_a_kept_model_of_another_device_or_a_damaged_file_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)]
    saved = SavedModel("fed", "dev1", 2, 7, "m1", ("a", "b"), w)
    save_model(tmp_path, saved)
    back = load_model(tmp_path, federation="fed", client_id="dev1")
    assert back is not None and (back.cluster_id, back.model_round, back.model_id) == (2, 7, "m1")
    assert back.param_names == ("a", "b") and all(np.array_equal(x, y) for x, y in zip(back.weights, w))
    assert stat.S_IMODE((tmp_path / MODEL_FILE).stat().st_mode) == 0o600
    with caplog.at_level(logging.WARNING, logger="fedsdk.client.saved"):
        assert load_model(tmp_path, federation="fed", client_id="dev2") is None
        assert load_model(tmp_path, federation="other", client_id="dev1") is None
        for damaged in (b"PK\x03\x04 not a model", b""):  # a zip that is not one, an empty file
            (tmp_path / MODEL_FILE).write_bytes(damaged)
            assert load_model(tmp_path, federation="fed", client_id="dev1") is None
        save_model(
            tmp_path,
            SavedModel("fed", "dev1", 0, 1, "m1", ("a", "b"), [w[0], np.full(3, np.nan, np.float32)]),
        )
        assert load_model(tmp_path, federation="fed", client_id="dev1") is None
    assert len([r for r in caplog.records if "not using the model kept" in r.getMessage()]) == 5
    assert load_model(tmp_path / "nowhere", federation="fed", client_id="dev1") is None  # nothing kept: quiet


async def test_a_model_kept_from_another_run_is_dropped_and_the_device_says_so(
    mosquitto: MosquittoProcess, tmp_path: Path
) -> None:
    """A state directory that holds round 5's model of an earlier run of the federation: the new run's
    coordinator, told the device holds a model, sends round 1's task without weights. The device cannot
    train round 1 from a round-5 model: it answers with an error, drops the model and says hello again with
    ``model_round`` -1, so that its next task carries the federation's model, which it then trains from."""
    fed = f"sv{secrets.token_hex(3)}"
    digits = load_digits(shape="flat")
    w0 = [np.asarray(w, np.float32) for w in init_params(SPEC, seed=0)]
    old = [w + 1.0 for w in w0]
    bundle = build_graphs(SPEC)
    save_model(tmp_path, SavedModel(fed, "dev1", 0, 5, bundle.model_id, tuple(bundle.param_names), old))

    client = FedClient(
        mosquitto.url,
        client_id="dev1",
        federation=fed,
        data=(digits.x_train[:80], digits.y_train[:80]),
        insecure=True,
        timeout=5.0,
        probe_bytes=0,
        state_dir=tmp_path,
    )
    coordinator = MqttTransport.from_url(mosquitto.url, client_id="coordinator", insecure=True, timeout=5.0)
    async with coordinator as co, client:
        await co.subscribe(T.up_filter(fed))
        up = _Up(co)
        run = asyncio.create_task(client.run(timeout=120))
        try:
            await co.publish(T.status(fed), encode(Status("running", "epoch1")), retain=True)
            hello = await up.first(T.HELLO)
            assert isinstance(hello, Hello) and hello.device["model_round"] == 5
            plain_task = restart_task(fed, 1, w0)  # mask none: this part is about the model, not HE
            weightless = dataclasses.replace(plain_task, weights=(), param_names=())
            await co.publish(T.down(fed, "dev1"), encode(weightless))
            error = await up.first(T.ERROR)
            assert isinstance(error, Error) and error.round_id == 1 and "another run" in error.reason
            hello = await up.first(T.HELLO)
            assert isinstance(hello, Hello) and hello.device["model_round"] == -1
            assert client.weights is None
            await co.publish(T.down(fed, "dev1"), encode(restart_task(fed, 2, w0)))
            update = await up.first(T.UPDATE)
            assert isinstance(update, Update) and update.round_id == 2
            await co.publish(T.status(fed), encode(Status("finished", "epoch1", 2)), retain=True)
            await asyncio.wait_for(run, WAIT)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await up.close()
