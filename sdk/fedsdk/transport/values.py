"""The transport's value types: where the broker is (:class:`BrokerAddress`, :func:`parse_broker_url`,
:func:`parse_broker_urls` for the nodes of a broker cluster), the
TLS files that reach it (:class:`TlsConfig`) and the identity its client certificate carries
(:func:`certificate_identity`, :func:`check_client_identity`), the Will it publishes for us, the
:class:`Message` it hands us, and the topics it accepts (:func:`check_topic`)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from fedsdk.errors import ConfigError, IdentityMismatch

__all__ = [
    "BrokerAddress",
    "Message",
    "TlsConfig",
    "Will",
    "certificate_identity",
    "check_client_identity",
    "check_topic",
    "parse_broker_url",
    "parse_broker_urls",
]

_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL. ``tls`` is true for ``mqtts``."""

    scheme: str
    host: str
    port: int
    tls: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://host[:1883]`` or ``mqtts://host[:8883]``. Credentials, paths and queries are refused
    (credentials in a URL end up in logs and shell history)."""
    if "," in url:
        raise ConfigError(f"{url!r} names several brokers; this setting takes one URL")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad broker URL {url!r}: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ConfigError(f"bad broker URL {url!r}: scheme must be mqtt or mqtts")
    if not parts.hostname:
        raise ConfigError(f"bad broker URL {url!r}: no host")
    if parts.username is not None or parts.password is not None:
        raise ConfigError("bad broker URL: credentials in the URL are not accepted; use username/password")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"bad broker URL {url!r}: no path, query or fragment allowed")
    if port == 0:
        raise ConfigError(f"bad broker URL {url!r}: port 0")
    return BrokerAddress(scheme, parts.hostname, port or _DEFAULT_PORTS[scheme], scheme == "mqtts")


def parse_broker_urls(urls: str) -> tuple[BrokerAddress, ...]:
    """Parse one broker URL or several, comma-separated: the nodes of one broker cluster, which a client
    tries in turn (``mqtts://n1:8883,mqtts://n2:8883``). All use the same scheme (a TLS client never falls
    back to plain TCP) and none appears twice."""
    parts = [u.strip() for u in urls.split(",")]
    if not urls.strip() or any(not u for u in parts):
        raise ConfigError(f"bad broker URL list {urls!r}: give URLs separated by commas, none empty")
    addresses = tuple(parse_broker_url(u) for u in parts)
    if len({a.scheme for a in addresses}) > 1:
        raise ConfigError(f"bad broker URL list {urls!r}: mixes mqtt:// and mqtts://; use one scheme")
    if len({(a.host, a.port) for a in addresses}) < len(addresses):
        raise ConfigError(f"bad broker URL list {urls!r}: a broker appears twice")
    return addresses


@dataclass(frozen=True)
class TlsConfig:
    """CA bundle that signs the broker's certificate, and this client's certificate and key (mutual TLS)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    check_hostname: bool = True

    def ssl_context(self) -> ssl.SSLContext:
        """A client context: TLS >= 1.2, the broker verified against ``ca_file``, our certificate loaded."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("TlsConfig: cert_file and key_file go together")
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"CA file {self.ca_file} unusable: {exc}; --ca takes the PEM certificate of the CA that "
                "signed the broker's"
            ) from exc
        if self.cert_file is not None:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"client certificate {self.cert_file} with key {self.key_file} unusable: {exc}; --cert "
                    "and --key take this client's PEM certificate and the private key it was made for"
                ) from exc
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.check_hostname
        return ctx


def certificate_identity(cert_file: str) -> str:
    """The identity a broker of the fleet gives the client that presents ``cert_file``: its subject CN.
    mosquitto makes the CN the MQTT username its ACL checks (``use_identity_as_username``) and the client id
    (``use_username_as_clientid``); the embedded broker refuses a client id other than the CN. ConfigError
    when the file is unreadable or its subject does not hold exactly one CN."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        with open(cert_file, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the client certificate {cert_file}: {exc}") from exc
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if len(cns) != 1:
        raise ConfigError(
            f"client certificate {cert_file} has {len(cns)} subject CNs; the broker takes the client's "
            "identity from its one CN: use a certificate of the fleet CA (fedsdk provision)"
        )
    return cns[0]


def check_client_identity(tls: TlsConfig | None, client_id: str) -> None:
    """Refuse, before connecting, a client certificate issued to another identity than ``client_id``
    (:class:`~fedsdk.errors.IdentityMismatch`): the embedded broker would refuse the connection, and
    mosquitto would run the session as the certificate's identity, whose ACL drops every topic of
    ``client_id`` without a word. Nothing to check without a client certificate."""
    if tls is None or tls.cert_file is None:
        return
    identity = certificate_identity(tls.cert_file)
    if identity != client_id:
        raise IdentityMismatch(
            f"certificate {tls.cert_file} is issued to {identity!r} but the client id is {client_id!r}: "
            f"connect as client id {identity!r}, or with the certificate issued to {client_id!r}",
            certificate=tls.cert_file,
            cert_identity=identity,
            requested_id=client_id,
        )


@dataclass(frozen=True)
class Will:
    """The message the broker publishes if the link dies without a DISCONNECT. Framed like any payload."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


@dataclass(frozen=True)
class Message:
    """One reassembled incoming payload."""

    topic: str
    payload: bytes
    retain: bool
    qos: int


def check_topic(topic: str, *, wildcards: bool) -> None:
    """Refuse a topic the broker would refuse: empty, NUL, over 65,535 bytes, or misplaced wildcards (none at
    all in a publish topic)."""
    if not isinstance(topic, str) or not topic or "\x00" in topic or len(topic.encode()) > 65535:
        raise ConfigError(f"invalid MQTT topic {topic!r}")
    levels = topic.split("/")
    for i, level in enumerate(levels):
        if ("+" in level or "#" in level) and not wildcards:
            raise ConfigError(f"wildcards are not allowed in a publish topic: {topic!r}")
        if "+" in level and level != "+":
            raise ConfigError(f"'+' must fill a whole level: {topic!r}")
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ConfigError(f"'#' must be the whole last level: {topic!r}")
