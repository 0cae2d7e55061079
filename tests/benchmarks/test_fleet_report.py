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


def _device(f: float, train: float, apply: float, decrypt: float) -> dict[str, Any]:
    split = dict.fromkeys(("sensitivity", "mask", "encrypt", "upload", "other", "wait"), 0.0)
    split.update(train=train, apply=apply, decrypt=decrypt, update_s=train)
    split.update(encrypted_ratio=1.0, speed_factor=f)
    return split


def test_the_slowest_devices_time_split_is_reported() -> None:
    devices = {"a": _device(1.0, 0.1, 0.01, 0.004), "b": _device(3.0, 0.4, 0.05, 0.0),
               "c": _device(3.0, 0.5, 0.07, 0.002)}  # fmt: skip
    arm = {
        "label": "fedsdk", "strategy": "fedsdk", "state": "finished", "mean_round_s": 0.6,
        "update_s": {"min": 0.1, "mean": 0.3, "max": 0.5}, "spread": 1.5, "he_spread": 2.0,
        "bytes_up": 1000.0, "bytes_down": 2000.0, "encrypted_ratio": 1.0, "union_ratio": 1.0,
        "final_accuracy_per_group": {}, "emulation": {"overrun_fraction": 0.0},
        "critical_path": dict.fromkeys(("devices", "aggregate", "apply", "coordinator"), 0.1),
        "split": {}, "devices": devices, "clusters": {},
    }  # fmt: skip
    sc = {"name": "system", "title": "t", "source": "s", "n_devices": 3, "time_scale": 15.0, "arms": [arm]}
    doc = {**_doc(2048), "scenarios": [sc]}
    text = markdown(doc, [])
    assert "Time split of the slowest devices (f=3)" in text
    row = next(line for line in text.splitlines() if line.startswith("| fedsdk | 0.450 |"))
    # train, sensitivity, mask, encrypt, upload, other, wait, apply, decrypt, update: the mean of b and c
    assert row == "| fedsdk | 0.450 | 0.000 | 0.000 | 0.000 | 0.000 | 0.000 | 0.000 | 0.060 | 0.001 | 0.450 |"
