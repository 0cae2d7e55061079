"""mosquitto 2.x configuration and ACL for a provisioned fleet.

The two templates below are also shipped, byte for byte, as ``certs/mosquitto.conf.template`` and
``certs/acl.template`` (a test keeps them equal). They follow mosquitto.conf(5) of mosquitto 2.0:

* one TLS listener (default 8883) with ``require_certificate true`` and ``use_identity_as_username true``:
  a client must present a certificate signed by the fleet CA (``cafile``), not listed in the CRL
  (``crlfile``), and its subject CN becomes the MQTT username the ACL checks. ``allow_anonymous false``
  refuses any session without a username, so a client without a certificate cannot connect;
* ``acl_file`` with ``pattern`` lines (``%u`` = username = CN) for devices and ``user`` blocks for the two
  service identities ``coordinator`` and ``keyserver``. mosquitto grants an operation when any line of the
  client's user block or any pattern matches, and denies everything else;
* persistence on (retained coordinator status and QoS 1 sessions survive a restart);
* ``max_packet_size`` derived from the largest message the coordinator accepts
  (:func:`fedsdk._chunking.max_packet_bytes`, 67,174,450 bytes for 64 MiB messages): mosquitto then refuses
  a larger PUBLISH from its length alone instead of buffering it (a device could otherwise make the broker
  and the coordinator hold messages of hundreds of megabytes). ``message_size_limit`` would drop such a
  message only after reading all of it, and acknowledge it to an MQTT 3.1.1 client as if delivered.

Decisions beyond the brief (DESIGN.md, "Transport"):

* In key mode ``keyserver`` the coordinator may also *write* ``fl/<fed>/keyserver/#``: it has to hand the
  encrypted aggregate to the key server, which reads only that subtree. In key mode ``shared`` no identity
  has any right on ``keyserver/`` topics.
* A device may read every cluster's broadcasts (``fl/<fed>/cluster/#``), not only its own cluster's:
  cluster membership changes at run time (re-clustering) and a static ``acl_file`` cannot follow it. Cluster
  broadcasts carry aggregates, never an individual update, so this leaks cluster means between clusters
  only. A dynamic-security or auth-plugin ACL could close it later.
* ``use_username_as_clientid true``: the MQTT client id is replaced by the username (the CN), so a device
  cannot connect under the coordinator's client id and take over (disconnect) its session.
* ``tls_version tlsv1.2`` is the *minimum* version in mosquitto 2.0 (TLS 1.3 is still negotiated).
"""

from __future__ import annotations

import os
from string import Template

from fedsdk._chunking import MAX_MESSAGE_BYTES, max_packet_bytes
from fedsdk.errors import ConfigError
from fedsdk.protocol.topics import validate_config_id

__all__ = ["ACL_TEMPLATE", "MOSQUITTO_CONF_TEMPLATE", "render_acl", "render_mosquitto_conf"]

MOSQUITTO_CONF_TEMPLATE = """\
# mosquitto 2.x configuration for the fedsdk federation "${FEDERATION}", written by `fedsdk provision`.
#
# Install on the broker host (certs/README.md explains each step):
#   install -d -m 0755 ${CONFIG_DIR}
#   install -m 0644 ca.pem server.pem crl.pem acl mosquitto.conf ${CONFIG_DIR}/
#   install -m 0600 -o mosquitto server.key ${CONFIG_DIR}/
#   mosquitto -c ${CONFIG_DIR}/mosquitto.conf
#
# Clients authenticate with a certificate signed by the fleet CA and nothing else: the certificate's CN
# becomes the MQTT username that the ACL checks. No passwords, no anonymous access.

per_listener_settings false
allow_anonymous false
acl_file ${CONFIG_DIR}/acl

# Persistence: the retained coordinator status and QoS 1 sessions survive a broker restart.
persistence true
persistence_location ${PERSISTENCE_DIR}
autosave_interval 60

# fedsdk keeps at most 20 chunks in flight per client. The queue is per receiving client: the coordinator
# receives every device's hello at once, and at mosquitto's default of 1000 a fleet of ~1000 devices joining
# together lost hellos (measured, docs/load.md), so it is raised.
max_inflight_messages 20
max_queued_messages 100000

# Nagle's algorithm off on client sockets: fedsdk's messages are small and latency-bound, and with Nagle on
# a publish can wait for a delayed ACK (40 ms on Linux) behind a PUBACK at every hop.
set_tcp_nodelay true

# The largest MQTT packet a client may send: one frame holding the largest message fedsdk accepts
# (${MAX_MESSAGE_BYTES} bytes plus the 42-byte frame header; a retained message is never chunked) on the
# longest topic MQTT allows. A client sending a larger packet is disconnected as soon as its length
# arrives, before mosquitto reads (and buffers) the payload.
max_packet_size ${MAX_PACKET_SIZE}

# mosquitto 2.0 logs an ACL denial ("Denied PUBLISH from <client> ... '<topic>'") only with log_type debug,
# which also logs every packet: add `log_type debug` while investigating a device whose messages vanish (a
# denied QoS 1 publish is still acknowledged under MQTT 3.1.1), then take it out again.
log_dest stderr
log_type error
log_type warning
log_type notice
log_type information
connection_messages true

# Mutual TLS: a client certificate signed by the fleet CA and not revoked is required. Its CN becomes the
# username and the client id, so no identity can take over another one's session by choosing its client id.
# `kill -HUP` (systemctl reload) re-reads acl and crl.pem for new connections.
listener ${PORT}${BIND}
protocol mqtt
cafile ${CONFIG_DIR}/ca.pem
certfile ${CONFIG_DIR}/server.pem
keyfile ${CONFIG_DIR}/server.key
crlfile ${CONFIG_DIR}/crl.pem
tls_version tlsv1.2
require_certificate true
use_identity_as_username true
use_username_as_clientid true
"""

ACL_TEMPLATE = """\
# mosquitto acl_file for the fedsdk federation "${FEDERATION}", written by `fedsdk provision`.
# The username is the client certificate's CN (use_identity_as_username true). A client may do exactly
# what a line below grants it; everything else is denied.

# Every device (%u is its certificate's CN = its client id): publish only under its own id; read only
# its own downstream topic, the cluster broadcasts and the coordinator's status.
# LIMITATION: a device may read every cluster's broadcasts, not only its own cluster's (membership changes
# at run time; a static ACL cannot follow it). Broadcasts carry cluster aggregates, never one update.
# mosquitto warns that the last two patterns contain no %u: intended, they apply to every device.
pattern write fl/${FEDERATION}/up/%u/#
pattern read fl/${FEDERATION}/down/%u
pattern read fl/${FEDERATION}/cluster/#
pattern read fl/${FEDERATION}/coordinator/status

# The coordinator: reads every device's messages; writes tasks, cluster broadcasts and its status.
user coordinator
topic read fl/${FEDERATION}/up/#
topic write fl/${FEDERATION}/down/#
topic write fl/${FEDERATION}/cluster/#
topic readwrite fl/${FEDERATION}/coordinator/status
#[keyserver]
topic write fl/${FEDERATION}/keyserver/#

# The key server (key mode keyserver): reads what the coordinator sends it, writes decrypted aggregates.
user keyserver
topic read fl/${FEDERATION}/keyserver/#
topic write fl/${FEDERATION}/cluster/#
#[/keyserver]
"""

_OPEN, _CLOSE = "#[keyserver]", "#[/keyserver]"


def _plain_path(value: str, what: str) -> str:
    if not value.startswith("/") or any(c.isspace() for c in value):
        raise ConfigError(f"{what} must be an absolute path without spaces, got {value!r}")
    return value


def render_mosquitto_conf(
    federation: str,
    *,
    config_dir: str | os.PathLike[str] = "/etc/mosquitto/fedsdk",
    persistence_dir: str | os.PathLike[str] = "/var/lib/mosquitto/",
    port: int = 8883,
    bind: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> str:
    """``mosquitto.conf`` whose TLS files and ACL live in ``config_dir`` on the broker host.

    ``max_message_bytes`` is the coordinator's largest accepted message; ``max_packet_size`` is derived
    from it (:func:`fedsdk._chunking.max_packet_bytes`).
    """
    if isinstance(port, bool) or not 0 < int(port) < 65536:
        raise ConfigError(f"broker port must be in 1..65535, got {port!r}")
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1:
        raise ConfigError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")
    conf_dir = _plain_path(os.fspath(config_dir), "broker config_dir").rstrip("/") or ""
    persist = _plain_path(os.fspath(persistence_dir), "broker persistence_dir")
    if not persist.endswith("/"):
        persist += "/"  # mosquitto appends the file name to persistence_location as is
    return Template(MOSQUITTO_CONF_TEMPLATE).substitute(
        FEDERATION=validate_config_id(federation, "federation"),
        CONFIG_DIR=conf_dir,
        PERSISTENCE_DIR=persist,
        PORT=str(int(port)),
        BIND=f" {bind}" if bind else "",
        MAX_MESSAGE_BYTES=str(max_message_bytes),
        MAX_PACKET_SIZE=str(max_packet_bytes(max_message_bytes)),
    )


def render_acl(federation: str, *, key_mode: str = "shared") -> str:
    """The ``acl_file`` of a federation: keyserver lines only in key mode ``keyserver``."""
    if key_mode not in ("shared", "keyserver"):
        raise ConfigError(f"key_mode must be shared or keyserver, got {key_mode!r}")
    text = Template(ACL_TEMPLATE).substitute(FEDERATION=validate_config_id(federation, "federation"))
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if line == _OPEN:
            inside = True
            continue
        if line == _CLOSE:
            inside = False
            continue
        if inside and key_mode != "keyserver":
            continue
        out.append(line)
    return "\n".join(out) + "\n"
