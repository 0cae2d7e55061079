"""A device's decline (an ``Error`` of code ``declined_<condition>``), through the engine's real inbound
handler and store: it ends the device's part of the round like an error, is counted apart from failures,
and is kept per device in the store even when a failed round's results are replaced."""

from __future__ import annotations

import time
from pathlib import Path

from engines import make_engine
from fedsdk.protocol import Error, Hello, encode
from fedsdk.protocol import topics as T
from fedsdk_coordinator.engine.state import RoundState, failure_summary


def say(e: object, cid: str, kind: str, msg: object) -> None:
    e.handle(T.up(e.config.federation, cid, kind), encode(msg))  # type: ignore[attr-defined]


def test_a_decline_ends_the_devices_part_and_is_no_failure(tmp_path: Path) -> None:
    e = make_engine(tmp_path, None, min_clients=2)
    for cid in ("a", "b", "c"):
        say(e, cid, T.HELLO, Hello(client_id=cid, num_samples=10, sdk_version="0.1.0", device={}))
    rnd = RoundState(1, 0, {"a", "b", "c"}, time.monotonic())
    e.open_rounds[0] = rnd
    say(e, "a", T.ERROR, Error(client_id="a", round_id=1, code="declined_charging", reason="on battery"))
    assert e.declines.as_dict() == {"declined_charging": 1} and e.failures.as_dict() == {}
    assert rnd.declined == ["a"] and rnd.waiting_for == ["b", "c"] and not rnd.done.is_set()
    say(e, "b", T.ERROR, Error(client_id="b", round_id=1, code="device", reason="loss is not finite"))
    say(e, "c", T.ERROR, Error(client_id="c", round_id=1, code="declined_temperature", reason="47 °C"))
    assert rnd.done.is_set()  # every participant answered: the round waits for nobody
    assert e.failures.as_dict() == {"device": 1}
    assert e.declines.as_dict() == {"declined_charging": 1, "declined_temperature": 1}
    assert e.health()["device_declines"] == e.declines.as_dict()
    why = failure_summary(rnd, 2)
    assert "1 device errors, e.g. b: device" in why and "2 declined (a, c)" in why, why
    statuses = {r["client_id"]: r["status"] for r in e.store.results(1)}
    assert statuses == {"a": "declined_charging", "b": "error:device", "c": "declined_temperature"}
    declines = {c.client_id: dict(c.declines) for c in e.store.clients()}
    assert declines == {"a": {"declined_charging": 1}, "b": {}, "c": {"declined_temperature": 1}}

    # The round failed and runs again: its stored replies go, the declines stay, a new one adds up.
    e.store.drop_replies(1)
    again = RoundState(1, 0, {"a", "b", "c"}, time.monotonic())
    e.open_rounds[0] = again
    say(e, "a", T.ERROR, Error(client_id="a", round_id=1, code="declined_charging", reason="still"))
    assert {c.client_id: dict(c.declines) for c in e.store.clients()}["a"] == {"declined_charging": 2}
