"""``fedsdk coordinator``: a configuration error is one line naming the fix (exit code 2, no traceback), and
the development PKI in ``<state-dir>/pki`` is made once and reused across starts."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store

from fedsdk.transport import MqttTransport, TlsConfig
from fedsdk_coordinator.cli._coord import free_port
from fedsdk_coordinator.cli.coordinator import dev_pki
from fedsdk_coordinator.provision import provision
from fedsdk_coordinator.provision.fleet import fleet_from_mapping
from fedsdk_coordinator.store import Store as StateStore


def coordinator(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedsdk", "coordinator", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit code 2 and a single ``fedsdk: ...`` line on stderr that holds every needle."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedsdk: "), out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def local(tmp_path: Path) -> list[str]:
    """A state directory and free loopback addresses for the embedded broker and the HTTP server."""
    return [
        "--state-dir", str(tmp_path / "state"), "--listen", f"127.0.0.1:{free_port()}",
        "--http", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip


@contextlib.contextmanager
def occupied() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# -- configuration errors: one line, exit code 2 ---------------------------------------------------
def test_unknown_model(tmp_path: Path) -> None:
    assert_one_line(coordinator(*local(tmp_path), "--model", "bogus"), "unknown model 'bogus'", "mlp")


def test_he_strategy_without_he_says_to_pass_he(tmp_path: Path) -> None:
    assert_one_line(coordinator(*local(tmp_path), "--strategy", "fedsdk"), "strategy fedsdk", "--he DIR")


def test_missing_he_key_folder(tmp_path: Path) -> None:
    out = coordinator(*local(tmp_path), "--strategy", "fedsdk", "--he", str(tmp_path / "nowhere"))
    assert_one_line(out, str(tmp_path / "nowhere"), "--he DIR")


def test_he_key_of_another_backend(tmp_path: Path) -> None:
    he = tmp_path / "he"
    he.mkdir()
    (he / "he.json").write_text('{"backend": "packed", "params": {}, "key_id": "00"}')
    (he / "he_public.bin").write_bytes(b"\0")
    out = coordinator(*local(tmp_path), "--strategy", "sensecrypt", "--he", str(he))
    assert_one_line(out, "sensecrypt", "paillier", "packed")


def test_without_a_strategy_the_federations_he_key_means_fedsdk(tmp_path: Path) -> None:
    he = tmp_path / "he"
    he.mkdir()
    (he / "he.json").write_text('{"backend": "ckks", "params": {}, "key_id": "00"}')
    (he / "he_public.bin").write_bytes(b"\0")
    out = coordinator(*local(tmp_path), "--he", str(he))  # the key says HE: fedsdk, whose backend is packed
    assert_one_line(out, "strategy fedsdk", "packed", "ckks")


def test_state_of_another_federation(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    with StateStore(tmp_path / "state" / "coordinator.sqlite") as store:
        store.set_json("identity", {"federation": "other", "strategy": "plaintext", "clustered": False})
    out = coordinator(*local(tmp_path), "--federation", "mine")
    assert_one_line(out, "belongs to another federation", "use another state directory")


def test_http_address_in_use(tmp_path: Path) -> None:
    with occupied() as port:
        out = coordinator(*local(tmp_path), "--http", f"127.0.0.1:{port}")
    assert_one_line(out, f"HTTP address 127.0.0.1:{port} is in use: pass --http HOST:PORT")


def test_embedded_broker_address_in_use(tmp_path: Path) -> None:
    with occupied() as port:
        out = coordinator(*local(tmp_path), "--listen", f"127.0.0.1:{port}")
    assert_one_line(out, f"127.0.0.1:{port} is in use: pass --listen HOST:PORT")


def _fleet(tmp_path: Path) -> Path:
    """A provisioned fleet whose broker runs on the coordinator host (no broker hosts in the fleet file)."""
    fleet = {
        "federation": "fedA",
        "devices": ["pi-01"],
        "coordinator": {"host": "coord.lan"},
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    provision(fleet_from_mapping(fleet), tmp_path / "fleet")
    return tmp_path / "fleet"


def test_a_kit_refuses_embedded_broker_options(tmp_path: Path) -> None:
    broker = _fleet(tmp_path) / "broker"
    out = coordinator(
        "--kit", str(tmp_path / "fleet" / "coordinator"), "--strategy", "fedsdk", "--listen", "0.0.0.0:8883",
        "--broker-cert", str(broker / "server.pem"), "--broker-key", str(broker / "server.key"),
        "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip
    assert_one_line(out, "--listen, --broker-cert, --broker-key", "--kit", "mqtts://coord.lan:8883")
    out = coordinator("--broker", "mqtts://broker.lan:8883", "--listen", "0.0.0.0:8883", *local(tmp_path)[:2])
    assert_one_line(out, "--listen", "--broker")


def test_the_embedded_broker_runs_with_the_fleet_certificates(tmp_path: Path) -> None:
    """certs/README.md, "Embedded broker": the broker certificate names coord.lan, the coordinator dials
    its own listener at another address; it must come up all the same. Without --strategy or an HE key
    it runs plaintext and warns that updates arrive in the clear."""
    fleet = _fleet(tmp_path)
    kit, broker = fleet / "coordinator", fleet / "broker"
    port = free_port()
    cmd = [
        sys.executable, "-m", "fedsdk", "coordinator", "--listen", f"127.0.0.1:{port}",
        "--http", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "state"), "--federation", "fedA",
        "--ca", str(kit / "ca.pem"), "--cert", str(kit / "client.pem"), "--key", str(kit / "client.key"),
        "--broker-cert", str(broker / "server.pem"), "--broker-key", str(broker / "server.key"),
        "--broker-crl", str(broker / "crl.pem"),
    ]  # fmt: skip
    log = tmp_path / "coordinator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "coordinator up" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        text = log.read_text()
        assert "coordinator up" in text, text[-3000:]
        # no --strategy and no HE key: plaintext, and a warning that says so once the coordinator is up
        assert "strategy plaintext" in text and "updates reach the coordinator in the clear" in text, text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the development PKI: made once, reused ---------------------------------------------------------
def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_the_pki_step_reuses_the_pki_of_the_last_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = dev_pki(state, ["dev1"], "127.0.0.1")
    first_ca, first_dev1 = load(first.ca_file), load(first.clients["dev1"][0])
    second = dev_pki(state, ["dev1", "dev2"], "0.0.0.0")
    assert load(second.ca_file) == first_ca
    store = Store([load(second.ca_file)])
    client = PolicyBuilder().store(store).build_client_verifier()
    for cert in (first_dev1, load(second.clients["dev1"][0]), load(second.clients["dev2"][0])):
        assert client.verify(cert, []).chain[-1] == first_ca  # the first start's device still verifies
    assert second.clients["dev1"][0].read_bytes() == first.clients["dev1"][0].read_bytes()
    assert second.issued == ("server", "dev2")  # the broker certificate now names this machine
    host = socket.gethostname().lower()
    covered = second.server_sans()
    for name in (host, f"{host.split('.')[0]}.local", "localhost", "127.0.0.1"):
        assert name in covered, (name, covered)
    server = PolicyBuilder().store(store).build_server_verifier(x509.DNSName(host))
    server.verify(load(second.server_cert), [])
    for path in state.glob("pki/*.key"):
        assert path.stat().st_mode & 0o777 == 0o600, path


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.1)
    raise AssertionError(f"the coordinator's broker did not listen on {port}: {log.read_text()[-3000:]}")


async def _connect(url: str, tls: TlsConfig) -> None:
    async with MqttTransport.from_url(url, client_id="dev1", tls=tls, timeout=10.0) as t:
        await t.subscribe("fl/default/down/dev1")


@pytest.mark.slow
def test_a_device_of_the_first_start_connects_after_a_crash_restart(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "fedsdk", "coordinator", "--state-dir", str(tmp_path / "state"),
        "--devices", "dev1", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    device = tmp_path / "device"  # what the device took away after the first start
    url = f"mqtts://127.0.0.1:{port}"
    for start in (1, 2):
        log = tmp_path / f"coordinator-{start}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_listening(port, proc, log)
            if start == 1:
                device.mkdir()
                for name in ("ca.pem", "dev1.pem", "dev1.key"):
                    shutil.copy2(tmp_path / "state" / "pki" / name, device / name)
            tls = TlsConfig(str(device / "ca.pem"), str(device / "dev1.pem"), str(device / "dev1.key"))
            asyncio.run(_connect(url, tls))
        finally:
            proc.send_signal(signal.SIGKILL)  # a crash: nothing is cleaned up
            proc.wait(10)
        assert "development PKI" in log.read_text()


def test_the_demo_runs_the_protected_strategy_unless_asked_for_plaintext() -> None:
    import argparse

    from fedsdk_coordinator.cli import demo
    from fedsdk_coordinator.strategies import strategy

    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["demo"])
    assert args.strategy == "fedsdk" and strategy(args.strategy).backend == "packed" and args.key_bits >= 2048
    assert parser.parse_args(["demo", "--strategy", "plaintext"]).strategy == "plaintext"


def test_the_demos_device_table_prints_no_nan_for_a_step_that_did_not_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedsdk_coordinator.cli.demo import TIMINGS, _print_tables

    ran = {t: 0.01 for t in TIMINGS if "sensitivity" not in t and "mask" not in t}
    summary = {
        "cluster_accuracy": {"0": 0.9},
        "clusters": {"d0": 0},
        "devices": {"d0": {"cluster": 0, "mean": {**ran, "budget": 0.0, "encrypted_ratio": 0.0}}},
    }
    _print_tables(summary)
    out = capsys.readouterr().out
    assert "nan" not in out.lower() and "step times in seconds" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("d0"))
    assert row.split().count("-") == len(TIMINGS) - len(ran) == 2


def test_the_sketch_size_help_names_the_engines_defaults() -> None:
    """The help of --sketch-dim names the engine's defaults (it said 128 while the code used 256)."""
    import argparse

    from fedsdk_coordinator.cli._strategy import add_strategy_options
    from fedsdk_coordinator.engine.config import SKETCH_DIM, SKETCH_DIM_DP

    p = argparse.ArgumentParser()
    add_strategy_options(p)
    text = " ".join(p.format_help().split())
    assert f"(default {SKETCH_DIM}, or {SKETCH_DIM_DP} with --dp-epsilon" in text, text
