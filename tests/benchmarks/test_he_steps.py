"""benchmarks/he_steps.py runs the product's own device steps and reports each one's CPU, warm and cold."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("he_steps", ROOT / "benchmarks" / "he_steps.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["he_steps"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_he_steps_reports_every_step(tmp_path: Path, capsys) -> None:
    out = tmp_path / "steps.json"
    # 1024-bit keys and three devices only to keep the test short; the figures that count use the defaults
    rc = _load().main(["--key-bits", "1024", "--devices", "3", "--repeats", "3", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "mlp" and doc["n_values"] == 4810 and doc["devices"] == 3
    names = [r["step"] for r in doc["rows"]]
    assert names[0].startswith(f"encrypt ({doc['packs']} packs")
    assert (
        "open 1 pack" in names and "share bundle in (3 seals)" in names and "plaintext aggregate in" in names
    )
    assert all(r["warm_ms"] > 0 and r["cold_ms"] > 0 for r in doc["rows"])
    assert "open 1 pack, prepared" in names and doc["prepared_opened"] > 2  # once per repetition, and more
    printed = capsys.readouterr().out
    assert "| open 3 packs |" in printed
