"""The load test's defaults: with clustering every device must hold enough digits to send its sketch."""

from __future__ import annotations

import pytest

from fedsdk.errors import ConfigError
from fedsdk.pipeline import sketch_min_samples
from fedsdk_bench.load import LoadConfig
from fedsdk_bench.load.cli import parser
from fedsdk_coordinator.engine.config import SKETCH_DIM


def test_default_samples_are_one_sgd_step_without_clustering() -> None:
    assert LoadConfig().samples == 7
    assert LoadConfig(samples=3).samples == 3


def test_clustering_defaults_to_the_fewest_samples_a_device_sketches() -> None:
    least = sketch_min_samples({"sketch_dim": SKETCH_DIM}, 64)
    assert least == 16
    assert LoadConfig(clustering=True).samples == least
    args = parser().parse_args(["--clustering"])
    assert args.samples is None  # resolved by LoadConfig, not by the parser


def test_clustering_with_too_few_samples_is_refused_up_front() -> None:
    with pytest.raises(ConfigError, match="--clustering needs at least 16 samples per device"):
        LoadConfig(clustering=True, samples=7)
