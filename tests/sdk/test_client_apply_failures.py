"""A device whose applying of an aggregate fails in an unexpected place still tells what happened.

1. Held-out data that does not fit the model (an app's ``eval_data`` with a column missing): the round's
   model is applied, the evaluation fails, and the device still reports the round (``eval_failed``, no
   test metrics) and keeps the failure as its summary's reason, instead of never reporting while the
   coordinator waits for it. A real FedClient (onnxruntime training) against a real mosquitto; the test
   plays the coordinator with its own transport.
2. Any other exception in the apply task (a bug): logged with its traceback at ERROR, counted, kept as the
   summary's reason, and the aggregate may be applied again when it is seen again, instead of ending the
   task with an exception asyncio only mentions when the task is collected.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import numpy as np
import pytest
from test_client_restart import SPEC, Upstream, make_task

from brokers import MosquittoProcess
from fedsdk.client import FedClient
from fedsdk.client.apply import Aggregates
from fedsdk.client.decryption import Decryption
from fedsdk.client.state import ClientSummary, DeviceState, Pending
from fedsdk.model.data import load_digits
from fedsdk.protocol import Aggregate, EncryptedAggregate, Report, Status, Update, encode
from fedsdk.protocol import topics as T
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.models import init_params

pytestmark = pytest.mark.timeout(120)


def plain(url: str, client_id: str) -> MqttTransport:
    return MqttTransport.from_url(url, client_id=client_id, insecure=True, timeout=5.0)


async def test_a_device_whose_evaluation_fails_still_reports_the_round(mosquitto: MosquittoProcess) -> None:
    fed = f"ut{secrets.token_hex(3)}"
    digits = load_digits(shape="flat")
    data = (digits.x_train[:120], digits.y_train[:120])
    bad_eval = (digits.x_test[:40, :-1], digits.y_test[:40])  # one feature short of the model's input
    w0 = [np.asarray(w, np.float32) for w in init_params(SPEC, seed=0)]
    async with plain(mosquitto.url, "coordinator") as coord:
        await coord.subscribe(T.up_filter(fed))
        up = Upstream(coord)
        client = FedClient(
            mosquitto.url,
            client_id="dev1",
            federation=fed,
            data=data,
            eval_data=bad_eval,
            insecure=True,
            timeout=5.0,
            probe_bytes=0,
        )
        async with client:
            run = asyncio.create_task(client.run(timeout=60))
            await coord.publish(T.status(fed), encode(Status("online", "epoch1")), retain=True)
            await up.next(T.HELLO)
            await coord.publish(T.down(fed, "dev1"), encode(make_task(fed, 1, w0)))
            update, _ = await up.next(T.UPDATE)
            assert isinstance(update, Update)
            new = [w + 0.01 for w in w0]
            await coord.publish(T.cluster(fed, 0), encode(Aggregate(1, 0, tuple(new), 1, 120)))
            report, _ = await up.next(T.REPORT)
            assert isinstance(report, Report) and report.round_id == 1
            assert report.metrics["eval_failed"] == 1.0
            assert not any(k.startswith("test_") for k in report.metrics)
            await coord.publish(T.status(fed), encode(Status("finished", "epoch1", 1)), retain=True)
            summary = await asyncio.wait_for(run, 30)
        await up.close()
    assert summary.state == "finished"
    assert summary.applied_rounds == [1]
    assert summary.rejected == {}, summary.rejected  # the aggregate was applied: nothing refused
    assert "round 1" in summary.reason and "evaluation" in summary.reason
    for got, want in zip(client.weights or [], new, strict=True):
        np.testing.assert_array_equal(got, want)


async def test_an_unexpected_error_while_applying_is_logged_counted_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    device = DeviceState("dev1", "fed", None, None, None, None, summary=ClientSummary("dev1"))
    w0 = [np.asarray(w, np.float32) for w in init_params(SPEC, seed=0)]
    device.pending[1] = pending = Pending(make_task("fed", 1, w0), w0)
    aggregates = Aggregates(device, Decryption(device))
    agg = Aggregate(1, 0, tuple(w0), 1, 10)
    calls = 0

    async def broken(a: Aggregate | EncryptedAggregate) -> None:
        nonlocal calls
        calls += 1
        pending.applying = True
        raise RuntimeError("a bug in applying")

    with caplog.at_level(logging.ERROR, logger="fedsdk.client.apply"):
        aggregates.start(agg, broken)
        task = next(iter(aggregates.applying))
        await asyncio.wait_for(aggregates.settle(), 5)
    assert task.done() and task.exception() is None  # handled in the task, not left for asyncio to report
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "round 1" in errors[0].getMessage()
    assert device.rejected["apply_failed"] == 1
    assert "round 1" in device.summary.reason and "a bug in applying" in device.summary.reason
    assert not pending.applying  # seen again (a retained copy after a reconnect), it is applied again
    aggregates.start(agg, broken)
    await asyncio.wait_for(aggregates.settle(), 5)
    assert calls == 2
