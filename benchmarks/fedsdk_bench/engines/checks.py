"""The checks 1-6, each a verdict (pass / fail / not supported) and what was seen."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time

from fedsdk.errors import FedError
from fedsdk.transport import MqttTransport, TlsConfig
from fedsdk_bench.engines.common import FED, HOST, LIMIT_BYTES, Cluster, Fleet, short
from fedsdk_bench.engines.mqtt import PahoPool, close_all, collect, transport, until

Check = dict[str, str]


def verdict(ok: bool | None, seen: str) -> Check:
    return {"result": "pass" if ok else ("not supported" if ok is None else "fail"), "seen": seen}


async def check_identity(fleet: Fleet, ports: list[int]) -> Check:
    seen = []
    t = transport(fleet, "a", ports[0])
    try:
        await t.connect()
        good = True
        seen.append("device cert: connected")
    except FedError as exc:
        good = False
        seen.append(f"device cert: {short(exc, 80)}")
    await close_all(t)
    refused = []
    for label, tls in (("no cert", TlsConfig(fleet.files("a")[0])), ("other CA", fleet.tls("foreign"))):
        t = MqttTransport(HOST, ports[0], client_id="a", tls=tls, timeout=5)
        try:
            await t.connect()
            refused.append(False)
            seen.append(f"{label}: CONNECTED")
        except FedError as exc:
            refused.append(True)
            seen.append(f"{label}: refused ({short(str(exc).split(': ', 1)[-1], 60)})")
        await close_all(t)
    return verdict(good and all(refused), "; ".join(seen))


async def check_acl(fleet: Fleet, ports: list[int]) -> Check:
    seen: list[str] = []
    coord = a = None
    bs: list[MqttTransport] = []
    try:
        coord = transport(fleet, "coordinator", ports[0])
        await coord.connect()
        await coord.subscribe(f"fl/{FED}/up/#")
        a = transport(fleet, "a", ports[1])
        await a.connect()
        await a.publish(f"fl/{FED}/up/a/update", b"genuine")
        try:
            await a.publish(f"fl/{FED}/up/b/update", b"forged", timeout=5)
            seen.append("forged publish: PUBACKed")
        except Exception as exc:
            seen.append(f"forged publish: {short(exc, 70)}")
        await asyncio.sleep(0.3)
        seen.append(f"a's link: {'up' if a.connected else 'down'}, {a.stats['reconnects']} reconnect(s)")
        got = await collect(coord, 3)
        topics = [m.topic for m in got]
        genuine = f"fl/{FED}/up/a/update" in topics
        forged = f"fl/{FED}/up/b/update" in topics
        seen.append(f"coordinator got genuine={genuine} forged={forged}")
        refused_all = True
        for flt in (f"fl/{FED}/up/#", f"fl/{FED}/down/a", "#", "$SYS/#"):
            b = transport(fleet, "b", ports[2], cid="b")
            bs.append(b)
            await b.connect()
            try:
                await b.subscribe(flt, timeout=5)
                seen.append(f"b SUB {flt}: granted")
                refused_all = False
            except Exception as exc:
                seen.append(f"b SUB {flt}: refused ({short(exc, 50)})")
            await close_all(b)  # one client id at a time; a granted filter is re-tested below
        leaks = 0
        granted = [s.split()[2].rstrip(":") for s in seen if s.endswith("granted")]
        if granted:
            b = transport(fleet, "b", ports[2])
            bs.append(b)
            await b.connect()
            for flt in granted:
                with contextlib.suppress(FedError):
                    await b.subscribe(flt, timeout=5)
            await coord.publish(f"fl/{FED}/down/a", b"task-for-a")
            await a.publish(f"fl/{FED}/up/a/update", b"a-private")
            leaks = len(await collect(b, 3))
            seen.append(f"b received {leaks} message(s) through granted filters")
        ok = genuine and not forged and (refused_all or leaks == 0)
        return verdict(ok, "; ".join(seen))
    finally:
        await close_all(coord, a, *bs)


async def check_retained(fleet: Fleet, ports: list[int]) -> Check:
    """The coordinator publishes a retained cluster broadcast on node 1; devices connecting afterwards to
    nodes 2 and 3 subscribe to the exact topic (as fedsdk devices do). Node 1 and a wildcard filter are
    reported for reference."""
    coord = None
    ts: list[MqttTransport] = []
    seen = []
    topic = f"fl/{FED}/cluster/0"
    try:
        coord = transport(fleet, "coordinator", ports[0])
        await coord.connect()
        body = b"cluster-0 aggregate " + secrets.token_hex(4).encode()
        await coord.publish(topic, body, retain=True)
        await close_all(coord)
        await asyncio.sleep(1.0)
        oks = []
        for who, i, flt in (
            ("a", 1, topic),
            ("b", 2, topic),
            ("c", 0, topic),
            ("c", 0, f"fl/{FED}/cluster/#"),
        ):
            t = transport(fleet, who, ports[i])
            ts.append(t)
            await t.connect()
            await t.subscribe(flt)
            got = [m for m in await collect(t, 5, 1) if m.payload == body]
            await close_all(t)
            if i:
                oks.append(bool(got))
            seen.append(f"node {i + 1} {flt}: {'received' if got else 'nothing in 5 s'}")
        return verdict(all(oks), "; ".join(seen))
    finally:
        await close_all(coord, *ts)


async def check_size(fleet: Fleet, ports: list[int]) -> Check:
    pool = PahoPool(fleet, workers=2)
    seen = []
    try:
        coord, cst = await pool.connect("coordinator", ports[0])
        await until(lambda: cst.connack is not None, 10)
        coord.subscribe(f"fl/{FED}/up/a/#", qos=1)
        await asyncio.sleep(1)
        dev, dst = await pool.connect("a", ports[0])
        await until(lambda: dst.connack is not None, 10)
        one = dev.publish(f"fl/{FED}/up/a/one", os.urandom(2**20), qos=1)
        small_ok = await until(lambda: any(t.endswith("/one") for t, _, _ in cst.received), 20)
        acked = await until(lambda: one.mid in dst.pubacks, 5)
        seen.append(
            f"1 MiB: {'delivered' if small_ok else 'NOT delivered'}, {'PUBACK' if acked else 'no PUBACK'}"
        )
        big_size = LIMIT_BYTES + 2**20
        big = dev.publish(f"fl/{FED}/up/a/big", os.urandom(big_size), qos=1)
        t0 = time.monotonic()
        await until(lambda: dst.disconnected is not None or big.mid in dst.pubacks, 10)
        closed_after = time.monotonic() - t0
        await asyncio.sleep(2)
        delivered = any(t.endswith("/big") for t, _, _ in cst.received)
        closed = dst.disconnected is not None
        seen.append(
            f"9 MiB: {'DELIVERED' if delivered else 'not delivered'}, "
            f"{'PUBACK' if big.mid in dst.pubacks else 'no PUBACK'}, "
            + (
                f"connection closed by broker after {closed_after:.1f} s"
                if closed
                else "connection kept open"
            )
        )
        if not closed:
            after = dev.publish(f"fl/{FED}/up/a/after", b"x" * 1024, qos=1)
            ok = await until(lambda: any(t.endswith("/after") for t, _, _ in cst.received), 5)
            seen.append(
                f"then 1 KiB on the same connection: {'delivered' if ok else 'not delivered'}, "
                f"{'PUBACK' if after.mid in dst.pubacks else 'no PUBACK'}"
            )
        return verdict(small_ok and not delivered and closed, "; ".join(seen))
    finally:
        await pool.close()


async def check_client_id(fleet: Fleet, ports: list[int]) -> Check:
    pool = PahoPool(fleet, workers=2)
    a = None
    seen = []
    try:
        _, bst = await pool.connect("b", ports[0])
        await until(lambda: bst.connack is not None, 10)
        seen.append(f"b connected on node 1 ({bst.rc})")
        a = transport(fleet, "a", ports[1], cid="b", reconnect_min=30, reconnect_max=30)
        try:
            await a.connect()
            refused = False
            seen.append("a (cert CN=a) with client_id b: accepted")
        except FedError as exc:
            refused = True
            seen.append(f"a with client_id b: refused ({short(exc, 60)})")
        await until(lambda: bst.disconnected is not None, 5)
        kicked = bst.disconnected is not None
        seen.append(
            f"b: {'disconnected by broker (' + str(bst.disconnected) + ')' if kicked else 'still connected'}"
        )
        return verdict(refused and not kicked, "; ".join(seen))
    finally:
        await close_all(a)
        await pool.close()


async def check_failover(cluster: Cluster, fleet: Fleet) -> Check:
    ports = cluster.mqtt_ports
    coord = c = c2 = None
    seen = []
    try:
        coord = transport(fleet, "coordinator", ports[0])
        await coord.connect()
        await coord.subscribe(f"fl/{FED}/up/c/#")
        c = transport(fleet, "c", ports[1])
        await c.connect()
        await c.publish(f"fl/{FED}/up/c/update", b"before-kill")
        seen.append("m1 PUBACKed by node 2")
        cluster.kill_node(1)
        t0 = time.monotonic()
        await close_all(c)
        c2 = transport(fleet, "c", ports[2], timeout=30)
        await c2.connect()
        t1 = time.monotonic()
        await c2.publish(f"fl/{FED}/up/c/update", b"after-kill", timeout=30)
        t2 = time.monotonic()
        seen.append(
            f"node 2 SIGKILLed; c connected to node 3 {t1 - t0:.1f} s after the kill, m2 PUBACKed "
            f"{t2 - t1:.1f} s later"
        )
        got = {m.payload for m in await collect(coord, 15, 2)}
        both = {b"before-kill", b"after-kill"} <= got
        seen.append(f"coordinator on node 1 received {sorted(p.decode() for p in got)}")
        return verdict(both, "; ".join(seen))
    except FedError as exc:
        seen.append(short(exc, 100))
        return verdict(False, "; ".join(seen))
    finally:
        await close_all(coord, c, c2)
