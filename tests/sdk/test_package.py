"""The package's top level: ``from fedsdk import FedClient`` works, and ``import fedsdk`` stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fedsdk


def test_the_client_and_its_companions_are_importable_from_the_top_level() -> None:
    from fedsdk.client import ClientSummary, FedClient, RoundRecord
    from fedsdk.transport import MqttTransport, TlsConfig

    assert fedsdk.FedClient is FedClient and fedsdk.ClientSummary is ClientSummary
    assert fedsdk.RoundRecord is RoundRecord
    assert fedsdk.MqttTransport is MqttTransport and fedsdk.TlsConfig is TlsConfig
    assert {"FedClient", "MqttTransport", "FedError"} <= set(dir(fedsdk)) & set(fedsdk.__all__)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        _ = fedsdk.NoSuchThing  # type: ignore[attr-defined]


def test_importing_the_package_does_not_load_numpy_or_onnxruntime() -> None:
    code = (
        "import sys, fedsdk; from fedsdk import FedError; "
        "print(sorted(m for m in ('numpy', 'onnxruntime', 'fedsdk.client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
