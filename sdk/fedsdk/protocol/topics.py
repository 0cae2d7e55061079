"""Topic names and message kinds: the constants of the wire protocol, in one place.

The topic tree (DESIGN.md, "Transport")::

    fl/<federation>/up/<client_id>/<kind>     a device publishes (kind: hello, update, error, bye, ...)
    fl/<federation>/down/<client_id>          the coordinator to one device
    fl/<federation>/cluster/<cluster_id>      the coordinator to every device of a cluster (and the relayed
                                              decryption shares of its devices, never retained)
    fl/<federation>/coordinator/status        retained coordinator status (also its last will)

Identifiers that become topic levels (federation, client id) must match ``[A-Za-z0-9_.-]{1,64}``. That keeps
out the MQTT 3.1.1 wildcards ``+`` and ``#`` and the level separator ``/`` (MQTT 3.1.1 §4.7.1), the ``$``
prefix reserved for broker topics (§4.7.2), empty levels, and anything a broker ACL pattern such as
``fl/+/up/%c/#`` could be confused by. The same rule is applied to every id carried inside a message, so an
id received in a payload can always be turned back into a topic.

:class:`MessageKind` is the one-byte message kind of the binary envelope (see ``envelope.py``). New message
types add a member here and register their class in ``messages.py``; numbers are never reused.
"""

from __future__ import annotations

import enum
import re

from fedsdk.errors import ConfigError, ValidationError

__all__ = [
    "BYE",
    "ERROR",
    "HELLO",
    "ID_PATTERN",
    "KEYS",
    "MODEL",
    "PROBE",
    "REPORT",
    "SHARE",
    "SHARES",
    "SKETCH",
    "UNMASK",
    "UPDATE",
    "UP_KINDS",
    "UP_KIND_OF",
    "MessageKind",
    "cluster",
    "down",
    "is_valid_id",
    "keyserver",
    "parse_up",
    "status",
    "up",
    "up_filter",
    "validate_config_id",
    "validate_id",
]


class MessageKind(enum.IntEnum):
    """The u8 message kind written in byte 5 of every envelope. 0 is never used."""

    HELLO = 1
    TASK = 2
    UPDATE = 3
    AGGREGATE = 4
    ERROR = 5
    STATUS = 6
    BYE = 7
    ENCRYPTED_UPDATE = 8
    ENCRYPTED_AGGREGATE = 9
    SKETCH = 10
    REPORT = 11
    DECRYPT_SHARE = 12
    SHARE_BUNDLE = 13
    MODEL_REQUEST = 14
    SEALED_MODEL = 15
    MASK_KEYS = 16
    MASK_ROSTER = 17
    MASK_SHARES = 18
    MASK_RELAY = 19
    UNMASK_REQUEST = 20
    UNMASK_SHARES = 21
    MASKED_UPDATE = 22


# The last level of an upstream topic: what a device publishes.
HELLO = "hello"
UPDATE = "update"
ERROR = "error"
BYE = "bye"
SKETCH = "sketch"
REPORT = "report"
SHARE = "share"  # a device's sealed part of a decrypted aggregate, relayed to its cluster (crypto/shares.py)
PROBE = "probe"  # raw bytes a device times to measure its uplink; no envelope, never decoded
MODEL = "model"  # a device's model sealed for one device of its cluster that lacks it (client/relay.py)
KEYS = "keys"  # a device's masking public keys for one session (secure aggregation, fedsdk.secagg)
SHARES = "shares"  # its Shamir shares of its masking secrets, sealed for each neighbour
UNMASK = "unmask"  # the shares that remove the masks of a sum
UP_KINDS: frozenset[str] = frozenset(
    {HELLO, UPDATE, ERROR, BYE, SKETCH, REPORT, SHARE, PROBE, MODEL, KEYS, SHARES, UNMASK}
)

#: Which upstream topic kind carries which message kind (a device publishes nothing else).
UP_KIND_OF: dict[MessageKind, str] = {
    MessageKind.HELLO: HELLO,
    MessageKind.UPDATE: UPDATE,
    MessageKind.ERROR: ERROR,
    MessageKind.BYE: BYE,
    MessageKind.ENCRYPTED_UPDATE: UPDATE,
    MessageKind.SKETCH: SKETCH,
    MessageKind.REPORT: REPORT,
    MessageKind.DECRYPT_SHARE: SHARE,
    MessageKind.SEALED_MODEL: MODEL,
    MessageKind.MASK_KEYS: KEYS,
    MessageKind.MASK_SHARES: SHARES,
    MessageKind.UNMASK_SHARES: UNMASK,
    MessageKind.MASKED_UPDATE: UPDATE,
}

ID_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
_ID_RE = re.compile(ID_PATTERN)


def is_valid_id(s: object) -> bool:
    """True when ``s`` is a str matching :data:`ID_PATTERN` in full (no trailing newline sneaks past)."""
    return isinstance(s, str) and _ID_RE.fullmatch(s) is not None


def _describe(s: object) -> str:
    text = repr(s)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_id(s: object, what: str) -> str:
    """Return ``s`` if it is a valid id, else raise ``ValidationError("bad_field")`` (for received data)."""
    if not is_valid_id(s):
        raise ValidationError("bad_field", f"{what} must match {ID_PATTERN}, got {_describe(s)}")
    assert isinstance(s, str)
    return s


def validate_config_id(s: object, what: str) -> str:
    """Return ``s`` if it is a valid id, else raise :class:`ConfigError` (for local configuration)."""
    if not is_valid_id(s):
        raise ConfigError(f"{what} must match {ID_PATTERN}, got {_describe(s)}")
    assert isinstance(s, str)
    return s


def _cluster_level(cluster_id: int) -> str:
    if isinstance(cluster_id, bool) or not isinstance(cluster_id, int) or not 0 <= cluster_id < 2**31:
        raise ConfigError(f"cluster id must be an int in [0, 2**31), got {_describe(cluster_id)}")
    return str(cluster_id)


def up(federation: str, client_id: str, kind: str) -> str:
    """``fl/<federation>/up/<client_id>/<kind>``: where a device publishes a message of ``kind``."""
    if kind not in UP_KINDS:
        raise ConfigError(f"upstream kind must be one of {sorted(UP_KINDS)}, got {_describe(kind)}")
    fed = validate_config_id(federation, "federation")
    cid = validate_config_id(client_id, "client id")
    return f"fl/{fed}/up/{cid}/{kind}"


def up_filter(federation: str) -> str:
    """``fl/<federation>/up/+/+``: the coordinator's subscription to every device's messages."""
    return f"fl/{validate_config_id(federation, 'federation')}/up/+/+"


def down(federation: str, client_id: str) -> str:
    """``fl/<federation>/down/<client_id>``: the coordinator to one device."""
    fed = validate_config_id(federation, "federation")
    return f"fl/{fed}/down/{validate_config_id(client_id, 'client id')}"


def cluster(federation: str, cluster_id: int) -> str:
    """``fl/<federation>/cluster/<cluster_id>``: the coordinator to every device of a cluster."""
    return f"fl/{validate_config_id(federation, 'federation')}/cluster/{_cluster_level(cluster_id)}"


def keyserver(federation: str, cluster_id: int) -> str:
    """Where the coordinator sends a cluster's encrypted aggregate in key mode ``keyserver``."""
    return f"fl/{validate_config_id(federation, 'federation')}/keyserver/{_cluster_level(cluster_id)}"


def status(federation: str) -> str:
    """``fl/<federation>/coordinator/status``: retained coordinator status and its last will."""
    return f"fl/{validate_config_id(federation, 'federation')}/coordinator/status"


def parse_up(topic: object) -> tuple[str, str, str]:
    """Split an upstream topic into ``(federation, client_id, kind)``.

    Raises ``ValidationError("bad_topic")`` for anything that :func:`up` could not have produced. The client
    id returned here is the sender as the broker saw it (the ACL lets a device publish only under its own id),
    so it is what ``validate.check_update(..., sender=...)`` compares the payload's ``client_id`` with.
    """
    if not isinstance(topic, str):
        raise ValidationError("bad_topic", f"topic must be a str, got {type(topic).__name__}")
    parts = topic.split("/")
    if len(parts) != 5 or parts[0] != "fl" or parts[2] != "up":
        raise ValidationError("bad_topic", f"not an upstream topic: {_describe(topic)}")
    _, federation, _, client_id, kind = parts
    if not is_valid_id(federation):
        raise ValidationError("bad_topic", f"bad federation in topic {_describe(topic)}")
    if not is_valid_id(client_id):
        raise ValidationError("bad_topic", f"bad client id in topic {_describe(topic)}")
    if kind not in UP_KINDS:
        raise ValidationError("bad_topic", f"unknown upstream kind in topic {_describe(topic)}")
    return federation, client_id, kind
