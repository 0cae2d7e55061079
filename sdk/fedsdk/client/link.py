"""The device's link to its coordinator, and its session: the MQTT transport (owned here), hello, status,
reconnects, goodbye, and the conditions that end a run (``docs/operations.md``, "Crash and restart").

* The device says hello whenever it sees a new coordinator instance (the retained status topic carries the
  coordinator's epoch: a restarted coordinator has a new one) and after each reconnect of its own link (the
  coordinator may have taken its connection-lost will for a goodbye). The hello's device facts carry
  ``model_round``: the round of the model it holds, -1 for none, so a coordinator under HE knows whether the
  device still holds its cluster's model; and ``model_run``, the run of the federation that model is of
  (when known), so that a coordinator started over under the same name does not take it as its own.
* A reply whose upload fails (the link stayed down past the transport's timeout) is sent again, whole, once
  the link is back; beyond that the coordinator's next request gets it from the task pipeline's cache of
  its last reply (``work.py``). Chunks the broker had not acknowledged are re-sent by the transport; a
  message whose chunks the broker lost (a broker restart) is never reassembled, which is why the whole reply
  is re-sent on request.
* The run stops when the coordinator reports ``finished`` or ``failed``, and whatever the coordinator does
  when it stays silent too long or its ``finished`` does not come after the last round (:meth:`Link.watch`).

Messages the session sends about the device (hello, the data-mismatch error) go through the ``publish``
the caller hands over, so that a :class:`~fedsdk.client.FedClient` subclass sees them
(``FedClient._publish``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fedsdk import __version__
from fedsdk.client.state import DeviceState, dims, follow_model
from fedsdk.errors import FedError, TrainingError, TransportClosed, TransportError, ValidationError
from fedsdk.model.data import fit_to_model
from fedsdk.profile import calibrate_he, device_facts
from fedsdk.protocol import (
    BYE_LEAVING,
    BYE_LOST,
    DATA_MISMATCH,
    BaseMessage,
    Bye,
    Error,
    Hello,
    Status,
    decode,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk.ratelog import LimitedLog
from fedsdk.transport import MqttTransport, TlsConfig, Will, check_client_identity

__all__ = ["Link", "Publish"]

log = logging.getLogger(__name__)
MAX_POOL_PARAMS = 1 << 31  # a status naming more parameters is not believed: no such model fits a message

Publish = Callable[[str, BaseMessage], Awaitable[tuple[float, int]]]
"""Send a message on one of the device's topics (by kind); returns (seconds, bytes)."""


class Link:
    """The device's session with its federation's coordinator, over the MQTT transport it owns."""

    def __init__(
        self,
        device: DeviceState,
        broker_url: str,
        *,
        tls: TlsConfig | None,
        insecure: bool,
        timeout: float,
        probe_bytes: int,
        connect_wait: float | None = None,
    ) -> None:
        self.device = device
        self._connect_wait = connect_wait  # how long connect() waits for a broker not up yet (None: timeout)
        self.said = LimitedLog(log)  # lines a sender causes (rejected, unexpected), limited per kind
        self.hello_epoch: str | None = None  # the coordinator instance last greeted
        self.heard = time.monotonic()  # when the coordinator was last heard from (any message)
        self.cluster_topic: str | None = None  # the topic of this device's cluster, once it has one
        self.hellos = 0  # hellos said (a coordinator may be a new instance after each)
        self._reconnected = asyncio.Event()
        self._he_vps: float | None = None
        self._uplink: float | None = None
        self._probe_bytes = probe_bytes
        self._fitted_for = ""  # the model whose description the local data was last checked against
        check_client_identity(tls, device.client_id)  # another device's certificate: refused before connect
        will_payload = encode(Bye(client_id=device.client_id, reason=BYE_LOST))
        self.transport = MqttTransport.from_url(
            broker_url,
            client_id=device.client_id,
            tls=tls,
            insecure=insecure,
            timeout=timeout,
            will=Will(self.topic(T.BYE), will_payload, qos=1, retain=False),
        )
        self.transport.on_reconnect = lambda _n: self._reconnected.set()

    def topic(self, kind: str) -> str:
        """This device's upward topic for messages of ``kind``."""
        return T.up(self.device.federation, self.device.client_id, kind)

    @property
    def down_topic(self) -> str:
        """The topic of the tasks addressed to this device."""
        return T.down(self.device.federation, self.device.client_id)

    # -- opening and closing ------------------------------------------------------------------
    async def connect(self) -> None:
        he = self.device.he
        if he is not None:  # measured HE throughput for the hello (DESIGN.md step 1)
            self._he_vps = await asyncio.get_running_loop().run_in_executor(None, calibrate_he, he)
        await self.transport.connect(self._connect_wait)

    async def subscribe(self) -> None:
        """Follow the federation's status and this device's tasks; measure the uplink for the hello."""
        await self.transport.subscribe(T.status(self.device.federation))
        await self.transport.subscribe(self.down_topic)
        if self._probe_bytes > 0:
            self._uplink = await self._probe_uplink()

    async def goodbye(self) -> None:
        """Tell the coordinator this device leaves (briefly: a link that is down is not waited for)."""
        try:
            bye = encode(Bye(client_id=self.device.client_id, reason=BYE_LEAVING))
            await self.transport.publish(self.topic(T.BYE), bye, timeout=2.0)
        except FedError:
            pass

    async def close(self) -> None:
        await self.transport.close()

    async def _probe_uplink(self) -> float | None:
        """The initial uplink estimate (DESIGN.md step 1): time ``probe_bytes`` of random bytes to the broker.

        Later estimates come from the real update uploads (the coordinator's moving average)."""
        payload = os.urandom(self._probe_bytes)
        t0 = time.perf_counter()
        try:
            await self.transport.publish(self.topic(T.PROBE), payload)
        except FedError as exc:
            log.warning("uplink probe failed: %s", exc)
            return None
        return len(payload) / max(time.perf_counter() - t0, 1e-6)

    # -- traffic ------------------------------------------------------------------------------
    async def messages(self) -> AsyncIterator[tuple[str, BaseMessage]]:
        """Incoming messages, decoded, with their topics; a message that does not decode is counted and
        skipped, any other is noted as the coordinator being heard. Raises TransportClosed as the
        transport's iterator does."""
        async for msg in self.transport.messages():
            try:
                decoded: BaseMessage = decode(msg.payload)
            except ValidationError as exc:
                self.device.rejected.add(exc.code)
                self.said.warning(exc.code, "rejected message on %s: %s", msg.topic, exc.reason)
                continue
            self.heard = time.monotonic()
            yield msg.topic, decoded

    async def send(self, kind: str, payload: bytes) -> tuple[float, int]:
        """Publish ``payload`` on our ``kind`` topic; if the upload fails (the link stayed down past the
        transport's timeout), wait for the link and send the whole payload once more."""
        topic = self.topic(kind)
        t0 = time.perf_counter()
        try:
            await self.transport.publish(topic, payload)
        except TransportClosed:
            raise
        except TransportError as exc:
            log.warning("upload of %d bytes on %s failed (%s): sending it again", len(payload), kind, exc)
            await self.transport.wait_connected()
            await self.transport.publish(topic, payload)
        return time.perf_counter() - t0, len(payload)

    async def publish(self, kind: str, msg: BaseMessage) -> tuple[float, int]:
        return await self.send(kind, encode(msg))

    async def follow_cluster(self, cluster_id: int) -> None:
        """Take the relays of cluster ``cluster_id`` (decryption shares) from now on, and only its; on a move
        to another cluster, the model held moves with it (:func:`~fedsdk.client.state.follow_model`)."""
        topic = T.cluster(self.device.federation, cluster_id)
        if topic != self.cluster_topic:
            if self.cluster_topic is not None:
                await self.transport.unsubscribe(self.cluster_topic)
            await self.transport.subscribe(topic)
            self.cluster_topic = topic
            if follow_model(self.device, cluster_id):
                log.info("cluster %d: back on its model of round %d", cluster_id, self.device.model_round)
            self.device.summary.cluster_id = cluster_id

    # -- the session --------------------------------------------------------------------------
    async def say_hello(self, publish: Publish) -> None:
        facts: dict[str, Any] = dict(device_facts())
        facts["model_round"] = self.device.model_round
        if self.device.model_run is not None:
            facts["model_run"] = self.device.model_run  # the run it is of (an earlier run's is not used)
        hello = Hello(
            client_id=self.device.client_id,
            num_samples=self.device.num_samples,
            sdk_version=__version__,
            device=facts,
            he_values_per_s=self._he_vps,
            uplink_bytes_per_s=self._uplink,
        )
        self.hellos += 1
        await publish(T.HELLO, hello)

    async def on_status(
        self, status: Status, publish: Publish, size_pool: Callable[[int], None] | None = None
    ) -> bool:
        """Take the coordinator's status: say hello to a coordinator instance not greeted yet (after checking
        the local data against its model), and size the obfuscator pool (``size_pool``) for the model's
        parameter count when the status gives it, so that obfuscators are made from the join on, not from
        the first task. True when the run is over: the federation finished or failed, or its model does not
        fit this device's data."""
        summary = self.device.summary
        if status.state in ("finished", "failed"):
            summary.state = status.state
            if status.detail:
                summary.reason = status.detail
            log.info("coordinator reports %s after round %d", status.state, status.round_id)
            return True
        if status.detail:
            log.warning("coordinator: %s", status.detail)
        if status.state in ("online", "running") and status.epoch != self.hello_epoch:
            reason = self.fit_data(status.model)
            if reason is not None:  # nothing is trained: the coordinator hears why, and goes on without us
                err = Error(
                    client_id=self.device.client_id, round_id=0, code=DATA_MISMATCH, reason=reason[:500]
                )
                await publish(T.ERROR, err)
                summary.state, summary.reason = "refused", reason
                # the run ends "refused" with this reason, which the caller reports (fedsdk join: last line)
                log.info("the federation's model does not fit this device's data: %s", reason)
                return True
            await self.say_hello(publish)
            self.hello_epoch = status.epoch
            params = status.model.get("params")
            if size_pool is not None and isinstance(params, int) and 0 < params <= MAX_POOL_PARAMS:
                size_pool(params)
            log.info("hello sent to coordinator %s", status.epoch)
        return False

    def fit_data(self, model: Mapping[str, Any]) -> str | None:
        """Check the local (and held-out) data against the model a coordinator's status describes, and shape
        it for that model (:func:`~fedsdk.model.data.fit_to_model`); returns why it does not fit, or None.
        An app's own trainer, or a status that describes no model, is not checked here."""
        device = self.device
        if device.trainer is not None or device.data is None or not model.get("input_shape"):
            return None
        model_id = str(model.get("model_id", ""))
        if model_id and model_id == self._fitted_for:
            return None
        try:
            ins, outs = dims(model["input_shape"]), dims(model.get("output_shape", ""))
            task = str(model.get("task", "classification"))
            data = fit_to_model(*device.data, input_shape=ins, output_shape=outs, task=task)
            held = device.eval
            if held is not None:
                held = fit_to_model(*held, input_shape=ins, output_shape=outs, task=task, what="held-out")
        except (TrainingError, ValueError) as exc:
            return str(exc)
        device.data, device.eval, self._fitted_for = data, held, model_id
        return None

    async def hello_after_reconnects(self, publish: Publish) -> None:
        """Say hello again after each reconnect of our link, once a coordinator has been seen."""
        while True:
            await self._reconnected.wait()
            self._reconnected.clear()
            if self.hello_epoch is None:
                continue
            try:
                await self.say_hello(publish)
                log.info("hello sent again after a reconnect")
            except TransportClosed:
                return
            except TransportError as exc:
                log.warning("hello after a reconnect failed: %s", exc)

    async def watch(self, idle_timeout: float | None, final_wait: float) -> tuple[str, str]:
        """Returns (state, reason) once the coordinator has been silent for ``idle_timeout`` seconds (None:
        no bound), or ``final_wait`` seconds after the last round was applied when ``finished`` did not
        come. The silence is counted from the start of the watch."""
        self.heard = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            last_round_at = self.device.last_round_at
            if last_round_at is not None and now - last_round_at > final_wait:
                n = len(self.device.summary.applied_rounds)
                return "finished", (
                    f"the federation's last round was applied ({n} rounds); "
                    f"the coordinator's 'finished' did not arrive within {final_wait:.0f} s"
                )
            if idle_timeout is not None and now - self.heard > idle_timeout:
                return "coordinator_lost", f"nothing heard from the coordinator for {idle_timeout:.0f} s"
