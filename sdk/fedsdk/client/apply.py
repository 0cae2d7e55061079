"""An aggregate, on the device: decrypt it (with the cluster's cooperative decryption shares), apply it once,
evaluate the model, report.

Under HE the coordinator never sees the whole model, so the device keeps its cluster's model: it starts
from the weights of its first task and adds each decrypted average update. After applying an aggregate the
device evaluates the model on its evaluation data (when it has any) and publishes a
:class:`~fedsdk.protocol.Report`, with the round's upload time.

Personalisation (``FedClient(personal_epochs=E)``, :mod:`fedsdk.personal`): after applying the aggregate and
evaluating it, a device with held-out data fine-tunes the cluster model on its training data for ``E``
epochs with the task's ``lr``, ``momentum`` and ``batch_size``, trains its own model ``E`` epochs more, uses
the best of the three on its held-out data that passes the test against the cluster model
(``FedClient.personal``), and adds the scalars ``personal_test_loss``, ``personal_test_<metric>``,
``personal_epochs``, ``uses_personal``, ``personal_own`` and ``personal_s`` to its report. The
device keeps holding the cluster model too: the next round trains from it, and under HE the next aggregate's
deltas apply to it.

An aggregate is applied once, for a round this device trained in and its cluster: a retained aggregate seen
again after a reconnect, or one for another round, is counted (``stale_round``) and ignored
(``docs/operations.md``, "Crash and restart").

Cooperative decryption happens before (:mod:`fedsdk.client.decryption`); aggregates are applied in a task
of their own (:class:`Aggregates`), so that the message loop keeps taking shares meanwhile; a new task
waits for the aggregates still being applied (:meth:`Aggregates.settle`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np

from fedsdk import pipeline
from fedsdk.client.decryption import Decryption
from fedsdk.client.link import Publish
from fedsdk.client.state import DeviceState, Pending, model_input, run_of
from fedsdk.crypto.base import Aggregate as HEAggregate
from fedsdk.errors import CryptoError, FedError, TransportClosed, TransportError, ValidationError
from fedsdk.personal import personalise
from fedsdk.protocol import Aggregate, EncryptedAggregate, Report, Task
from fedsdk.protocol import topics as T

__all__ = ["Aggregates", "ApplySteps", "same_run"]

log = logging.getLogger(__name__)
progress = logging.getLogger("fedsdk.progress")  # one line per round; the CLI shows it by default

AnyAggregate = Aggregate | EncryptedAggregate


class ApplySteps(NamedTuple):
    """What FedClient hands :meth:`Aggregates.on_aggregate`: the steps in the executor, and how to send."""

    decrypt_packs: Callable[[int, HEAggregate, list[int]], list[Any]]  # (round, aggregate, ranks) -> plains
    apply: Callable[[AnyAggregate, Pending, list[Any] | None], dict[str, float]]  # merge, evaluate: metrics
    publish: Publish
    personalise: Callable[[Pending], dict[str, float]] | None = None  # fine-tune and choose: metrics
    keep: Callable[[Pending], None] | None = None  # write the model now held to disk (client/saved.py)


def same_run(task: Task, agg: AnyAggregate) -> bool:
    """Whether ``agg`` belongs to the run of the federation ``task`` came from. The coordinator tags both
    with its run (``config["run"]``, ``metrics["run"]``: a random number kept with its state directory);
    the broker keeps each cluster's last aggregate, so a federation started over under the same name meets
    the earlier run's, whose round may be the one a device waits for. An untagged task (an older
    coordinator) takes any aggregate."""
    run = run_of(task)
    return run is None or agg.metrics.get("run") == float(run)


class Aggregates:
    """Applies each aggregate once, in a task of its own: decrypt (:class:`Decryption`), make the round's
    model, evaluate it, report."""

    def __init__(self, device: DeviceState, decryption: Decryption) -> None:
        self.device = device
        self._decryption = decryption
        self.applying: set[asyncio.Task[None]] = set()  # the aggregates being applied

    def start(self, agg: AnyAggregate, apply: Callable[[AnyAggregate], Awaitable[None]]) -> None:
        """Apply ``agg`` with ``apply`` in a task of its own (kept in :attr:`applying` until it ends)."""
        name = f"fedclient-apply-{self.device.client_id}"
        task = asyncio.create_task(self._guarded(agg, apply), name=name)
        self.applying.add(task)
        task.add_done_callback(self.applying.discard)

    async def settle(self) -> None:
        """Wait for the aggregates being applied (a new task may build on the model one of them makes)."""
        if self.applying:
            await asyncio.gather(*self.applying, return_exceptions=True)

    async def _guarded(self, agg: AnyAggregate, apply: Callable[[AnyAggregate], Awaitable[None]]) -> None:
        """Run ``apply`` so that no failure ends the task unseen (asyncio would only mention it when the
        task is collected). An unexpected exception is logged with its traceback (code, not values),
        counted (``apply_failed``) and kept as the summary's reason; the aggregate is applied again if it
        is seen again, and the device goes on with the next task."""
        try:
            await apply(agg)
        except TransportClosed:
            pass  # the message loop sees the closed link too
        except TransportError as exc:  # the link stayed down: the coordinator goes on without our report
            self.device.summary.send_failures += 1
            log.warning("could not send the report of round %d: %s", agg.round_id, exc)
        except Exception as exc:  # the apply task's last line: nothing may escape unseen
            pending = self.device.pending.get(agg.round_id)
            if pending is not None and agg.round_id not in self.device.summary.applied_rounds:
                pending.applying = False
            self.device.rejected.add("apply_failed")
            self.device.summary.reason = f"round {agg.round_id}: applying the aggregate failed: {exc!r}"
            log.error("round %d: applying the aggregate failed", agg.round_id, exc_info=exc)

    def apply(self, agg: AnyAggregate, pending: Pending, sums: list[Any] | None = None) -> dict[str, float]:
        """Make the round's model from ``agg`` (with ``sums``, the raw decryptions of its ciphertexts, for
        an encrypted one) and evaluate it (in the executor)."""
        device = self.device
        t0 = time.perf_counter()
        if isinstance(agg, EncryptedAggregate):
            assert device.he is not None and sums is not None
            avg = device.he.merge_aggregate(self._decryption.parsed(agg), sums)
            delta = pipeline.unflatten(avg, [tuple(w.shape) for w in pending.base])
            new = [b + d for b, d in zip(pending.base, delta, strict=True)]
        elif agg.kind == "delta":  # from the key server: one flat array, or one array per parameter
            shapes = [tuple(w.shape) for w in pending.base]
            parts = list(agg.weights)
            if len(parts) == 1 and parts[0].size == sum(w.size for w in pending.base):
                parts = pipeline.unflatten(np.asarray(parts[0], dtype=np.float64), shapes)
            if [tuple(p.shape) for p in parts] != shapes:
                raise ValidationError("wrong_shape", "aggregate does not match the model's shapes")
            new = [b + np.asarray(d, dtype=np.float32) for b, d in zip(pending.base, parts, strict=True)]
        else:
            new = [np.array(w, dtype=np.float32) for w in agg.weights]
        if [w.shape for w in new] != [w.shape for w in pending.base]:
            raise ValidationError("wrong_shape", "aggregate does not match the model's shapes")
        out = {"merge_s": time.perf_counter() - t0, "upload_s": pending.upload_s}
        device.weights = new
        if device.eval is not None and device.model_id is not None:
            model, (x, y) = device.models[device.model_id], device.eval
            try:
                loss, value = model.evaluate(new, model_input(pending.task, x), y)
            except (FedError, ValueError) as exc:
                # the model is applied all the same: the round is reported, without test metrics
                out["eval_failed"] = 1.0
                pending.eval_error = str(exc)
                return out
            device.summary.metric = model.metric_name
            out.update({"test_loss": loss, f"test_{model.metric_name}": value, "test_samples": float(len(y))})
        return out

    def personalise(self, pending: Pending) -> dict[str, float]:
        """Fine-tune the cluster model just applied and choose the model the device uses
        (:func:`fedsdk.personal.personalise`; in the executor). Its report scalars; none when
        personalisation is off or the device lacks what it needs."""
        device = self.device
        if (
            device.personal_epochs <= 0
            or device.eval is None
            or device.data is None
            or device.weights is None
            or device.model_id not in device.models
        ):
            return {}
        task, cfg = pending.task, pending.task.config
        (x, y), (ex, ey) = device.data, device.eval
        chosen = personalise(
            device.models[device.model_id or ""],
            device.weights,
            (model_input(task, x), y),
            (model_input(task, ex), ey),
            lr=float(cfg.get("lr", 0.05)),
            momentum=float(cfg.get("momentum", 0.9)),
            weight_decay=float(cfg.get("weight_decay", 0.0)),
            batch_size=int(cfg.get("batch_size", 32)),
            epochs=device.personal_epochs,
            seed=int(cfg.get("seed", task.round_id)),
            round_id=task.round_id,
            previous=device.personal.own if device.personal is not None else None,
            initial=device.initial,
        )
        device.personal = chosen
        return dict(chosen.metrics)

    async def on_aggregate(self, agg: AnyAggregate, steps: ApplySteps) -> None:
        device, summary = self.device, self.device.summary
        pending = device.pending.get(agg.round_id)
        if (
            pending is None
            or pending.applying
            or agg.round_id in summary.applied_rounds
            or agg.cluster_id != pending.task.cluster_id
        ):
            device.rejected.add("stale_round")
            return
        if not same_run(pending.task, agg):
            device.rejected.add("other_run")
            log.warning(
                "round %d: an aggregate of another run of the federation (a retained copy?) is not applied",
                agg.round_id,
            )
            return
        pending.applying = True
        loop = asyncio.get_running_loop()
        try:
            sums: list[Any] | None = None
            dec: dict[str, float] = {}
            if isinstance(agg, EncryptedAggregate):
                sums, dec, from_peer = await self._decryption.decrypt(agg, pending, steps)
            try:
                metrics = await loop.run_in_executor(None, steps.apply, agg, pending, sums)
            except CryptoError:
                # Shares are checked only when the aggregate does not decode (the happy path decodes once).
                if not (isinstance(agg, EncryptedAggregate) and sums is not None):
                    raise
                if not await self._decryption.recheck(agg, sums, dec, from_peer, steps.decrypt_packs):
                    raise
                metrics = await loop.run_in_executor(None, steps.apply, agg, pending, sums)
        except (ValidationError, CryptoError, ValueError) as exc:
            pending.applying = False
            device.rejected.add(
                getattr(exc, "code", "crypto" if isinstance(exc, CryptoError) else "bad_aggregate")
            )
            log.warning("rejected aggregate of round %d: %s", agg.round_id, exc)
            summary.reason = f"round {agg.round_id}: aggregate refused: {exc}"
            return
        metrics.update(dec)
        metrics.setdefault("decrypt_s", 0.0)
        if pending.eval_error:
            summary.reason = f"round {agg.round_id}: evaluation on held-out data failed: {pending.eval_error}"
            log.warning("%s", summary.reason)
        if steps.personalise is not None and device.personal_epochs > 0:
            try:
                metrics.update(await loop.run_in_executor(None, steps.personalise, pending))
            except (FedError, ValueError) as exc:  # the cluster model becomes the one the device uses
                device.personal = None
                log.warning("round %d: personalisation failed: %s", agg.round_id, exc)
        if pending.leak is not None:
            try:
                metrics.update(await pending.leak)
            except (FedError, ValueError) as exc:
                log.warning("round %d: leakage count failed: %s", agg.round_id, exc)
        summary.applied_rounds.append(agg.round_id)
        device.model_round, device.model_run = agg.round_id, run_of(pending.task)
        last = pending.task.config.get("rounds")
        if isinstance(last, int | float) and agg.round_id >= last:
            device.last_round_at = time.monotonic()
        device.pending = {r: p for r, p in device.pending.items() if r > agg.round_id}
        value = metrics.get(f"test_{summary.metric}")
        if value is not None:
            summary.accuracy[agg.round_id] = value
        mine = metrics.get(f"personal_test_{summary.metric}")
        if mine is not None:
            summary.personal_accuracy[agg.round_id] = mine
            summary.uses_personal[agg.round_id] = metrics.get("uses_personal") == 1.0
        report = Report(
            client_id=device.client_id, round_id=agg.round_id, cluster_id=agg.cluster_id, metrics=metrics
        )
        try:
            await steps.publish(T.REPORT, report)
        finally:  # after the report, off the round's critical path; also when the report could not go
            if steps.keep is not None:
                try:
                    await loop.run_in_executor(None, steps.keep, pending)
                except (OSError, ValueError) as exc:
                    log.warning("round %d: could not keep the model on disk: %s", agg.round_id, exc)
        shown = "" if value is None else f", held-out {summary.metric} {value:.4f}"
        if mine is not None:
            which = "personal" if summary.uses_personal[agg.round_id] else "cluster"
            shown += f", personal {mine:.4f} (uses the {which} model)"
        of = f"/{last:.0f}" if isinstance(last, int | float) else ""
        progress.info(
            "round %d%s cluster %d: model applied%s, update %.0f%% encrypted (%d bytes), %.2f s "
            "(%.2f s to decrypt and apply)",
            agg.round_id, of, agg.cluster_id, shown, 100 * pending.encrypted_ratio, pending.nbytes,
            time.monotonic() - pending.started, metrics.get("decrypt_s", 0.0) + metrics.get("merge_s", 0.0),
        )  # fmt: skip
