"""FedClient across coordinator restarts, replays and reconnects (tracker issue 5, item 5).

A real FedClient (onnxruntime training) against a real mosquitto; the test plays the coordinator with its
own transport. What is checked: the device applies an aggregate once and only for a round it trained in
(a repeated, a retained-after-reconnect and a never-trained round's aggregate are all ignored); it says
hello again after its link is cut; a task for the round it already answered, from a new coordinator epoch,
gets the cached reply byte for byte without training again; an older round's task is refused.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

from brokers import MosquittoProcess
from fedsdk.client import FedClient
from fedsdk.model.data import load_digits
from fedsdk.protocol import Aggregate, Hello, Report, Status, Task, Update, decode, encode
from fedsdk.protocol import topics as T
from fedsdk.transport import Message, MqttTransport
from fedsdk_coordinator.models import build_graphs, init_params, mlp

pytestmark = pytest.mark.timeout(120)
SPEC = mlp(hidden=(8,))
WAIT = 30.0


def plain(url: str, client_id: str) -> MqttTransport:
    return MqttTransport.from_url(url, client_id=client_id, insecure=True, timeout=5.0)


class Upstream:
    """The coordinator's view: every message devices publish, in order (a pump task fills a queue)."""

    def __init__(self, transport: MqttTransport) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.pump = asyncio.create_task(self._pump(transport))

    async def _pump(self, transport: MqttTransport) -> None:
        async for msg in transport.messages():
            self.queue.put_nowait(msg)

    async def next(self, kind: str) -> tuple[object, bytes]:
        """The next message of ``kind`` (hello, update, report, ...); others are skipped."""
        while True:
            msg = await asyncio.wait_for(self.queue.get(), WAIT)
            if msg.topic.rsplit("/", 1)[1] == kind:
                return decode(msg.payload), msg.payload

    async def nothing(self, kind: str, seconds: float) -> None:
        try:
            got = await asyncio.wait_for(self.next(kind), seconds)
        except asyncio.TimeoutError:
            return
        raise AssertionError(f"unexpected {kind}: {got[0]!r}")

    async def close(self) -> None:
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)


def make_task(fed: str, round_id: int, weights: list[np.ndarray]) -> Task:
    bundle = build_graphs(SPEC)
    return Task(
        federation=fed,
        round_id=round_id,
        cluster_id=0,
        deadline_s=60.0,
        param_names=tuple(bundle.param_names),
        weights=tuple(weights),
        config={
            "phase": "train",
            "lr": 0.05,
            "batch_size": 32,
            "epochs": 1,
            "seed": round_id,
            "mask": "none",
        },
        model_id=bundle.model_id,
        train_graph=bundle.train_graph,
        eval_graph=bundle.eval_graph,
    )


async def test_device_answers_again_and_applies_each_aggregate_once(mosquitto: MosquittoProcess) -> None:
    fed = f"ut{secrets.token_hex(3)}"
    digits = load_digits(shape="flat")
    data = (digits.x_train[:120], digits.y_train[:120])
    w0 = [np.asarray(w, np.float32) for w in init_params(SPEC, seed=0)]
    status, down, cluster = T.status(fed), T.down(fed, "dev1"), T.cluster(fed, 0)
    async with plain(mosquitto.url, "coordinator") as coord:
        await coord.subscribe(T.up_filter(fed))
        up = Upstream(coord)
        client = FedClient(
            mosquitto.url,
            client_id="dev1",
            federation=fed,
            data=data,
            insecure=True,
            timeout=5.0,
            probe_bytes=0,
        )
        async with client:
            run = asyncio.create_task(client.run(timeout=90))
            await coord.publish(status, encode(Status("online", "epoch1")), retain=True)
            hello, _ = await up.next(T.HELLO)
            assert isinstance(hello, Hello) and hello.device["model_round"] == -1

            await coord.publish(down, encode(make_task(fed, 1, w0)))
            update, update_bytes = await up.next(T.UPDATE)
            assert isinstance(update, Update) and update.round_id == 1

            new = [w + 0.01 for w in w0]
            # an aggregate for a round this device did not train in: ignored
            await coord.publish(cluster, encode(Aggregate(2, 0, tuple(new), 1, 120)))
            await up.nothing(T.REPORT, 1.0)
            # round 1's aggregate, retained as the coordinator publishes it: applied once, reported once
            agg1 = encode(Aggregate(1, 0, tuple(new), 1, 120))
            await coord.publish(cluster, agg1, retain=True)
            report, _ = await up.next(T.REPORT)
            assert isinstance(report, Report) and report.round_id == 1
            await coord.publish(cluster, agg1)  # seen again: ignored
            await up.nothing(T.REPORT, 1.0)

            # cut the device's link (a second session under its id takes over); it reconnects with
            # backoff, re-subscribes and says hello again. The retained aggregate arrives again on the
            # re-subscription, as does the retained status; the transport drops both copies (same message
            # ids as the ones delivered live)
            async with plain(mosquitto.url, "dev1"):
                pass
            hello, _ = await up.next(T.HELLO)
            assert isinstance(hello, Hello) and hello.device["model_round"] == 1
            # the retained copies, dropped by id (the hello can overtake the second copy's arrival)
            for _ in range(100):
                if client._transport.stats["duplicates"] >= 2:
                    break
                await asyncio.sleep(0.05)
            assert client._transport.stats["duplicates"] >= 2
            # the coordinator re-publishes its latest aggregate after a reconnect: a new message, ignored
            await coord.publish(cluster, agg1, retain=True)
            await up.nothing(T.REPORT, 1.0)

            # a restarted coordinator (new epoch) asks for round 1 again: the same bytes, no training
            await coord.publish(status, encode(Status("online", "epoch2")), retain=True)
            await up.next(T.HELLO)
            await coord.publish(down, encode(make_task(fed, 1, w0)))
            _, again = await up.next(T.UPDATE)
            assert again == update_bytes
            # an older round's task is a replay: refused, nothing sent
            await coord.publish(down, encode(make_task(fed, 0, w0)))
            await up.nothing(T.UPDATE, 1.0)

            await coord.publish(status, encode(Status("finished", "epoch2", 1)), retain=True)
            summary = await asyncio.wait_for(run, WAIT)
        await up.close()
    assert summary.state == "finished"
    assert summary.applied_rounds == [1]
    assert len(summary.rounds) == 1, "trained once"
    assert summary.resent == 1
    # round 2's aggregate, round 1's seen twice more, round 0's task
    assert summary.rejected == {"stale_round": 4}, summary.rejected
    for got, want in zip(client.weights or [], new, strict=True):
        np.testing.assert_array_equal(got, want)
