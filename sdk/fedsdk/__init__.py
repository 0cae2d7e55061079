"""fedsdk: federated learning for edge devices with selective homomorphic encryption.

``from fedsdk import FedClient`` is the entry point for an app that embeds a device (see the README). The
client and its companions are imported on first use (PEP 562), so ``import fedsdk`` stays cheap: the error
classes need neither numpy nor onnxruntime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedsdk.errors import (
    CiphertextError,
    ConfigError,
    ConnectError,
    CryptoError,
    EncodingError,
    FedError,
    KeyMismatchError,
    ProtocolError,
    StateError,
    TrainingError,
    TransportClosed,
    TransportError,
    TransportTimeout,
    UpdateWithheld,
    ValidationError,
)

__version__ = "0.1.0"

# name -> module it lives in, imported on first access
_LAZY = {
    "FedClient": "fedsdk.client",
    "ClientSummary": "fedsdk.client",
    "RoundRecord": "fedsdk.client",
    "PersonalModel": "fedsdk.personal",
    "MqttTransport": "fedsdk.transport",
    "TlsConfig": "fedsdk.transport",
}

if TYPE_CHECKING:
    from fedsdk.client import ClientSummary, FedClient, RoundRecord
    from fedsdk.personal import PersonalModel
    from fedsdk.transport import MqttTransport, TlsConfig


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedsdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CiphertextError",
    "ClientSummary",
    "ConfigError",
    "ConnectError",
    "CryptoError",
    "EncodingError",
    "FedClient",
    "FedError",
    "KeyMismatchError",
    "MqttTransport",
    "PersonalModel",
    "ProtocolError",
    "RoundRecord",
    "StateError",
    "TlsConfig",
    "TrainingError",
    "TransportClosed",
    "TransportError",
    "TransportTimeout",
    "UpdateWithheld",
    "ValidationError",
    "__version__",
]
