"""Who gets cooperative decryption (coordinator/fedsdk_coordinator/coop.py): the engine's switches and the
benchmark arm; the split and the partition are in tests/sdk/crypto/test_crypto_shares.py, the relay in
tests/coordinator/test_handler_fuzz.py, devices in tests/sdk/test_client_coop.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from engines import make_engine, until
from fedsdk.crypto import HEBackend
from fedsdk.errors import ConfigError
from fedsdk.protocol import Hello, Report, Task, Update, decode, encode
from fedsdk.protocol import topics as T
from fedsdk_coordinator.engine.cluster import run_cluster_round
from fedsdk_coordinator.engine.measure import Measured
from fedsdk_coordinator.engine.state import RoundState
from fedsdk_coordinator.strategies import ClusterPlan


@pytest.mark.parametrize(
    "strategy, backend, extra, coop",
    [
        ("fedsdk", "packed", {}, True),  # the default
        ("fedsdk", "packed", {"coop_decrypt": False}, False),
        ("fedsdk", "packed", {"key_mode": "keyserver"}, False),  # the key server decrypts
        ("sensecrypt", "paillier", {}, False),  # the papers' baselines keep their protocol
        ("plaintext", None, {}, False),
    ],
)
def test_which_federations_split_the_decryption(
    tmp_path: Path, public: dict[str, HEBackend], strategy: str, backend: str | None, extra: dict, coop: bool
) -> None:
    e = make_engine(tmp_path, public[backend] if backend else None, strategy=strategy, **extra)
    assert e.strategy.coop is coop
    assert bool(e.strategy.shares(ClusterPlan(["d0", "d1", "d2"], 0, e.measured))) is coop
    assert e.strategy.shares(ClusterPlan(["solo"], 0, e.measured)) == {}  # nobody to share with


def test_the_devices_measured_last_to_train_get_no_part(tmp_path: Path, public: dict[str, HEBackend]) -> None:
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk")
    measured = {
        "d0": Measured(train_s=0.10, decrypt_values_per_s=3e4),
        "d1": Measured(train_s=0.20, decrypt_values_per_s=1e4),
        "d2": Measured(train_s=0.46, decrypt_values_per_s=1e4),  # within 10 % of the slowest
        "d3": Measured(train_s=0.48, decrypt_values_per_s=1e4),
    }
    shares = e.strategy.shares(ClusterPlan(list(measured), 0, measured))
    # a quarter of the cluster at most: d3 only, though d2 too is within 10 % of the slowest
    assert shares["d0"] == pytest.approx((0.0, 0.6)) and shares["d1"] == pytest.approx((0.6, 0.8))
    assert shares["d2"] == pytest.approx((0.8, 1.0)) and shares["d3"] == (1.0, 1.0)


def test_asking_for_it_where_it_cannot_work_is_an_error(tmp_path: Path, public: dict[str, HEBackend]) -> None:
    with pytest.raises(ConfigError, match="packed backend"):
        make_engine(tmp_path, public["paillier"], strategy="sensecrypt", coop_decrypt=True)
    with pytest.raises(ConfigError, match="packed backend"):
        make_engine(tmp_path, None, strategy="plaintext", coop_decrypt=True)
    with pytest.raises(ConfigError, match="share_wait_s"):
        make_engine(tmp_path, public["packed"], strategy="fedsdk", share_wait_s=-1.0)


def test_a_task_carries_the_devices_part_only_in_its_round(
    tmp_path: Path, public: dict[str, HEBackend]
) -> None:
    import asyncio

    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, share_wait_s=2.5)
    e.online = dict.fromkeys(("d0", "d1"))  # type: ignore[arg-type]
    (rnd,) = asyncio.run(e._plan(1))
    assert rnd.shares == {"d0": (0.0, 0.5), "d1": (0.5, 1.0)}  # no speed measured yet: equal parts
    task = decode(e._task(1, 0, "d1", phase="train", budget=0.1))
    assert isinstance(task, Task)
    assert (task.config["share_lo"], task.config["share_hi"], task.config["share_wait_s"]) == (0.5, 1.0, 2.5)
    other = decode(e._task(2, 0, "d1", phase="train", budget=0.1))  # not the planned round
    assert isinstance(other, Task) and "share_lo" not in other.config


def test_benchmark_arm_turns_it_off() -> None:
    from fedsdk_bench.fleet import parse_arm

    assert parse_arm("fedsdk").coop is None
    arm = parse_arm("fedsdk+noconsensus+nocoop")
    assert (arm.consensus, arm.coop) == (False, False)
    with pytest.raises(ConfigError, match=r"\+nocoop"):
        parse_arm("fedsdk+coop")


def test_the_devices_whose_updates_arrive_last_get_no_part(
    tmp_path: Path, public: dict[str, HEBackend]
) -> None:
    # Devices of one speed class train on different amounts of data, so their measured training times
    # differ by more than the 10 % margin: d3 arrives last but trains within 80 % of the slowest, d2. With
    # how early each update arrives measured, that decides; before, the training times did.
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk")
    measured = {
        "d0": Measured(train_s=0.10, decrypt_values_per_s=1e4, slack=0.70),
        "d1": Measured(train_s=0.20, decrypt_values_per_s=1e4, slack=0.50),
        "d2": Measured(train_s=0.50, decrypt_values_per_s=1e4, slack=0.15),
        "d3": Measured(train_s=0.40, decrypt_values_per_s=1e4, slack=0.02),
    }
    shares = e.strategy.shares(ClusterPlan(list(measured), 0, measured))
    assert shares["d3"] == (1.0, 1.0) and shares["d2"] == pytest.approx((2 / 3, 1.0))  # d3: empty part
    # while one device's slack is not measured yet, the training times decide
    measured["d0"].slack = None
    shares = e.strategy.shares(ClusterPlan(list(measured), 0, measured))
    assert shares["d2"][0] == shares["d2"][1] and shares["d3"] == pytest.approx((2 / 3, 1.0))


async def test_a_round_every_device_replied_to_measures_how_early_each_update_arrived(tmp_path: Path) -> None:
    e = make_engine(tmp_path, None, strategy="plaintext", min_clients=2, report_timeout_s=5.0, deadline_s=1.0)

    def say(cid: str, kind: str, msg: object) -> None:
        e.handle(T.up(e.config.federation, cid, kind), encode(msg))  # type: ignore[arg-type]

    ids = ("a", "b", "c")
    for cid in ids:
        say(cid, T.HELLO, Hello(client_id=cid, num_samples=10, sdk_version="0.1.0", device={}))
    zeros = tuple(np.zeros_like(w) for w in e.initial)

    async def devices(rnd: RoundState, late: dict[str, float]) -> None:
        for cid, at in late.items():
            await asyncio.sleep(max(0.0, at - (asyncio.get_running_loop().time() - t0)))
            say(cid, T.UPDATE, Update(cid, rnd.round_id, 0, 10, zeros, metrics={"train_s": 0.1}))
        await until(lambda: not rnd.collecting, "the round to stop collecting", timeout=10.0)
        for cid in late:
            say(cid, T.REPORT, Report(client_id=cid, round_id=rnd.round_id, cluster_id=0, metrics={}))

    # round 2: c never replies, the deadline ends the round, and nothing is measured
    for round_id, late in ((1, {"a": 0.0, "b": 0.1, "c": 0.4}), (2, {"a": 0.0, "b": 0.1})):
        rnd = RoundState(round_id, 0, set(late) | ({"c"} if round_id == 2 else set()), time.monotonic())
        e.open_rounds[0] = rnd
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(run_cluster_round(e, rnd), devices(rnd, late))
        e.open_rounds.pop(0, None)
        if round_id == 1:
            slack = {cid: e.measured[cid].slack for cid in ids}
            assert slack["c"] == 0.0
            assert slack["a"] == pytest.approx(1.0, abs=0.05) and slack["b"] == pytest.approx(0.75, abs=0.1)
    assert e.measured["a"].recent["slack"] == [pytest.approx(1.0, abs=0.05)]  # round 2 added nothing
