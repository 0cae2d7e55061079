"""NATS: three nats-server nodes with routes, JetStream and the MQTT gateway over mTLS."""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from fedsdk_bench.engines.common import FED, HOST, LIMIT_BYTES, NATS_BASE, Cluster, Fleet


def nats_binary() -> str | None:
    here = Path(sys.executable).parent / "nats-server"
    return str(here) if here.exists() else shutil.which("nats-server")


class NatsCluster(Cluster):
    """nats-server x3: routes between them, JetStream (needed by the MQTT gateway for QoS 1, sessions and
    retained messages), MQTT over mTLS with ``verify_and_map`` (the certificate subject is the user) and one
    permission entry per user. MQTT ``a/b`` is NATS subject ``a.b``; a ``x/#`` filter needs ``x`` and
    ``x.>``."""

    name = "nats"

    def __init__(self, fleet: Fleet, work: Path, binary: str) -> None:
        super().__init__(fleet, work)
        self.binary = binary
        self.mqtt_ports = [NATS_BASE + 21 + i for i in range(3)]
        self.http_ports = [NATS_BASE + 31 + i for i in range(3)]

    def _users(self) -> str:
        f = f"fl.{FED}"
        entries = [
            {
                "user": "CN=coordinator",
                "permissions": {
                    "publish": {
                        "allow": [
                            f"{f}.down.>",
                            f"{f}.cluster.>",
                            f"{f}.coordinator.status",
                            f"{f}.keyserver.>",
                        ]
                    },
                    "subscribe": {"allow": [f"{f}.up", f"{f}.up.>", f"{f}.coordinator.status"]},
                },
            },
            {
                "user": "CN=keyserver",
                "permissions": {
                    "publish": {"allow": [f"{f}.cluster.>"]},
                    "subscribe": {"allow": [f"{f}.keyserver", f"{f}.keyserver.>"]},
                },
            },
        ]
        for cid in self.fleet.users:
            entries.append(
                {
                    "user": f"CN={cid}",
                    "permissions": {
                        "publish": {"allow": [f"{f}.up.{cid}.>"]},
                        "subscribe": {
                            "allow": [
                                f"{f}.down.{cid}",
                                f"{f}.cluster",
                                f"{f}.cluster.>",
                                f"{f}.coordinator.status",
                            ]
                        },
                    },
                }
            )
        return "\n".join("    " + json.dumps(e) for e in entries)

    def launch(self) -> None:
        b = self.fleet.broker
        tls = (
            f'cert_file: "{b}/server.pem", key_file: "{b}/server.key", ca_file: "{b}/ca.pem", '
            "verify_and_map: true"
        )
        routes = ", ".join(f"nats-route://{HOST}:{NATS_BASE + 11 + j}" for j in range(3))
        users = self._users()
        for i in range(3):
            d = self.work / f"n{i + 1}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "nats.conf"
            conf.write_text(
                f"server_name: n{i + 1}\n"
                f"listen: {HOST}:{NATS_BASE + 1 + i}\n"
                f"http: {HOST}:{self.http_ports[i]}\n"
                f"max_payload: {LIMIT_BYTES}\n"
                f'jetstream {{ store_dir: "{d}/js" }}\n'
                f"cluster {{\n  name: fedsdk-bench\n  listen: {HOST}:{NATS_BASE + 11 + i}\n"
                f"  routes: [{routes}]\n}}\n"
                f"tls {{ {tls} }}\n"
                f"mqtt {{\n  listen: {HOST}:{self.mqtt_ports[i]}\n  tls {{ {tls}, timeout: 5 }}\n}}\n"
                f"authorization {{\n  users = [\n{users}\n  ]\n}}\n"
            )
            self.procs.append(self.popen([self.binary, "-c", str(conf)], d / "nats.log"))

    def _get(self, i: int, path: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.http_ports[i]}{path}", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def wait_joined(self, deadline: float) -> None:
        """Every node reports routes to the two others and a healthy JetStream (``/healthz``)."""
        while time.monotonic() < deadline:
            ok = True
            for i in range(3):
                routez = self._get(i, "/routez")
                health = self._get(i, "/healthz")
                peers = {r.get("remote_name") for r in (routez or {}).get("routes") or []}
                if len(peers - {None}) < 2 or (health or {}).get("status") != "ok":
                    ok = False
                    break
            if ok:
                return
            time.sleep(0.1)
        raise RuntimeError("NATS nodes did not all join: " + self.log_tail())

    def log_tail(self) -> str:
        return " | ".join((self.work / f"n{i + 1}" / "nats.log").read_text()[-300:] for i in range(3))
