"""The fleet benchmark's report states its settings; keys below the provisioned size say so."""

from __future__ import annotations

from typing import Any

from fedsdk_bench.fleet.report import markdown


def _doc(key_bits: int) -> dict[str, Any]:
    config = {"model": "mlp", "rounds": 3, "epochs": 40, "key_bits": key_bits, "pool": 256}
    return {"started": "now", "machine": "here", "elapsed_s": 1.0, "n_values": 4810, "config": config,
            "scenarios": []}  # fmt: skip


def test_keys_below_the_provisioned_size_are_flagged_in_the_settings() -> None:
    weak = markdown(_doc(1024), [])
    assert "Paillier keys of 1024 bits (below the 2048 bits fedsdk provisions" in weak
    strong = markdown(_doc(2048), [])
    assert "Paillier keys of 2048 bits, obfuscator pool 256" in strong
    assert "below the" not in strong
