"""``fedsdk join`` with another device's certificate, and with ``--kit`` plus options, against a real
mosquitto 2 running the configuration ``fedsdk provision`` writes and against the embedded broker.

A device whose certificate is issued to another identity than its client id used to hang without a word on
mosquitto (the session runs as the certificate's identity, whose ACL drops the device's own topics; mosquitto
2.0 even grants the SUBSCRIBE to them) and to exit 3 with "not authorized" on the embedded broker. It is
now refused before connecting, on both, with both identities named (exit 2).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from brokers import (
    BrokerStartError,
    EmbeddedBrokerThread,
    MosquittoProcess,
    find_mosquitto,
    fleet_embedded_broker,
    free_port,
    provision_loopback_fleet,
)
from fedsdk.errors import TransportError
from fedsdk.model.data import save_npz
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.provision import load_kit

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

FED = "idfed"
WITHIN_S = 30  # a device that cannot work must say so within this time


@dataclass
class Fleet:
    root: Path
    kind: str  # mosquitto | embedded
    broker: MosquittoProcess | EmbeddedBrokerThread
    data: Path

    def kit(self, name: str) -> Path:
        return self.root / "devices" / name


def _start(tmp: Path, kind: str) -> Fleet:
    port = free_port()
    root = tmp / f"fleet-{port}"
    provision_loopback_fleet(
        root, port, federation=FED, devices=["a", "b"], key_mode="shared", persist=tmp / "persist"
    )
    data = tmp / "d.npz"
    save_npz(data, np.zeros((4, 64), np.float32), np.arange(4) % 10)
    broker: MosquittoProcess | EmbeddedBrokerThread
    if kind == "embedded":
        broker = fleet_embedded_broker(root, port, federation=FED, key_mode="shared")
        return Fleet(root, kind, broker, data)
    binary = find_mosquitto()
    assert binary is not None
    (tmp / "persist").mkdir(exist_ok=True)
    run = tmp / f"run-{port}"
    run.mkdir()
    conf = (root / "broker" / "mosquitto.conf").read_text()
    if os.geteuid() == 0 and not re.search(r"^user ", conf, re.MULTILINE):
        conf = "user root\n" + conf  # mosquitto 2 started as root stays root only when told so
    (run / "mosquitto.conf").write_text(conf)
    broker = MosquittoProcess(binary, run, port, None)
    broker.start()
    return Fleet(root, kind, broker, data)


@pytest.fixture(scope="module", params=["mosquitto", "embedded"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    kind: str = request.param
    if kind == "mosquitto" and find_mosquitto() is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set and mosquitto is not installed", pytrace=False)
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    tmp = tmp_path_factory.mktemp(f"identity-{kind}")
    for attempt in range(3):  # the free port may be taken between free_port() and the broker's bind
        try:
            started = _start(tmp / str(attempt), kind)
            break
        except BrokerStartError as exc:
            if "in use" not in str(exc) or attempt == 2:
                raise
    try:
        yield started
    finally:
        started.broker.stop()


def join(fleet: Fleet, *words: str) -> subprocess.CompletedProcess[str]:
    """``fedsdk join`` in a process of its own; a run still going after WITHIN_S seconds fails the test."""
    cmd = [sys.executable, "-m", "fedsdk", "join", *words, "--data", str(fleet.data)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=WITHIN_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"fedsdk join {' '.join(words)} still running after {WITHIN_S} s: {exc.stderr!r}")


def connections(fleet: Fleet, name: str) -> int:
    """How many sessions the broker opened for identity ``name`` (mosquitto) or refused (embedded)."""
    text = fleet.broker.log_text()
    return text.count(f" as {name} (") + text.count(f"its certificate is {name!r}")


@pytest.mark.parametrize("form", ["files", "kit"])
def test_another_devices_certificate_is_refused_before_connecting(fleet: Fleet, form: str) -> None:
    a, b = fleet.kit("a"), fleet.kit("b")
    if form == "files":
        words = [f"mqtts://127.0.0.1:{fleet.broker.port}", "--client-id", "b", "--ca", str(a / "ca.pem")]
        said = "but --client-id is 'b'"
    else:
        words, said = ["--kit", str(b)], "but the kit's client id is 'b'"
    before = connections(fleet, "a")
    out = join(fleet, *words, "--cert", str(a / "client.pem"), "--key", str(a / "client.key"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"certificate {a / 'client.pem'} is issued to 'a' {said}: use --client-id a" in out.stderr
    assert connections(fleet, "a") == before  # refused at start: the broker never saw it


def test_a_kit_with_its_ca_given_keeps_the_kits_certificate(fleet: Fleet, tmp_path: Path) -> None:
    """``--ca`` replaces the CA only: the kit's client certificate still authenticates the device (it used
    to be dropped, and the handshake failed: exit 3)."""
    a = fleet.kit("a")
    ca = shutil.copy(a / "ca.pem", tmp_path / "fleet-ca.pem")
    before = connections(fleet, "a")
    out = join(fleet, "--kit", str(a), "--ca", str(ca), "--timeout", "2", "--idle-timeout", "0")
    assert out.returncode == 1, out.stderr[-2000:]  # connected, subscribed, then no coordinator within 2 s
    assert "a: timeout after 0 rounds applied" in out.stderr and "no end within 2" in out.stderr
    if fleet.kind == "mosquitto":
        assert connections(fleet, "a") == before + 1


async def test_a_refused_subscription_says_why(fleet: Fleet) -> None:
    """The embedded broker answers a SUBSCRIBE its ACL denies with failure code 0x80 (SUBACK): the
    subscribe, and so a device's start-up (``FedClient``), fails with the reason instead of waiting.
    mosquitto 2.0 grants a SUBSCRIBE its acl_file denies and drops the messages instead (MQTT 3.1.1 and 5
    alike): there is nothing to act on, which is why the identity is checked before connecting."""
    kit = load_kit(fleet.kit("a"))
    async with MqttTransport.from_url(kit.broker_url, client_id="a", tls=kit.tls, timeout=5) as t:
        if fleet.kind == "mosquitto":
            await t.subscribe(f"fl/{FED}/down/b")  # granted; nothing will be delivered
            return
        with pytest.raises(TransportError) as exc:
            await t.subscribe(f"fl/{FED}/down/b")
    said = str(exc.value)
    assert f"the broker refused the subscription to fl/{FED}/down/b (SUBACK failure)" in said
    assert "its ACL does not let this client read it; check the federation" in said
