"""A device applies only an aggregate of its task's run of the federation (``fedsdk.client.apply.same_run``):
the run tag travels as an int in the task's config and as a float in the aggregate's metrics, through the
real wire format, and must compare exactly for every tag the coordinator makes (52 bits)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fedsdk.client.apply import same_run
from fedsdk.protocol import Aggregate, Task, decode, encode

TASK = Task(
    federation="fed", round_id=3, cluster_id=0, deadline_s=60.0, param_names=(), weights=(),
    config={"phase": "train"},
)  # fmt: skip


def aggregate(metrics: dict[str, float]) -> Aggregate:
    zeros = (np.zeros(3, np.float32),)
    return Aggregate(round_id=3, cluster_id=0, weights=zeros, num_clients=1, total_samples=5, metrics=metrics)


def wire(msg: object) -> object:
    return decode(encode(msg))  # type: ignore[arg-type]


runs = st.integers(1, 2**52 - 1)


@given(run=runs, other=runs)
def test_an_aggregate_is_applied_only_in_its_own_run(run: int, other: int) -> None:
    task = wire(dataclasses.replace(TASK, config={"phase": "train", "run": run}))
    assert isinstance(task, Task)
    mine = wire(aggregate({"decrypt_s": 0.1, "run": float(run)}))
    theirs = wire(aggregate({"run": float(other)}))
    assert isinstance(mine, Aggregate) and isinstance(theirs, Aggregate)
    assert same_run(task, mine)
    assert same_run(task, theirs) == (run == other)
    assert not same_run(task, aggregate({}))  # an untagged aggregate is of another coordinator's run


@given(run=runs)
def test_an_untagged_task_takes_any_aggregate(run: int) -> None:
    assert same_run(TASK, aggregate({"run": float(run)})) and same_run(TASK, aggregate({}))
