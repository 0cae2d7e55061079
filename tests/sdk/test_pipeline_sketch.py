"""The device's first-round sketch (``fedsdk.pipeline.make_sketch``): it refuses to sketch too few samples
without DP noise, since the sketch inversion recovers them (tests/sdk/audit/test_audit_sketch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fedsdk.errors import TrainingError
from fedsdk.model import OnnxModel
from fedsdk.model.data import load_digits
from fedsdk.pipeline import make_sketch, sketch_min_samples
from fedsdk_coordinator.models import build_graphs, init_params, mlp


@pytest.fixture(scope="module")
def setup() -> tuple[OnnxModel, list[np.ndarray], np.ndarray, np.ndarray]:
    spec = mlp()
    digits = load_digits("flat")
    return OnnxModel.from_bundle(build_graphs(spec)), init_params(spec, 0), digits.x_train, digits.y_train


def test_the_minimum_follows_the_sketch_size_and_the_input_size() -> None:
    assert sketch_min_samples({"sketch_dim": 128}, 64) == 8
    assert sketch_min_samples({"sketch_dim": 32}, 64) == 2
    assert sketch_min_samples({"sketch_dim": 256}, 64) == 16
    assert sketch_min_samples({"sketch_dim": 128}, 784) == 2  # never below 2
    assert (
        sketch_min_samples({"sketch_dim": 128, "sketch_min_samples": 12}, 64) == 12
    )  # the task may raise it
    assert sketch_min_samples({"sketch_dim": 128}, 64, floor=1) == 1  # the device's own floor


def test_the_coordinator_cannot_lower_the_minimum(
    setup: tuple[OnnxModel, list[np.ndarray], np.ndarray, np.ndarray],
) -> None:
    """The task config comes from the coordinator, the party the minimum protects against: asking for a
    minimum of 1, or for a DP ε so large that the noise vanishes, must not get it a one-sample sketch."""
    model, w, x, y = setup
    assert sketch_min_samples({"sketch_dim": 128, "sketch_min_samples": 1}, 64) == 8
    with pytest.raises(TrainingError, match="1 local samples, fewer than the 16"):
        make_sketch(model, w, x[:1], y[:1], {"sketch_dim": 256, "sketch_min_samples": 1})
    with pytest.raises(TrainingError, match=r"DP epsilon 1e\+06 is above 10: too little noise"):
        make_sketch(model, w, x[:1], y[:1], {"sketch_dim": 256, "dp_epsilon": 1e6})
    assert make_sketch(model, w, x[:1], y[:1], {"sketch_dim": 32, "dp_epsilon": 10.0}).shape == (32,)


def test_too_few_samples_without_noise_are_refused(
    setup: tuple[OnnxModel, list[np.ndarray], np.ndarray, np.ndarray],
) -> None:
    model, w, x, y = setup
    config = {"sketch_dim": 128, "sketch_seed": 5}
    with pytest.raises(
        TrainingError, match=r"sketch withheld: 7 local samples, fewer than the 8 a sketch of 128"
    ):
        make_sketch(model, w, x[:7], y[:7], config)
    sketch = make_sketch(model, w, x[:8], y[:8], config)
    assert sketch.shape == (128,) and 0.0 < np.linalg.norm(sketch) <= 1.0
    with pytest.raises(TrainingError, match="1 local samples, fewer than the 2"):
        make_sketch(model, w, x[:1], y[:1], {"sketch_dim": 32, "sketch_seed": 5})
    assert make_sketch(model, w, x[:2], y[:2], {"sketch_dim": 32, "sketch_seed": 5}).shape == (32,)


def test_with_dp_noise_any_number_of_samples_is_sketched(
    setup: tuple[OnnxModel, list[np.ndarray], np.ndarray, np.ndarray],
) -> None:
    model, w, x, y = setup
    config = {"sketch_dim": 32, "sketch_seed": 5, "dp_epsilon": 1.0}
    noisy = make_sketch(model, w, x[:1], y[:1], config, rng=np.random.default_rng(0))
    clean = make_sketch(model, w, x[:1], y[:1], {**config, "dp_epsilon": 0.0}, min_samples=1)
    # ε = 1 for one example: noise of standard deviation about 7 on a unit vector
    assert np.linalg.norm(noisy - clean) > 10 * np.linalg.norm(clean)
