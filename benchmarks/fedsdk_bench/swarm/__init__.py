"""A swarm of light simulated devices that replay pre-computed update messages over MQTT with mutual TLS.

Tens of thousands of devices, each with its own certificate and its own MQTT connection, publish messages
framed exactly like a real device's, so that a broker (or a broker cluster) and the aggregation behind it
see real message sizes, frame counts and connection counts, without one simulated device training or
encrypting anything. What the swarm sends is read from files (:func:`write_payloads`), never piped.

Parts:

* :func:`issue_identities` signs one client certificate per simulated device with the fleet CA of a
  ``fedsdk provision`` folder, with the project's own :func:`~fedsdk_coordinator.pki.issue_cert`: subject
  CN = client id, the SPIFFE URI SAN, EKU clientAuth, a P-256 key of its own (about 0.2 ms each).
* :func:`run_swarm` spawns worker processes; each drives its share of the devices (``devices[i::n]``) as
  paho-mqtt 2 clients on ONE asyncio loop with paho's external-loop interface (``loop_read`` on readable,
  ``loop_write`` on writable, ``loop_misc`` once a second for every client; paho's
  ``examples/loop_asyncio.py``): no thread per client. Per round every worker reports its devices
  connected, the parent calls ``go`` and releases all workers at once, each device publishes its message
  (``fedsdk._chunking.split_payload`` frames, QoS 1 on ``fl/<fed>/up/<id>/<kind>``, at most 20 frames
  unacknowledged) and the worker reports when every PUBACK is in.

Decisions:

* paho's own TLS handshake is blocking (``Client._create_socket`` calls ``do_handshake`` on a blocking
  socket): one slow handshake would stall thousands of devices on the loop. The swarm connects TCP and
  shakes hands itself, non-blocking, and hands the ready socket to paho through that private method
  (:class:`~fedsdk_bench.swarm.connection.PremadeClient`); everything after it (CONNECT, PUBLISH, PUBACK,
  keepalive) is paho's.
* Failover: a device whose connection fails or drops reconnects to the next URL of the list (round robin)
  after a jittered pause of 0.2-2 s (doubling from 0.2-0.4 s), with a fresh paho client, and re-publishes
  every frame of the current message not yet acknowledged: receivers drop duplicates (the reassembler
  keys by message id and chunk index). A device fails for good after :data:`MAX_ATTEMPTS` attempts in a
  row without a connection (about 15 s), or at once when the broker refuses it in its CONNACK, the
  broker's certificate does not verify or its own files are unusable. (A broker refusing the device's
  certificate under TLS 1.3 closes the connection after the handshake: that is retried like a lost node.)
  A missing payload file fails the device for that round only.
* Connections (first ones and reconnects) are paced to ``connect_per_s`` overall, evenly split between the
  workers: pace a fleet that reconnects at once to measure a broker's TLS accept path rather than a
  stampede. A worker spends about 3 ms of CPU per connection (SSL context, handshake, paho), so on a
  2-core machine shared with mosquitto the rate tops out near 300-450 connections/s whatever is asked.
* Timing uses ``time.monotonic()`` across processes (CLOCK_MONOTONIC, system-wide on Linux and macOS):
  a round's ``seconds`` run from the parent's release to the last PUBACK of any worker.
* Simulated identities are not recorded in the fleet's ledger (``ca/issued.json``), so they cannot be
  revoked one by one; they are valid for ``days`` (30 by default, not the fleet's 825) and the ids the
  fleet reserves for its services (``coordinator``, ``keyserver``, ...) are refused.

Modules: ``model`` (settings, results, a worker's work order), ``identities`` (certificates, payload
files), ``parent`` (:func:`run_swarm`: spawns the workers, releases the rounds, gathers the reports),
``device`` (a worker process: its devices on one asyncio loop), ``connection`` (non-blocking TCP + TLS
handed to paho, the connection pacer).
"""

from __future__ import annotations

from fedsdk_bench.swarm.identities import issue_identities, payload_path, write_payloads
from fedsdk_bench.swarm.model import CONNECT_TIMEOUT as CONNECT_TIMEOUT
from fedsdk_bench.swarm.model import KEEPALIVE as KEEPALIVE
from fedsdk_bench.swarm.model import MAX_ATTEMPTS, WINDOW, RoundResult, SimDevice, SwarmError, SwarmResult
from fedsdk_bench.swarm.parent import run_swarm

__all__ = [
    "MAX_ATTEMPTS",
    "WINDOW",
    "RoundResult",
    "SimDevice",
    "SwarmError",
    "SwarmResult",
    "issue_identities",
    "payload_path",
    "run_swarm",
    "write_payloads",
]
