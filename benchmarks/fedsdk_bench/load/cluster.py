"""The load run on a broker cluster (``--cluster N``): three NATS nodes and N aggregation workers, started
by ``fedsdk cluster up`` as docs/scale.md runs them, in place of mosquitto.

The fleet is provisioned as an operator provisions one (``broker.engine = "nats"``, three nodes on
loopback, key mode shared, a packed-Paillier key of ``--key-bits`` under ``--strategy fedsdk``). The
coordinator runs on its kit with the aggregation workers. Every device gets a certificate of the fleet's
CA (with the URI its NATS user is mapped by), recorded in the fleet (:func:`register_devices`); the first
device is provisioned with a whole kit, whose HE key every device uses (in key mode shared each kit holds
the same).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedsdk.errors import ConfigError
from fedsdk.transport import TlsConfig

__all__ = ["ClusterBroker", "cluster_broker"]


@dataclass
class ClusterBroker:
    """A running fleet cluster: what the coordinator and the devices connect with."""

    root: Path
    url: str  # every node's MQTT URL, comma-separated (as in the kits)
    nats_urls: tuple[str, ...]  # where the coordinator meets the aggregation workers
    coordinator_tls: TlsConfig
    device_tls: dict[str, TlsConfig]
    he_coordinator: Path | None
    he_device: Path | None
    nodes: list[int] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)
    log: Path | None = None

    @property
    def pid(self) -> int | None:
        """The first node's pid (the harness samples one broker process's memory)."""
        return self.nodes[0] if self.nodes else None

    def log_text(self) -> str:
        return "" if self.log is None else self.log.read_text(errors="replace")

    def version(self) -> str:
        from fedsdk_coordinator.scale.nodes import find_nats_server

        binary = find_nats_server()
        if binary is None:
            return "unknown"
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"


def _kit_tls(kit: Path) -> TlsConfig:
    return TlsConfig(str(kit / "ca.pem"), str(kit / "client.pem"), str(kit / "client.key"))


@contextlib.contextmanager
def cluster_broker(
    work: Path, ids: Sequence[str], federation: str, *, workers: int, key_bits: int, he: bool
) -> Iterator[ClusterBroker]:
    """Provision the fleet under ``work/fleet``, start it with ``fedsdk cluster up --workers N``, and stop
    it (nodes and workers) on leaving."""
    from fedsdk_bench.scale import ClusterUp
    from fedsdk_bench.swarm import issue_identities
    from fedsdk_coordinator.mosquitto import free_port
    from fedsdk_coordinator.provision import fleet_from_mapping, provision, register_devices
    from fedsdk_coordinator.scale.nodes import find_nats_server

    if find_nats_server() is None:
        raise ConfigError("--cluster needs nats-server: pip install 'fedsdk[cluster]'")
    if workers < 1:
        raise ConfigError("--cluster needs at least one aggregation worker")
    root = work / "fleet"
    nodes = [{"host": "127.0.0.1", "port": free_port(), "nats_port": free_port(), "cluster_port": free_port()}
             for _ in range(3)]  # fmt: skip
    spec = {
        "federation": federation, "devices": [ids[0]], "coordinator": {"host": "127.0.0.1"},
        "broker": {"hosts": ["127.0.0.1"], "engine": "nats", "bind": "127.0.0.1", "nodes": nodes},
        "key_mode": "shared", "he": {"backend": "packed", "options": {"key_bits": key_bits}},
    }  # fmt: skip
    provision(fleet_from_mapping(spec), root)
    first = root / "devices" / ids[0]
    sims = issue_identities(root, list(ids[1:]), root / "sim")
    register_devices(root, {d.client_id: Path(d.cert_file).read_bytes() for d in sims})
    ca = str(root / "ca" / "ca.pem")
    device_tls = {ids[0]: _kit_tls(first)}
    device_tls.update({d.client_id: TlsConfig(ca, str(d.cert_file), str(d.key_file)) for d in sims})
    coordinator = root / "coordinator"
    kit = json.loads((coordinator / "fedsdk.json").read_text(encoding="utf-8"))
    nats = json.loads((coordinator / "nats.json").read_text(encoding="utf-8"))
    up = ClusterUp(root, workers)
    try:
        yield ClusterBroker(
            root=root,
            url=str(kit["broker_url"]),
            nats_urls=tuple(nats["nats_urls"]),
            coordinator_tls=_kit_tls(coordinator),
            device_tls=device_tls,
            he_coordinator=coordinator / "he" if he else None,
            he_device=first / "he" if he else None,
            nodes=up.nodes,
            workers=up.workers,
            log=up.log,
        )
    finally:
        up.stop()
