"""The device's side of the model relay (fedsdk.client.relay), without a broker: what it seals when asked
while an aggregate is being applied, and what it refuses to hold."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import until
from fedsdk.client.relay import ModelRelay
from fedsdk.client.saved import SavedModel, load_model, model_bytes, model_from_bytes
from fedsdk.client.state import ClientSummary, DeviceState
from fedsdk.client.work import Work
from fedsdk.crypto import HEBackend, PackedPaillierBackend, PaillierKeys
from fedsdk.crypto.shares import ModelSealer
from fedsdk.protocol import BaseMessage, ModelRequest, SealedModel
from fedsdk.selfaudit import DEFAULT_THRESHOLD_DB

NAMES = ("w", "b")


@pytest.fixture(scope="module")
def he() -> Iterator[HEBackend]:
    backend = PackedPaillierBackend(PaillierKeys.generate(1024), parallel=False)
    yield backend
    backend.close()


def weights(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]


def holder(he: HEBackend, cid: str = "d0") -> tuple[DeviceState, ModelRelay]:
    device = DeviceState(cid, "fed", None, None, None, he, summary=ClientSummary(cid))
    work = Work(
        device, intra_op_threads=1, pool_capacity=0, self_audit=False, self_audit_db=DEFAULT_THRESHOLD_DB
    )
    work.names = NAMES
    return device, ModelRelay(device, work, link=None, state_dir=None)  # type: ignore[arg-type]


async def test_a_request_during_an_apply_seals_the_round_the_apply_makes(he: HEBackend) -> None:
    device, relay = holder(he)
    device.summary.cluster_id = 0
    device.weights, device.model_round = weights(4), 4
    applied = asyncio.Event()

    async def settle() -> None:  # an apply under way: the weights of round 5 are set, its round not yet
        await applied.wait()

    sent: list[tuple[str, BaseMessage]] = []

    async def publish(kind: str, msg: BaseMessage) -> tuple[float, int]:
        sent.append((kind, msg))
        return 0.0, 0

    device.weights = weights(5)  # what the apply's executor step does first
    relay.take(ModelRequest(round_id=4, cluster_id=0, for_client="d1"), publish, settle)
    await asyncio.sleep(0.1)
    assert sent == []  # nothing sealed while the apply runs
    device.model_round = 5  # ... and what it does last, on the loop
    applied.set()
    await until(lambda: sent, "the sealed model", 10)
    kind, msg = sent[0]
    assert kind == "model" and isinstance(msg, SealedModel) and msg.round_id == 5
    body = ModelSealer(he).open(
        msg.sealed, federation="fed", sender="d0", recipient="d1", round_id=5, cluster_id=0
    )
    saved = model_from_bytes(body)
    assert saved.model_round == 5
    for a, b in zip(saved.weights, weights(5), strict=True):
        assert a.tobytes() == b.tobytes()


async def test_a_relayed_model_is_held_only_when_newer_and_shaped_like_the_model(he: HEBackend) -> None:
    device, relay = holder(he, "d1")
    device.weights, device.model_round, device.model_id = weights(2), 2, "m"

    def sealed(round_id: int, ws: list[np.ndarray], *, names: tuple[str, ...] = NAMES) -> SealedModel:
        saved = SavedModel("fed", "d0", 0, round_id, "m", names, ws)
        box = ModelSealer(he).seal(
            model_bytes(saved), federation="fed", sender="d0", recipient="d1", round_id=round_id, cluster_id=0
        )
        return SealedModel("d0", "d1", round_id, 0, box)

    got: Any = await relay.on_model(sealed(2, weights(9)), NAMES)
    assert got == (None, True) and device.model_round == 2  # not newer: kept, but it says hello
    wrong = [np.zeros((3, 4), np.float32), np.zeros(3, np.float32)]
    assert await relay.on_model(sealed(3, wrong), NAMES) == (None, False)
    assert await relay.on_model(sealed(3, weights(3), names=("x", "y")), NAMES) == (None, False)
    msg = sealed(3, weights(3))
    forged = SealedModel("d0", "d1", 4, 0, msg.sealed)  # the round changed on the way
    assert await relay.on_model(forged, NAMES) == (None, False)
    assert device.rejected.as_dict()["bad_relay"] == 3
    saved, hello = await relay.on_model(msg, NAMES)
    assert hello and saved is not None and device.model_round == 3 and device.weights is not None
    assert device.weights[0].tobytes() == weights(3)[0].tobytes()


async def relay_to_d1(he: HEBackend, state_dir: Path) -> tuple[DeviceState, Work, list[int]]:
    """A device d1 without a model, with ``state_dir``, takes d0's round-3 model relayed to it; the rounds
    of the models it said hello holding."""
    hellos: list[int] = []
    device = DeviceState("d1", "fed", None, None, None, he, summary=ClientSummary("d1"))
    work = Work(
        device, intra_op_threads=1, pool_capacity=0, self_audit=False, self_audit_db=DEFAULT_THRESHOLD_DB
    )

    class Link:
        async def say_hello(self, publish: Any) -> None:
            hellos.append(device.model_round)

    async def publish(kind: str, msg: BaseMessage) -> tuple[float, int]:
        raise AssertionError("nothing to publish")

    relay = ModelRelay(device, work, Link(), state_dir)  # type: ignore[arg-type]
    saved = SavedModel("fed", "d0", 0, 3, "m", NAMES, weights(3))
    box = ModelSealer(he).seal(
        model_bytes(saved), federation="fed", sender="d0", recipient="d1", round_id=3, cluster_id=0
    )
    await relay.on_message(SealedModel("d0", "d1", 3, 0, box), publish)
    return device, work, hellos


async def test_a_relayed_model_is_kept_in_the_state_directory_and_announced(
    he: HEBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fedsdk.progress"):
        _, work, hellos = await relay_to_d1(he, tmp_path / "state")
    assert hellos == [3] and work.names == NAMES  # it says hello holding round 3's model
    shown = [r.getMessage() for r in caplog.records if r.name == "fedsdk.progress"]
    assert shown == ["holds cluster 0's model of round 3, sealed for it by d0 and relayed by the coordinator"]
    kept = load_model(tmp_path / "state", federation="fed", client_id="d1")
    assert kept is not None and kept.model_round == 3 and kept.client_id == "d1"
    assert kept.weights[1].tobytes() == weights(3)[1].tobytes()


async def test_a_relayed_model_that_cannot_be_kept_is_held_and_announced_all_the_same(
    he: HEBackend, tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the state directory should be")
    device, _, hellos = await relay_to_d1(he, blocked)
    assert hellos == [3] and device.model_round == 3
