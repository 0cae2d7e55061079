"""Layer specs, ModelSpec validation and serialisation, presets, parameter initialisation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsdk.errors import ConfigError
from fedsdk_coordinator.models import (
    AvgPool2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
    init_params,
    lenet,
    mlp,
)


def test_presets_shapes_and_names() -> None:
    m = mlp()
    assert m.input_shape == (64,) and m.num_classes == 10
    assert m.param_names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert m.param_shapes == ((64, 64), (64,), (10, 64), (10,))
    assert mlp(20, (16, 8), 3).param_shapes == ((16, 20), (16,), (8, 16), (8,), (3, 8), (3,))
    net = lenet()
    assert net.input_shape == (1, 8, 8)
    assert net.shapes[6] == (16, 2, 2) and net.shapes[-1] == (10,)
    assert net.param_shapes[0] == (6, 1, 3, 3)
    assert net.num_params == sum(int(np.prod(s)) for s in net.param_shapes)
    assert lenet(3, 16, 5).shapes[7] == (16 * 4 * 4,)
    with pytest.raises(ConfigError, match="multiple of 4"):
        lenet(image_size=6)


def test_layer_arguments_are_normalised() -> None:
    conv = Conv2d(1, 2, 3, stride=(2, 1), padding=1)
    assert conv.kernel_size == (3, 3) and conv.stride == (2, 1) and conv.padding == (1, 1)
    pool = MaxPool2d(2)
    assert pool.stride == (2, 2) and pool.padding == (0, 0)
    assert AvgPool2d([3, 2], stride=1).kernel_size == (3, 2)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ModelSpec((Linear(4, 3),), (5,), 3), "Linear"),
        (lambda: ModelSpec((Linear(4, 3),), (4,), 2), "ends in shape"),
        (lambda: ModelSpec((Conv2d(2, 3, 3), Flatten(), Linear(3, 2)), (1, 3, 3), 2), "Conv2d"),
        (lambda: ModelSpec((Conv2d(1, 3, 5), Flatten(), Linear(3, 2)), (1, 3, 3), 2), "empty"),
        (lambda: ModelSpec((MaxPool2d(2), Flatten()), (4,), 4), "MaxPool2d"),
        (lambda: ModelSpec((), (4,), 4), "at least one layer"),
        (lambda: ModelSpec((Flatten(),), (1,), 1), "num_classes"),
        (lambda: ModelSpec(("relu",), (4,), 4), "layer specs"),  # type: ignore[arg-type]
        (lambda: Dropout(1.0), "Dropout"),
        (lambda: Conv2d(1, 2, 0), "kernel"),
        (lambda: Conv2d(1, 2, (1, 2, 3)), "pair"),
        (lambda: MaxPool2d(2, padding=2), "half the kernel"),
        (lambda: Linear(0, 3), "positive"),
    ],
)
def test_bad_specs_raise_config_error(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        make()


def test_spec_round_trips_through_json() -> None:
    spec = ModelSpec(
        (
            Conv2d(1, 4, (3, 2), stride=(1, 2), padding=(1, 0), bias=False),
            ReLU(),
            AvgPool2d(2, stride=1, count_include_pad=False),
            MaxPool2d(2),
            Dropout(0.25),
            Flatten(),
            Linear(4 * 3 * 1, 5),
        ),
        (1, 8, 9),
        5,
    )
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["layers"][0] == {
        "type": "Conv2d",
        "in_channels": 1,
        "out_channels": 4,
        "kernel_size": [3, 2],
        "stride": [1, 2],
        "padding": [1, 0],
        "bias": False,
    }
    back = ModelSpec.from_dict(data)
    assert back == spec
    assert back.shapes == spec.shapes
    assert ModelSpec.from_dict(lenet().to_dict()) == lenet()


@pytest.mark.parametrize(
    "data",
    [
        {"input_shape": [4], "num_classes": 2, "layers": [{"type": "Softmax"}]},
        {"input_shape": [4], "num_classes": 2, "layers": [{"type": "Linear", "in_features": 4}]},
        {"input_shape": [4], "num_classes": 2, "layers": [{"type": "Linear", "in": 4, "out": 2}]},
        {"num_classes": 2, "layers": []},
    ],
)
def test_bad_spec_dicts_raise_config_error(data: dict) -> None:
    with pytest.raises(ConfigError):
        ModelSpec.from_dict(data)


def test_init_params_he_and_glorot() -> None:
    spec = mlp(256, (512,), 10)
    params = init_params(spec, seed=3)
    assert [p.shape for p in params] == list(spec.param_shapes)
    assert all(p.dtype == np.float32 for p in params)
    w0, b0, w1, b1 = params
    assert float(np.std(w0)) == pytest.approx(np.sqrt(2 / 256), rel=0.02)  # He normal, fan_in 256
    limit = np.sqrt(6 / (512 + 10))  # Glorot uniform on the logits layer
    assert float(np.abs(w1).max()) <= limit and float(np.abs(w1).max()) > 0.95 * limit
    assert not b0.any() and not b1.any()
    again = init_params(spec, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(params, again))
    assert not np.array_equal(init_params(spec, seed=4)[0], w0)
    conv = init_params(lenet(), 0)[0]
    assert float(np.std(conv)) == pytest.approx(np.sqrt(2 / 9), rel=0.3)  # fan_in = 1*3*3, 54 values
