"""The cluster's consensus mask (fedsdk_coordinator.consensus) and its form in a task's config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.errors import ConfigError
from fedsdk.pipeline import decode_pack_mask, encode_pack_mask
from fedsdk.protocol import Task, decode, encode
from fedsdk_coordinator.consensus import consensus_mask


def _masks(rows: list[str]) -> list[np.ndarray]:
    return [np.array([c == "1" for c in r]) for r in rows]


def test_the_most_voted_packs_as_many_as_the_largest_mask() -> None:
    # votes per pack: 3 2 1 1 0 1; mask sizes 1, 2, 4 -> 4 packs: 0, 1, then the lowest of the one-vote packs
    got = consensus_mask(_masks(["100000", "110000", "101101"]))
    assert got is not None and np.flatnonzero(got).tolist() == [0, 1, 2, 3]


def test_ties_go_to_the_lower_pack_and_unvoted_packs_never_count() -> None:
    # disjoint masks: one vote each; largest size 2 -> the two lowest voted packs
    got = consensus_mask(_masks(["1100000", "0011000", "0000010"]))
    assert got is not None and np.flatnonzero(got).tolist() == [0, 1]
    # votes 2 0 1 1 1: the two-vote pack, then the lowest one-vote packs; pack 1 never
    got = consensus_mask(_masks(["10110", "10001"]))
    assert got is not None and np.flatnonzero(got).tolist() == [0, 2, 3]


def test_nothing_to_agree_on() -> None:
    assert consensus_mask([]) is None
    assert consensus_mask(_masks(["000", "000"])) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=6144))
def test_pack_masks_round_trip_through_a_task(bits: list[bool]) -> None:
    mask = np.array(bits, dtype=bool)
    text = encode_pack_mask(mask)
    task = Task("fed", 2, 0, 60.0, (), (), config={"mask_consensus": text})  # fits the config's limits
    back = decode(encode(task))
    assert isinstance(back, Task)
    np.testing.assert_array_equal(decode_pack_mask(str(back.config["mask_consensus"]), mask.size), mask)


def test_masks_that_do_not_fit_are_refused_on_both_sides() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        encode_pack_mask(np.ones(6145, dtype=bool))
    text = encode_pack_mask(np.ones(10, dtype=bool))
    with pytest.raises(ConfigError, match="needs 1"):
        decode_pack_mask(text, 8)  # two bytes for a model of one byte's packs
    with pytest.raises(ConfigError, match="past the last pack"):
        decode_pack_mask(text, 9)
    with pytest.raises(ConfigError, match="not base64"):
        decode_pack_mask("@@@@", 8)


@pytest.mark.parametrize(
    "strategy, floor, ok",
    [
        ("fedsdk", "first-linear", True),
        ("maskcrypt", "first-linear, last-linear", True),
        ("fedsdk", "middle-linear", False),
        ("plaintext", "first-linear", False),  # nothing is encrypted, a floor would be a lie
        ("plain-he", "last-linear", False),  # everything is
    ],
)
def test_the_coordinator_checks_the_mask_floor(tmp_path: Path, strategy: str, floor: str, ok: bool) -> None:
    from engines import make_engine
    from fedsdk.crypto import generate_backend, load_backend

    backend = {"fedsdk": "packed", "maskcrypt": "paillier", "plain-he": "paillier"}.get(strategy)
    he = None
    if backend:
        full = generate_backend(backend, key_bits=1024)
        he = load_backend(backend, full.params, full.public_bytes())
    make = lambda: make_engine(tmp_path, he, strategy=strategy, mask_floor=floor)  # noqa: E731
    if ok:
        task = decode(make()._task(1, 0, "d0", phase="train", budget=0.1))
        assert isinstance(task, Task) and task.config["mask_floor"] == floor
    else:
        with pytest.raises(ConfigError, match="mask floor"):
            make()


def test_benchmark_arms_turn_the_consensus_off() -> None:
    from fedsdk_bench.fleet import parse_arm

    assert parse_arm("fedsdk").consensus is None  # the strategy's default: on
    arm = parse_arm("fedsdk+keyserver+noconsensus")
    assert (arm.strategy, arm.key_mode, arm.consensus) == ("fedsdk", "keyserver", False)
    with pytest.raises(ConfigError, match=r"\+noconsensus"):
        parse_arm("fedsdk+nope")
