"""Cooperative decryption between real FedClients (fedsdk.coop): three devices with the same packed Paillier
key train under a real mosquitto; the test plays the coordinator with its own transport and the public key
only: it splits the union in thirds, aggregates, and relays the devices' shares (a bundle each), except
that it never relays the third device's share (a device that left) and slips in two forgeries: one under
the second device's name that does not authenticate (not sealed with the key), and one under the first
device's name, sealed with the key (a rogue key holder) but holding garbage, relayed before the real one.
What is checked: every device ends with the same model, exactly the one the secret key decrypts from the
aggregate; the unauthenticated forgery is refused on arrival; the garbage one is caught when the assembled
aggregate does not decode, and the devices that took it decrypt that third themselves; the first two
decrypt the missing third themselves after the wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import numpy as np
import pytest

from brokers import MosquittoProcess
from fedsdk.client import FedClient
from fedsdk.crypto import generate_backend, load_backend
from fedsdk.crypto.shares import ShareSealer
from fedsdk.model.data import load_digits
from fedsdk.pipeline import contribution_from_message, message_from_he_aggregate, unflatten
from fedsdk.protocol import (
    DecryptShare,
    EncryptedUpdate,
    Hello,
    Report,
    ShareBundle,
    Status,
    Task,
    decode,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk.transport import Message, MqttTransport
from fedsdk_coordinator.models import build_graphs, init_params, mlp

pytestmark = pytest.mark.timeout(180)
SPEC = mlp(hidden=(8,))
WAIT = 60.0
DEVICES = ("d0", "d1", "d2")
THIRDS = {"d0": (0.0, 1 / 3), "d1": (1 / 3, 2 / 3), "d2": (2 / 3, 1.0)}


def plain(url: str, client_id: str) -> MqttTransport:
    return MqttTransport.from_url(url, client_id=client_id, insecure=True, timeout=5.0)


def make_task(fed: str, cid: str, weights: list[np.ndarray]) -> Task:
    bundle = build_graphs(SPEC)
    lo, hi = THIRDS[cid]
    return Task(
        federation=fed,
        round_id=1,
        cluster_id=0,
        deadline_s=60.0,
        param_names=tuple(bundle.param_names),
        weights=tuple(weights),
        config={
            "phase": "train",
            "lr": 0.05,
            "batch_size": 32,
            "epochs": 1,
            "seed": 1,
            "mask": "all",
            "share_lo": lo,
            "share_hi": hi,
            "share_wait_s": 0.5,
        },
        model_id=bundle.model_id,
        train_graph=bundle.train_graph,
        eval_graph=bundle.eval_graph,
    )


async def test_devices_assemble_the_aggregate_from_shares_and_cover_a_missing_one(
    mosquitto: MosquittoProcess,
) -> None:
    fed = f"co{secrets.token_hex(3)}"
    digits = load_digits(shape="flat")
    w0 = [np.asarray(w, np.float32) for w in init_params(SPEC, seed=0)]
    keyholder = generate_backend("packed", key_bits=1024)
    params, public, secret = keyholder.params, keyholder.public_bytes(), keyholder.secret_bytes()
    coordinator_he = load_backend("packed", params, public)
    rogue = ShareSealer(keyholder)  # a device that holds the key and seals garbage under d0's name
    queue: asyncio.Queue[Message] = asyncio.Queue()

    async def pump(t: MqttTransport) -> None:
        async for m in t.messages():
            queue.put_nowait(m)

    async def next_of(kind: str) -> tuple[str, object, bytes]:
        while True:
            m = await asyncio.wait_for(queue.get(), WAIT)
            if m.topic.rsplit("/", 1)[1] == kind:
                return m.topic.split("/")[3], decode(m.payload), m.payload

    clients = [
        FedClient(
            mosquitto.url,
            client_id=cid,
            federation=fed,
            data=(digits.x_train[40 * i : 40 * i + 40], digits.y_train[40 * i : 40 * i + 40]),
            he=load_backend("packed", params, public, secret, parallel=False),
            insecure=True,
            timeout=5.0,
            probe_bytes=0,
        )
        for i, cid in enumerate(DEVICES)
    ]
    async with plain(mosquitto.url, "coordinator") as coord:
        await coord.subscribe(T.up_filter(fed))
        pumping = asyncio.create_task(pump(coord))
        for c in clients:
            await c.__aenter__()
        runs = [asyncio.create_task(c.run(timeout=120)) for c in clients]
        try:
            await coord.publish(T.status(fed), encode(Status("running", "epoch1")), retain=True)
            for _ in DEVICES:
                _, hello, _ = await next_of(T.HELLO)
                assert isinstance(hello, Hello)
            for cid in DEVICES:
                await coord.publish(T.down(fed, cid), encode(make_task(fed, cid, w0)))
            updates: dict[str, EncryptedUpdate] = {}
            while len(updates) < len(DEVICES):
                cid, msg, _ = await next_of(T.UPDATE)
                assert isinstance(msg, EncryptedUpdate)
                updates[cid] = msg
            agg = coordinator_he.aggregate([contribution_from_message(updates[c]) for c in DEVICES])
            union = int(agg.mask.sum())
            assert union == agg.mask.size  # mask "all": every pack is encrypted
            total = sum(u.num_samples for u in updates.values())
            envelope = message_from_he_aggregate(
                agg, round_id=1, cluster_id=0, total_samples=total, metrics={}
            )
            await coord.publish(T.cluster(fed, 0), encode(envelope), retain=True)
            reports: dict[str, Report] = {}
            shares: dict[str, DecryptShare] = {}
            forged = False
            while len(reports) < len(DEVICES):
                m = await asyncio.wait_for(queue.get(), WAIT)
                cid, kind = m.topic.split("/")[3], m.topic.rsplit("/", 1)[1]
                if kind == T.SHARE:
                    share = decode(m.payload)
                    assert isinstance(share, DecryptShare)
                    shares[cid] = share
                    if cid == "d1" and not forged:  # a forgery under d1's name first, then d1's own
                        fake = dataclasses.replace(share, sealed=bytes(len(share.sealed)))
                        await coord.publish(T.cluster(fed, 0), encode(ShareBundle.of(1, 0, [fake])))
                        forged = True
                    if cid == "d0":  # sealed with the key, but garbage: authenticates, does not decode
                        junk = [secrets.randbelow(rogue.n) for _ in share.pack_indices]
                        where = {"federation": fed, "round_id": 1, "cluster_id": 0, "client_id": "d0"}
                        sealed = rogue.seal(junk, packs=share.pack_indices, **where)
                        garbage = dataclasses.replace(share, sealed=sealed)
                        await coord.publish(T.cluster(fed, 0), encode(ShareBundle.of(1, 0, [garbage])))
                    if cid != "d2":  # d2's share is lost
                        await coord.publish(T.cluster(fed, 0), encode(ShareBundle.of(1, 0, [share])))
                elif kind == T.REPORT:
                    report = decode(m.payload)
                    assert isinstance(report, Report)
                    reports[cid] = report
            await coord.publish(T.status(fed), encode(Status("finished", "epoch1", 1)), retain=True)
            summaries = await asyncio.wait_for(asyncio.gather(*runs), WAIT)
        finally:
            for r in runs:
                r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            for c in clients:
                await c.__aexit__(None, None, None)
            pumping.cancel()
            await asyncio.gather(pumping, return_exceptions=True)

    thirds = {cid: shares[cid].pack_indices.size for cid in DEVICES}
    assert sum(thirds.values()) == union and min(thirds.values()) > 0
    # d0 takes d1's share and decrypts d2's third after the wait; d1 took the garbage as d0's share (the
    # real one came second), so it decrypts d0's third once the aggregate failed to decode, and d2's after
    # the wait; d2 has every share at once and decrypts its own third and d0's.
    for cid, shared in (("d0", thirds["d1"]), ("d1", 0), ("d2", thirds["d1"])):
        m = reports[cid].metrics
        assert m["shared_packs"] == shared and m["decrypted_packs"] == union - shared, (cid, m)
    assert reports["d0"].metrics["share_wait_s"] >= 0.5 and reports["d1"].metrics["share_wait_s"] >= 0.5
    keyholder_avg = keyholder.decrypt_aggregate(agg)
    want = [b + d for b, d in zip(w0, unflatten(keyholder_avg, [w.shape for w in w0]), strict=True)]
    for c, s in zip(clients, summaries, strict=True):
        assert s.state == "finished" and s.applied_rounds == [1], (c.client_id, s)
        for got, w in zip(c.weights or [], want, strict=True):
            np.testing.assert_array_equal(got, w)
    assert clients[0].rejected.as_dict() == {"bad_share": 1}  # the forgery under d1's name
    assert clients[1].rejected.as_dict() == {"bad_share": 1}  # the garbage under d0's name
    assert clients[2].rejected.as_dict() == {"bad_share": 2}  # both
    keyholder.close()
