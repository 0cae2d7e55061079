"""Key material, byte formats, picklable coordinator inputs, and agreement with python-paillier."""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import pickle
import secrets
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from phe.encoding import EncodedNumber

from fedsdk.crypto import (
    DEFAULT_BACKEND,
    CKKSBackend,
    FixedPoint,
    ObfuscatorFactory,
    PackedPaillierBackend,
    PaillierBackend,
    PaillierKeys,
    aggregate_contributions,
    generate_backend,
    load_backend,
)
from fedsdk.crypto._intmath import HAVE_GMPY2, IntOps
from fedsdk.crypto.obfuscator import raw_encrypt_with


@pytest.fixture(scope="module")
def keys() -> PaillierKeys:
    return PaillierKeys.generate(1024)


@pytest.fixture(scope="module")
def packed(keys: PaillierKeys) -> Iterator[PackedPaillierBackend]:
    b = PackedPaillierBackend(keys, FixedPoint(max_devices=16), parallel=False)
    yield b
    b.close()


def test_default_backend_is_packed_2048_with_fewer_bytes_per_value_than_float32() -> None:
    with generate_backend() as b:
        assert b.name == DEFAULT_BACKEND == "packed"
        assert isinstance(b, PackedPaillierBackend)
        assert b.keys.key_bits == 2048
        assert b.fixed.share and b.params["encoding"] == "share"
        assert (b.slot_bits, b.slots, b.ciphertext_nbytes) == (15, 136, 512)
        x = np.linspace(-1, 1, 20 * 136)  # 20 full packs
        _, report = b.encrypt_update(x, 7)
        assert report.ciphertext_bytes / x.size == 512 / 136 < 4.0
        assert report.clipped == np.count_nonzero(np.abs(x) > 0.5) > 0


@settings(max_examples=30, deadline=None)
@given(
    m_bytes=st.binary(min_size=1, max_size=127), crt=st.booleans(), fast=st.booleans(), short=st.booleans()
)
def test_obfuscated_encryption_decrypts_with_phe(
    keys: PaillierKeys, m_bytes: bytes, crt: bool, fast: bool, short: bool
) -> None:
    if fast and not HAVE_GMPY2:
        return
    p, q = keys.primes  # type: ignore[misc]
    factory = ObfuscatorFactory(int(keys.n), p if crt else None, q if crt else None, fast=fast, short=short)
    x, xn, tag = factory.make_one()
    assert (tag is not None) == (crt and short)
    assert 0 < x < keys.nsquare and xn == x % keys.n
    assert keys.private_key.raw_decrypt(int(x)) == 0  # an n-th residue: encrypts 0
    m = int.from_bytes(m_bytes, "big") % int(keys.n)
    ops = IntOps(fast)
    c = raw_encrypt_with(ops.big(m), (x, xn), ops.big(int(keys.n)), ops.big(int(keys.nsquare)))
    assert keys.private_key.raw_decrypt(int(c)) == m
    assert int(c) == (1 + int(keys.n) * m) * int(x) % int(keys.nsquare)  # textbook Paillier, g = n + 1


def test_crt_and_public_obfuscators_are_both_random(keys: PaillierKeys) -> None:
    p, q = keys.primes  # type: ignore[misc]
    for short in (True, False):
        for factory in (ObfuscatorFactory(int(keys.n), short=short), ObfuscatorFactory(int(keys.n), p, q)):
            xs = {int(o.x) for o in factory.make(20)}
            assert len(xs) == 20
    assert pickle.loads(pickle.dumps(ObfuscatorFactory(int(keys.n), p, q))).uses_crt


def test_packed_ciphertext_is_a_phe_ciphertext_of_the_slot_integer(packed: PackedPaillierBackend) -> None:
    enc = packed.encode(np.array([0.25, -0.5, 0.5, 0.0]), 3)
    c = packed.raw_encrypt_packs(enc.packs)[0]
    assert packed.keys.private_key.raw_decrypt(int(c)) == int(enc.packs[0])
    slots = [(int(enc.packs[0]) >> (packed.slot_bits * j)) & ((1 << packed.slot_bits) - 1) for j in range(4)]
    o = packed.fixed.offset
    assert slots == [3 * (o + o // 2), 0, 3 * 2 * o, 3 * o]


def test_paillier_encoding_equals_phe_encoding(keys: PaillierKeys) -> None:
    b = PaillierBackend(keys, FixedPoint(frac_bits=13))
    rng = np.random.default_rng(3)
    xs = np.concatenate([rng.uniform(-0.5, 0.5, 200), [0.5, -0.5, 0.0, 1 / 3, 2.0**-16, 2.0**-17 * 3]])
    enc = b.encode(xs, 1)
    reps = np.concatenate(enc.packs)
    for x, rep in zip(xs, reps, strict=True):
        phe_enc = EncodedNumber.encode(keys.public_key, float(x), precision=2.0**-13)
        assert phe_enc.exponent == b.exponent
        assert phe_enc.encoding == int(rep) % keys.public_key.n
    cts = b.raw_encrypt_packs(enc.packs[:5])  # phe's own encrypt path (no pool)
    assert [keys.private_key.decrypt(c[0]) for c in cts] == pytest.approx(
        xs[:5].tolist(), abs=b.quantisation_bound
    )


@pytest.mark.parametrize("name", ["packed", "paillier", "ckks"])
def test_key_bytes_round_trip_and_key_ids_agree(name: str, keys: PaillierKeys) -> None:
    if name == "ckks":
        device = CKKSBackend.generate(
            poly_modulus_degree=4096, coeff_mod_bit_sizes=(60, 49), max_devices=16, max_weight=100
        )
    else:
        cls = PackedPaillierBackend if name == "packed" else PaillierBackend
        device = cls(keys, FixedPoint(max_devices=16))
    params = json.loads(json.dumps(device.params))  # JSON-able
    public = load_backend(name, params, device.public_bytes())
    again = load_backend(name, params, device.public_bytes(), device.secret_bytes())
    assert device.key_id == public.key_id == again.key_id
    assert again.can_decrypt and not public.can_decrypt
    assert public.pack_size == device.pack_size
    x = np.linspace(-0.4, 0.4, 2 * device.pack_size + 1)
    c1, _ = device.encrypt_update(x, 2)
    c2, _ = again.encrypt_update(-x, 2, np.arange(c1.mask.size) % 2 == 0)
    agg = public.aggregate([c1, c2])
    np.testing.assert_allclose(again.decrypt_aggregate(agg), 0.0, atol=device.quantisation_bound)
    if name == "ckks":  # the coordinator's context has no secret key; ciphertexts carry no context
        assert not public.ctx.has_secret_key()  # type: ignore[attr-defined]
        assert len(c1.ciphertexts[0]) < len(device.public_bytes())
    device.close()


def test_contributions_and_aggregates_pickle_and_aggregate_in_a_process_pool(
    packed: PackedPaillierBackend,
) -> None:
    rng = np.random.default_rng(5)
    xs = [rng.uniform(-0.5, 0.5, 120) for _ in range(3)]
    n_packs = packed.num_packs(120)
    contribs = [packed.encrypt_update(x, i + 1, rng.random(n_packs) < 0.5)[0] for i, x in enumerate(xs)]
    contribs = pickle.loads(pickle.dumps(contribs))
    args = (packed.name, packed.params, packed.public_bytes(), contribs)
    ctx = multiprocessing.get_context("forkserver")
    with cf.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        agg = ex.submit(aggregate_contributions, *args).result(timeout=120)
    local = aggregate_contributions(*args)
    assert agg.ciphertexts.__len__() == local.ciphertexts.__len__()
    assert np.array_equal(agg.clear, local.clear) and np.array_equal(agg.mask, local.mask)
    agg = pickle.loads(pickle.dumps(agg))
    ref = sum((i + 1) * x for i, x in enumerate(xs)) / 6
    np.testing.assert_allclose(packed.decrypt_aggregate(agg), ref, atol=packed.quantisation_bound)


def test_primitive_interface_add_and_add_plain(packed: PackedPaillierBackend) -> None:
    a = packed.encode(np.array([0.1, -0.2]), 2)
    b = packed.encode(np.array([0.3, 0.4]), 5)
    ca = packed.encrypt(a.packs[0])
    cb = packed.ciphertext_from_bytes(
        packed.ciphertext_to_bytes(packed.encrypt(b.packs[0])), key_id=packed.key_id
    )
    s = packed.add(ca, cb)
    s2 = packed.add_plain(ca, b.packs[0])
    for total in (packed.decrypt(s), packed.decrypt(s2)):
        out = packed.decode([total], 7)[0, :2]
        np.testing.assert_allclose(out, [(0.2 + 1.5) / 7, (-0.4 + 2.0) / 7], atol=packed.quantisation_bound)


def test_secret_bytes_are_not_the_public_bytes(keys: PaillierKeys) -> None:
    assert keys.public_bytes() not in keys.secret_bytes()
    assert PaillierKeys.from_bytes(keys.public_bytes()).primes is None
    assert secrets.compare_digest(PaillierKeys.from_bytes(keys.public_bytes()).key_id, keys.key_id)


def test_everything_works_without_gmpy2_installed() -> None:
    """In a fresh interpreter where ``import gmpy2`` fails, as on a device without the ``fast`` extra."""
    code = """
import sys
sys.modules["gmpy2"] = None
import numpy as np
import phe.util
from fedsdk.crypto import HAVE_GMPY2, generate_backend, load_backend
assert not HAVE_GMPY2 and not phe.util.HAVE_GMP
b = generate_backend("packed", key_bits=1024, max_devices=8)
assert not b.ops.fast
pub = load_backend("packed", b.params, b.public_bytes())
x = np.linspace(-0.5, 0.5, 100)
masks = np.arange(b.num_packs(100)) % 2 == 0
cs = [b.encrypt_update(x * s, 2730, masks)[0] for s in (1.0, -1.0, 0.5)]
out = b.decrypt_aggregate(pub.aggregate(cs))
assert np.abs(out - x / 6).max() <= b.fixed.error_bound(3, 3 * 2730), np.abs(out - x / 6).max()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
