"""RabbitMQ: three rabbitmq-server nodes on one host with the MQTT plugin over mTLS."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from fedsdk_bench.engines.common import (
    FED,
    HOST,
    LIMIT_BYTES,
    RABBIT_BASE,
    RABBIT_SBIN,
    Cluster,
    Fleet,
    accepting,
    short,
)


def rabbit_binary() -> str | None:
    own = RABBIT_SBIN / "rabbitmq-server"
    return str(own) if own.exists() else shutil.which("rabbitmq-server")


class RabbitCluster(Cluster):
    """rabbitmq-server x3 on one host (rabbit1..3@localhost), our own epmd on a port in range, a shared
    cookie (``$HOME/.erlang.cookie``), the MQTT plugin with a TLS listener that requires a client
    certificate, ``mqtt.ssl_cert_login`` (the certificate CN is the user), passwordless users and topic
    permissions on ``amq.topic`` (MQTT ``/`` is ``.`` in routing keys, ``+``/``#`` are ``*``/``#``).
    Nodes 2 and 3 join node 1 with ``rabbitmqctl stop_app; join_cluster; start_app``."""

    name = "rabbitmq"
    EPMD = RABBIT_BASE

    def __init__(self, fleet: Fleet, work: Path, binary: str) -> None:
        super().__init__(fleet, work)
        self.binary = binary
        self.ctl_bin = str(Path(binary).with_name("rabbitmqctl"))
        self.mqtt_ports = [RABBIT_BASE + 21 + i for i in range(3)]
        self.home = work / "home"
        self.nodes = [f"rabbit{i + 1}@localhost" for i in range(3)]
        self.ctl_log = work / "rabbitmqctl.log"

    def env(self, i: int | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env |= {
            "HOME": str(self.home),
            "ERL_EPMD_PORT": str(self.EPMD),
            "ERL_EPMD_ADDRESS": HOST,
            "RABBITMQ_CTL_DIST_PORT_MIN": str(RABBIT_BASE + 40),
            "RABBITMQ_CTL_DIST_PORT_MAX": str(RABBIT_BASE + 79),
            "RABBITMQ_CONF_ENV_FILE": str(self.work / "no-env.conf"),
        }
        if i is not None:
            d = self.work / f"n{i + 1}"
            env |= {
                "RABBITMQ_NODENAME": self.nodes[i],
                "RABBITMQ_NODE_IP_ADDRESS": HOST,
                "RABBITMQ_NODE_PORT": str(RABBIT_BASE + 1 + i),
                "RABBITMQ_DIST_PORT": str(RABBIT_BASE + 11 + i),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            }
        return env

    def ctl(self, *args: str, node: int = 0, timeout: float = 120) -> str:
        argv = [self.ctl_bin, "-n", self.nodes[node], *args]
        r = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, cwd=self.work
        )
        with open(self.ctl_log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n{r.stdout}{r.stderr}rc={r.returncode}\n")
        if r.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} on {self.nodes[node]}: {short(r.stderr or r.stdout)}"
            )
        return r.stdout

    def launch(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)
        epmd = shutil.which("epmd") or "epmd"
        self.helpers.append(
            self.popen([epmd, "-port", str(self.EPMD), "-address", HOST], self.work / "epmd.log")
        )
        end = time.monotonic() + 10
        while not accepting(self.EPMD) and time.monotonic() < end:
            time.sleep(0.05)
        b = self.fleet.broker
        for i in range(3):
            d = self.work / f"n{i + 1}"
            (d / "log").mkdir(parents=True, exist_ok=True)
            (d / "enabled_plugins").write_text("[rabbitmq_mqtt,rabbitmq_auth_mechanism_ssl].\n")
            (d / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = {HOST}:{RABBIT_BASE + 1 + i}\n"
                "mqtt.listeners.tcp = none\n"
                f"mqtt.listeners.ssl.default = {HOST}:{self.mqtt_ports[i]}\n"
                "mqtt.allow_anonymous = false\n"
                "mqtt.ssl_cert_login = true\n"
                "ssl_cert_login_from = common_name\n"
                f"ssl_options.cacertfile = {b}/ca.pem\n"
                f"ssl_options.certfile = {b}/server.pem\n"
                f"ssl_options.keyfile = {b}/server.key\n"
                "ssl_options.verify = verify_peer\n"
                "ssl_options.fail_if_no_peer_cert = true\n"
                f"max_message_size = {LIMIT_BYTES}\n"
                "log.console = false\n"
                "log.file.level = info\n"
            )
            self.procs.append(self.popen([self.binary], d / "stdout.log", env=self.env(i)))

    def _definitions(self) -> dict[str, Any]:
        """Users (no password: certificate login only), vhost permissions limited to amq.topic and the
        client's own subscription queues, and topic permissions on amq.topic."""
        f = rf"fl\.{FED}"

        def user(name: str) -> dict[str, Any]:
            return {
                "name": name,
                "password_hash": "",
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": [],
            }

        def perm(name: str) -> dict[str, str]:
            own = rf"^(amq\.topic|mqtt-subscription-{name}qos[01])$"
            return {"user": name, "vhost": "/", "configure": own, "write": own, "read": own}

        def topic(name: str, write: str, read: str) -> dict[str, str]:
            return {"user": name, "vhost": "/", "exchange": "amq.topic", "write": write, "read": read}

        names = ["coordinator", "keyserver", *self.fleet.users]
        topics = [
            topic(
                "coordinator",
                rf"^({f}\.down\..+|{f}\.cluster\..+|{f}\.keyserver\..+|{f}\.coordinator\.status)$",
                rf"^({f}\.up\..+|{f}\.coordinator\.status)$",
            ),
            topic("keyserver", rf"^{f}\.cluster\..+$", rf"^{f}\.keyserver\..+$"),
        ]
        topics += [
            topic(c, rf"^{f}\.up\.{c}\..+$", rf"^({f}\.down\.{c}|{f}\.cluster\..+|{f}\.coordinator\.status)$")
            for c in self.fleet.users
        ]
        return {
            "users": [user(n) for n in names],
            "vhosts": [{"name": "/"}],
            "permissions": [perm(n) for n in names],
            "topic_permissions": topics,
        }

    def _wait_port(self, i: int, deadline: float) -> None:
        while not accepting(self.mqtt_ports[i]):
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"{self.nodes[i]} exited: {self.log_tail(i)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.nodes[i]} MQTT listener not up: {self.log_tail(i)}")
            time.sleep(0.1)

    def wait_joined(self, deadline: float) -> None:
        for i in range(3):
            self._wait_port(i, deadline)
        for i in (1, 2):
            self.ctl("stop_app", node=i)
            self.ctl("join_cluster", self.nodes[0], node=i)
            self.ctl("start_app", node=i)
        defs = self.work / "definitions.json"
        defs.write_text(json.dumps(self._definitions()))
        self.ctl("import_definitions", str(defs))
        self.ctl("delete_user", "guest")
        status = json.loads(self.ctl("cluster_status", "--formatter", "json"))
        running = set(status.get("running_nodes", []))
        if running != set(self.nodes):
            raise RuntimeError(f"cluster_status running_nodes = {sorted(running)}")
        for i in range(3):
            self._wait_port(i, deadline)

    def log_tail(self, i: int = 0) -> str:
        d = self.work / f"n{i + 1}"
        files = [*sorted(d.glob("log/*.log")), d / "stdout.log"]
        texts = [p.read_text(errors="replace")[-400:] for p in files if p.exists()]
        return " | ".join(texts)
