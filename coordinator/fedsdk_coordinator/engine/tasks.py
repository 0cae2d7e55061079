"""A device's task for a round, as plain data: the training settings from the :class:`RoundConfig`, the
strategy's device settings on top (:meth:`Strategy.task_options`), and the device's part of the planned
round (weight unit, decryption share)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedsdk.model import GraphBundle, OnnxModel
from fedsdk.protocol import Status, Task
from fedsdk_coordinator.engine.config import RoundConfig
from fedsdk_coordinator.engine.state import RoundState
from fedsdk_coordinator.strategies.base import Strategy

__all__ = ["make_status", "make_task", "shape_text"]


def shape_text(shape: Sequence[int]) -> str:
    """A sample's shape as tasks and the status carry it: ``(1, 28, 28)`` -> ``"1,28,28"``."""
    return ",".join(str(int(d)) for d in shape)


def make_task(
    c: RoundConfig,
    strategy: Strategy,
    bundle: GraphBundle,
    *,
    round_id: int,
    cluster_id: int,
    client_id: str,
    phase: str,
    budget: float,
    weights: Sequence[np.ndarray] | None,
    planned: RoundState | None,
    run: int = 0,
) -> Task:
    """``client_id``'s task; ``weights`` is the model to start from (``None``: the device holds it) and
    ``planned`` the cluster's open round, whose per-device parts go into the task of that round only.
    ``run``: the run of the federation (:meth:`Store.run_tag`); a device applies only an aggregate of its
    task's run (a retained aggregate of an earlier run of the same federation name is not one)."""
    config: dict[str, Any] = {
        "phase": phase,
        "lr": c.lr,
        "momentum": c.momentum,
        "batch_size": c.batch_size,
        "epochs": c.epochs,
        "weight_decay": c.weight_decay,
        "seed": c.seed * 100_003 + round_id,
        "input_shape": shape_text(bundle.input_shape),
        "budget": float(budget),
        "metric": c.metric,
        "mask_beta1": c.mask_beta1,
        "mask_beta2": c.mask_beta2,
        "mask_B": c.mask_B,
        "mask_C": c.mask_C,
        "mask_eta_mi": c.mask_eta_mi,
        "mask_policy": c.mask_policy,
        "mask_floor": c.mask_floor,
        "mask_noise": c.mask_noise,
        "mask_clip": c.mask_clip,
        "sketch_dim": c.sketch_size,
        "sketch_seed": c.seed * 7919 + 1,
        "dp_epsilon": c.dp_epsilon,
        "dp_clip": c.dp_clip,
        "key_mode": c.key_mode,
        "rounds": c.rounds,  # the federation's last round (devices stop waiting once they applied it)
    }
    if run:
        config["run"] = run
    config.update(strategy.task_options(cluster_id, phase))
    this_round = phase == "train" and planned is not None and planned.round_id == round_id
    if this_round and planned is not None and planned.weight_unit > 1:
        config["weight_unit"] = planned.weight_unit
    if this_round and planned is not None and planned.weight_mult > 1:
        config["weight_mult"] = planned.weight_mult
    if this_round and planned is not None and planned.session:
        config["secagg_session"] = planned.session  # the round is masked (fedsdk.secagg)
    if this_round and planned is not None and client_id in planned.shares:
        config["share_lo"], config["share_hi"] = planned.shares[client_id]
        config["share_wait_s"] = c.share_wait_s
    return Task(
        federation=c.federation,
        round_id=round_id,
        cluster_id=cluster_id,
        deadline_s=c.deadline_s,
        param_names=tuple(bundle.param_names) if weights is not None else (),
        weights=tuple(weights) if weights is not None else (),
        config=config,
        model_id=bundle.model_id,
        train_graph=bundle.train_graph,
        eval_graph=bundle.eval_graph,
    )


def make_status(bundle: GraphBundle, model: OnnxModel, state: str, epoch: str, round_id: int) -> Status:
    """The coordinator's status, with what the federation trains so that a device can check its data
    before it joins."""
    described = {
        "model_id": bundle.model_id,
        "task": model.task,
        "input_shape": shape_text(bundle.input_shape),
        "output_shape": shape_text(model.output_shape),
        "params": sum(math.prod(s) for s in bundle.param_shapes),  # devices size their obfuscator pool by it
    }
    return Status(state=state, epoch=epoch, round_id=round_id, model=described)
