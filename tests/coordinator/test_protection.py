"""What the coordinator asks devices to protect, per strategy: ``fedsdk`` fills its masks to the budget and
runs the device's leakage check, the paper strategies keep their papers' objective; the budget cap holds
every device's α below a chosen value. The device side is in tests/sdk/test_masking.py (fill) and
tests/sdk/test_leakage.py (the check)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines import make_engine
from fedsdk.crypto import HEBackend
from fedsdk.errors import ConfigError
from fedsdk.protocol import Task, decode


@pytest.mark.parametrize(
    "strategy, backend, extra, fill, leak_db",
    [
        ("fedsdk", "packed", {}, True, 20.0),  # the default
        ("fedsdk", "packed", {"mask_fill": False, "mask_leak_db": 0.0}, False, 0.0),
        ("fedsdk", "packed", {"mask_leak_db": 30.0}, True, 30.0),
        ("sensecrypt", "paillier", {}, False, 0.0),  # the paper's eq. 4
        ("maskcrypt", "paillier", {}, False, 0.0),  # top-α, no solver
        ("plaintext", None, {}, False, 0.0),
    ],
)
def test_what_each_strategy_asks_devices_to_protect(
    tmp_path: Path,
    public: dict[str, HEBackend],
    strategy: str,
    backend: str | None,
    extra: dict,
    fill: bool,
    leak_db: float,
) -> None:
    e = make_engine(tmp_path, public[backend] if backend else None, strategy=strategy, **extra)
    task = decode(e._task(1, 0, "d0", phase="train", budget=0.5))
    assert isinstance(task, Task)
    assert (task.config["mask_fill"], task.config["mask_leak_db"]) == (fill, leak_db)
    assert task.config["rounds"] == e.config.rounds


def test_the_budget_cap_holds_every_alpha_below_it(tmp_path: Path, public: dict[str, HEBackend]) -> None:
    from fedsdk_coordinator.engine.measure import Measured as _Measured
    from fedsdk_coordinator.strategies import ClusterPlan

    members = ["d0", "d1", "d2"]
    free = make_engine(tmp_path / "a", public["packed"], strategy="fedsdk", clustering=False)
    capped = make_engine(
        tmp_path / "b", public["packed"], strategy="fedsdk", clustering=False, budget_cap=0.3
    )
    for e in (free, capped):
        for cid in members:  # fast devices: every one can afford its whole update
            e.measured[cid] = _Measured(he_values_per_s=1e7, uplink_bytes_per_s=1e8, train_s=0.01)
    assert all(b == 1.0 for b in free.strategy.budgets(ClusterPlan(members, 0, free.measured)).values())
    assert all(b == 0.3 for b in capped.strategy.budgets(ClusterPlan(members, 0, capped.measured)).values())
    with pytest.raises(ConfigError, match="budget_cap"):
        make_engine(tmp_path / "c", public["packed"], strategy="fedsdk", budget_cap=0.0)
    with pytest.raises(ConfigError, match="mask_leak_db"):
        make_engine(tmp_path / "d", public["packed"], strategy="fedsdk", mask_leak_db=-1.0)


def test_benchmark_arm_turns_the_fill_off() -> None:
    from fedsdk_bench.fleet import parse_arm

    assert parse_arm("fedsdk").fill is None
    assert parse_arm("fedsdk+nofill").fill is False
    with pytest.raises(ConfigError, match=r"\+nofill"):
        parse_arm("fedsdk+fill")


def test_noise_on_the_clear_part_is_asked_for_and_refused_where_nothing_is_clear(
    tmp_path: Path, public: dict[str, HEBackend]
) -> None:
    e = make_engine(tmp_path / "a", public["packed"], strategy="fedsdk", mask_noise=0.05, mask_clip=2.0)
    task = decode(e._task(1, 0, "d0", phase="train", budget=0.5))
    assert isinstance(task, Task)
    assert (task.config["mask_noise"], task.config["mask_clip"]) == (0.05, 2.0)
    for strategy, he in (("plaintext", None), ("plain-he", public["paillier"])):
        with pytest.raises(ConfigError, match="masking strategy"):
            make_engine(tmp_path / strategy, he, strategy=strategy, mask_noise=0.05)
    with pytest.raises(ConfigError, match="mask_clip"):
        make_engine(tmp_path / "c", public["packed"], strategy="fedsdk", mask_noise=0.05, mask_clip=0.0)


def test_a_measured_mask_choice_that_costs_more_than_it_saves_gives_every_device_the_whole_update(
    tmp_path: Path, public: dict[str, HEBackend]
) -> None:
    from fedsdk.protocol import Update
    from fedsdk_coordinator.engine.measure import Measured as _Measured
    from fedsdk_coordinator.strategies import ClusterPlan

    members = ["d0", "d1"]
    e = make_engine(tmp_path, public["packed"], strategy="fedsdk", clustering=False, target_round_s=1.0)
    for cid in members:  # cold encryption of the whole update takes 1.1 s: it does not fit the 1 s target
        e.measured[cid] = _Measured(he_values_per_s=e.n_values / 1.1, uplink_bytes_per_s=1e8, train_s=0.5)
    partial = e.strategy.budgets(ClusterPlan(members, 0, e.measured))
    assert all(0 < b < 1 for b in partial.values()), partial

    def choice(cid: str, sensitivity_s: float, mask_s: float) -> None:
        metrics = {"train_s": 0.5, "sensitivity_s": sensitivity_s, "mask_s": mask_s}
        e.inbound.measure(cid, Update(cid, 1, 0, 10, (np.zeros(1, np.float32),), metrics))

    choice("d0", 0.01, 2.0)  # the choice took 2 s: longer than encrypting everything (1.1 s)
    choice("d0", 0.01, 0.1)  # a cheaper choice later does not lower the estimate
    assert e.measured["d0"].select_s == pytest.approx(2.01)
    assert all(b == 1.0 for b in e.strategy.budgets(ClusterPlan(members, 0, e.measured)).values())
    choice("d1", 0.0, 0.5)  # no sensitivity computed: the device did not choose, nothing is learnt
    assert e.measured["d1"].select_s is None
