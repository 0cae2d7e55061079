"""The key server: a separate process that holds the federation's HE secret key (paper 000 appendix I).

In key mode ``keyserver`` devices hold only the public key, so a device colluding with the coordinator
cannot decrypt another device's update. The coordinator sends each cluster's encrypted aggregate to
``fl/<federation>/keyserver/<cluster>``; the key server decrypts it and publishes the average update, as
an :class:`~fedsdk.protocol.Aggregate` of kind ``delta`` holding one flat float32 array, on that cluster's
topic. The coordinator never holds a secret key. With the fleet ACL (``certs/``) it may publish on cluster
topics but does not subscribe to them; on a broker without ACLs it could read the decrypted average, which
is why fleets use mosquitto with the generated ACL.

An aggregate of fewer than ``min_aggregate`` devices (default 3, ``fedsdk.secagg``) is refused, never
decrypted: its published average would be one or two devices' updates. Under secure aggregation the
coordinator cannot form one (the devices refuse to mask into it); the key server checks all the same.

Each aggregate is decrypted once per (cluster, round) of a run of the federation: a replay of an older round
is counted and dropped. The coordinator tags each aggregate with its run (``metrics["run"]``, kept with its
state directory), and the decrypted one carries the tag on to the devices. An aggregate of another run than
the last one decrypted starts the count again (logged): a federation started over under the same name (a
new coordinator state directory) numbers its rounds from 1 again, and this key server, long-running or
handed the earlier run's retained aggregate when it subscribed, used to refuse them up to the earlier run's
last round. Not a bound on a dishonest coordinator, which numbers the rounds anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from fedsdk.crypto import HEBackend
from fedsdk.errors import ConfigError, CryptoError, TransportClosed, ValidationError
from fedsdk.pipeline import he_aggregate_from_message
from fedsdk.protocol import Aggregate, EncryptedAggregate, RejectCounter, decode, encode
from fedsdk.protocol import topics as T
from fedsdk.secagg import DEFAULT_MIN_AGGREGATE
from fedsdk.transport import MqttTransport

__all__ = ["KeyServer"]

log = logging.getLogger(__name__)


def _run_metric(msg: EncryptedAggregate) -> dict[str, float]:
    """``msg``'s run tag, for the decrypted aggregate's metrics (empty when untagged)."""
    return {"run": msg.metrics["run"]} if "run" in msg.metrics else {}


class KeyServer:
    """Decrypts cluster aggregates for one federation. Owns nothing but its transport's messages."""

    def __init__(
        self,
        transport: MqttTransport,
        he: HEBackend,
        *,
        federation: str,
        min_aggregate: int = DEFAULT_MIN_AGGREGATE,
    ) -> None:
        if not he.can_decrypt:
            raise ConfigError("the key server needs the HE secret key")
        self.min_aggregate = int(min_aggregate)
        self.transport = transport
        self.he = he
        self.federation = federation
        self.rejected = RejectCounter()
        self.decrypted: dict[int, int] = {}  # cluster -> last round decrypted, of run ``self.run_tag``
        self.run_tag: float | None = None  # the run of the last tagged aggregate seen

    def _decrypt(self, msg: EncryptedAggregate) -> bytes:
        t0 = time.perf_counter()
        flat = self.he.decrypt_aggregate(he_aggregate_from_message(msg))
        out = Aggregate(
            round_id=msg.round_id,
            cluster_id=msg.cluster_id,
            weights=(np.asarray(flat, dtype=np.float32),),
            num_clients=msg.n_devices,
            total_samples=msg.total_samples,
            metrics={"decrypt_s": time.perf_counter() - t0, **_run_metric(msg)},
            kind="delta",
        )
        return encode(out)

    async def handle(self, topic: str, payload: bytes) -> None:
        """Decrypt one aggregate and forward it to its cluster. Never raises for a bad message."""
        if not topic.startswith(f"fl/{self.federation}/keyserver/"):
            return  # amqtt 0.12 also hands a new session the retained messages of others' subscriptions
        try:
            msg = decode(payload)
            if not isinstance(msg, EncryptedAggregate):
                raise ValidationError("wrong_kind", f"{type(msg).__name__} on a key-server topic")
            if topic != T.keyserver(self.federation, msg.cluster_id):
                raise ValidationError("bad_topic", "aggregate of another cluster or federation")
            run = msg.metrics.get("run")
            if run is not None and run != self.run_tag:
                if self.decrypted:
                    log.info("an aggregate of another run of %s: rounds counted again", self.federation)
                self.decrypted.clear()
                self.run_tag = run
            if msg.n_devices < self.min_aggregate:
                raise ValidationError(
                    "min_aggregate",
                    f"an aggregate of {msg.n_devices} devices, fewer than min_aggregate "
                    f"{self.min_aggregate}: its average would be too few devices' updates to publish",
                )
            if msg.round_id <= self.decrypted.get(msg.cluster_id, 0):
                raise ValidationError(
                    "stale_round", f"round {msg.round_id} of cluster {msg.cluster_id} again"
                )
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(None, self._decrypt, msg)
            self.decrypted[msg.cluster_id] = msg.round_id
            await self.transport.publish(T.cluster(self.federation, msg.cluster_id), out, retain=True)
            log.info("decrypted round %d of cluster %d for its devices", msg.round_id, msg.cluster_id)
        except (ValidationError, CryptoError) as exc:
            self.rejected.add(getattr(exc, "code", "crypto"))
            log.warning("key server rejected a message on %s: %s", topic, exc)

    async def run(self) -> None:
        await self.transport.subscribe(f"fl/{self.federation}/keyserver/+", qos=1)  # paced, never dropped
        try:
            async for m in self.transport.messages():
                await self.handle(m.topic, m.payload)
        except TransportClosed:
            pass
