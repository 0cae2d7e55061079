"""A device's openings made ahead (``Decryption.prepare_for``) when its part of a round was empty.

The coordinator's split gives a slow device one pack in some rounds and none in others. A device that
decrypted nothing itself in round 1 still took round 1's aggregate from its cluster's shares, and that
aggregate is what round 2's openings are guessed from: each contributor's next coins follow the ones it
used in round 1. Three devices of one key, each with its own obfuscator sequence; the test plays the other
two devices' shares into the device's book and checks that round 2's part opens with prepared openings and
exactly (phe's ``raw_decrypt``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedsdk.client.apply import ApplySteps
from fedsdk.client.decryption import Decryption
from fedsdk.client.state import ClientSummary, DeviceState, Pending
from fedsdk.coop import PeerShare, share_ranks
from fedsdk.crypto.base import Aggregate
from fedsdk.crypto.fixedpoint import FixedPoint
from fedsdk.crypto.packed import PackedPaillierBackend
from fedsdk.crypto.paillier_keys import PaillierKeys
from fedsdk.pipeline import message_from_he_aggregate
from fedsdk.protocol import EncryptedAggregate, Task

PACKS = 6


def task(round_id: int, lo: float, hi: float) -> Task:
    return Task(
        federation="fed",
        round_id=round_id,
        cluster_id=0,
        deadline_s=60.0,
        param_names=(),
        weights=(),
        config={"phase": "train", "share_lo": lo, "share_hi": hi, "share_wait_s": 5.0},
    )


@pytest.mark.asyncio
async def test_a_device_with_an_empty_part_prepares_its_next_part() -> None:
    keys = PaillierKeys.generate(1024)
    rng = np.random.default_rng(3)
    devices = [PackedPaillierBackend(keys, FixedPoint(max_devices=16), parallel=False) for _ in range(3)]
    coordinator = PackedPaillierBackend(PaillierKeys(int(keys.n)), FixedPoint(max_devices=16), parallel=False)
    me = devices[0]
    n = PACKS * me.pack_size
    state = DeviceState("d0", "fed", None, None, None, me, ClientSummary("d0"))
    decryption = Decryption(state)

    def round_of(round_id: int) -> tuple[EncryptedAggregate, Aggregate, list[int]]:
        contributions = [d.encrypt_update(rng.normal(0, 0.2, n), 3)[0] for d in devices]
        agg = coordinator.aggregate(contributions)
        msg = message_from_he_aggregate(agg, round_id=round_id, cluster_id=0, total_samples=9, metrics={})
        return msg, agg, [keys.private_key.raw_decrypt(int(me._ct(c))) for c in agg.ciphertexts]

    async def publish(kind: str, msg: Any) -> tuple[float, int]:
        return 0.0, 0

    steps = ApplySteps(lambda _r, agg, ranks: decryption.decrypt_packs(agg, ranks), lambda *_: {}, publish)

    async def apply(t: Task, msg: EncryptedAggregate, plains: list[int]) -> tuple[list[Any], dict[str, Any]]:
        """The device's decryption of ``msg`` with every rank outside its part shared by a peer."""
        pending = state.pending[t.round_id]
        a, b = share_ranks(t.config, len(plains)) or (0, 0)
        peers = [r for r in range(len(plains)) if not a <= r < b]
        pending.book.add(PeerShare("d1", np.array(peers, dtype=np.int64), [plains[r] for r in peers]))
        sums, metrics, _ = await decryption.decrypt(msg, pending, steps)
        return sums, metrics

    try:
        # round 1: an empty part (the whole union comes from the others' shares)
        t1 = task(1, 0.0, 0.0)
        state.pending[1] = Pending(t1, [])
        msg, _, plains = round_of(1)
        sums, metrics = await apply(t1, msg, plains)
        assert sums == plains and metrics["decrypted_packs"] == 0
        # round 2: a third of the union; its openings are made once the update is sent
        t2 = task(2, 0.0, 1 / 3)
        state.pending[2] = Pending(t2, [])
        decryption.prepare_for(t2, decryption.prepare_openings)  # decrypt() waits for it
        msg, _, plains = round_of(2)
        sums, metrics = await apply(t2, msg, plains)
        assert sums == plains
        assert metrics["decrypted_packs"] == 2 and metrics["prepared_packs"] == 2, metrics
    finally:
        for d in devices:
            d.close()
