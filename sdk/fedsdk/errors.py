"""The one exception tree of fedsdk.

Everything fedsdk raises descends from :class:`FedError`. The branches follow who must react::

    FedError
    ├── ConfigError            the operator: a bad option, a missing file, an unsafe setting
    │   └── IdentityMismatch   a client certificate issued to another identity than the client id
    ├── StateError             the programmer: an object used in the wrong state (not opened, closed)
    ├── TransportError         the network: retry, reconnect
    │   ├── ConnectError       the broker could not be reached or refused us (TLS, auth)
    │   ├── TransportClosed    the link dropped while we waited on it
    │   └── TransportTimeout   a network wait ran past its timeout
    ├── ProtocolError          a peer: a message that must be rejected
    │   └── ValidationError    carries a short machine code (``code``) and a human reason
    ├── CryptoError            key material or ciphertexts that cannot be used
    │   ├── KeyMismatchError   a ciphertext or context under another key
    │   ├── CiphertextError    a ciphertext out of range or of the wrong length
    │   └── EncodingError      values that cannot be encoded safely (NaN/Inf, overflow risk)
    ├── TrainingError          the model or the data on the device
    ├── UpdateWithheld         the device's self-audit found its own update leaking: it is not sent
    └── MaskingRefused         secure aggregation could not be set up as the device requires: it is not sent

Foreign errors (paho, aiohttp, phe, tenseal, onnxruntime) are converted at the boundary with
``raise ... from exc``; where a round and a client are known they are carried on the exception.
"""

from __future__ import annotations

__all__ = [
    "CiphertextError",
    "ConfigError",
    "ConnectError",
    "CryptoError",
    "EncodingError",
    "FedError",
    "IdentityMismatch",
    "KeyMismatchError",
    "MaskingRefused",
    "ProtocolError",
    "StateError",
    "TrainingError",
    "TransportClosed",
    "TransportError",
    "TransportTimeout",
    "UpdateWithheld",
    "ValidationError",
]


class FedError(Exception):
    """Base of every error fedsdk raises. ``round_id`` and ``client_id`` are set when known."""

    def __init__(self, message: str, *, round_id: int | None = None, client_id: str | None = None) -> None:
        super().__init__(message)
        self.round_id = round_id
        self.client_id = client_id

    def __str__(self) -> str:
        base = super().__str__()
        ctx = []
        if self.client_id is not None:
            ctx.append(f"client={self.client_id}")
        if self.round_id is not None:
            ctx.append(f"round={self.round_id}")
        return f"{base} ({', '.join(ctx)})" if ctx else base


class ConfigError(FedError):
    """A configuration the operator must fix."""


class IdentityMismatch(ConfigError):
    """The client certificate is issued to another identity (its subject CN) than the client id the device
    connects with. The brokers take the identity from the certificate (mosquitto's
    ``use_identity_as_username``, the embedded broker's ``CertificateIdentity``), so such a device would be
    refused, or silently denied its own topics by the ACL. ``certificate`` is the file, ``cert_identity`` its
    CN, ``requested_id`` the client id asked for."""

    def __init__(self, message: str, *, certificate: str, cert_identity: str, requested_id: str) -> None:
        super().__init__(message)
        self.certificate = certificate
        self.cert_identity = cert_identity
        self.requested_id = requested_id


class StateError(FedError):
    """An object used in a state that does not allow the call."""


class TransportError(FedError):
    """The MQTT link failed."""


class ConnectError(TransportError):
    """The broker could not be reached or refused the connection."""


class TransportClosed(TransportError):
    """The link dropped (or was closed) while a caller waited on it."""


class TransportTimeout(TransportError):
    """A network wait ran past its timeout."""


class ProtocolError(FedError):
    """A message from a peer that must be rejected."""


class ValidationError(ProtocolError):
    """A received message failed validation. ``code`` is a short stable label used in counters."""

    def __init__(
        self, code: str, reason: str, *, round_id: int | None = None, client_id: str | None = None
    ) -> None:
        super().__init__(f"{code}: {reason}", round_id=round_id, client_id=client_id)
        self.code = code
        self.reason = reason


class CryptoError(FedError):
    """Key material, ciphertexts or encodings that cannot be used."""


class KeyMismatchError(CryptoError):
    """A ciphertext or context made under another key."""


class CiphertextError(CryptoError):
    """A ciphertext out of range, or bytes of the wrong length."""


class EncodingError(CryptoError):
    """Values that cannot be encoded safely: NaN/Inf, or a configuration that could overflow."""


class TrainingError(FedError):
    """The model, the training graph or the local data is unusable."""


class UpdateWithheld(FedError):
    """The device's self-audit (:mod:`fedsdk.selfaudit`) recovered local samples from the update it was
    about to send, so the update is withheld. ``code`` is the code of the ``Error`` reply sent instead."""

    code = "self_audit"


class MaskingRefused(FedError):
    """The device does not send its update because the round's secure aggregation is not what it requires
    (too few devices in the sum, a neighbour without a certificate of the fleet CA, no relay of its
    partners' shares in time; :mod:`fedsdk.secagg.session`). ``code`` is the code of the ``Error`` reply
    sent instead (``min_aggregate``, ``bad_certificate``, ``secagg_timeout``, ...)."""

    def __init__(self, code: str, reason: str, *, round_id: int | None = None) -> None:
        super().__init__(reason, round_id=round_id)
        self.code = code
