"""Choosing a backend by name: key generation on devices, public-only loading on the coordinator.

A federation fixes ``(name, params)``; devices hold ``public_bytes`` and ``secret_bytes`` (key mode
``shared``) or only the public part (``keyserver``); the coordinator only ever loads the public part.
:func:`aggregate_contributions` is a plain top-level function over picklable arguments, so the coordinator
can run it in a process pool; each worker process keeps the public backends it built in a small cache.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from fedsdk.crypto.base import Aggregate, Contribution, HEBackend
from fedsdk.crypto.ckks import CKKSBackend
from fedsdk.crypto.packed import PackedPaillierBackend
from fedsdk.crypto.paillier import PaillierBackend
from fedsdk.errors import ConfigError

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "aggregate_contributions",
    "available_backends",
    "generate_backend",
    "load_backend",
]

BACKENDS: dict[str, type[HEBackend]] = {
    PaillierBackend.name: PaillierBackend,
    PackedPaillierBackend.name: PackedPaillierBackend,
    CKKSBackend.name: CKKSBackend,
}
DEFAULT_BACKEND = PackedPaillierBackend.name


def available_backends() -> list[str]:
    """Backends usable on this machine (``ckks`` needs the ``ckks`` extra)."""
    names = [PaillierBackend.name, PackedPaillierBackend.name]
    try:
        import tenseal  # noqa: F401

        names.append(CKKSBackend.name)
    except ImportError:  # pragma: no cover - depends on extras
        pass
    return names


def _cls(name: str) -> type[HEBackend]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown HE backend {name!r}; choose one of {sorted(BACKENDS)}") from None


def generate_backend(name: str = DEFAULT_BACKEND, **options: Any) -> HEBackend:
    """New key material and a backend holding the secret key (a device, or ``fedsdk provision``).

    ``options``: ``key_bits`` (Paillier, default 2048), ``fast`` (force gmpy2 on/off), ``pack_size``
    (``paillier``, ``ckks``), ``slot_bits`` (``packed``), CKKS ``poly_modulus_degree``,
    ``coeff_mod_bit_sizes``, ``scale_bits``, and the fixed-point bounds ``clip``, ``frac_bits``,
    ``max_weight``, ``max_devices``.
    """
    cls = _cls(name)
    return cls.generate(**options)  # type: ignore[attr-defined]  # every backend class defines it


def load_backend(
    name: str, params: Mapping[str, Any], public: bytes, secret: bytes | None = None, **options: Any
) -> HEBackend:
    """Rebuild a backend from its parameters and key bytes; without ``secret`` it cannot decrypt."""
    cls = _cls(name)
    return cls.from_bytes(dict(params), public, secret, **options)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=8)
def _public_backend(name: str, params_json: str, public: bytes) -> HEBackend:
    return load_backend(name, json.loads(params_json), public)


def aggregate_contributions(
    name: str,
    params: Mapping[str, Any],
    public: bytes,
    contributions: Sequence[Contribution],
    correction: Any = None,
) -> Aggregate:
    """Mixed ciphertext/plaintext FedAvg sum with a public-only backend (see :meth:`HEBackend.aggregate`;
    ``correction``: of masked contributions)."""
    backend = _public_backend(name, json.dumps(dict(params), sort_keys=True), bytes(public))
    return backend.aggregate(contributions, correction)
