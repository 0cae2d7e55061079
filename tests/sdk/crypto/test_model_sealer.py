"""The sealed model relay's crypto and wire format (fedsdk.crypto.shares.ModelSealer, fedsdk.client.saved,
fedsdk.protocol.relay).

Properties: a model sealed by one device of a federation opens, bit for bit, for the device it was sealed for
and for nobody else: another recipient, sender, round, cluster, federation or key refuses it, and so does a
key derived for decryption shares from the same secret; a public-only backend cannot seal.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsdk.client.saved import SavedModel, model_bytes, model_from_bytes
from fedsdk.crypto import HEBackend, PackedPaillierBackend, PaillierKeys, load_backend
from fedsdk.crypto.shares import ModelSealer, ShareSealer
from fedsdk.errors import CiphertextError, CryptoError, ValidationError
from fedsdk.protocol import ModelRequest, SealedModel, decode, encode

WHERE = {"federation": "fed", "sender": "dev-0", "recipient": "dev-1", "round_id": 7, "cluster_id": 2}
ids = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True)


@pytest.fixture(scope="module")
def backends() -> Iterator[tuple[HEBackend, HEBackend, HEBackend]]:
    """A device's backend, the public-only one of the same key, and a device of another federation."""
    dev = PackedPaillierBackend(PaillierKeys.generate(1024), parallel=False)
    other = PackedPaillierBackend(PaillierKeys.generate(1024), parallel=False)
    yield dev, load_backend("packed", dev.params, dev.public_bytes()), other
    dev.close()
    other.close()


def model(round_id: int = 7, cluster_id: int = 2) -> SavedModel:
    rng = np.random.default_rng(round_id)
    weights = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]
    return SavedModel("fed", "dev-0", cluster_id, round_id, "mlp-abc", ("w", "b"), weights)


def test_a_sealed_model_opens_bit_for_bit_for_its_recipient(backends: tuple[HEBackend, ...]) -> None:
    dev = backends[0]
    saved = model()
    sealed = ModelSealer(dev).seal(model_bytes(saved), **WHERE)
    assert model_bytes(saved) not in sealed  # sealed, not just wrapped
    back = model_from_bytes(ModelSealer(dev).open(sealed, **WHERE))  # another device, same key
    assert (back.federation, back.client_id, back.model_round, back.cluster_id) == ("fed", "dev-0", 7, 2)
    assert back.param_names == saved.param_names and back.model_id == saved.model_id
    for a, b in zip(back.weights, saved.weights, strict=True):
        assert a.dtype == np.float32 and a.tobytes() == b.tobytes()


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(sorted(WHERE)), value=ids, number=st.integers(0, 2**31 - 1))
def test_any_other_recipient_sender_round_cluster_or_federation_is_refused(
    backends: tuple[HEBackend, ...], field: str, value: str, number: int
) -> None:
    sealer = ModelSealer(backends[0])
    sealed = sealer.seal(b"model bytes", **WHERE)
    changed = dict(WHERE, **{field: number if field.endswith("_id") else value})
    if changed == WHERE:
        return
    with pytest.raises(CiphertextError):
        sealer.open(sealed, **changed)


def test_another_key_a_share_key_or_a_public_key_cannot_open_or_seal(backends: tuple[HEBackend, ...]) -> None:
    dev, public, other = backends
    sealed = ModelSealer(dev).seal(b"model bytes", **WHERE)
    with pytest.raises(CiphertextError):
        ModelSealer(other).open(sealed, **WHERE)
    with pytest.raises(CiphertextError):  # the decryption shares' key is another one (HKDF info)
        ShareSealer(dev).open(sealed, federation="fed", round_id=7, cluster_id=2, client_id="dev-0", packs=[])
    with pytest.raises(CiphertextError):
        ModelSealer(dev).open(sealed[:20], **WHERE)
    with pytest.raises(CryptoError):
        ModelSealer(public)


def test_the_relay_messages_cross_the_wire_and_refuse_bad_ids() -> None:
    req = ModelRequest(round_id=3, cluster_id=1, for_client="pi-02")
    back = decode(encode(req))
    assert isinstance(back, ModelRequest) and (back.round_id, back.cluster_id, back.for_client) == (
        3,
        1,
        "pi-02",
    )
    msg = SealedModel("pi-01", "pi-02", 3, 1, b"\x00" * 40)
    got = decode(encode(msg))
    assert isinstance(got, SealedModel) and got.sealed == msg.sealed and got.for_client == "pi-02"
    for bad in ("", "a/b", "+", "x" * 65):
        with pytest.raises(ValidationError):
            ModelRequest(round_id=3, cluster_id=1, for_client=bad)
        with pytest.raises(ValidationError):
            SealedModel("pi-01", bad, 3, 1, b"")
    with pytest.raises(ValidationError):
        ModelRequest(round_id=-1, cluster_id=1, for_client="pi-02")


def test_model_bytes_refuse_what_is_not_a_finite_model() -> None:
    saved = model()
    bad = SavedModel(
        "fed", "dev-0", 2, 7, "m", ("w", "b"), [np.full((4, 3), np.nan, np.float32), saved.weights[1]]
    )
    with pytest.raises(ValueError):
        model_from_bytes(model_bytes(bad))
    with pytest.raises((ValueError, OSError, zipfile.BadZipFile)):
        model_from_bytes(b"not a model file")
    # a member that unpacks to far more than the bytes it came in (a zip bomb from a device with the key)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w0.npy", b"\0" * 10_000_000)
    with pytest.raises(ValueError, match="compressed"):
        model_from_bytes(buf.getvalue())
