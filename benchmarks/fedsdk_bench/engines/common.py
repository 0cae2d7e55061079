"""Shared by every engine: the ports and sizes, the test fleet, process helpers and the cluster base class."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fedsdk.transport import TlsConfig
from fedsdk_coordinator.pki import KeyPair, issue_cert, make_ca

HOST = "127.0.0.1"
FED = "nfed"
NATS_BASE, RABBIT_BASE = 25000, 25100  # every port used lies in 25000-25999
LIMIT_BYTES = 8 * 2**20
LOAD_PAYLOAD = 20_000
TP_MESSAGES, TP_CONCURRENCY = 2_000, 20
NATS_BIN_NAMES = ("nats-server",)
RABBIT_SBIN = Path("/usr/lib/rabbitmq/bin")


# ---------------------------------------------------------------------------------------------- fleet
@dataclass
class Fleet:
    """The provisioned fleet (``fedsdk provision``) plus load-device certificates and a foreign CA."""

    root: Path
    load_ids: list[str]
    named: tuple[str, ...] = ("a", "b", "c")

    @property
    def broker(self) -> Path:
        return self.root / "broker"

    def files(self, who: str) -> tuple[str, str, str]:
        """(ca, cert, key) of an identity: a provisioned device, the coordinator, a load device, "foreign"."""
        if who in self.named:
            d = self.root / "devices" / who
        elif who in ("coordinator", "keyserver"):
            d = self.root / who
        elif who == "foreign":
            d = self.root / "foreign"
        else:
            d = self.root / "load"
            return str(self.broker / "ca.pem"), str(d / f"{who}.pem"), str(d / f"{who}.key")
        return str(self.broker / "ca.pem"), str(d / "client.pem"), str(d / "client.key")

    def tls(self, who: str) -> TlsConfig:
        return TlsConfig(*self.files(who))

    def context(self, who: str) -> ssl.SSLContext:
        ca, cert, key = self.files(who)
        ctx = ssl.create_default_context(cafile=ca)
        ctx.load_cert_chain(cert, key)
        return ctx

    @property
    def users(self) -> list[str]:
        return [*self.named, *self.load_ids]


def make_fleet(root: Path, devices: int) -> Fleet:
    """Provision the fleet like the test suite does, then issue one P-256 client certificate per load
    device with the fleet CA, and a certificate with CN=a from a CA the brokers do not trust."""
    from fedsdk_coordinator.provision import fleet_from_mapping, provision

    mapping = {
        "federation": FED,
        "devices": ["a", "b", "c"],
        "coordinator": {"host": HOST},
        "broker": {
            "hosts": [HOST, "localhost"],
            "port": 25999,
            "bind": HOST,
            "config_dir": str(root / "broker"),
            "persistence_dir": str(root / "persist") + "/",
        },
        "key_mode": "keyserver",
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }
    provision(fleet_from_mapping(mapping), root)
    ca = KeyPair((root / "ca" / "ca.pem").read_bytes(), (root / "ca" / "ca.key").read_bytes())
    load = root / "load"
    load.mkdir()
    ids = [f"d{i:05d}" for i in range(devices)]
    for cid in ids:
        pair = issue_cert(ca, cid, days=2)
        (load / f"{cid}.pem").write_bytes(pair.cert_pem)
        (load / f"{cid}.key").write_bytes(pair.key_pem)
    foreign = root / "foreign"
    foreign.mkdir()
    pair = issue_cert(make_ca("not-the-fleet-ca"), "a", days=2)
    (foreign / "client.pem").write_bytes(pair.cert_pem)
    (foreign / "client.key").write_bytes(pair.key_pem)
    return Fleet(root, ids)


# ------------------------------------------------------------------------------------------ processes
def group_rss_kib(pgid: int) -> int:
    """Resident memory (KiB) of every process in the process group ``pgid``."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def kill_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the process group led by ``proc`` (started with a new session), SIGKILL after ``grace``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group (erl_child_setup, inet_gethost)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def accepting(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
        return True
    return False


def short(exc: BaseException | str, n: int = 140) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


class Cluster:
    """Three nodes of one engine. Subclasses launch them and know when they have joined."""

    name = "?"

    def __init__(self, fleet: Fleet, work: Path) -> None:
        self.fleet, self.work = fleet, work
        self.procs: list[subprocess.Popen[bytes]] = []  # node i at index i
        self.helpers: list[subprocess.Popen[bytes]] = []  # epmd
        self.mqtt_ports: list[int] = []

    def launch(self) -> None:
        raise NotImplementedError

    def wait_joined(self, deadline: float) -> None:
        raise NotImplementedError

    def node_rss_kib(self) -> list[int]:
        return [group_rss_kib(p.pid) if p.poll() is None else 0 for p in self.procs]

    def kill_node(self, i: int) -> None:
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(10)

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):
                kill_group(p)
        for p in self.helpers:
            with contextlib.suppress(Exception):
                kill_group(p, grace=3)

    def popen(
        self, argv: list[str], logfile: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(logfile, "ab") as out:
            return subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=self.work
            )
