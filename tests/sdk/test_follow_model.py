"""A device moving between clusters keeps the model it leaves and takes back the one it left before
(fedsdk.client.state.follow_model): what the trial of proposed clusters and a cluster that is not kept
need under HE, where the coordinator holds no model to send."""

from __future__ import annotations

import numpy as np

from fedsdk.client.saved import held_model
from fedsdk.client.state import ClientSummary, DeviceState, follow_model


def _device(cluster: int | None, value: float, model_round: int) -> DeviceState:
    d = DeviceState("d0", "f", None, None, None, None, ClientSummary("d0", cluster_id=cluster))
    d.weights, d.model_round = [np.full(3, value, np.float32)], model_round
    return d


def test_a_split_starts_from_the_model_held_and_keeps_it_aside() -> None:
    d = _device(0, 1.0, 2)
    assert not follow_model(d, 1)  # a new cluster: trains on from the shared model of round 2
    assert d.weights is not None and d.weights[0][0] == 1.0 and d.model_round == 2
    assert list(d.parked) == [0] and d.parked[0][0] == 2
    d.weights[0][:] = 5.0  # training the cluster's model does not touch the copy kept aside
    assert d.parked[0][1][0][0] == 1.0


def test_turns_swap_the_two_models_and_a_relay_can_serve_the_one_kept_aside() -> None:
    d = _device(1, 7.0, 3)  # cluster 1's model of round 3; the shared model of round 2 kept aside
    d.parked = {0: (2, [np.full(3, 1.0, np.float32)])}
    kept = held_model(d, ("w",), 0)  # another device asks for the shared model: the one kept aside
    assert kept is not None and kept.model_round == 2 and kept.weights[0][0] == 1.0
    assert follow_model(d, 0)
    assert d.weights is not None and d.weights[0][0] == 1.0 and d.model_round == 2
    assert d.parked[1][0] == 3 and d.parked[1][1][0][0] == 7.0
    d.summary.cluster_id = 0
    assert follow_model(d, 1) and d.weights[0][0] == 7.0 and d.model_round == 3


def test_back_to_an_older_cluster_without_its_model_holds_none() -> None:
    d = _device(2, 7.0, 5)  # restarted: the model kept aside was in memory only
    assert not follow_model(d, 0)
    assert d.weights is None and d.model_round == -1  # says so, and gets it relayed
    d = _device(2, 7.0, 5)
    assert not follow_model(d, 4)  # a newer id is a new cluster: it starts from the model held
    assert d.weights is not None and d.model_round == 5
    fresh = _device(None, 1.0, 0)
    assert not follow_model(fresh, 3) and fresh.parked == {}  # no cluster yet: nothing to keep
