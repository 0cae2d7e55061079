"""amqtt plugins that make the embedded broker enforce the fleet's identities and ACL (see :mod:`.acl`).

Loaded by amqtt from the broker configuration (``"plugins": {"fedsdk_coordinator.broker_plugins.…": …}``)
only when the embedded broker runs with TLS; this module imports amqtt and is never imported otherwise.

* :class:`CertificateIdentity` (authentication): the identity is the CN of the client certificate the TLS
  handshake verified against the fleet CA, nothing the client says; with a CRL, a revoked certificate
  is refused (:class:`.acl.RevocationList`). A client whose MQTT client id differs
  from its CN is refused: mosquitto's ``use_username_as_clientid`` rewrites the id instead, amqtt cannot, and
  refusing keeps the property that matters (no certificate can take over another identity's session).
  A last-will topic the identity may not write is refused at connect too, as mosquitto does: amqtt would
  otherwise publish the will unchecked.
* :class:`FleetAcl` (topic check): publish needs ``write``, subscribe and each delivery need ``read`` under
  :meth:`.acl.AclRules.allows` with username = client id = CN.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from amqtt.contexts import Action, BaseContext
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin

from fedsdk_coordinator.acl import Access, RevocationList, parse_acl

__all__ = ["CertificateIdentity", "FleetAcl", "certificate_cn"]

log = logging.getLogger("fedsdk_coordinator.broker")

_CN_KEY = "fedsdk_certificate_cn"


def _peer(session: Any) -> tuple[str | None, int | None]:
    """(subject CN, serial number) of the session's verified client certificate; ``None`` for what is
    missing. Cached per TLS connection in the session's attributes."""
    ssl_object = getattr(session, "ssl_object", None) if session is not None else None
    if ssl_object is None:
        return None, None
    cached = session.attributes.get(_CN_KEY)
    if cached is not None and cached[0] is ssl_object:  # a reconnect brings a new ssl_object
        return cached[1], cached[2]
    cert = ssl_object.getpeercert() or {}
    names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    cn = names[0] if len(names) == 1 else None
    try:
        serial: int | None = int(cert["serialNumber"], 16)
    except (KeyError, TypeError, ValueError):
        serial = None
    session.attributes[_CN_KEY] = (ssl_object, cn, serial)
    return cn, serial


def certificate_cn(session: Any) -> str | None:
    """The subject CN of the session's verified client certificate, or ``None`` without one."""
    return _peer(session)[0]


class CertificateIdentity(BaseAuthPlugin):
    """Accepts a client only with a verified certificate whose CN equals its MQTT client id, and whose
    last will (if any) goes to a topic the ACL lets it write."""

    @dataclass
    class Config:
        acl: str = ""
        crl_file: str = ""
        ca_file: str = ""

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        self.rules = parse_acl(self._get_config_option("acl", ""))
        crl = self._get_config_option("crl_file", "")
        self.crl = RevocationList(crl, self._get_config_option("ca_file", "")) if crl else None

    async def authenticate(self, *, session: Any) -> bool | None:
        return self.admit(session)

    def admit(self, session: Any) -> bool:
        """The check itself, on a session fresh from its CONNECT (the broker calls it before amqtt's session
        bookkeeping; ``authenticate`` repeats it where amqtt asks)."""
        cn, serial = _peer(session)
        if cn is None or serial is None:
            log.warning("embedded broker: refused a client without a certificate CN")
            return False
        if self.crl is not None and self.crl.revoked(serial):
            log.warning("embedded broker: refused %s: its certificate (serial %x) is revoked", cn, serial)
            return False
        if session.client_id != cn:
            log.warning(
                "embedded broker: refused client id %r: its certificate is %r (connect with the CN as id)",
                session.client_id,
                cn,
            )
            return False
        if session.will_flag and not self.rules.allows(cn, cn, "write", session.will_topic or ""):
            log.warning("embedded broker ACL: refused %s: last will on %s", cn, session.will_topic)
            return False
        return True


class FleetAcl(BaseTopicPlugin):
    """The fleet's ACL (the text of ``render_acl``) applied to publish, subscribe and delivery."""

    @dataclass
    class Config:
        acl: str = ""

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        self.rules = parse_acl(self._get_config_option("acl", ""))

    async def topic_filtering(
        self, *, session: Any = None, topic: str | None = None, action: Action | None = None
    ) -> bool | None:
        cn = certificate_cn(session)
        if cn is None or not topic or action is None:
            return False
        access: Access = "write" if action == Action.PUBLISH else "read"
        allowed = self.rules.allows(cn, session.client_id or "", access, topic)
        if not allowed and action != Action.RECEIVE:
            log.warning("embedded broker ACL: refused %s %s on %s", cn, action.value, topic)
        return allowed
