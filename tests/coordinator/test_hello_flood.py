"""A device that says hello again and again with the same facts (a flood, or a reconnect loop) is written
to the store once, not once per hello."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engines import Driven
from fedsdk.protocol import Hello, encode
from fedsdk.protocol import topics as T


def test_identical_hellos_write_the_store_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driven(tmp_path / "s.sqlite", federation="flood")
    writes: list[str] = []
    upsert = d.store.upsert_client

    def counted(client_id: str, *args: Any) -> None:
        writes.append(client_id)
        upsert(client_id, *args)

    monkeypatch.setattr(d.store, "upsert_client", counted)
    envelope = encode(Hello("d0", 10, "0.1.0", {"cores": 4}))
    for _ in range(2000):
        d.engine.handle(T.up("flood", "d0", T.HELLO), envelope)
    assert writes == ["d0"]
    d.engine.handle(T.up("flood", "d0", T.HELLO), encode(Hello("d0", 12, "0.1.0", {"cores": 4})))
    assert writes == ["d0", "d0"]  # new facts are written
    assert [r.num_samples for r in d.store.clients()] == [12]
