"""The model relay on the device: under HE only the devices hold their cluster's model, so one that lacks it
(it joined late, restarted without its state directory, or was down while rounds went by) gets it from a
device of its cluster that holds it, through the coordinator, which cannot read it
(``fedsdk_coordinator.engine.relay`` decides who asks whom).

* A **holder** asked for its model (:class:`~fedsdk.protocol.ModelRequest` on its ``down`` topic) seals the
  model it holds, as the bytes of a model file (:func:`fedsdk.client.saved.model_bytes`), for the device
  named (:class:`fedsdk.crypto.shares.ModelSealer`) and publishes it (:class:`~fedsdk.protocol.SealedModel`).
* The **device that lacks it** opens the sealed model relayed to it, checks that it is its federation's, of
  the round and cluster it claims, newer than the model it holds and shaped like it, holds it from then on
  (and keeps it in its state directory), and says hello again, so that the coordinator knows it holds the
  cluster's model and tasks it without weights. A model that does not open or check is refused (counted
  as ``bad_relay``); a model not newer than the one it holds changes nothing, but the device says hello
  all the same (its last report may have been lost, and the coordinator asked because of it). A model of
  the round it holds but of another run of the federation (its own was kept from an earlier run, which the
  coordinator saw in its hello) replaces it; before, the device refused it and said hello again, the
  coordinator asked for it again at once, and the two went round thousands of times a minute.
"""

from __future__ import annotations

import asyncio
import logging
import os
import zipfile
from collections.abc import Awaitable, Callable

from fedsdk.client.link import Link, Publish
from fedsdk.client.saved import SavedModel, held_model, keep_model, model_bytes, model_from_bytes
from fedsdk.client.state import DeviceState
from fedsdk.client.work import Work
from fedsdk.crypto.shares import ModelSealer
from fedsdk.errors import CryptoError, FedError, TransportClosed, TransportError
from fedsdk.protocol import ModelRequest, SealedModel
from fedsdk.protocol import topics as T

__all__ = ["ModelRelay"]

log = logging.getLogger(__name__)
progress = logging.getLogger("fedsdk.progress")  # one line when a relayed model is held (the CLI shows it)


class ModelRelay:
    """Seals this device's model for a device of its cluster, and takes one sealed for it (module
    docstring)."""

    def __init__(
        self, device: DeviceState, work: Work, link: Link, state_dir: str | os.PathLike[str] | None
    ) -> None:
        self.device, self._work, self._link, self._state_dir = device, work, link, state_dir
        self._sealer: ModelSealer | None = None
        self.tasks: set[asyncio.Task[None]] = set()  # requests and relayed models being handled

    def take(
        self, msg: ModelRequest | SealedModel, publish: Publish, settle: Callable[[], Awaitable[None]]
    ) -> None:
        """Handle ``msg`` in a task of its own, once the aggregates being applied are (``settle``): an apply
        sets the weights in the executor before the round they belong to, so a model sealed or replaced
        meanwhile could carry another round's weights. The message loop goes on meanwhile (an apply may be
        waiting for the decryption shares it brings)."""

        async def run() -> None:
            await settle()
            try:
                await self.on_message(msg, publish)
            except TransportClosed:
                pass  # the message loop sees the closed link too
            except TransportError as exc:  # the coordinator asks again if it still needs it
                log.warning(
                    "could not send the model sealed for %s: %s", getattr(msg, "for_client", "?"), exc
                )
            except (FedError, OSError, ValueError) as exc:  # a task's last line: nothing escapes unseen
                log.warning("model relay (%s) failed: %s", type(msg).__name__, exc)

        task = asyncio.create_task(run(), name=f"fedclient-relay-{self.device.client_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def on_message(self, msg: ModelRequest | SealedModel, publish: Publish) -> None:
        """A request to seal this device's model, or a model relayed to it: held, kept in the state
        directory, and announced with a new hello."""
        names = self._work.names
        if isinstance(msg, ModelRequest):
            await self.on_request(msg, names, publish)
            return
        saved, hello = await self.on_model(msg, names)
        if saved is not None:
            self._work.names = saved.param_names
            if self._state_dir is not None:
                keep = (self._state_dir, self.device, saved.param_names, saved.cluster_id)
                try:
                    await asyncio.get_running_loop().run_in_executor(None, keep_model, *keep)
                except (OSError, ValueError) as exc:  # held all the same; the next applied round tries again
                    log.warning("could not keep the relayed model in %s: %s", self._state_dir, exc)
        if hello:
            await self._link.say_hello(publish)

    def sealer(self) -> ModelSealer | None:
        he = self.device.he
        if self._sealer is None and he is not None and he.can_decrypt:
            self._sealer = ModelSealer(he)
        return self._sealer

    async def on_request(self, req: ModelRequest, names: tuple[str, ...], publish: Publish) -> None:
        """Seal the model this device holds for ``req.for_client`` and publish it (nothing when it holds
        none of that cluster, or an older one than asked for)."""
        device = self.device
        sealer, cluster = self.sealer(), device.summary.cluster_id
        saved = held_model(device, names, req.cluster_id)
        if sealer is None or saved is None or not names or saved.model_round < req.round_id:
            log.warning(
                "asked for the model of round %d for %s: this device holds round %d's, not sent",
                req.round_id, req.for_client, -1 if saved is None else saved.model_round,
            )  # fmt: skip
            return
        if cluster is not None and cluster != req.cluster_id and req.cluster_id not in device.parked:
            log.warning(
                "asked for cluster %d's model: this device holds cluster %d's", req.cluster_id, cluster
            )
            return

        def seal() -> bytes:
            return sealer.seal(
                model_bytes(saved),
                federation=device.federation,
                sender=device.client_id,
                recipient=req.for_client,
                round_id=saved.model_round,
                cluster_id=saved.cluster_id,
            )

        sealed = await asyncio.get_running_loop().run_in_executor(None, seal)
        msg = SealedModel(device.client_id, req.for_client, saved.model_round, saved.cluster_id, sealed)
        await publish(T.MODEL, msg)
        log.info("sealed the model of round %d for %s", saved.model_round, req.for_client)

    def _holds(self, round_id: int) -> tuple[None, bool]:
        """A relayed model not newer than the one this device holds: not taken; it says hello again."""
        log.info("relayed model of round %d: this device holds round %d's", round_id, self.device.model_round)
        return None, True

    async def on_model(self, msg: SealedModel, names: tuple[str, ...]) -> tuple[SavedModel | None, bool]:
        """Open a model relayed to this device: the model to hold from now on (None: refused, or not newer
        than the one it holds), and whether to say hello again (module docstring)."""
        device = self.device
        sealer = self.sealer()
        if msg.for_client != device.client_id or sealer is None:
            device.rejected.add("bad_relay")
            log.warning("a model relayed for %s refused: not for this device, or no HE key", msg.for_client)
            return None, False
        if msg.round_id < device.model_round:
            return self._holds(msg.round_id)

        def open_() -> SavedModel:
            body = sealer.open(
                msg.sealed,
                federation=device.federation,
                sender=msg.client_id,
                recipient=device.client_id,
                round_id=msg.round_id,
                cluster_id=msg.cluster_id,
            )
            return model_from_bytes(body)

        try:
            saved = await asyncio.get_running_loop().run_in_executor(None, open_)
            claimed = (device.federation, msg.client_id, msg.round_id, msg.cluster_id)
            if (saved.federation, saved.client_id, saved.model_round, saved.cluster_id) != claimed:
                raise ValueError("its header names another federation, sender, round or cluster")
            if names and saved.param_names != names:
                raise ValueError("its parameters are not this model's")
            held = device.weights
            if held is not None and [w.shape for w in held] != [w.shape for w in saved.weights]:
                raise ValueError("its shapes are not those of the model this device holds")
            if device.model_id and saved.model_id != device.model_id:
                raise ValueError(f"it is model {saved.model_id!r}, not {device.model_id!r}")
            same_run = saved.run is None or saved.run == device.model_run
            if saved.model_round == device.model_round and same_run:  # one of another run is replaced
                return self._holds(msg.round_id)
        except (CryptoError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            device.rejected.add("bad_relay")
            log.warning("model of round %d relayed from %s refused: %s", msg.round_id, msg.client_id, exc)
            return None, False
        device.weights, device.model_round, device.model_run = saved.weights, saved.model_round, saved.run
        device.model_id, device.summary.cluster_id = saved.model_id or device.model_id, saved.cluster_id
        device.pending = {r: p for r, p in device.pending.items() if r > saved.model_round}
        progress.info(  # shown by default: the device trains from the next task on
            "holds cluster %d's model of round %d, sealed for it by %s and relayed by the coordinator",
            saved.cluster_id, saved.model_round, msg.client_id,
        )  # fmt: skip
        return saved, True
