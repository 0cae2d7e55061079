"""The CLI's contract: exit codes, JSON output, clear refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedsdk.model.data import save_npz


def fedsdk(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedsdk", *args], capture_output=True, text=True, timeout=120
    )


def test_profile_json_measures_he() -> None:
    out = fedsdk("profile", "--json", "--backend", "packed", "--key-bits", "1024", "--seconds", "0.2")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["cores"] >= 1 and facts["he_packed_values_per_s"] > 0


def test_join_refuses_plain_tcp_without_the_flag(tmp_path: Path) -> None:
    data = tmp_path / "d.npz"
    save_npz(data, np.zeros((4, 64), np.float32), np.arange(4) % 10)
    out = fedsdk("join", "mqtts://127.0.0.1:1", "--data", str(data), "--client-id", "x")
    assert out.returncode == 2
    assert "TLS needs --ca" in out.stderr


def test_join_reports_an_unreachable_broker(tmp_path: Path) -> None:
    data = tmp_path / "d.npz"
    save_npz(data, np.zeros((4, 64), np.float32), np.arange(4) % 10)
    out = fedsdk("join", "mqtt://127.0.0.1:9", "--insecure", "--data", str(data), "--client-id", "x")
    assert out.returncode == 3, out.stderr
    assert "cannot reach the broker" in out.stderr


def test_join_refuses_a_self_audit_threshold_that_is_not_positive(tmp_path: Path) -> None:
    data = tmp_path / "d.npz"
    save_npz(data, np.zeros((4, 64), np.float32), np.arange(4) % 10)
    url = "mqtt://127.0.0.1:9"
    out = fedsdk("join", url, "--insecure", "--data", str(data), "--self-audit", "--self-audit-db", "0")
    assert out.returncode == 2, out.stderr
    assert "self-audit threshold must be a finite number of dB > 0" in out.stderr


def test_join_documents_personalisation_and_refuses_a_negative_epoch_count(tmp_path: Path) -> None:
    out = fedsdk("join", "--help")
    assert out.returncode == 0
    help_text = " ".join(out.stdout.split())
    assert "--personal-epochs N" in help_text and "default 5 with held-out data; 0 turns it off" in help_text
    assert "--save-personal-model" in help_text
    data = tmp_path / "d.npz"
    save_npz(data, np.zeros((4, 64), np.float32), np.arange(4) % 10)
    out = fedsdk("join", "mqtt://127.0.0.1:9", "--insecure", "--data", str(data), "--personal-epochs", "-1")
    assert out.returncode == 2 and "--personal-epochs must be 0 (off) or more" in out.stderr


def test_bad_data_file_is_a_config_error(tmp_path: Path) -> None:
    out = fedsdk("join", "mqtt://127.0.0.1:9", "--insecure", "--data", str(tmp_path / "missing.npz"))
    assert out.returncode == 2 and "missing.npz" in out.stderr


def test_coordinator_refuses_broker_options_it_cannot_honour(tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path / "state")]
    out = fedsdk("coordinator", "--broker-crl", str(tmp_path / "crl.pem"), *state)  # dev PKI: no fleet CRL
    assert out.returncode == 2 and "--broker-crl needs the fleet's certificates" in out.stderr
    out = fedsdk("coordinator", "--insecure", "--broker-acl", str(tmp_path / "acl"), *state)
    assert out.returncode == 2 and "for the embedded broker with TLS" in out.stderr
    acl = tmp_path / "acl"
    acl.write_text("user coordinator\ntopic read fl/default/up/#\nallow everything\n")
    out = fedsdk("coordinator", "--broker-acl", str(acl), "--listen", "127.0.0.1:1", *state)
    assert out.returncode == 2 and "ACL line 3: cannot read 'allow everything'" in out.stderr
