"""The transport's value types: where the broker is (:class:`BrokerAddress`, :func:`parse_broker_url`), the
TLS files that reach it (:class:`TlsConfig`), the Will it publishes for us, the :class:`Message` it hands
us, and the topics it accepts (:func:`check_topic`)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from fedsdk.errors import ConfigError

__all__ = ["BrokerAddress", "Message", "TlsConfig", "Will", "check_topic", "parse_broker_url"]

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
            if self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"TLS files unusable (ca={self.ca_file}, cert={self.cert_file}): {exc}"
            ) from exc
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.check_hostname
        return ctx


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
