"""A throw-away mosquitto 2 on a free loopback port, owned by a harness (the load test, the fleet benchmark).

DESIGN.md: "mosquitto for fleets and CI" (3-5x faster than the embedded amqtt broker, and it enforces ACLs).
A fresh broker per run also means no retained message of one run can reach the next. Configuration
decisions (mosquitto.conf(5), mosquitto 2.0):

* ``listener <port> 127.0.0.1``: loopback only, so the plain-TCP default never leaves the machine.
* ``user root`` when the harness runs as root: mosquitto 2 otherwise drops to the ``mosquitto`` user and
  cannot read the files of the run.
* ``max_queued_messages`` raised from 1,000 to ``max_queued`` (100,000 by default). The coordinator is one
  MQTT session that receives every device's probe, hello, update, report and bye; when hundreds of devices
  publish in the same second, the QoS 1 messages waiting for that one session exceed mosquitto's default
  queue and the broker drops the excess *silently*. A harness must measure the federation, not that
  limit, so it raises it and says so in its report (the load test's ``--max-queued 1000`` shows the default).
* ``max_connections -1`` (no limit; the default, written out), ``persistence false`` (a throw-away broker),
  ``max_inflight_messages 20`` (the default, matching the transport's flow-control window).
* ``set_tcp_nodelay true``: Nagle's algorithm off on the broker's client sockets, as the transport does on
  its own (:mod:`fedsdk.transport`); otherwise a message to a device can wait for a delayed ACK (40 ms).
* ``max_packet_size`` (:data:`fedsdk._chunking.MAX_PACKET_BYTES`): the largest PUBLISH that carries the
  largest message the coordinator accepts, as ``fedsdk provision`` writes it; a larger packet disconnects
  its sender before the broker reads the payload.
* ``tls``: a TLS listener that requires a client certificate from the run's development CA, the
  certificate's CN becoming the MQTT username (as in production; no ACL file: the ACL is tested elsewhere,
  with the configuration ``fedsdk provision`` writes).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from fedsdk._chunking import MAX_PACKET_BYTES
from fedsdk.errors import ConfigError, ConnectError
from fedsdk_coordinator.pki import DevPki

__all__ = ["HOST", "LoopbackMosquitto", "accepting", "find_mosquitto", "free_port", "terminate"]

HOST = "127.0.0.1"


def find_mosquitto() -> str | None:
    """Path of the mosquitto binary (PATH first, then Debian's /usr/sbin), or None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def accepting(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` (0.2 s connect timeout)."""
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM ``proc``, wait ``timeout``, then SIGKILL; nothing if it is None or has exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


class LoopbackMosquitto:
    """A mosquitto subprocess; a context manager that always stops it (SIGTERM, then SIGKILL)."""

    def __init__(self, directory: Path, *, tls: DevPki | None = None, max_queued: int = 100_000) -> None:
        binary = find_mosquitto()
        if binary is None:
            raise ConfigError("this needs mosquitto 2 (apt-get install mosquitto)")
        if max_queued < 1:
            raise ConfigError("max_queued must be at least 1")
        self.binary = binary
        self.directory = Path(directory)
        self.tls = tls
        self.max_queued = max_queued
        self.port = 0
        self.config_file = self.directory / "mosquitto.conf"
        self.log_file = self.directory / "mosquitto.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls is not None else 'mqtt'}://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def config_text(self, port: int) -> str:
        lines = [
            "# written by fedsdk_coordinator.mosquitto",
            "per_listener_settings false",
            "persistence false",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "connection_messages false",
            f"max_queued_messages {self.max_queued}",
            "max_inflight_messages 20",
            "max_connections -1",
            "set_tcp_nodelay true",
            f"max_packet_size {MAX_PACKET_BYTES}",
            f"listener {port} {HOST}",
        ]
        if os.geteuid() == 0:
            lines.insert(1, "user root")
        if self.tls is None:
            lines.append("allow_anonymous true")
        else:
            lines += [
                f"cafile {self.tls.ca_file}",
                f"certfile {self.tls.server_cert}",
                f"keyfile {self.tls.server_key}",
                "require_certificate true",
                "use_identity_as_username true",
                "allow_anonymous false",
            ]
        return "\n".join(lines) + "\n"

    def log_text(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def start(self, ready_timeout: float = 10.0) -> None:
        """Start on a free port (three tries) and wait, bounded, until it accepts connections."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            self.port = free_port()
            self.config_file.write_text(self.config_text(self.port))
            with open(self.log_file, "ab") as log:
                self._proc = subprocess.Popen(
                    [self.binary, "-c", str(self.config_file)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + ready_timeout
            while time.monotonic() < deadline and self._proc.poll() is None:
                if accepting(self.port):
                    return
                time.sleep(0.05)
            in_use = "Address already in use" in self.log_text()
            self.stop()
            if not in_use:
                break
        raise ConnectError(f"mosquitto did not start on 127.0.0.1:{self.port}:\n{self.log_text()[-2000:]}")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait ``timeout``, SIGKILL. Idempotent."""
        proc, self._proc = self._proc, None
        terminate(proc, timeout)

    def __enter__(self) -> LoopbackMosquitto:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
