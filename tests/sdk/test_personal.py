"""Personalisation (fedsdk.personal) on real models: the digits MLP and a small imported regression graph."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits
from fedsdk.personal import choose, personalise

onnx = pytest.importorskip("onnx")
models = pytest.importorskip("fedsdk_coordinator.models")

FT = {"lr": 0.05, "momentum": 0.9, "batch_size": 32, "seed": 0}


@pytest.fixture(scope="module")
def digits() -> dict[str, Any]:
    """The ``mlp`` preset (64-64-10), and a global model trained on all the digits (20 epochs)."""
    ds = load_digits()
    spec = models.mlp(64, (64,), 10)
    model = OnnxModel.from_bundle(models.build_graphs(spec))
    w0 = models.init_params(spec, seed=0)
    trained = OnnxTrainer(model, ds.x_train, ds.y_train, lr=0.05, epochs=20, seed=0).fit(w0).weights
    weak = OnnxTrainer(model, ds.x_train, ds.y_train, lr=0.05, epochs=1, seed=0).fit(w0).weights
    return {"ds": ds, "model": model, "trained": trained, "weak": weak, "initial": w0}


@pytest.mark.parametrize("which", ["weak", "trained"])
def test_a_device_with_two_classes_keeps_its_fine_tuned_model(digits: dict[str, Any], which: str) -> None:
    ds, model, cluster = digits["ds"], digits["model"], digits[which]
    classes = (3, 8)
    train = np.flatnonzero(np.isin(ds.y_train, classes))[:120]
    held = np.isin(ds.y_test, classes)
    before = [w.copy() for w in cluster]
    p = personalise(
        model, cluster, (ds.x_train[train], ds.y_train[train]), (ds.x_test[held], ds.y_test[held]),
        epochs=5, round_id=4, **FT,
    )  # fmt: skip
    _, cluster_acc = model.evaluate(cluster, ds.x_test[held], ds.y_test[held])
    _, personal_acc = model.evaluate(p.weights, ds.x_test[held], ds.y_test[held])
    assert p.uses_personal and 1 <= p.epochs <= 5 and p.round_id == 4
    assert personal_acc > cluster_acc
    assert p.metrics["personal_test_accuracy"] == personal_acc >= 0.98
    assert p.metrics["uses_personal"] == 1.0 and p.metrics["personal_epochs"] == p.epochs
    assert p.metrics["personal_s"] > 0
    assert all(np.array_equal(a, b) for a, b in zip(cluster, before, strict=True))  # pure: input untouched


def test_an_iid_device_with_a_well_trained_model_is_never_worse_off(digits: dict[str, Any]) -> None:
    ds, model, cluster = digits["ds"], digits["model"], digits["trained"]
    for seed in range(4):
        rng = np.random.default_rng(seed)
        train = rng.choice(len(ds.y_train), 120, replace=False)
        held = rng.choice(len(ds.y_test), 72, replace=False)
        p = personalise(
            model, cluster, (ds.x_train[train], ds.y_train[train]), (ds.x_test[held], ds.y_test[held]),
            epochs=5, **FT,
        )  # fmt: skip
        _, cluster_acc = model.evaluate(cluster, ds.x_test[held], ds.y_test[held])
        loss, acc = model.evaluate(p.weights, ds.x_test[held], ds.y_test[held])
        assert acc >= cluster_acc
        assert p.metrics == pytest.approx(
            {"personal_test_loss": loss, "personal_test_accuracy": acc, "personal_epochs": p.epochs,
             "uses_personal": float(p.uses_personal), "personal_s": p.metrics["personal_s"],
             "personal_own": 0.0}
        )  # fmt: skip
        # the rest of the test set, which chose nothing: the chosen model generalises as well, within 2 %
        rest = np.setdiff1d(np.arange(len(ds.y_test)), held)
        _, rest_personal = model.evaluate(p.weights, ds.x_test[rest], ds.y_test[rest])
        _, rest_cluster = model.evaluate(cluster, ds.x_test[rest], ds.y_test[rest])
        assert rest_personal >= rest_cluster - 0.02, (seed, rest_personal, rest_cluster)


def test_zero_epochs_and_a_kept_cluster_model_return_the_cluster_arrays_themselves(
    digits: dict[str, Any],
) -> None:
    ds, model, cluster = digits["ds"], digits["model"], digits["trained"]
    train, held = (ds.x_train[:100], ds.y_train[:100]), (ds.x_test[:50], ds.y_test[:50])
    p = personalise(model, cluster, train, held, epochs=0, **FT)
    assert not p.uses_personal and p.epochs == 0
    assert all(a is b for a, b in zip(p.weights, cluster, strict=True))
    _, acc = model.evaluate(cluster, *held)
    assert p.metrics["personal_test_accuracy"] == acc and p.metrics["uses_personal"] == 0.0
    # a held-out set the cluster model already gets all right: a fine-tuned model can only tie on accuracy,
    # and then wins only with a held-out loss lower by the paired test
    right = np.flatnonzero(model.logits(cluster, ds.x_test).argmax(axis=1) == ds.y_test)[:60]
    held_right = (ds.x_test[right], ds.y_test[right])
    p = personalise(model, cluster, train, held_right, epochs=3, **FT)
    assert p.metrics["personal_test_accuracy"] == 1.0
    if p.uses_personal:
        assert p.metrics["personal_test_loss"] < model.evaluate(cluster, *held_right)[0]
    else:
        assert p.epochs == 0 and all(a is b for a, b in zip(p.weights, cluster, strict=True))


def _regression_model() -> tuple[OnnxModel, list[np.ndarray]]:
    """4 features -> Gemm 8 -> Relu -> Gemm 1, imported as a regression model (MSE loss, MAE metric)."""
    h = onnx.helper
    rng = np.random.default_rng(0)
    inits = {
        "fc1.weight": rng.normal(scale=0.5, size=(8, 4)),
        "fc1.bias": np.zeros(8),
        "fc2.weight": rng.normal(scale=0.5, size=(1, 8)),
        "fc2.bias": np.zeros(1),
    }
    graph = h.make_graph(
        [
            h.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["hidden"], transB=1),
            h.make_node("Relu", ["hidden"], ["relu"]),
            h.make_node("Gemm", ["relu", "fc2.weight", "fc2.bias"], ["output"], transB=1),
        ],
        "regressor",
        [h.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", 4])],
        [h.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", 1])],
        initializer=[onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    imported = models.import_onnx(
        h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]).SerializeToString(), task="regression"
    )
    return OnnxModel.from_bundle(imported.bundle), imported.weights


def test_regression_keeps_the_model_with_the_lower_mae() -> None:
    """A device whose targets sit 1.5 above the cluster's: fine-tuning lowers the MAE and wins (lower is
    better); on the cluster's own response it cannot win by much, and whatever it picks is no worse."""
    model, cluster = _regression_model()
    rng = np.random.default_rng(1)
    coef = rng.normal(size=(4, 1)).astype(np.float32)

    def data(n: int, offset: float) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(n, 4)).astype(np.float32)
        return x, (x @ coef + offset).astype(np.float32)

    cluster = OnnxTrainer(model, *data(400, 0.0), lr=0.02, epochs=30, seed=0).fit(cluster).weights
    held = data(60, 1.5)
    p = personalise(model, cluster, data(120, 1.5), held, epochs=5, **{**FT, "lr": 0.02})
    assert model.metric_name == "mae" and p.uses_personal
    assert p.metrics["personal_test_mae"] < model.evaluate(cluster, *held)[1] - 0.5
    same = data(60, 0.0)
    q = personalise(model, cluster, data(120, 0.0), same, epochs=5, **{**FT, "lr": 0.02})
    assert q.metrics["personal_test_mae"] <= model.evaluate(cluster, *same)[1]


def test_choose_directions_and_ties() -> None:
    assert choose([0.9, 0.95, 0.97, 0.96], "accuracy") == 2
    assert choose([0.9, 0.95, 0.97, 0.96], "mae") == 0
    assert choose([0.5, 0.3, 0.2, 0.2], "mae") == 2  # tie: fewer epochs
    assert choose([0.8, 0.8, 0.8], "label_accuracy") == 0  # tie: the cluster model
    assert choose([0.8, float("nan"), 0.9], "accuracy") == 2
    assert choose([float("nan"), 0.1], "accuracy") == 1


scores = st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]) | st.floats(0, 5), min_size=1, max_size=8)


@given(scores, st.sampled_from(["accuracy", "label_accuracy", "mae"]))
def test_the_chosen_candidate_is_never_worse_than_the_cluster_model_and_ties_go_to_it(
    values: list[float], metric: str
) -> None:
    k = choose(values, metric)
    sign = 1.0 if metric == "mae" else -1.0  # sign * score: lower is better
    assert sign * values[k] <= sign * values[0]
    assert sign * values[k] == min(sign * v for v in values)  # the best score
    assert k == min(i for i, v in enumerate(values) if v == values[k])  # the first to reach it
    if values[k] == values[0]:
        assert k == 0


def test_a_client_without_held_out_data_says_so_once_and_keeps_personalisation_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fedsdk.client import FedClient
    from fedsdk.errors import ConfigError

    data = (np.zeros((4, 64), np.float32), np.arange(4))
    with caplog.at_level("INFO", logger="fedsdk.client.core"):
        off = FedClient("mqtt://127.0.0.1:9", client_id="d0", data=data, insecure=True, personal_epochs=5)
    assert off._device.personal_epochs == 0 and off.personal is None
    assert [r.getMessage() for r in caplog.records].count(
        "d0: personalisation needs held-out data (eval_data) and local samples (data); it stays off"
    ) == 1
    on = FedClient("mqtt://127.0.0.1:9", client_id="d1", data=data, eval_data=data, insecure=True,
                   personal_epochs=5)  # fmt: skip
    assert on._device.personal_epochs == 5
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="personal_epochs"):
            FedClient("mqtt://127.0.0.1:9", client_id="d2", data=data, insecure=True, personal_epochs=bad)


def test_the_paired_test_gates_fine_tuned_candidates_and_breaks_metric_ties_by_loss() -> None:
    from fedsdk.personal import T_CRITICAL, paired_t

    base = np.array([0.5, 0.4, 0.6, 0.5, 0.7, 0.3])
    assert paired_t(base, base - 0.2) > 1e6  # every sample gains the same (up to rounding): certain
    assert paired_t(base, base) == 0.0
    noisy = base + np.array([0.3, -0.3, 0.2, -0.2, 0.1, -0.15])  # gains and losses: not significant
    assert paired_t(base, noisy) < T_CRITICAL
    # a better score without evidence loses; with it, wins; at an equal score the lower loss wins
    assert choose([0.9, 0.95], "accuracy", evidence=[0.0, 1.0]) == 0
    assert choose([0.9, 0.95], "accuracy", evidence=[0.0, 2.0]) == 1
    assert choose([0.9, 0.9, 0.9], "accuracy", evidence=[0.0, 3.0, 3.0], losses=[0.4, 0.3, 0.2]) == 2
    assert choose([0.9, 0.9], "accuracy", evidence=[0.0, 1.0], losses=[0.4, 0.1]) == 0
    assert choose([0.9, 0.9], "accuracy", losses=[0.4, 0.4]) == 0  # a full tie: the cluster model
    with pytest.raises(ConfigError):
        choose([0.9, 0.9], "accuracy", losses=[0.4])


def test_a_device_unlike_its_cluster_goes_on_with_its_own_model(digits: dict[str, Any]) -> None:
    """A device whose digits are turned 180° under a cluster model of upright digits: five fine-tune epochs
    from the cluster model each round stay where they are, while its own model, trained five epochs a round
    from the federation's initial model (``previous``: the last round's ``own``), is chosen and ends near
    training alone for as many epochs."""
    ds, model, cluster, w0 = digits["ds"], digits["model"], digits["trained"], digits["initial"]
    rng = np.random.default_rng(0)
    idx = rng.choice(len(ds.y_train), 150, replace=False)
    turned = np.rot90(ds.x_train[idx].reshape(-1, 8, 8), 2, axes=(1, 2)).reshape(-1, 64)
    train, held = (turned[:120], ds.y_train[idx][:120]), (turned[120:], ds.y_train[idx][120:])
    test_x = np.rot90(ds.x_test.reshape(-1, 8, 8), 2, axes=(1, 2)).reshape(-1, 64)
    p = None
    for r in range(1, 9):
        own = p.own if p is not None else None
        p = personalise(model, cluster, train, held, epochs=5, round_id=r, previous=own, initial=w0, **FT)
        assert p.own is not None
    assert p is not None and p.uses_personal and p.metrics["personal_own"] == 1.0 and p.weights is p.own
    fresh = personalise(model, cluster, train, held, epochs=5, round_id=8, **FT)  # a fine-tune only
    _, acc_fresh = model.evaluate(fresh.weights, test_x, ds.y_test)
    _, acc_own = model.evaluate(p.weights, test_x, ds.y_test)
    alone = OnnxTrainer(model, *train, lr=0.05, epochs=40, seed=0).fit(w0).weights
    _, acc_alone = model.evaluate(alone, test_x, ds.y_test)
    assert acc_own > acc_fresh + 0.05 and acc_own >= acc_alone - 0.03, (acc_own, acc_fresh, acc_alone)
    # without the initial model (a device that never saw it) the own model starts from the fine-tuned one
    first = personalise(model, cluster, train, held, epochs=5, round_id=1, **FT)
    assert first.own is not None and all(
        np.array_equal(a, b) for a, b in zip(first.own, fresh.own or [], strict=False)
    )


def test_an_own_model_the_cluster_model_beats_is_kept_but_not_used(digits: dict[str, Any]) -> None:
    ds, model, cluster = digits["ds"], digits["model"], digits["trained"]
    rng = np.random.default_rng(1)
    train = rng.choice(len(ds.y_train), 120, replace=False)
    held = rng.choice(len(ds.y_test), 72, replace=False)
    p = personalise(
        model, cluster, (ds.x_train[train], ds.y_train[train]), (ds.x_test[held], ds.y_test[held]),
        epochs=0, previous=digits["weak"], **FT,
    )  # fmt: skip
    assert not p.uses_personal and p.weights[0] is cluster[0] and p.metrics["personal_own"] == 0.0
    assert p.own is not None and np.array_equal(p.own[0], digits["weak"][0])  # trained on next round


@settings(deadline=None)
@given(st.integers(6, 2000), st.integers(1, 12))
def test_the_critical_value_is_students_t_divided_among_the_candidates(n: int, k: int) -> None:
    from scipy.stats import t

    from fedsdk.personal import T_CRITICAL, t_critical

    exact = max(T_CRITICAL, float(t.ppf(1 - 0.05 / k, n - 1)))
    assert t_critical(n, k) == pytest.approx(exact, rel=0.01)
    assert t_critical(n, k + 1) > t_critical(n, k) and t_critical(n + 1, k) <= t_critical(n, k)


def test_no_candidate_wins_over_fewer_than_four_held_out_samples() -> None:
    from fedsdk.personal import t_critical

    assert t_critical(3, 1) == float("inf")
    assert choose([0.5, 1.0], "accuracy", [0.0, 50.0], critical=t_critical(3)) == 0
