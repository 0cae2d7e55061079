"""benchmarks/secagg_session.py times one masking session stage by stage, with the real messages."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("secagg_session", ROOT / "benchmarks" / "secagg_session.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["secagg_session"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_stage_of_both_sides_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "session.json"
    assert _load().main(["--devices", "6", "--values", "64", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["devices"] == 6 and doc["neighbours"] == 5  # a complete graph below 40 devices
    assert set(doc["device_ms"]) == {
        "device: keys", "device: shares", "device: relay", "device: mask expansion", "device: unmask answer",
    }  # fmt: skip
    assert set(doc["coordinator_ms"]) == {
        "coordinator: keys", "coordinator: rosters", "coordinator: shares", "coordinator: relays",
        "coordinator: unmask",
    }  # fmt: skip
    assert doc["device_total_ms"] > 0 and doc["coordinator_total_ms"] > 0


def test_signed_keys_carry_their_certificate(tmp_path: Path) -> None:
    mod = _load()
    plain = mod.run(4, 16)
    signed = mod.run(4, 16, pki_dir=tmp_path / "pki")
    assert not plain["signed"] and signed["signed"]
    assert signed["message_bytes"]["MaskKeys"] > plain["message_bytes"]["MaskKeys"] + 300  # a DER certificate
    assert signed["message_bytes"]["MaskShares"] == plain["message_bytes"]["MaskShares"]
