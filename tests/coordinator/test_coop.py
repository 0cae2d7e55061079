"""Who gets cooperative decryption (coordinator/fedsdk_coordinator/coop.py): the engine's switches and the
benchmark arm; the split and the partition are in tests/sdk/crypto/test_crypto_shares.py, the relay in
tests/coordinator/test_handler_fuzz.py, devices in tests/sdk/test_client_coop.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import make_engine
from fedsdk.crypto import HEBackend
from fedsdk.errors import ConfigError
from fedsdk.protocol import Task, decode
from fedsdk_coordinator.engine.measure import Measured
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
