"""Fixtures of the coordinator tests."""

from __future__ import annotations

import pytest

from fedsdk.crypto import HEBackend, generate_backend, load_backend


@pytest.fixture(scope="module")
def public() -> dict[str, HEBackend]:
    """Public-only HE backends (what a coordinator holds), one per per-pack and per-value backend."""
    out = {}
    for name in ("packed", "paillier"):
        full = generate_backend(name, key_bits=1024)
        out[name] = load_backend(name, full.params, full.public_bytes())
    return out
