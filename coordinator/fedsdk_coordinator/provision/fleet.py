"""The fleet file: what ``fedsdk provision`` builds a federation's keys and kits from.

A fleet file is JSON (any Python >= 3.10) or TOML (Python >= 3.11 only, through the standard library's
``tomllib``; fedsdk adds no TOML dependency, so on 3.10 a ``.toml`` fleet file is refused with a hint to use
JSON). Both spell the same structure; ``certs/fleet.example.json`` is the reference::

    {
      "federation": "clinic-a",                       # topic level fl/<federation>/..., [A-Za-z0-9_.-]{1,64}
      "devices": ["pi-01", "pi-02", "phone-07"],      # client ids = certificate CNs = MQTT usernames
      "coordinator": {"host": "coord.lan", "http_port": 8080},
      "broker": {"hosts": ["broker.lan", "192.168.1.10"], "port": 8883},
      "key_mode": "shared",                           # or "keyserver" (SenseCrypt appendix I)
      "he": {"backend": "packed", "options": {"key_bits": 2048}},
      "validity_days": {"ca": 3650, "leaf": 825}
    }

Decisions:

* Unknown keys are refused (a typo such as ``"keymode"`` must not silently fall back to a default).
* ``broker.hosts`` become the broker certificate's SANs (IP literals as IP SANs, everything else as DNS
  names); the first one is the host of the broker URL every kit connects to (``broker.url`` overrides the
  URL, not the SANs). Without ``broker.hosts`` the broker is assumed to run on the coordinator host (the
  embedded broker), so the SANs are ``[coordinator.host]``.
* Device ids must not collide with the service identities ``coordinator``, ``keyserver`` and ``broker``:
  the ACL names the first two as users, and ``pattern`` lines apply to every certificate CN.
* ``broker.config_dir`` is where the broker's files will live *on the broker host*, installed for a system
  service; ``broker/mosquitto.system.conf`` names them by absolute path (and ``broker.persistence_dir``).
  ``broker/mosquitto.conf`` runs the broker in the fleet folder itself and ignores both
  (``provision.mosquitto``). ``broker.bind`` limits the listener to one address (default: all).
* ``broker.engine`` is ``mosquitto`` (the default: one broker) or ``nats``: a NATS cluster whose nodes speak
  MQTT to the devices and the coordinator and NATS (JetStream) to the aggregation workers
  (``provision.nats``). ``broker.nodes`` is its node count, all on ``broker.hosts[0]`` with consecutive
  ports from ``broker.port`` (and 4222, 6222 for the NATS and route ports), or a list of
  ``{"host", "port", "nats_port", "cluster_port"}``, one per node (default 3 nodes). The kits' broker URL
  then lists every node, comma-separated: a device connects to one and fails over to the next.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsdk.crypto import BACKENDS, DEFAULT_BACKEND
from fedsdk.errors import ConfigError
from fedsdk.protocol.topics import validate_config_id
from fedsdk.transport import parse_broker_urls

__all__ = [
    "ENGINES",
    "KEY_MODES",
    "RESERVED_IDS",
    "BrokerSpec",
    "Fleet",
    "HESpec",
    "NodeSpec",
    "fleet_from_mapping",
    "load_fleet",
]

KEY_MODES = ("shared", "keyserver")
ENGINES = ("mosquitto", "nats")
#: Identities the provisioner issues itself; no device may take one of these ids.
RESERVED_IDS = frozenset({"coordinator", "keyserver", "broker", "server", "ca", "aggregator"})

_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _check_host(host: object, what: str) -> str:
    """An IP literal or an RFC 1123 host name (labels of 1-63 letters, digits, hyphens; 253 bytes at most)."""
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{what} must be a non-empty host name or IP address, got {host!r}")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.rstrip(".")
    if len(name) > 253 or not all(_DNS_LABEL.match(label) for label in name.split(".")):
        raise ConfigError(f"{what}: {host!r} is neither an IP address nor a valid DNS host name")
    return name


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _table(data: object, what: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a table/object, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown key(s) in {what}: {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})"
        )
    return dict(data)


@dataclass(frozen=True)
class NodeSpec:
    """One node of a broker cluster: its host, the MQTT port devices use, the NATS port aggregation workers
    use and the port the nodes route to each other on (all TLS)."""

    host: str
    port: int
    nats_port: int
    cluster_port: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "nats_port": self.nats_port,
            "cluster_port": self.cluster_port,
        }


@dataclass(frozen=True)
class BrokerSpec:
    """Where the MQTT broker runs and how its listener is set up."""

    hosts: tuple[str, ...]
    port: int = 8883
    url: str | None = None
    bind: str | None = None
    config_dir: str = "/etc/mosquitto/fedsdk"
    persistence_dir: str = "/var/lib/mosquitto/"
    engine: str = "mosquitto"
    nodes: tuple[NodeSpec, ...] = ()

    @property
    def dns_names(self) -> tuple[str, ...]:
        return tuple(h for h in self.hosts if not _is_ip(h))

    @property
    def ip_addresses(self) -> tuple[str, ...]:
        return tuple(h for h in self.hosts if _is_ip(h))

    @property
    def broker_url(self) -> str:
        """The URL every kit connects to: ``broker.url`` if given, else ``mqtts://<hosts[0]>:<port>``, or
        every node's, comma-separated, for a cluster."""
        if self.url is not None:
            return self.url
        if self.nodes:
            return ",".join(_mqtts(n.host, n.port) for n in self.nodes)
        return _mqtts(self.hosts[0], self.port)


def _mqtts(host: str, port: int) -> str:
    return f"mqtts://[{host}]:{port}" if ":" in host else f"mqtts://{host}:{port}"


def _nodes(raw: object, host: str, port: int) -> tuple[NodeSpec, ...]:
    """``broker.nodes``: a count (every node on ``host``, consecutive ports) or one table per node."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        count = _int(raw, "broker.nodes", 1, 64)
        if port + count > 65536:
            raise ConfigError(f"broker.nodes {count} from port {port} runs past 65535")
        return tuple(NodeSpec(host, port + i, 4222 + i, 6222 + i) for i in range(count))
    if not isinstance(raw, list | tuple) or not raw:
        raise ConfigError("broker.nodes must be a node count or a non-empty list of node tables")
    nodes = []
    for i, item in enumerate(raw):
        what = f"broker.nodes[{i}]"
        t = _table(item, what, {"host", "port", "nats_port", "cluster_port"})
        nodes.append(
            NodeSpec(
                _check_host(t.get("host", host), f"{what}.host"),
                _int(t.get("port", port), f"{what}.port", 1, 65535),
                _int(t.get("nats_port", 4222), f"{what}.nats_port", 1, 65535),
                _int(t.get("cluster_port", 6222), f"{what}.cluster_port", 1, 65535),
            )
        )
    seen: set[tuple[str, int]] = set()
    for n in nodes:
        for p in (n.port, n.nats_port, n.cluster_port):
            if (n.host, p) in seen:
                raise ConfigError(f"broker.nodes: port {p} on {n.host} is used twice")
            seen.add((n.host, p))
    return tuple(nodes)


@dataclass(frozen=True)
class HESpec:
    """The federation's HE backend and the options given to ``fedsdk.crypto.generate_backend``."""

    backend: str = DEFAULT_BACKEND
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fleet:
    """A validated fleet description (see the module docstring for the file format)."""

    federation: str
    devices: tuple[str, ...]
    coordinator_host: str
    broker: BrokerSpec
    key_mode: str = "shared"
    he: HESpec = field(default_factory=HESpec)
    http_port: int = 8080
    ca_days: int = 3650
    leaf_days: int = 825

    def with_devices(self, devices: tuple[str, ...]) -> Fleet:
        """The same fleet with another device list (validated like a fresh file)."""
        data = self.to_dict()
        data["devices"] = list(devices)
        return fleet_from_mapping(data)

    def to_dict(self) -> dict[str, Any]:
        """The fleet in file form; ``fleet_from_mapping(f.to_dict()) == f``."""
        b = self.broker
        broker: dict[str, Any] = {
            "hosts": list(b.hosts),
            "port": b.port,
            "config_dir": b.config_dir,
            "persistence_dir": b.persistence_dir,
        }
        if b.url is not None:
            broker["url"] = b.url
        if b.bind is not None:
            broker["bind"] = b.bind
        if b.engine != "mosquitto":
            broker["engine"] = b.engine
            broker["nodes"] = [n.to_dict() for n in b.nodes]
        return {
            "federation": self.federation,
            "devices": list(self.devices),
            "coordinator": {"host": self.coordinator_host, "http_port": self.http_port},
            "broker": broker,
            "key_mode": self.key_mode,
            "he": {"backend": self.he.backend, "options": dict(self.he.options)},
            "validity_days": {"ca": self.ca_days, "leaf": self.leaf_days},
        }


def _device_ids(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list | tuple):
        raise ConfigError(f"devices must be a list of client ids, got {type(raw).__name__}")
    ids: list[str] = []
    for d in raw:
        cid = validate_config_id(d, "device id")
        if cid in RESERVED_IDS:
            raise ConfigError(
                f"device id {cid!r} is reserved for a service identity ({sorted(RESERVED_IDS)})"
            )
        if cid in ids:
            raise ConfigError(f"device id {cid!r} appears twice")
        ids.append(cid)
    return tuple(ids)


def _absolute_dir(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or any(c.isspace() for c in value):
        raise ConfigError(f"{what} must be an absolute path without spaces (mosquitto.conf), got {value!r}")
    return value


def fleet_from_mapping(data: Mapping[str, Any]) -> Fleet:
    """Validate a parsed fleet file. Raises :class:`ConfigError` naming the first problem."""
    top = _table(
        data,
        "the fleet file",
        {"federation", "devices", "coordinator", "broker", "key_mode", "he", "validity_days"},
    )
    if "federation" not in top:
        raise ConfigError("the fleet file needs a 'federation' name")
    federation = validate_config_id(top["federation"], "federation")
    devices = _device_ids(top.get("devices", []))

    coord = _table(top.get("coordinator", {}), "coordinator", {"host", "http_port"})
    if "host" not in coord:
        raise ConfigError("coordinator.host is required (the machine the coordinator runs on)")
    coordinator_host = _check_host(coord["host"], "coordinator.host")
    http_port = _int(coord.get("http_port", 8080), "coordinator.http_port", 1, 65535)

    b = _table(
        top.get("broker", {}),
        "broker",
        {"hosts", "port", "url", "bind", "config_dir", "persistence_dir", "engine", "nodes"},
    )
    hosts_raw = b.get("hosts", [coordinator_host])
    if not isinstance(hosts_raw, list | tuple) or not hosts_raw:
        raise ConfigError("broker.hosts must be a non-empty list of host names / IP addresses")
    hosts = tuple(dict.fromkeys(_check_host(h, "broker.hosts") for h in hosts_raw))
    url = b.get("url")
    if url is not None:
        if not isinstance(url, str) or not parse_broker_urls(url)[0].tls:
            raise ConfigError(f"broker.url must be an mqtts:// URL (kits use TLS), got {url!r}")
    bind = b.get("bind")
    if bind is not None:
        bind = _check_host(bind, "broker.bind")
    engine = b.get("engine", "mosquitto")
    if engine not in ENGINES:
        raise ConfigError(f"broker.engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    port = _int(b.get("port", 8883), "broker.port", 1, 65535)
    if engine == "mosquitto" and "nodes" in b:
        raise ConfigError("broker.nodes is for a broker cluster: set broker.engine to nats, or drop nodes")
    nodes = _nodes(b.get("nodes", 3), hosts[0], port) if engine == "nats" else ()
    hosts = tuple(dict.fromkeys((*hosts, *(n.host for n in nodes))))  # every node's name in the certificate
    broker = BrokerSpec(
        engine=engine,
        nodes=nodes,
        hosts=hosts,
        port=port,
        url=url,
        bind=bind,
        config_dir=_absolute_dir(b.get("config_dir", "/etc/mosquitto/fedsdk"), "broker.config_dir").rstrip(
            "/"
        )
        or "/",
        persistence_dir=_absolute_dir(
            b.get("persistence_dir", "/var/lib/mosquitto/"), "broker.persistence_dir"
        ),
    )

    key_mode = top.get("key_mode", "shared")
    if key_mode not in KEY_MODES:
        raise ConfigError(f"key_mode must be one of {', '.join(KEY_MODES)}, got {key_mode!r}")

    he_raw = _table(top.get("he", {}), "he", {"backend", "options"})
    backend = he_raw.get("backend", DEFAULT_BACKEND)
    if backend not in BACKENDS:
        raise ConfigError(f"he.backend must be one of {', '.join(sorted(BACKENDS))}, got {backend!r}")
    options = he_raw.get("options", {})
    if not isinstance(options, Mapping):
        raise ConfigError("he.options must be a table/object of generate_backend options")
    try:
        options = json.loads(json.dumps(dict(options)))  # JSON-able, detached from the parsed file
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"he.options must be plain JSON values: {exc}") from exc

    validity = _table(top.get("validity_days", {}), "validity_days", {"ca", "leaf"})
    ca_days = _int(validity.get("ca", 3650), "validity_days.ca", 1, 36500)
    leaf_days = _int(validity.get("leaf", 825), "validity_days.leaf", 1, 36500)
    if leaf_days > ca_days:
        raise ConfigError("validity_days.leaf must not exceed validity_days.ca")
    return Fleet(
        federation=federation,
        devices=devices,
        coordinator_host=coordinator_host,
        broker=broker,
        key_mode=key_mode,
        he=HESpec(backend, options),
        http_port=http_port,
        ca_days=ca_days,
        leaf_days=leaf_days,
    )


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet file: ``.toml`` with ``tomllib`` (Python >= 3.11), anything else as JSON."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read fleet file {p}: {exc}") from exc
    if p.suffix.lower() == ".toml":
        if sys.version_info < (3, 11):
            raise ConfigError(f"{p}: TOML fleet files need Python >= 3.11 (tomllib); write it as JSON")
        import tomllib

        try:
            data: Any = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{p} is not valid TOML: {exc}") from exc
    else:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{p} is not valid JSON: {exc}") from exc
    return fleet_from_mapping(data)
