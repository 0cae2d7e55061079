"""A NATS broker cluster for a fleet that outgrows one broker: the configuration ``fedsdk provision`` writes.

Chosen over RabbitMQ's MQTT plugin by measurement (``docs/results/broker-engines.md``). Every node speaks
MQTT 3.1.1 to the devices, the coordinator and the key server (unchanged clients: paho, QoS 1), and the
NATS protocol with JetStream to the aggregation workers (``fedsdk_coordinator.workers``). The nodes route
to each other, so a device connects to any node and fails over to another (its kit lists them all).

Files in the fleet's ``broker/nats/`` (``fedsdk cluster up --fleet-dir fleet/`` runs them in place):

* ``node-<i>.conf``, one per node: its listeners (MQTT for the devices, NATS for the workers, the route
  port for the other nodes), JetStream with its store in ``data/node-<i>/``, and ``include fleet.conf``;
* ``fleet.conf``: who may connect and what each identity may do, rewritten by ``fedsdk provision
  add-device | revoke | reissue``; ``kill -HUP`` each node (or ``nats-server --signal reload=<pid>``)
  to apply it: a revoked certificate's open connections are closed and new ones refused.

What mosquitto gives fedsdk, and how the cluster keeps it (decisions, tested in
``tests/integration/test_acl.py`` against a 3-node cluster):

* **The certificate is the identity.** ``verify_and_map``: a client must present a certificate of the fleet
  CA, and NATS maps it to a user by its URI ``urn:fedsdk:cert:<serial>`` (``pki.issue_cert``): one user
  per *valid certificate* of the ledger (``ca/issued.json``), holding the rights of the certificate's id.
  ``allowed_connection_types`` keeps devices on MQTT and the workers on the NATS protocol.
* **Revocation.** NATS reads no CRL. A revoked or superseded certificate has no user in ``fleet.conf``,
  so the reload refuses it, while a newer certificate of the same id keeps working. (Pinning the valid
  keys with ``pinned_certs`` was tried first: nats-server cannot reload the ``mqtt`` block, so the whole
  reload was refused, measured.)
* **The ACL.** Per identity, the publish and subscribe rights of the generated mosquitto ACL
  (``provision.mosquitto``), as NATS subjects: MQTT ``a/b`` is the subject ``a.b`` and a ``.`` inside a
  level is ``//``; an MQTT filter ``x/#`` also matches ``x`` itself, so both are granted.
* **Retained broadcasts** are kept by NATS in a JetStream stream replicated to every node (up to 3), so a
  device that connects to any node gets them. **QoS 1** for publishing; devices subscribe with QoS 0
  (``fedsdk.transport.mqtt``: each QoS 1 subscription would be a replicated consumer), the coordinator
  with QoS 1 (``MAX_CONSUMERS`` lets more than 1,000 such subscriptions exist).
* **Size limits.** ``max_payload`` 8 MiB (the NATS ceiling its authors advise): a larger MQTT PUBLISH is
  refused from its header. fedsdk clients given several nodes send a message up to 8 MiB less 4 KiB in
  one frame (``fedsdk.transport.mqtt.CLUSTER_CHUNK``); the update stream keeps at most
  ``STREAM_BYTES`` bytes.

Decision beyond the brief: the workers' identity ``aggregator`` (one certificate, ``fleet/aggregator/``,
shared by every worker: they are interchangeable) may use the JetStream API, which also lets it delete
the update stream; it is an operator's process on an operator's machine, like the coordinator.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from fedsdk.errors import ConfigError
from fedsdk.transport.mqtt import CLUSTER_MAX_PAYLOAD
from fedsdk_coordinator.provision.fleet import Fleet, NodeSpec
from fedsdk_coordinator.provision.ledger import Ledger

__all__ = [
    "MAX_PAYLOAD",
    "NATS_DIR",
    "STREAM_BYTES",
    "mqtt_subject",
    "nats_urls",
    "render_fleet_conf",
    "render_node_conf",
    "stream_name",
    "update_subject",
    "write_nats",
]

#: The cluster's folder inside ``broker/``.
NATS_DIR = "nats"
#: The largest message a client may publish (NATS ``max_payload``).
MAX_PAYLOAD = CLUSTER_MAX_PAYLOAD  # the devices' one-frame size is this less room for the header
#: Consumers a stream may have (``jetstream.limits.default_max_consumers``, nats-server 2.15 or later).
MAX_CONSUMERS = 10_000_000
#: The most the update stream keeps on each node's disk before it refuses new updates.
STREAM_BYTES = 8 * 1024**3


def mqtt_subject(topic: str) -> str:
    """The NATS subject of an MQTT topic or filter: ``/`` is ``.``, a ``.`` inside a level is ``//``, ``+``
    is ``*`` and ``#`` is ``>``."""
    levels = []
    for level in topic.split("/"):
        level = level.replace(".", "//")
        levels.append({"+": "*", "#": ">"}.get(level, level))
    return ".".join(levels)


def _filter(topic: str) -> list[str]:
    """The subjects an MQTT filter covers: ``x/#`` matches ``x`` too."""
    if topic.endswith("/#"):
        return [mqtt_subject(topic[:-2]), mqtt_subject(topic)]
    return [mqtt_subject(topic)]


def stream_name(federation: str) -> str:
    """The JetStream stream that keeps a federation's updates for the workers."""
    return "FEDSDK_UP_" + "".join(c if c.isalnum() else "_" for c in federation)


def update_subject(federation: str) -> str:
    """The subject every device's update is published on (``fl/<fed>/up/<id>/update``)."""
    return mqtt_subject(f"fl/{federation}/up/+/update")


def nats_urls(nodes: Iterable[NodeSpec]) -> list[str]:
    """The workers' URLs of the cluster's nodes."""
    return [f"tls://{n.host}:{n.nats_port}" for n in nodes]


def _rights(fed: str, key_mode: str) -> dict[str, tuple[list[str], list[str]]]:
    """Per service identity: MQTT topics it may publish, MQTT filters it may subscribe to (the same
    rights as ``provision.mosquitto.ACL_TEMPLATE``)."""
    base = f"fl/{fed}"
    coordinator_pub = [f"{base}/down/#", f"{base}/cluster/#", f"{base}/coordinator/status", f"{base}/agg/#"]
    if key_mode == "keyserver":
        coordinator_pub.append(f"{base}/keyserver/#")
    coordinator_sub = [f"{base}/up/#", f"{base}/coordinator/status", f"{base}/agg/#", "_INBOX/#"]
    rights = {"coordinator": (coordinator_pub, coordinator_sub)}
    if key_mode == "keyserver":
        rights["keyserver"] = ([f"{base}/cluster/#"], [f"{base}/keyserver/#"])
    return rights


def _device_rights(fed: str, cid: str) -> tuple[list[str], list[str]]:
    base = f"fl/{fed}"
    return [f"{base}/up/{cid}/#"], [f"{base}/down/{cid}", f"{base}/cluster/#", f"{base}/coordinator/status"]


def _user(name: str, pub: list[str], sub: list[str], kinds: list[str], *, responds: bool = False) -> str:
    subjects = {
        "publish": [s for t in pub for s in _filter(t)],
        "subscribe": [s for t in sub for s in _filter(t)],
    }
    perms = ", ".join(f"{k}: {{allow: {json.dumps(v)}}}" for k, v in subjects.items())
    if responds:  # may answer a request on its reply subject (the coordinator's verdict on a partial)
        perms += ", allow_responses: true"
    return (
        f"    {{user: {json.dumps(name)}, allowed_connection_types: {json.dumps(kinds)}, "
        f"permissions: {{{perms}}}}}"
    )


def render_fleet_conf(fleet: Fleet, ledger: Ledger) -> str:
    """``fleet.conf``: one user per valid client certificate of the ledger, with its id's rights."""
    fed = fleet.federation
    devices = set(fleet.devices)
    services = _rights(fed, fleet.key_mode)
    users = []
    for cert in ledger.certs:
        if cert.revoked or cert.role == "broker":
            continue
        name = cert.nats_user or f"CN={cert.cn}"
        if cert.cn in devices:
            users.append(_user(name, *_device_rights(fed, cert.cn), ["MQTT"]))
        elif cert.cn in services:
            coordinator = cert.cn == "coordinator"
            kinds = ["MQTT", "STANDARD"] if coordinator else ["MQTT"]
            users.append(_user(name, *services[cert.cn], kinds, responds=coordinator))
        elif cert.cn == "aggregator":
            agg = f"fl/{fed}/agg/#"
            pub = ["$JS/API/#", "$JS/ACK/#", agg]
            users.append(_user(name, pub, ["_INBOX/#", agg], ["STANDARD"]))
    lines = [
        f'# The identities of the fedsdk federation "{fed}" and their rights, by `fedsdk provision`: one',
        "# user per valid client certificate (its URI urn:fedsdk:cert:<serial>). Rewritten by add-device,",
        "# revoke and reissue; SIGHUP every node to apply it (a revoked certificate's connections close).",
        "authorization {",
        "  users = [",
        *users,
        "  ]",
        "}",
        "",
    ]
    return "\n".join(lines)


def render_node_conf(fleet: Fleet, index: int, folder: Path, *, bind: str | None = None) -> str:
    """``node-<index + 1>.conf``, running in place from ``folder`` (the fleet's ``broker/nats``)."""
    nodes = fleet.broker.nodes
    if not 0 <= index < len(nodes):
        raise ConfigError(f"node {index} of a cluster of {len(nodes)}")
    node, broker = nodes[index], folder.parent
    if any(c.isspace() or c == '"' for c in str(folder)):
        raise ConfigError(f"the fleet folder {folder} must not contain spaces or quotes (nats-server.conf)")
    host = bind or fleet.broker.bind or "0.0.0.0"
    routes = ", ".join(f'"nats-route://{n.host}:{n.cluster_port}"' for n in nodes)
    files = f'cert_file: "{broker}/server.pem", key_file: "{broker}/server.key", ca_file: "{broker}/ca.pem"'
    return f"""\
# Node {index + 1} of {len(nodes)} of the NATS cluster of the fedsdk federation "{fleet.federation}",
# written by `fedsdk provision`. Runs in place: nats-server -c {folder}/node-{index + 1}.conf
# (or every node with its aggregation workers: fedsdk cluster up --fleet-dir {broker.parent}).
include "fleet.conf"

server_name: "{fleet.federation}-{index + 1}"
# The NATS protocol, for the aggregation workers (mutual TLS, identity aggregator).
listen: "{host}:{node.nats_port}"
max_payload: {MAX_PAYLOAD}
max_pending: 67108864
tls {{ {files}, verify_and_map: true, timeout: 5 }}

jetstream {{
  store_dir: "{folder}/data/node-{index + 1}"
  max_memory_store: 268435456
  max_file_store: {2 * STREAM_BYTES}
  # every QoS 1 MQTT subscription is a consumer of the stream $MQTT_msgs (3 a device); NATS 2.15 caps a
  # stream at 1,000 consumers unless told otherwise (the 1,001st subscription is refused)
  limits {{ default_max_consumers: {MAX_CONSUMERS} }}
}}

cluster {{
  name: "fedsdk-{fleet.federation.replace(".", "-")}"
  listen: "{host}:{node.cluster_port}"
  routes: [{routes}]
  tls {{ {files}, verify: true, timeout: 5 }}
}}

# MQTT for the devices, the coordinator and the key server: the certificate's CN is the user of fleet.conf.
mqtt {{
  listen: "{host}:{node.port}"
  tls {{ {files}, verify_and_map: true, timeout: 5 }}
  max_ack_pending: 20
  ack_wait: "30s"
}}
"""


def write_nats(root: Path, final: Path, fleet: Fleet, ledger: Ledger) -> None:
    """Write ``broker/nats/`` of a fleet under construction in ``root`` (renamed to ``final`` later)."""
    from fedsdk_coordinator.pki import write_public

    folder = root / "broker" / NATS_DIR
    (folder / "data").mkdir(mode=0o700, parents=True, exist_ok=True)
    for i in range(len(fleet.broker.nodes)):
        conf = render_node_conf(fleet, i, final / "broker" / NATS_DIR)
        write_public(folder / f"node-{i + 1}.conf", conf.encode())
    write_public(folder / "fleet.conf", render_fleet_conf(fleet, ledger).encode())
