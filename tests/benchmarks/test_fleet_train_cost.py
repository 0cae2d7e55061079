"""The fleet emulation's training cost (``--train-cost``): each round's CPU time, or the least a device's
training has taken so far; and the dilation charging a step what its caller says it cost."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk_bench.fleet.emulation import Dilation, TrainCost


@given(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=40))
def test_least_is_the_least_so_far_and_measured_is_each_rounds_own(cpus: list[float]) -> None:
    least, measured = TrainCost("least"), TrainCost("measured")
    for i, cpu in enumerate(cpus):
        assert least.cost(cpu) == min(cpus[: i + 1]) <= cpu
        assert measured.cost(cpu) == cpu


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ConfigError, match="train_cost"):
        TrainCost("median")


def _spin(seconds: float) -> None:
    c0 = time.thread_time()
    while time.thread_time() - c0 < seconds:
        pass


def test_a_step_lasts_k_times_its_cost_with_the_callers_adjustment() -> None:
    d = Dilation(time_scale=4.0, speed_factor=1.0)
    with d.step("train") as plain:
        _spin(0.02)
    assert plain.cpu_s >= 0.02 and plain.emulated_s == max(4 * plain.cpu_s, plain.wall_s)
    with d.step("train") as cheaper:
        _spin(0.02)
        cheaper.cpu_adjust_s = -0.015  # the step is said to have cost 15 ms less than it took
    assert 0.005 <= cheaper.cpu_s < plain.cpu_s - 0.01
    assert cheaper.emulated_s == max(4 * cheaper.cpu_s, cheaper.wall_s)
    assert d.stats["train"]["cpu_s"] == pytest.approx(plain.cpu_s + cheaper.cpu_s)
