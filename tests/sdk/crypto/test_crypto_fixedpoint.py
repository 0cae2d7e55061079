"""Fixed-point encoding and the slot layout (fedsdk.crypto.fixedpoint)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedsdk.crypto.fixedpoint import FixedPoint, clip_values, pack_slots, unpack_slots
from fedsdk.errors import EncodingError


def test_default_bounds_need_26_bit_slots_and_old_keys_keep_39() -> None:
    f = FixedPoint()
    assert (f.clip, f.frac_bits, f.max_weight, f.max_devices, f.max_total_weight) == (
        0.5,
        13,
        65_535,
        1024,
        8191,
    )
    assert f.offset == 4096 and f.max_code == 8192
    assert f.max_slot_sum == 8191 * 8192
    assert f.required_slot_bits == 26
    assert f.quantisation_bound == 2.0**-14
    old = FixedPoint.from_params({"clip": 0.5, "frac_bits": 13, "max_weight": 65_535, "max_devices": 1024})
    assert old.max_total_weight is None and old.max_total == 1024 * 65_535
    assert old.max_slot_sum == 1024 * 65_535 * 8192 and old.required_slot_bits == 39


@given(counts=st.lists(st.integers(1, 10**9), min_size=1, max_size=1024), total=st.integers(1025, 2**20))
def test_a_rounds_weights_in_its_unit_fit_the_bounds(counts: list[int], total: int) -> None:
    f = FixedPoint(max_total_weight=total)
    unit = f.weight_unit(counts)
    weights = [f.quantise_weight(n, unit) for n in counts]
    assert sum(weights) <= total and 1 <= min(weights) and max(weights) <= f.max_weight
    assert f.check_group(weights) == sum(weights)
    if unit > 1:  # the unit is the smallest that fits: one less would not guarantee it
        assert sum(counts) > (unit - 1) * (total - len(counts)) or max(counts) > (unit - 1) * f.max_weight
    else:
        assert weights == counts  # unit 1: the weights are the sample counts, FedAvg is exact


def test_weights_past_the_total_are_refused() -> None:
    f = FixedPoint(max_total_weight=2000)
    with pytest.raises(EncodingError, match="sum to 2001"):
        f.check_group([1000, 1001])
    with pytest.raises(EncodingError):
        f.check_weight(2001)
    with pytest.raises(Exception, match="above max_devices"):
        FixedPoint(max_devices=1024, max_total_weight=1024)
    assert FixedPoint.quantise_weight(3000, 8) == 375 and FixedPoint.quantise_weight(3, 8) == 1


@given(
    clip=st.floats(1e-3, 1e3),
    frac_bits=st.integers(0, 30),
    max_weight=st.integers(1, 10**6),
    max_devices=st.integers(1, 4096),
)
def test_required_bits_hold_the_bound_and_no_fewer(
    clip: float, frac_bits: int, max_weight: int, max_devices: int
) -> None:
    try:
        f = FixedPoint(clip, frac_bits, max_weight, max_devices)
    except Exception:
        return  # clip·2**f rounds to 0: refused, tested below
    s = f.required_slot_bits
    assert f.max_slot_sum < 2**s
    assert f.max_slot_sum >= 2 ** (s - 1)


def test_clip_counts_and_refuses_non_finite() -> None:
    out, moved = clip_values(np.array([-2.0, -0.5, 0.0, 0.5, 0.7, 1e300]), 0.5)
    assert moved == 3
    assert out.tolist() == [-0.5, -0.5, 0.0, 0.5, 0.5, 0.5]
    with pytest.raises(EncodingError):
        clip_values(np.array([0.0, np.nan]), 1.0)


@given(hnp.arrays(np.float64, st.integers(1, 200), elements=st.floats(-2, 2, allow_nan=False)))
def test_quantisation_error_is_within_half_a_step(x: np.ndarray) -> None:
    f = FixedPoint(clip=1.0, frac_bits=10)
    q, moved = f.quantise(x)
    xc = np.clip(x, -1, 1)
    assert moved == int(np.count_nonzero(np.abs(x) > 1))
    assert np.all(np.abs(q / f.scale - xc) <= f.quantisation_bound)
    assert np.all(np.abs(q) <= f.offset)


@settings(max_examples=60)
@given(
    slot_bits=st.integers(1, 63),
    k=st.integers(1, 40),
    rows=st.integers(1, 5),
    data=st.data(),
)
def test_pack_then_unpack_is_identity(slot_bits: int, k: int, rows: int, data: st.DataObject) -> None:
    codes = data.draw(
        hnp.arrays(np.uint64, (rows, k), elements=st.integers(0, 2**slot_bits - 1)), label="codes"
    )
    packed = pack_slots(codes, slot_bits)
    assert all(len(p) == (k * slot_bits + 7) // 8 for p in packed)
    for row, p in zip(codes, packed, strict=True):  # the packed integer is Σ code_j · 2**(s·j)
        assert int.from_bytes(p, "little") == sum(int(c) << (slot_bits * j) for j, c in enumerate(row))
    assert np.array_equal(unpack_slots(b"".join(packed), rows, k, slot_bits), codes)


def test_unpack_refuses_bits_above_the_slot_area() -> None:
    codes = np.array([[1, 2, 3]], dtype=np.uint64)
    (p,) = pack_slots(codes, 5)  # 15 bits in 2 bytes: one spare bit
    bad = (int.from_bytes(p, "little") | (1 << 15)).to_bytes(2, "little")
    with pytest.raises(EncodingError):
        unpack_slots(bad, 1, 3, 5)
    with pytest.raises(EncodingError):
        unpack_slots(p + b"\x00", 1, 3, 5)


def test_sums_of_packed_codes_add_slot_by_slot_without_carry() -> None:
    f = FixedPoint(clip=0.5, frac_bits=6, max_weight=3, max_devices=5)
    s = f.required_slot_bits
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 3 * f.max_code + 1, (1, 7), dtype=np.uint64) for _ in range(5)]
    rows[0][:] = 3 * f.max_code  # the largest code every device may send
    ints = [int.from_bytes(pack_slots(r, s)[0], "little") for r in rows]
    total = sum(ints).to_bytes((7 * s + 7) // 8, "little")
    assert np.array_equal(unpack_slots(total, 1, 7, s), sum(rows))
