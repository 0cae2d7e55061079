"""One engine's whole run (start, figures, checks) and the comparison table."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from fedsdk_bench.engines.checks import (
    Check,
    check_acl,
    check_client_id,
    check_failover,
    check_identity,
    check_retained,
    check_size,
    verdict,
)
from fedsdk_bench.engines.common import Cluster, Fleet, short
from fedsdk_bench.engines.load import load_test, throughput
from fedsdk_bench.engines.mqtt import mqtt_ready


async def run_engine(cluster: Cluster, fleet: Fleet) -> dict[str, Any]:
    res: dict[str, Any] = {"engine": cluster.name, "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.launch)
    await asyncio.to_thread(cluster.wait_joined, t0 + 300)
    await mqtt_ready(fleet, cluster.mqtt_ports, t0 + 300)
    res["start_ready_s"] = round(time.monotonic() - t0, 2)
    await asyncio.sleep(5)
    idle = cluster.node_rss_kib()
    res["rss_idle_nodes_mib"] = [round(r / 1024, 1) for r in idle]
    print(
        f"[{cluster.name}] ready in {res['start_ready_s']} s, idle RSS {res['rss_idle_nodes_mib']} MiB",
        flush=True,
    )
    for key, step in (
        ("load", lambda: load_test(fleet, cluster, sum(idle))),
        ("throughput", lambda: throughput(fleet, cluster.mqtt_ports)),
    ):
        try:
            res[key] = await step()
        except Exception as exc:
            res[key] = {"error": short(exc, 200)}
        print(f"[{cluster.name}] {key}: {res[key]}", flush=True)
    checks: dict[str, Check] = {}
    plan: list[tuple[str, Callable[[], Any]]] = [
        ("1 certificate identity", lambda: check_identity(fleet, cluster.mqtt_ports)),
        ("2 per-device ACL", lambda: check_acl(fleet, cluster.mqtt_ports)),
        ("3 retained across nodes", lambda: check_retained(fleet, cluster.mqtt_ports)),
        ("5 size limit 8 MiB", lambda: check_size(fleet, cluster.mqtt_ports)),
        ("6 another device's client id", lambda: check_client_id(fleet, cluster.mqtt_ports)),
        ("4 QoS 1 + node failover", lambda: check_failover(cluster, fleet)),  # kills node 2: last
    ]
    for name, step in plan:
        try:
            checks[name] = await asyncio.wait_for(step(), 180)
        except Exception as exc:
            checks[name] = verdict(False, f"error: {short(exc, 200)}")
        print(f"[{cluster.name}] check {name}: {checks[name]['result']} - {checks[name]['seen']}", flush=True)
    res["checks"] = dict(sorted(checks.items()))
    return res


def table(results: list[dict[str, Any]]) -> str:
    def get(r: dict[str, Any], *path: str) -> Any:
        for p in path:
            r = r.get(p, {}) if isinstance(r, dict) else {}
        return "-" if r in ({}, None) else r

    rows: list[tuple[str, list[str]]] = []
    names = sorted({k for r in results for k in r.get("checks", {})})
    for name in names:
        rows.append((f"check {name}", [get(r, "checks", name, "result") for r in results]))
    rows += [
        ("start to ready (s)", [str(get(r, "start_ready_s")) for r in results]),
        ("idle RSS per node (MiB)", [" / ".join(map(str, get(r, "rss_idle_nodes_mib"))) for r in results]),
        (
            "devices connected",
            [f"{get(r, 'load', 'connected')}/{get(r, 'load', 'devices')}" for r in results],
        ),
        ("connect all (s)", [str(get(r, "load", "connect_all_s")) for r in results]),
        ("publish -> all received (s)", [str(get(r, "load", "receive_all_s")) for r in results]),
        ("messages lost", [str(get(r, "load", "lost")) for r in results]),
        ("RSS connected, 3 nodes (MiB)", [str(get(r, "load", "rss_connected_mib")) for r in results]),
        (
            "  per connection (KiB)",
            [str(get(r, "load", "rss_per_connection_connected_kib")) for r in results],
        ),
        ("RSS after load, 3 nodes (MiB)", [str(get(r, "load", "rss_after_mib")) for r in results]),
        ("  per connection (KiB)", [str(get(r, "load", "rss_per_connection_kib")) for r in results]),
        ("throughput 20 kB QoS1 (msg/s)", [str(get(r, "throughput", "msgs_per_s")) for r in results]),
    ]
    width = max(len(k) for k, _ in rows)
    cols = [max(len(r["engine"]), *(len(str(v[i])) for _, v in rows)) for i, r in enumerate(results)]
    lines = [" | ".join([" " * width, *(r["engine"].ljust(c) for r, c in zip(results, cols))])]
    lines += [" | ".join([k.ljust(width), *(str(x).ljust(c) for x, c in zip(v, cols))]) for k, v in rows]
    return "\n".join(lines)
