"""Every malformed input is refused with a precise error from fedsdk.errors, never computed on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.crypto import (
    CKKSBackend,
    FixedPoint,
    HEBackend,
    PackedPaillierBackend,
    PaillierBackend,
    PaillierKeys,
    load_backend,
)
from fedsdk.crypto.base import Contribution
from fedsdk.crypto.fixedpoint import pack_slots
from fedsdk.errors import CiphertextError, ConfigError, CryptoError, EncodingError, KeyMismatchError

FIXED = FixedPoint(max_weight=1000, max_devices=8)


@pytest.fixture(scope="module")
def keys() -> tuple[PaillierKeys, PaillierKeys]:
    return PaillierKeys.generate(1024), PaillierKeys.generate(1024)


@pytest.fixture(scope="module")
def paillier_pair(keys: tuple[PaillierKeys, PaillierKeys]) -> Iterator[tuple[HEBackend, HEBackend]]:
    a = PackedPaillierBackend(keys[0], FIXED, parallel=False)
    b = PackedPaillierBackend(keys[1], FIXED, parallel=False)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def ckks_pair() -> tuple[HEBackend, HEBackend]:
    opts = dict(
        poly_modulus_degree=4096, coeff_mod_bit_sizes=(60, 49), pack_size=8, max_weight=1000, max_devices=8
    )
    return CKKSBackend.generate(**opts), CKKSBackend.generate(**opts)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def per_value(keys: tuple[PaillierKeys, PaillierKeys]) -> Iterator[HEBackend]:
    b = PaillierBackend(keys[0], FIXED, pack_size=2)
    yield b
    b.close()


# ---------------------------------------------------------------- ciphertext range and length
@pytest.mark.parametrize("which", ["packed", "paillier"])
def test_ciphertext_at_or_above_n_squared_is_refused(
    which: str, paillier_pair: tuple[HEBackend, HEBackend], per_value: HEBackend
) -> None:
    backend = paillier_pair[0] if which == "packed" else per_value
    keys = backend.keys  # type: ignore[attr-defined]
    size = keys.ciphertext_nbytes
    nsq = int(keys.nsquare)
    for bad in (nsq, nsq + 1, 2 ** (8 * size) - 1, 0):
        one = bad.to_bytes(size, "big")
        with pytest.raises(CiphertextError, match="out of range"):
            backend.raw_ciphertext_from_bytes(one * (2 if which == "paillier" else 1))
    assert backend.raw_ciphertext_from_bytes(
        (nsq - 1).to_bytes(size, "big") * (2 if which == "paillier" else 1)
    )


@pytest.mark.parametrize("delta", [-1, 1, -100])
def test_ciphertext_of_wrong_length_is_refused(
    paillier_pair: tuple[HEBackend, HEBackend], delta: int
) -> None:
    backend = paillier_pair[0]
    c, _ = backend.encrypt_update(np.zeros(3), 1)
    data = c.ciphertexts[0]
    bad = data[:delta] if delta < 0 else data + b"\x00" * delta
    with pytest.raises(CiphertextError, match="bytes"):
        backend.ciphertext_from_bytes(bad)
    with pytest.raises(CiphertextError):
        backend.aggregate([Contribution(c.backend, c.key_id, c.n_values, c.weight, c.mask, (bad,), ())])


def test_plaintext_of_wrong_length_is_refused(paillier_pair: tuple[HEBackend, HEBackend]) -> None:
    backend = paillier_pair[0]
    c, _ = backend.encrypt_update(np.zeros(3), 1, np.array([False]))
    bad = Contribution(c.backend, c.key_id, c.n_values, c.weight, c.mask, (), (c.plaintexts[0][:-1],))
    with pytest.raises(CiphertextError):
        backend.aggregate([c, bad])


def test_ckks_garbage_and_truncated_ciphertexts_are_refused(ckks_pair: tuple[HEBackend, HEBackend]) -> None:
    a, _ = ckks_pair
    c, _ = a.encrypt_update(np.zeros(5), 1)
    for bad in (b"garbage" * 10, c.ciphertexts[0][:-10], b""):
        with pytest.raises(CiphertextError):
            a.ciphertext_from_bytes(bad)


def test_contribution_shape_mismatch_is_refused() -> None:
    with pytest.raises(CiphertextError):
        Contribution("packed", b"k" * 16, 10, 1, np.array([True, False]), (b"x", b"y"), ())


# ---------------------------------------------------------------- other key
def test_ciphertext_under_another_key_is_refused(paillier_pair: tuple[HEBackend, HEBackend]) -> None:
    a, b = paillier_pair
    ca, _ = a.encrypt_update(np.linspace(-0.5, 0.5, 10), 3)
    cb, _ = b.encrypt_update(np.linspace(-0.5, 0.5, 10), 3)
    with pytest.raises(KeyMismatchError):
        a.aggregate([ca, cb])
    with pytest.raises(KeyMismatchError):
        a.ciphertext_from_bytes(cb.ciphertexts[0], key_id=cb.key_id)
    x = a.ciphertext_from_bytes(ca.ciphertexts[0], key_id=ca.key_id)
    y = b.ciphertext_from_bytes(cb.ciphertexts[0], key_id=cb.key_id)
    with pytest.raises(KeyMismatchError):
        a.add(x, y)
    with pytest.raises(KeyMismatchError):
        a.decrypt(y)
    agg_b = b.aggregate([cb])
    with pytest.raises(KeyMismatchError):
        a.decrypt_aggregate(agg_b)
    # even stripped of its key id, a foreign ciphertext does not decode: the slot checks catch it
    forged = type(agg_b)(
        "packed", a.key_id, agg_b.n_values, agg_b.total_weight, 1, agg_b.mask, agg_b.ciphertexts
    )
    with pytest.raises(CiphertextError):
        a.decrypt_aggregate(forged)


def test_ckks_under_another_key_is_refused(ckks_pair: tuple[HEBackend, HEBackend]) -> None:
    a, b = ckks_pair
    ca, _ = a.encrypt_update(np.zeros(5), 1)
    cb, _ = b.encrypt_update(np.zeros(5), 1)
    with pytest.raises(KeyMismatchError):
        a.aggregate([ca, cb])
    agg_b = b.aggregate([cb])
    with pytest.raises(KeyMismatchError):
        a.decrypt_aggregate(agg_b)
    forged = type(agg_b)("ckks", a.key_id, 5, 1, 1, agg_b.mask, agg_b.ciphertexts, agg_b.clear)
    with pytest.raises(CiphertextError):
        a.decrypt_aggregate(forged)


def test_phe_numbers_under_another_key_are_refused(keys: tuple[PaillierKeys, PaillierKeys]) -> None:
    a = PaillierBackend(keys[0], FIXED)
    b = PaillierBackend(keys[1], FIXED)
    x = a.raw_encrypt_packs([np.array([1])])[0]
    y = b.raw_encrypt_packs([np.array([1])])[0]
    with pytest.raises(KeyMismatchError):
        a.raw_add(x, y)


def test_secret_key_of_another_modulus_is_refused(keys: tuple[PaillierKeys, PaillierKeys]) -> None:
    with pytest.raises(KeyMismatchError):
        PaillierKeys.from_bytes(keys[0].public_bytes(), keys[1].secret_bytes())


# ---------------------------------------------------------------- overflow
def test_slot_configuration_that_could_overflow_is_refused(keys: tuple[PaillierKeys, PaillierKeys]) -> None:
    need = FIXED.required_slot_bits
    assert FIXED.max_slot_sum < 2**need <= 2 * FIXED.max_slot_sum
    with pytest.raises(EncodingError, match="overflow"):
        PackedPaillierBackend(keys[0], FIXED, slot_bits=need - 1, parallel=False)
    wider = PackedPaillierBackend(keys[0], FIXED, slot_bits=need + 3, parallel=False)
    assert wider.slot_bits == need + 3
    with pytest.raises(EncodingError):  # more than 63 bits per slot
        PackedPaillierBackend(keys[0], FixedPoint(frac_bits=40, max_total_weight=2**30), parallel=False)
    with pytest.raises(EncodingError):  # per-value phe: int64 plaintext sums could overflow
        PaillierBackend(keys[0], FixedPoint(frac_bits=48, max_total_weight=2**30))
    with pytest.raises(EncodingError):  # CKKS: the weighted sum does not fit above the scale
        CKKSBackend.generate(
            poly_modulus_degree=4096, coeff_mod_bit_sizes=(60, 49), clip=1.0, max_total_weight=2**30
        )


def test_weights_and_group_size_beyond_the_bounds_are_refused(
    paillier_pair: tuple[HEBackend, HEBackend],
) -> None:
    a, _ = paillier_pair
    for w in (0, -1, FIXED.max_weight + 1, 2.5, True):
        with pytest.raises(EncodingError):
            a.encrypt_update(np.zeros(3), w)  # type: ignore[arg-type]
    c, _ = a.encrypt_update(np.zeros(3), 1)
    with pytest.raises(EncodingError, match="max_devices"):
        a.aggregate([c] * (FIXED.max_devices + 1))
    heavy = Contribution(c.backend, c.key_id, c.n_values, FIXED.max_weight + 1, c.mask, c.ciphertexts, ())
    with pytest.raises(EncodingError, match="max_weight"):
        a.aggregate([heavy])


def test_plaintext_slot_above_its_weight_is_refused(paillier_pair: tuple[HEBackend, HEBackend]) -> None:
    a, _ = paillier_pair
    c, _ = a.encrypt_update(np.full(3, 0.5), 10, np.array([False]))
    lie = Contribution(c.backend, c.key_id, c.n_values, 1, c.mask, (), c.plaintexts)  # claims weight 1
    with pytest.raises(EncodingError, match="overflow"):
        a.aggregate([lie])
    top = bytearray(c.plaintexts[0])
    top[-1] |= 0x80  # a bit above the slot area
    with pytest.raises(EncodingError):
        a.aggregate([Contribution(c.backend, c.key_id, c.n_values, 10, c.mask, (), (bytes(top),))])


# ---------------------------------------------------------------- input values and key custody
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["packed", "paillier", "ckks"])
def test_nan_and_inf_are_refused(
    bad: float, which: str, paillier_pair: tuple[HEBackend, HEBackend], per_value: HEBackend, ckks_pair: tuple
) -> None:
    backend = {"packed": paillier_pair[0], "paillier": per_value, "ckks": ckks_pair[0]}[which]
    with pytest.raises(EncodingError, match="non-finite"):
        backend.encrypt_update(np.array([0.1, bad, 0.2]), 1)


def test_public_only_backends_cannot_decrypt(
    paillier_pair: tuple[HEBackend, HEBackend], ckks_pair: tuple
) -> None:
    for device in (paillier_pair[0], ckks_pair[0]):
        public = load_backend(device.name, device.params, device.public_bytes())
        c, _ = device.encrypt_update(np.zeros(4), 1)
        agg = public.aggregate([c])
        with pytest.raises(CryptoError, match="cannot decrypt"):
            public.decrypt_aggregate(agg)
        with pytest.raises(CryptoError, match="cannot decrypt"):
            public.decrypt(public.ciphertext_from_bytes(c.ciphertexts[0]))
        with pytest.raises(CryptoError):
            public.secret_bytes()
        assert device.decrypt_aggregate(agg).shape == (4,)


def test_bad_key_material_and_parameters_are_refused(keys: tuple[PaillierKeys, PaillierKeys]) -> None:
    with pytest.raises(CryptoError):
        PaillierKeys.from_bytes(b"nonsense")
    with pytest.raises(CryptoError):
        PaillierKeys.from_bytes(keys[0].public_bytes()[:-3])
    with pytest.raises(ConfigError):
        PaillierKeys.generate(512)
    with pytest.raises(ConfigError):
        load_backend("rot13", {}, b"")
    with pytest.raises(ConfigError):
        FixedPoint(clip=float("nan"))
    with pytest.raises(ConfigError):
        FixedPoint(clip=1e-9, frac_bits=4)
    with pytest.raises(EncodingError):
        load_backend(
            "packed", {**PackedPaillierBackend(keys[0], FIXED).params, "slots": 3}, keys[0].public_bytes()
        )


# ---------------------------------------------------------------- decoding decrypted packs
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_decode_takes_exact_slot_sums_and_refuses_any_pack_outside_the_slot_area(
    paillier_pair: tuple[HEBackend, HEBackend], data: st.DataObject
) -> None:
    """``decode`` of the raw decryptions (ints or gmpy2 integers) gives the average the slot sums stand
    for, and refuses a list holding one pack with a bit above the slot area, or a negative one. 1024-bit
    keys keep the test short; the slot layout follows the key size, the rule does not."""
    he = paillier_pair[0]
    assert isinstance(he, PackedPaillierBackend)
    weight = data.draw(st.integers(1, FIXED.max_weight), label="weight")
    n_packs = data.draw(st.integers(1, 4), label="packs")
    top = weight * FIXED.max_code
    codes = np.array(
        data.draw(st.lists(st.integers(0, top), min_size=n_packs * he.slots, max_size=n_packs * he.slots)),
        dtype=np.uint64,
    ).reshape(n_packs, he.slots)
    packs: list[Any] = [int.from_bytes(p, "little") for p in pack_slots(codes, he.slot_bits)]
    if data.draw(st.booleans(), label="gmpy2"):
        packs = [he.ops.big(p) for p in packs]
    want = (codes.astype(np.int64) - FIXED.offset * weight) / (float(FIXED.scale) * weight)
    np.testing.assert_array_equal(he.decode(packs, weight), want)
    bad = data.draw(st.integers(0, n_packs - 1), label="bad pack")
    over = list(packs)
    over[bad] = over[bad] + (1 << (he.slots * he.slot_bits + data.draw(st.integers(0, 40), label="bit")))
    with pytest.raises(CiphertextError, match="slot area"):
        he.decode(over, weight)
    over[bad] = -1 - data.draw(st.integers(0, 2**64), label="below zero")
    with pytest.raises(CiphertextError, match="slot area"):
        he.decode(over, weight)
