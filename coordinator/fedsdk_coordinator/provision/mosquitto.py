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

Two configurations from the one template, both in the fleet's ``broker/`` folder:

* ``mosquitto.conf`` runs the broker *in place*, as the README does (``mosquitto -c
  fleet/broker/mosquitto.conf``): it names the files of that folder by absolute path (mosquitto resolves a
  relative path against its working directory, not the configuration's) and keeps its data in
  ``broker/data/``. The fleet folder is 0700 and ``server.key`` 0600, owned by the user who provisioned
  them, and mosquitto 2 started as root switches to ``user`` (default ``mosquitto``) *before* it reads the
  ACL, the CRL and its data, so the in-place file says ``user <the provisioning user>``: started by that
  user it changes nothing (mosquitto switches only when started as root), started by root it runs as the
  owner of the files, ``root`` itself when root provisioned. No file is loosened for another account.
* ``mosquitto.system.conf`` is for a system service on a broker host: the same settings with the files in
  ``broker.config_dir`` (``/etc/mosquitto/fedsdk``), data in ``broker.persistence_dir`` and ``user
  mosquitto``; its header holds the ``install`` commands (``server.key`` 0600 owned by ``mosquitto``).

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

import getpass
import os
from string import Template

from fedsdk._chunking import MAX_MESSAGE_BYTES, max_packet_bytes
from fedsdk.errors import ConfigError
from fedsdk.protocol.topics import validate_config_id

__all__ = [
    "ACL_TEMPLATE",
    "IN_PLACE_CONF",
    "IN_PLACE_DATA",
    "MOSQUITTO_CONF_TEMPLATE",
    "SYSTEM_CONF",
    "current_user",
    "render_acl",
    "render_in_place_conf",
    "render_mosquitto_conf",
]

MOSQUITTO_CONF_TEMPLATE = """\
# mosquitto 2.x configuration for the fedsdk federation "${FEDERATION}", written by `fedsdk provision`.
#
${USAGE}
#
# Clients authenticate with a certificate signed by the fleet CA and nothing else: the certificate's CN
# becomes the MQTT username that the ACL checks. No passwords, no anonymous access.

# Started as root, mosquitto switches to this user (and its group) before it reads the ACL, the CRL and
# the persistence file, so this user must be able to read every file below; started as any other user it
# runs as that user and this line has no effect.
user ${USER}

per_listener_settings false
allow_anonymous false
acl_file ${CONFIG_DIR}/acl

# Persistence: the retained coordinator status and QoS 1 sessions survive a broker restart.
persistence true
persistence_location ${PERSISTENCE_DIR}
autosave_interval 60

# fedsdk keeps at most 20 chunks in flight per client. The queue is per receiving client: the coordinator
# receives every device's hello at once, and at mosquitto's default of 1000 a fleet of ~1000 devices joining
# together lost hellos (measured, docs/results/load.md), so it is raised.
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

#: The two configurations in a fleet's ``broker/`` folder (see the module docstring).
IN_PLACE_CONF, SYSTEM_CONF = "mosquitto.conf", "mosquitto.system.conf"
#: The in-place broker's persistence folder, inside ``broker/``.
IN_PLACE_DATA = "data"

_SYSTEM_USAGE = """\
# For the broker host's system service. Install it there as root, from a copy of the fleet's broker/
# folder (certs/README.md explains each step):
#   install -d -m 0755 ${CONFIG_DIR}
#   install -m 0644 ca.pem server.pem crl.pem acl ${CONFIG_DIR}/
#   install -m 0644 mosquitto.system.conf ${CONFIG_DIR}/mosquitto.conf
#   install -m 0600 -o ${USER} server.key ${CONFIG_DIR}/
#   install -d -m 0700 -o ${USER} ${PERSISTENCE_DIR}
#   mosquitto -c ${CONFIG_DIR}/mosquitto.conf        (or point the service's -c at it)"""

_IN_PLACE_USAGE = """\
# Runs the broker from the fleet folder `fedsdk provision` wrote, as the operator, from any directory:
#   mosquitto -c ${CONFIG_DIR}/mosquitto.conf
# Every file is named by its absolute path in that folder: after moving the fleet folder, provision again
# or edit the paths. The fleet folder is private (0700) and server.key 0600, owned by the user who
# provisioned them, named in `user` below: start mosquitto as that user, or as root (mosquitto started as
# root switches to `user` before it reads the files). For a broker host's system service install
# mosquitto.system.conf instead (its header says how)."""


def _plain_path(value: str, what: str) -> str:
    if not value.startswith("/") or any(c.isspace() for c in value):
        raise ConfigError(f"{what} must be an absolute path without spaces, got {value!r}")
    return value


def _check_port(port: int, max_message_bytes: int) -> None:
    if isinstance(port, bool) or not 0 < int(port) < 65536:
        raise ConfigError(f"broker port must be in 1..65535, got {port!r}")
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1:
        raise ConfigError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")


def _render(
    federation: str,
    *,
    usage: str,
    conf_dir: str,
    persist: str,
    user: str,
    port: int,
    bind: str | None,
    max_message_bytes: int,
) -> str:
    if not persist.endswith("/"):
        persist += "/"  # mosquitto appends the file name to persistence_location as is
    if not user or any(c.isspace() for c in user):
        raise ConfigError(f"the broker's user must be a user name without spaces, got {user!r}")
    values = {
        "FEDERATION": validate_config_id(federation, "federation"),
        "CONFIG_DIR": conf_dir,
        "PERSISTENCE_DIR": persist,
        "USER": user,
        "PORT": str(int(port)),
        "BIND": f" {bind}" if bind else "",
        "MAX_MESSAGE_BYTES": str(max_message_bytes),
        "MAX_PACKET_SIZE": str(max_packet_bytes(max_message_bytes)),
    }
    return Template(MOSQUITTO_CONF_TEMPLATE).substitute(values, USAGE=Template(usage).substitute(values))


def render_mosquitto_conf(
    federation: str,
    *,
    config_dir: str | os.PathLike[str] = "/etc/mosquitto/fedsdk",
    persistence_dir: str | os.PathLike[str] = "/var/lib/mosquitto/",
    port: int = 8883,
    bind: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    user: str = "mosquitto",
) -> str:
    """``mosquitto.system.conf``: for a system service whose TLS files and ACL are installed in
    ``config_dir`` on the broker host, run as ``user`` (mosquitto's own default, ``mosquitto``).

    ``max_message_bytes`` is the coordinator's largest accepted message; ``max_packet_size`` is derived
    from it (:func:`fedsdk._chunking.max_packet_bytes`).
    """
    _check_port(port, max_message_bytes)
    return _render(
        federation,
        usage=_SYSTEM_USAGE,
        conf_dir=_plain_path(os.fspath(config_dir), "broker config_dir").rstrip("/") or "",
        persist=_plain_path(os.fspath(persistence_dir), "broker persistence_dir"),
        user=user,
        port=port,
        bind=bind,
        max_message_bytes=max_message_bytes,
    )


def current_user() -> str:
    """The name of the user this process runs as; ``mosquitto`` when it has none (a bare container uid).
    ``getpass`` rather than ``pwd``, which Windows lacks: an operator may provision there."""
    try:
        if hasattr(os, "geteuid"):
            import pwd

            return pwd.getpwuid(os.geteuid()).pw_name
        return getpass.getuser()
    except (KeyError, OSError):
        return "mosquitto"


def render_in_place_conf(
    federation: str,
    broker_dir: str | os.PathLike[str],
    *,
    port: int = 8883,
    bind: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    user: str | None = None,
) -> str:
    """``mosquitto.conf`` of a fleet's ``broker/`` folder: the broker run where ``fedsdk provision`` wrote
    it (``broker_dir``, absolute), keeping its data in ``broker_dir/data/``, as ``user`` when started as root
    (default: the user running this, who owns the files provision writes)."""
    _check_port(port, max_message_bytes)
    path = os.fspath(broker_dir)
    if not path.startswith("/") or path != path.strip() or any(c in path for c in "\r\n"):
        # mosquitto takes a value to the end of its line and strips the blanks around it
        raise ConfigError(
            f"the fleet folder must be an absolute path without line breaks or surrounding blanks, got "
            f"{path!r}: choose another --out"
        )
    path = path.rstrip("/")
    return _render(
        federation,
        usage=_IN_PLACE_USAGE,
        conf_dir=path,
        persist=f"{path}/{IN_PLACE_DATA}/",
        user=user or current_user(),
        port=port,
        bind=bind,
        max_message_bytes=max_message_bytes,
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
