"""The device's self-audit (:mod:`fedsdk.selfaudit`): the attack on what would be sent, and the verdict.

* a hand case: a first-layer row that is ``c·x`` of a local sample (bias ``c``) is an exact copy and the
  update is withheld; with that row and its bias hidden, the attacker's best guess is the middle of the
  value range (6.02 dB) and the update passes;
* a real update of the ``mlp`` preset (local training on 240 digits): it passes as trained; with one
  first-layer row replaced by ``c·x`` of a local sample it is withheld, naming counts and dB only; with the
  packs holding that row encrypted it passes again;
* models whose first layer does not read the samples are skipped with the reason; thresholds are checked;
  ``FedClient`` refuses a bad threshold and a self-audit without local samples.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsdk.client import FedClient
from fedsdk.errors import ConfigError, FedError, UpdateWithheld
from fedsdk.model import OnnxModel, OnnxTrainer
from fedsdk.model.data import load_digits, partition_label_skew
from fedsdk.pipeline import flatten
from fedsdk.selfaudit import check_threshold, not_applicable, self_audit
from fedsdk_coordinator.models import build_graphs, init_params, mlp

HAND_SHAPES = [(3, 4), (3,), (2, 3), (2,)]


def hand_update(x0: np.ndarray) -> np.ndarray:
    w = np.zeros((3, 4))
    b = np.zeros(3)
    w[0], b[0] = 0.5 * x0, 0.5  # row 0 saw sample 0 alone: its weight row is δ·x0, its bias entry δ
    return np.concatenate([w.ravel(), b, np.full(6, 0.01), np.full(2, 0.01)])


def test_a_copied_sample_is_withheld_and_a_hidden_one_passes_by_hand() -> None:
    x = np.array([[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    update = hand_update(x[0])
    result = self_audit(update, np.ones(update.size, bool), HAND_SHAPES, x)
    assert result.scores[0] == math.inf  # row 0 / bias 0 is sample 0 exactly
    assert result.scores[1] == pytest.approx(0.0)  # sample 1 vs the only candidate, x0: MSE 1 over range 1
    assert result.leaked == 1 and not result.passed
    assert result.reason() == (
        "update withheld: the self-audit recovered 1 of 2 local samples at >= 25 dB (max an exact copy)"
    )
    visible = np.ones(update.size, bool)
    visible[0:4] = visible[12] = False  # row 0 and its bias encrypted
    hidden = self_audit(update, visible, HAND_SHAPES, x)
    # nothing left to read: the attacker's guess is the middle of the range, MSE 0.25 -> 10·log10(4) dB
    np.testing.assert_allclose(hidden.scores, [10 * math.log10(4)] * 2)
    assert hidden.passed and hidden.leaked == 0 and hidden.max_db == pytest.approx(6.0206, abs=1e-3)
    assert hidden.seconds >= 0 and not hidden.skipped


def test_the_threshold_decides() -> None:
    x = np.array([[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    update = hand_update(x[0])
    update[0:4] += 0.05 * np.array([1.0, -1.0, 1.0, -1.0])  # the copy is no longer exact
    scores = self_audit(update, np.ones(update.size, bool), HAND_SHAPES, x).scores
    s0 = float(scores[0])
    assert 10 < s0 < 60
    assert not self_audit(update, np.ones(update.size, bool), HAND_SHAPES, x, threshold_db=s0).passed
    assert self_audit(update, np.ones(update.size, bool), HAND_SHAPES, x, threshold_db=s0 + 0.1).passed


@pytest.fixture(scope="module")
def trained() -> tuple[np.ndarray, list[tuple[int, ...]], np.ndarray]:
    """A real ``mlp`` update: one epoch of local training on 240 digits of all classes, as a device does it.
    This shard's update, as trained, lets no sample be recovered (many shards' updates do: docs/audit.md)."""
    digits = load_digits(shape="flat")
    idx = partition_label_skew(digits.y_train, 6, n_groups=1, seed=0).indices[0]
    x, y = digits.x_train[idx], digits.y_train[idx]
    spec = mlp()
    model = OnnxModel.from_bundle(build_graphs(spec))
    base = [np.asarray(w, np.float32) for w in init_params(spec, seed=0)]
    fit = OnnxTrainer(model, x, y, lr=0.05, momentum=0.9, batch_size=32, epochs=1).fit(base, seed=1)
    update = flatten([np.asarray(a, np.float32) - b for a, b in zip(fit.weights, base, strict=True)])
    return update, [tuple(w.shape) for w in base], x


def test_a_real_update_with_a_planted_copy_is_withheld_and_passes_when_the_row_is_encrypted(
    trained: tuple[np.ndarray, list[tuple[int, ...]], np.ndarray],
) -> None:
    update, shapes, x = trained
    n_in = shapes[0][1]
    everything = np.ones(update.size, bool)
    clean = self_audit(update, everything, shapes, x)
    assert clean.passed and clean.samples == len(x) >= 200, clean.max_db
    k = int(np.argmax(x.max(axis=1) - x.min(axis=1)))  # a sample spanning the whole value range
    row = 7
    leaky = update.copy()
    leaky[row * n_in : (row + 1) * n_in] = -0.003 * x[k]  # the row is c·x_k, here with c < 0
    result = self_audit(leaky, everything, shapes, x)
    assert not result.passed and result.leaked >= 1 and result.scores[k] >= 25, result.max_db
    reason = result.reason()
    assert reason.startswith(f"update withheld: the self-audit recovered {result.leaked} of {len(x)} local")
    assert f"{x[k][10]:.3f}" not in reason  # counts and dB only
    pack = 52  # 2048-bit packed Paillier: 52 values a pack
    mask = np.zeros(-(-update.size // pack), bool)
    mask[row * n_in // pack : ((row + 1) * n_in - 1) // pack + 1] = True  # the packs holding the row
    hidden = np.repeat(mask, pack)[: update.size]
    passed = self_audit(leaky, ~hidden, shapes, x)
    assert passed.passed and passed.max_db < 25, passed.max_db


def test_models_whose_first_layer_does_not_read_the_samples_are_skipped() -> None:
    cnn = [(6, 1, 3, 3), (6,), (16, 6, 3, 3), (16,)]
    assert "not a fully connected layer" in not_applicable(cnn, 64)
    assert "reads 32 values, a local sample has 64" in not_applicable([(8, 32), (8,)], 64)
    assert "not followed by its bias" in not_applicable([(8, 64), (10, 8)], 64)
    assert not_applicable([(8, 64), (8,), (10, 8), (10,)], 64) == ""
    update = np.ones(sum(int(np.prod(s)) for s in cnn))
    result = self_audit(update, np.ones(update.size, bool), cnn, np.zeros((5, 1, 8, 8)))
    assert result.skipped and result.passed and result.samples == 0


@pytest.mark.parametrize("bad", [0.0, -3.0, math.nan, math.inf, "loud"])
def test_a_threshold_must_be_a_positive_number(bad: object) -> None:
    with pytest.raises(ConfigError, match="self-audit threshold"):
        check_threshold(bad)  # type: ignore[arg-type]
    data = np.zeros((4, 64), np.float32), np.zeros(4)
    with pytest.raises(ConfigError, match="self-audit threshold"):
        FedClient("mqtt://127.0.0.1:1", client_id="d", data=data, insecure=True, self_audit_db=bad)  # type: ignore[arg-type]


def test_the_client_needs_local_samples_for_a_self_audit() -> None:
    class NoData:
        num_samples = 4

        def fit(self, base: list[np.ndarray]) -> object:
            raise AssertionError("not called")

    with pytest.raises(ConfigError, match="needs the local samples"):
        FedClient("mqtt://127.0.0.1:1", client_id="d", trainer=NoData(), insecure=True, self_audit=True)  # type: ignore[arg-type]
    assert issubclass(UpdateWithheld, FedError) and UpdateWithheld.code == "self_audit"
