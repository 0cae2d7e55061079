"""The key server refuses to decrypt an aggregate of fewer than ``min_aggregate`` devices: its published
average would be one or two devices' updates, readable by every reader of the cluster topic."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsdk.crypto import generate_backend
from fedsdk.pipeline import message_from_he_aggregate
from fedsdk.protocol import Aggregate, decode, encode
from fedsdk.protocol import topics as T
from fedsdk_coordinator.keyserver import KeyServer


class Published:
    """What the key server publishes (it publishes nothing else)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.sent.append((topic, payload))


async def test_an_aggregate_of_too_few_devices_is_never_decrypted() -> None:
    with generate_backend(
        "packed", key_bits=1024, encoding="weighted", frac_bits=13
    ) as he:  # hand-made weights
        updates = [he.encrypt_update(np.full(40, 0.01 * (i + 1)), 3)[0] for i in range(3)]
        out = Published()
        server = KeyServer(out, he, federation="ks", min_aggregate=3)  # type: ignore[arg-type]
        topic = T.keyserver("ks", 0)
        for n, round_id in ((1, 1), (2, 2), (3, 3)):
            agg = he.aggregate(updates[:n])
            msg: Any = message_from_he_aggregate(
                agg, round_id=round_id, cluster_id=0, total_samples=9, metrics={}
            )
            await server.handle(topic, encode(msg))
        assert server.rejected.as_dict() == {"min_aggregate": 2}
        assert [t for t, _ in out.sent] == [T.cluster("ks", 0)]
        published = decode(out.sent[0][1])
        assert isinstance(published, Aggregate) and published.round_id == 3 and published.num_clients == 3
        np.testing.assert_allclose(published.weights[0], 0.02, atol=he.quantisation_bound * 1.01)
