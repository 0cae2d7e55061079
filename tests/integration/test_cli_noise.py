"""What the console shows at default verbosity, from real processes, beyond the round lines
(test_cli_output.py): no amqtt protocol warnings (its errors stay), each failure said once, no file written
into the current folder unasked, TLS errors that name the file at fault, and counts in the singular.

The coordinator here runs its embedded broker in the clear on loopback (``--insecure``): the checks are
about what is printed, not about the transport."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedsdk.model.data import save_npz
from fedsdk_coordinator.cli._coord import free_port
from fedsdk_coordinator.clustering import cluster_sketches, describe
from fedsdk_coordinator.pki import make_dev_pki

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FEDSDK = [sys.executable, "-m", "fedsdk"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
# MQTT 3.1 (protocol level 3), which the embedded broker does not speak: amqtt logs two WARNINGs
OLD_CONNECT = b"\x10\x10\x00\x04MQTT\x03\x02\x00\x3c\x00\x04abcd"


def run(*args: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FEDSDK, *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


def until(check: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Coordinator:
    def __init__(self, work: Path) -> None:
        self.port, self.work = free_port(), work
        self.out, self.err = work / "coordinator.out", work / "coordinator.err"
        args = ["--listen", f"127.0.0.1:{self.port}", "--http", f"127.0.0.1:{free_port()}", "--rounds", "1"]
        args += ["--min-clients", "2", "--strategy", "plaintext", "--secagg", "off", "--insecure"]
        args += ["--deadline", "10", "--state-dir", str(work / "state")]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([*FEDSDK, "coordinator", *args], stdout=out, stderr=err, env=ENV)
        until(lambda: "coordinator up" in self.out.read_text() or self.proc.poll() is not None, "the start")
        assert self.proc.poll() is None, self.err.read_text()[-2000:]

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.err.read_text()

    def send(self, payload: bytes) -> None:
        """A raw client: connect, send ``payload``, read what comes back, close."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(payload)
            try:
                s.recv(16)
            except OSError:
                pass

    def join(self, cid: str, data: Path, *extra: str) -> subprocess.Popen[str]:
        cmd = [*FEDSDK, "join", self.url, "--insecure", "--client-id", cid, "--data", str(data), *extra]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    co = Coordinator(tmp_path_factory.mktemp("coordinator"))
    try:
        yield co
    finally:
        co.proc.send_signal(2)
        try:
            co.proc.wait(30)
        except subprocess.TimeoutExpired:
            co.proc.kill()
            co.proc.wait()


def test_amqtt_warnings_are_quiet_and_its_errors_are_kept(coordinator: Coordinator) -> None:
    coordinator.send(OLD_CONNECT)
    coordinator.send(b"")  # a connection that closes at once: amqtt's ERROR "No data from ..."
    until(lambda: "ERROR amqtt" in coordinator.stderr(), "amqtt's error line")
    time.sleep(0.5)
    err = coordinator.stderr()
    assert not re.search(r"WARNING amqtt", err), err[-3000:]
    assert re.search(r"ERROR amqtt\.broker: No data from", err), err[-3000:]


def test_a_refused_device_says_why_once(coordinator: Coordinator, tmp_path: Path) -> None:
    data = tmp_path / "narrow.npz"  # 32 features for a model of 64 inputs
    save_npz(data, np.zeros((20, 32), np.float32), np.arange(20) % 10)
    proc = coordinator.join("narrow", data, "--timeout", "60")
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err[-3000:]
    reason = "samples of shape (32,) do not fit the model input (64,)"
    assert err.count(reason) == 1, err[-3000:]
    assert err.strip().splitlines()[-1] == f"narrow: refused: local data: {reason}"


def test_a_failed_round_is_one_error_line(coordinator: Coordinator, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"  # values at float32's limit: the training loss is not finite
    save_npz(bad, np.full((50, 64), 3e38, np.float32), np.arange(50) % 3)
    procs = [coordinator.join(f"bad{i}", bad, "--timeout", "60") for i in range(2)]
    try:
        until(lambda: "runs again once a device joins" in coordinator.stderr(), "round 1 to fail")
        time.sleep(0.5)
    finally:
        for p in procs:
            p.terminate()
            p.communicate(timeout=30)
    errors = [ln for ln in coordinator.stderr().splitlines() if " ERROR fedsdk_coordinator" in ln]
    assert len(errors) == 1, "\n".join(errors)
    assert errors[0].endswith("round 1 cluster 0 failed: 0 valid updates, quorum 2")


def test_the_demo_writes_no_file_into_the_current_folder(tmp_path: Path) -> None:
    cwd, work = tmp_path / "cwd", tmp_path / "work"
    cwd.mkdir()
    small = [
        "demo",
        "--clients",
        "3",
        "--rounds",
        "1",
        "--epochs",
        "1",
        "--key-bits",
        "1024",
        "--model",
        "mlp16",
    ]
    out = run(*small, "--insecure", cwd=cwd)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert list(cwd.iterdir()) == []
    assert out.stdout.strip().endswith("no summary kept (--json PATH or --workdir DIR keeps it)")
    out = run(*small, "--insecure", "--workdir", str(work), cwd=cwd)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert list(cwd.iterdir()) == [] and (work / "summary.json").is_file()
    assert out.stdout.strip().endswith(f"summary in {work / 'summary.json'}")


def test_bench_crypto_writes_its_json_only_when_asked(tmp_path: Path) -> None:
    small = ["bench", "crypto", "--quick", "--backends", "packed"]
    out = run(*small, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(tmp_path.iterdir()) == [] and "JSON written" not in out.stdout
    out = run(*small, "--json", "b.json", cwd=tmp_path)
    assert out.returncode == 0 and (tmp_path / "b.json").is_file()
    assert out.stdout.strip().endswith("JSON written to b.json")


def test_tls_errors_name_the_file_at_fault_never_none(tmp_path: Path) -> None:
    data = tmp_path / "d.npz"
    save_npz(data, np.zeros((4, 64), np.float32), np.arange(4))
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    out = run("join", "mqtts://127.0.0.1:1", "--ca", str(not_pem), "--data", str(data), timeout=60)
    assert out.returncode == 2, out.stderr
    assert "None" not in out.stderr and f"CA file {not_pem} unusable" in out.stderr
    assert "--ca takes the PEM certificate of the CA" in out.stderr
    pki = make_dev_pki(tmp_path / "pki", client_ids=["dev-a", "dev-b"])
    a, b = pki.tls_for("dev-a"), pki.tls_for("dev-b")
    args = ["--ca", str(a.ca_file), "--cert", str(a.cert_file), "--key", str(b.key_file)]
    out = run("join", "mqtts://127.0.0.1:1", "--client-id", "dev-a", *args, "--data", str(data), timeout=60)
    assert out.returncode == 2, out.stderr
    assert "None" not in out.stderr
    assert f"client certificate {a.cert_file} with key {b.key_file} unusable" in out.stderr


def test_one_cluster_is_said_in_the_singular() -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(size=16)
    sketches = {f"d{i}": base + 1e-3 * rng.normal(size=16) for i in range(4)}
    text = describe(cluster_sketches(sketches))
    assert text.startswith("4 devices in 1 cluster") and "1 clusters" not in text, text
