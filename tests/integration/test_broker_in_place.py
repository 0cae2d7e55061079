"""The README's broker steps, as written: ``fedsdk provision --fleet <fleet file> --out fleet/`` and then
``mosquitto -c fleet/broker/mosquitto.conf`` from the same directory; a device kit then connects over
mutual TLS and the coordinator kit receives what it publishes.

The fleet file is ``certs/fleet.example.json`` (its ``broker.config_dir`` names ``/etc/mosquitto/fedsdk``,
where nothing is installed) with the broker on a free loopback port. Who provisions and who starts
mosquitto matters, because mosquitto 2 started as root switches to its ``user`` before it reads the ACL:

* ``self``: this test's user does both (root in a container, an ordinary user elsewhere);
* ``user``: an unprivileged account (``nobody``) does both; needs root to switch accounts;
* ``root-starts-user-fleet``: ``nobody`` provisions, root starts mosquitto (``sudo mosquitto -c ...``).

The provisioning child for ``nobody`` is started as root and switches to ``nobody`` after importing fedsdk,
because the interpreter may live where ``nobody`` cannot read it (a root-only pyenv).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokers import Recorder, find_mosquitto, free_port
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.mosquitto import accepting, terminate
from fedsdk_coordinator.provision import load_kit

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

CERTS = Path(__file__).resolve().parents[2] / "certs"
UNPRIVILEGED = "nobody"

# Provision as another account: import everything as root, then drop to the account and run the CLI.
PROVISION_AS = """\
import os, sys
from fedsdk.cli import main, _parser
import fedsdk_coordinator.cli.provision, fedsdk_coordinator.provision, fedsdk_coordinator.pki
_parser("provision")
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
os.environ["HOME"] = os.getcwd()
sys.exit(main(sys.argv[3:]))
"""


def _fleet_file(work: Path, port: int) -> Path:
    fleet = json.loads((CERTS / "fleet.example.json").read_text())
    fleet["coordinator"]["host"] = "127.0.0.1"
    fleet["broker"].update(hosts=["127.0.0.1"], port=port, bind="127.0.0.1")  # config_dir kept: /etc/...
    fleet["he"]["options"]["key_bits"] = 1024  # key size is beside the point here, and 2048 is slow
    path = work / "fleet.json"
    path.write_text(json.dumps(fleet))
    return path


@pytest.fixture
def work() -> Iterator[Path]:
    """A directory under /tmp that an unprivileged account can use (pytest's tmp_path is root's own)."""
    path = Path(tempfile.mkdtemp(prefix="fedsdk-inplace-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _provision(work: Path, as_user: pwd.struct_passwd | None) -> None:
    args = ["provision", "--fleet", "fleet.json", "--out", "fleet/"]
    if as_user is None:
        cmd = [sys.executable, "-m", "fedsdk", *args]
    else:
        os.chown(work, as_user.pw_uid, as_user.pw_gid)
        os.chown(work / "fleet.json", as_user.pw_uid, as_user.pw_gid)
        cmd = [sys.executable, "-c", PROVISION_AS, str(as_user.pw_uid), str(as_user.pw_gid), *args]
    out = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]


def _start_mosquitto(work: Path, port: int, as_user: pwd.struct_passwd | None) -> subprocess.Popen[bytes]:
    """``mosquitto -c fleet/broker/mosquitto.conf`` in ``work``, as the README has it; waits until it
    accepts connections, or fails with its log."""
    binary = find_mosquitto()
    assert binary is not None
    log = open(work / "mosquitto.log", "wb")  # closed once the process holds it
    account = {} if as_user is None else {"user": as_user.pw_uid, "group": as_user.pw_gid, "extra_groups": []}
    proc = subprocess.Popen(
        [binary, "-c", "fleet/broker/mosquitto.conf"],
        cwd=work,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        **account,  # type: ignore[call-overload]
    )
    log.close()
    deadline = time.monotonic() + 15
    while not accepting(port):
        text = (work / "mosquitto.log").read_text(errors="replace")
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate(proc)
            pytest.fail(f"mosquitto -c fleet/broker/mosquitto.conf did not start:\n{text}")
        time.sleep(0.05)
    return proc


async def _device_reaches_coordinator(fleet: Path) -> None:
    coord_kit, device_kit = load_kit(fleet / "coordinator"), load_kit(fleet / "devices" / "pi-01")
    fed = coord_kit.federation
    coord = MqttTransport.from_url(
        coord_kit.broker_url, client_id=coord_kit.client_id, tls=coord_kit.tls, timeout=5
    )
    device = MqttTransport.from_url(
        device_kit.broker_url, client_id=device_kit.client_id, tls=device_kit.tls, timeout=5
    )
    async with coord, device:
        got = Recorder(coord)
        await coord.subscribe(f"fl/{fed}/up/#")
        await device.publish(f"fl/{fed}/up/pi-01/hello", b"over mutual TLS", qos=1)
        for _ in range(250):
            if got.got:
                break
            await asyncio.sleep(0.02)
        assert [(m.topic, m.payload) for m in got.got] == [(f"fl/{fed}/up/pi-01/hello", b"over mutual TLS")]
        await coord.close()
        await got._pump


@pytest.mark.parametrize(
    ("provisioner", "starter"),
    [("self", "self"), ("user", "user"), ("user", "root")],
    ids=["self", "user", "root-starts-user-fleet"],
)
def test_readme_broker_steps_run_as_written(work: Path, provisioner: str, starter: str) -> None:
    if find_mosquitto() is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set and mosquitto is not installed", pytrace=False)
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    if "user" in (provisioner, starter) and os.geteuid() != 0:
        pytest.skip("switching to another account needs root (the 'self' case runs as this user)")
    account = pwd.getpwnam(UNPRIVILEGED) if provisioner == "user" else None
    port = free_port()
    _fleet_file(work, port)
    _provision(work, account)
    fleet = work / "fleet"
    proc = _start_mosquitto(work, port, account if starter == "user" else None)
    try:
        asyncio.run(_device_reaches_coordinator(fleet))
        assert proc.poll() is None
    finally:
        terminate(proc)
    log = (work / "mosquitto.log").read_text(errors="replace")
    # the readiness probe (a TCP connect closed before any TLS handshake) is logged by mosquitto's OpenSSL,
    # now and then, as an unexpected EOF from an unknown client: not an error of the steps under test
    errors = [ln for ln in log.splitlines() if "Error" in ln and "unexpected eof while reading" not in ln]
    assert not errors, log
    assert (fleet / "broker" / "data" / "mosquitto.db").is_file(), log  # persistence saved at exit
    conf = (fleet / "broker" / "mosquitto.conf").read_text()
    owner = pwd.getpwuid(fleet.stat().st_uid).pw_name
    assert f"user {owner}" in conf.splitlines()  # root starting it switches to the files' owner
    assert (fleet / "broker" / "server.key").stat().st_mode & 0o077 == 0  # the key stays private
    assert fleet.stat().st_mode & 0o077 == 0  # and so does the fleet folder
