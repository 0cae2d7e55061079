"""The figures: N devices connecting and publishing at once, and one publisher's throughput."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import paho.mqtt.client as paho

from fedsdk_bench.engines.common import FED, LOAD_PAYLOAD, TP_CONCURRENCY, TP_MESSAGES, Cluster, Fleet, short
from fedsdk_bench.engines.mqtt import PahoPool, PahoState, close_all, collect, transport, until


async def load_test(fleet: Fleet, cluster: Cluster, idle_kib: int) -> dict[str, Any]:
    """N devices connect (mTLS), then publish one 20,000-byte QoS 1 message each at the same moment."""
    ports, n = cluster.mqtt_ports, len(fleet.load_ids)
    pool = PahoPool(fleet)
    out: dict[str, Any] = {"devices": n}
    try:
        coord, cst = await pool.connect("coordinator", ports[0])
        await until(lambda: cst.connack is not None, 10)
        sub = f"fl/{FED}/up/+/update"
        coord.subscribe(sub, qos=1)
        await asyncio.sleep(1.0)
        states: list[PahoState] = []
        clients: list[tuple[paho.Client, str]] = []
        errors: list[str] = []

        async def one(i: int, cid: str) -> None:
            try:
                c, st = await pool.connect(cid, ports[i % 3])
                clients.append((c, cid))
                states.append(st)
            except Exception as exc:
                errors.append(short(exc, 80))

        t0 = time.monotonic()
        await asyncio.gather(*(one(i, cid) for i, cid in enumerate(fleet.load_ids)))
        await until(lambda: all(s.connack is not None or s.disconnected for s in states), 60 + n * 0.1, 0.05)
        connected = sum(
            1 for s in states if s.connack is not None and s.rc == "Success" and not s.disconnected
        )
        t_conn = max((s.connack for s in states if s.connack), default=t0) - t0
        out |= {"connected": connected, "connect_all_s": round(t_conn, 2), "connect_errors": len(errors)}
        if errors:
            out["connect_error_sample"] = errors[0]
        refused = [s.rc for s in states if s.rc not in (None, "Success")]
        if refused:
            out["connack_refused"] = len(refused)
        await asyncio.sleep(2)
        rss_connected = sum(cluster.node_rss_kib())
        out["rss_connected_mib"] = round(rss_connected / 1024, 1)
        out["rss_per_connection_connected_kib"] = round((rss_connected - idle_kib) / max(connected, 1), 1)
        payload = os.urandom(LOAD_PAYLOAD)
        t1 = time.monotonic()
        for c, cid in clients:
            c.publish(f"fl/{FED}/up/{cid}/update", payload, qos=1)
        await until(lambda: len({t for t, _, _ in cst.received}) >= n, 60 + n * 0.05, 0.05)
        got = {t for t, size, _ in cst.received if size == LOAD_PAYLOAD}
        last = max((ts for _, _, ts in cst.received), default=t1)
        pubacks = sum(len(s.pubacks) for s in states)
        rss = cluster.node_rss_kib()
        out |= {
            "received": len(got),
            "lost": n - len(got),
            "receive_all_s": round(last - t1, 2) if len(got) == n else None,
            "pubacks": pubacks,
            "rss_after_mib": round(sum(rss) / 1024, 1),
            "rss_after_nodes_mib": [round(r / 1024, 1) for r in rss],
            "rss_per_connection_kib": round((sum(rss) - idle_kib) / max(connected, 1), 1),
        }
        return out
    finally:
        await pool.close()


async def throughput(fleet: Fleet, ports: list[int]) -> dict[str, Any]:
    """One MqttTransport publisher (node 1) and one subscriber (node 2); 2,000 x 20,000 bytes at QoS 1."""
    pub = transport(fleet, "a", ports[0], timeout=30)
    sub = transport(fleet, "coordinator", ports[1], timeout=30)
    try:
        await sub.connect()
        await sub.subscribe(f"fl/{FED}/up/a/tp")
        await pub.connect()
        await asyncio.sleep(0.5)
        payload = os.urandom(LOAD_PAYLOAD)
        gate = asyncio.Semaphore(TP_CONCURRENCY)

        async def send() -> None:
            async with gate:
                await pub.publish(f"fl/{FED}/up/a/tp", payload)

        t0 = time.monotonic()
        sender = asyncio.gather(*(send() for _ in range(TP_MESSAGES)))
        got = await collect(sub, 120, TP_MESSAGES)
        elapsed = time.monotonic() - t0
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sender, 30)
        n = len(got)
        return {
            "messages": TP_MESSAGES,
            "received": n,
            "seconds": round(elapsed, 2),
            "msgs_per_s": round(n / elapsed, 1),
            "mb_per_s": round(n * LOAD_PAYLOAD / elapsed / 1e6, 2),
        }
    finally:
        await close_all(pub, sub)
