"""The MQTT transport of fedsdk: one :class:`MqttTransport` owns one broker connection.

MQTT 3.1.1 over TLS through paho-mqtt; every payload framed and, when large, chunked
(:mod:`fedsdk._chunking`); an optional uplink limit for benchmarks. The modules, each with the decisions
that shape its code:

* ``values``: broker URLs, TLS files and the identity a client certificate carries, the Will, the
  incoming :class:`Message`, topic rules.
* ``ratelimit``: :class:`TokenBucket`, the benchmarks' uplink emulation.
* ``link``: the paho client, its connection attempts and the paho thread's way to the event loop.
* ``traffic``: what crosses an open link: chunks out under flow control, subscriptions, frames in.
* ``mqtt``: :class:`MqttTransport`, the public object: its states, connect and reconnect, publish,
  subscribe, messages, stats.

One decision holds for all of them: logs carry topics, sizes, ids and reasons, never payload bytes or key
material. They all log as ``fedsdk.transport``.
"""

from __future__ import annotations

from fedsdk._chunking import MAX_MESSAGE_BYTES, MAX_PACKET_BYTES, max_frame_bytes, max_packet_bytes
from fedsdk.transport.mqtt import MqttTransport
from fedsdk.transport.ratelimit import TokenBucket
from fedsdk.transport.values import (
    BrokerAddress,
    Message,
    TlsConfig,
    Will,
    certificate_identity,
    check_client_identity,
    parse_broker_url,
    parse_broker_urls,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_PACKET_BYTES",
    "BrokerAddress",
    "Message",
    "MqttTransport",
    "TlsConfig",
    "TokenBucket",
    "Will",
    "certificate_identity",
    "check_client_identity",
    "max_frame_bytes",
    "max_packet_bytes",
    "parse_broker_url",
    "parse_broker_urls",
]
