"""The fleet's mosquitto ACL, read and enforced by the embedded broker.

`fedsdk provision` writes one ``acl_file`` for mosquitto
(:func:`fedsdk_coordinator.provision.mosquitto.render_acl`). The embedded amqtt broker enforces the *same
text* rather than a second copy of the rules, so the laptop default and a mosquitto fleet grant exactly the
same rights: a device publishes only under ``fl/<fed>/up/<its id>/``, reads only its own downstream topic, the
cluster broadcasts and the coordinator status; the coordinator and the key server get their ``user`` blocks.
Without it any device holding a fleet certificate could subscribe to ``fl/<fed>/up/#`` and read every other
device's update, and in key mode ``shared``, where every device holds the HE secret key, decrypt them.

The subset of mosquitto.conf(5) "acl_file" understood here is the one fedsdk writes: ``user NAME``,
``topic [read|write|readwrite] TOPIC`` and ``pattern [read|write|readwrite] TOPIC`` with ``%u`` (username)
and ``%c`` (client id) substituted; ``#`` comments. As in mosquitto, ``topic`` lines before the first
``user`` line are for anonymous clients, and the embedded broker has none (it requires a certificate), so
they grant nothing. Any other line is an error, never silently skipped. As in mosquitto, an identity
containing ``+``, ``#`` or ``/`` gets no pattern rights (it could otherwise widen a pattern).

Matching (decision): a concrete topic (publish, delivery) matches an ACL filter by the usual MQTT rules. A
*subscription filter* is allowed only when every message it could ever deliver is allowed: its ``+`` level
needs a ``+`` or ``#`` in the ACL, its ``#`` needs a ``#``. That is what mosquitto 2.0 does for the filters
fedsdk uses; it refuses ``fl/<fed>/#`` to a device even though some topics under it are readable.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fedsdk.errors import ConfigError
from fedsdk_coordinator.provision.crl import revoked_serials

__all__ = ["Access", "AclRules", "RevocationList", "filter_covers", "parse_acl"]

log = logging.getLogger("fedsdk_coordinator.broker")

Access = Literal["read", "write"]
_GRANTS = {"read": ("read",), "write": ("write",), "readwrite": ("read", "write")}


def filter_covers(acl_filter: str, requested: str) -> bool:
    """Whether every topic ``requested`` (a topic or a subscription filter) can match is inside
    ``acl_filter``."""
    acl, req = acl_filter.split("/"), requested.split("/")
    for i, a in enumerate(acl):
        if a == "#":
            return True  # covers this level and everything below, including an empty rest
        if i >= len(req):
            return False
        r = req[i]
        if r == "#":
            return False  # a multi-level request needs a multi-level grant
        if a == "+":
            continue
        if r != a:  # a literal grant covers only the same literal (a requested "+" is wider)
            return False
    return len(req) == len(acl)


@dataclass(frozen=True)
class _Rule:
    access: tuple[str, ...]
    topic: str


@dataclass(frozen=True)
class AclRules:
    """Parsed ``acl_file``: rules for anonymous clients (kept, never granted here), per user, and
    patterns."""

    anonymous: tuple[_Rule, ...] = ()
    users: dict[str, tuple[_Rule, ...]] = field(default_factory=dict)
    patterns: tuple[_Rule, ...] = ()

    def allows(self, username: str, client_id: str, access: Access, topic: str) -> bool:
        """mosquitto's rule: granted when any line of the user's block or any pattern grants ``access`` on
        a filter that covers ``topic``; denied otherwise."""
        if not topic:
            return False
        for rule in self.users.get(username, ()):
            if access in rule.access and filter_covers(rule.topic, topic):
                return True
        if any(c in ident for ident in (username, client_id) for c in "+#/") or not username:
            return False
        for rule in self.patterns:
            if access in rule.access:
                acl_topic = rule.topic.replace("%u", username).replace("%c", client_id)
                if filter_covers(acl_topic, topic):
                    return True
        return False


def _rule(words: list[str], lineno: int) -> _Rule:
    if len(words) == 2:
        access, topic = "readwrite", words[1]
    elif len(words) == 3 and words[1] in _GRANTS:
        access, topic = words[1], words[2]
    else:
        raise ConfigError(f"ACL line {lineno}: expected '{words[0]} [read|write|readwrite] TOPIC'")
    return _Rule(_GRANTS[access], topic)


def parse_acl(text: str) -> AclRules:
    """Parse the acl_file subset described in the module docstring; :class:`ConfigError` on anything else."""
    anonymous: list[_Rule] = []
    users: dict[str, list[_Rule]] = {}
    patterns: list[_Rule] = []
    current: list[_Rule] = anonymous
    for lineno, raw in enumerate(text.splitlines(), 1):
        words = raw.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "user" and len(words) == 2:
            current = users.setdefault(words[1], [])
        elif words[0] == "topic":
            current.append(_rule(words, lineno))
        elif words[0] == "pattern":
            patterns.append(_rule(words, lineno))
        else:
            raise ConfigError(f"ACL line {lineno}: cannot read {raw.strip()!r}")
    return AclRules(tuple(anonymous), {u: tuple(r) for u, r in users.items()}, tuple(patterns))


class RevocationList:
    """The fleet's CRL (``broker/crl.pem``), as the embedded broker checks it at each connect.

    The file is read again whenever its inode, modification time or size changes (fedsdk replaces it
    atomically), so ``fedsdk provision revoke`` takes effect for the next connection without a restart
    (mosquitto needs a SIGHUP). A CRL that is not
    signed by the fleet CA, or cannot be read, refuses *every* certificate until it is fixed (fail closed,
    logged once per change): a broken revocation list must not let a revoked device back in.
    """

    def __init__(self, crl_file: str | os.PathLike[str], ca_file: str | os.PathLike[str]) -> None:
        self.path, self.ca_path = Path(crl_file), Path(ca_file)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._serials: frozenset[int] | None = None  # None: unusable (fail closed)

    def _load(self) -> frozenset[int]:
        try:
            crl_pem, ca_pem = self.path.read_bytes(), self.ca_path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the CRL {self.path} or the CA {self.ca_path}: {exc}") from exc
        try:
            return frozenset(revoked_serials(crl_pem, ca_pem))
        except ConfigError as exc:
            raise ConfigError(f"{self.path}: {exc}") from exc

    def check(self) -> None:
        """Load now; :class:`ConfigError` if the file is unusable."""
        with self._lock:
            self._serials = self._load()
            st = self.path.stat()
            self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)

    def revoked(self, serial: int) -> bool:
        with self._lock:
            try:
                st = self.path.stat()
                stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                stamp = None
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._serials = self._load()
                    log.info("embedded broker: CRL %s loaded (%d revoked)", self.path, len(self._serials))
                except ConfigError as exc:
                    self._serials = None
                    log.error("embedded broker: refusing every client until the CRL is fixed: %s", exc)
            return self._serials is None or serial in self._serials
