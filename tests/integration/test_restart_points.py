"""Restart at every point of a round: the coordinator (a process) is killed with SIGKILL at each stage a
round passes (``fedsdk_coordinator.failpoints``: tasks sent, first reply stored, all stored, aggregate
stored, aggregate published, first report in, round completed), one stage per round, and started again on
the same state directory each time; four devices (FedClients in this process, so their models and counts
can be read) stay connected to a real mosquitto throughout, with a quorum of two.

After the seven restarts, under plaintext and under the ``fedsdk`` strategy (packed Paillier, sketch round,
clustering, cooperative decryption): every device took part in every round (an update from each in the
store's results, round after round), each device applied each round exactly once, and the final models
equal those of an uninterrupted run with the same seeds, bit for bit.

The HE run uses ``mlp16`` and 1024-bit keys to keep the suite short (fourteen federations' worth of
coordinator starts); what is tested is the restart logic, not the key size. ``--target-round`` is large so
that every device's budget is its whole update, so masks do not depend on measured speeds and two runs are
comparable bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from brokers import free_port, require_mosquitto, start_mosquitto
from fedsdk.client import ClientSummary, FedClient
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import load_he, save_he
from fedsdk.model.data import load_digits, partition_iid
from fedsdk_coordinator.failpoints import STAGES
from fedsdk_coordinator.store import Store

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(900)]

DEVICES = ("d1", "d2", "d3", "d4")
ROUNDS = len(STAGES)  # one stage per round
SEED = 5


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


@pytest.fixture(scope="module")
def device_data() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, len(DEVICES), seed=2)
    return {
        cid: (digits.x_train[idx], digits.y_train[idx])
        for cid, idx in zip(DEVICES, part.indices, strict=True)
    }


TAG = "FEDSDK_TEST_COORDINATOR"


def left_behind(tag: str, timeout: float) -> list[str]:
    """The live processes whose environment carries ``TAG=tag`` (a coordinator and what it started), once
    none are left or after ``timeout`` seconds; those still there are killed so that no test leaks them."""

    def tagged() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG) == tag:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    deadline = time.monotonic() + timeout
    while (found := tagged()) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = []
    for p in found:
        with contextlib.suppress(psutil.Error):
            described.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
            p.kill()
    return described


@dataclass
class Outcome:
    kills: list[int]  # exit codes of the coordinator processes that hit their crash point
    summaries: dict[str, ClientSummary]
    weights: dict[str, list[np.ndarray]]  # each device's final model
    state: Path


async def federate(
    tmp: Path,
    data: dict[str, tuple[np.ndarray, np.ndarray]],
    points: Sequence[str],
    coordinator_args: Sequence[str] = (),
    he_dir: Path | None = None,
) -> Outcome:
    """One federation: a coordinator process per crash point (each killed there) and a last one that runs
    to the end; the devices stay up throughout."""
    fed = f"rp{secrets.token_hex(3)}"
    state = tmp / "state"
    logs = tmp / "logs"
    logs.mkdir()
    with start_mosquitto(tmp / "mosq") as broker:

        def coordinator(i: int, point: str | None) -> subprocess.Popen[bytes]:
            env = dict(os.environ)
            env.pop("FEDSDK_FAILPOINT", None)
            env[TAG] = f"{fed}-{i}"  # inherited by every process the coordinator starts
            if point:
                env["FEDSDK_FAILPOINT"] = point
            cmd = [
                sys.executable, "-m", "fedsdk", "-v", "coordinator", "--broker", broker.url, "--insecure",
                "--state-dir", str(state), "--federation", fed, "--rounds", str(ROUNDS), "--min-clients", "2",
                "--start-clients", str(len(DEVICES)), "--deadline", "30", "--seed", str(SEED),
                "--http", f"127.0.0.1:{free_port()}", "--exit-when-done", *coordinator_args,
            ]  # fmt: skip
            with open(logs / f"coordinator{i}.log", "wb") as out:
                return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

        clients = {
            cid: FedClient(
                broker.url,
                client_id=cid,
                federation=fed,
                data=data[cid],
                insecure=True,
                he=load_he(he_dir) if he_dir is not None else None,
                probe_bytes=0,
            )
            for cid in DEVICES
        }

        async def device(client: FedClient) -> ClientSummary:
            async with client:
                return await client.run(timeout=600)

        runs = [asyncio.create_task(device(c)) for c in clients.values()]
        kills: list[int] = []
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i, point in enumerate([*points, None]):
                procs.append(coordinator(i, point))
                code = await asyncio.to_thread(procs[-1].wait, 600)
                log = (logs / f"coordinator{i}.log").read_text(errors="replace")
                if point is not None:
                    assert code == -signal.SIGKILL, f"{point}: exit {code}, no crash there\n{log[-3000:]}"
                    kills.append(code)
                    left = await asyncio.to_thread(left_behind, f"{fed}-{i}", 15.0)
                    assert not left, f"{point}: the killed coordinator left processes behind: {left}"
                else:
                    assert code == 0, log[-3000:]
            summaries = dict(zip(clients, await asyncio.wait_for(asyncio.gather(*runs), 120), strict=True))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for t in runs:
                t.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    weights = {cid: [w.copy() for w in c.weights or []] for cid, c in clients.items()}
    return Outcome(kills, summaries, weights, state)


def check(outcome: Outcome, reference: Outcome, *, points: int) -> None:
    assert len(outcome.kills) == points
    for cid, summary in outcome.summaries.items():
        assert summary.state == "finished", (cid, summary.state, summary.reason)
        assert summary.applied_rounds == list(range(1, ROUNDS + 1)), (cid, summary.applied_rounds)
    with Store(outcome.state / "coordinator.sqlite") as s:
        assert s.completed_round() == ROUNDS
        assert {r.state for r in s.rounds()} == {"done"}
        for r in range(1, ROUNDS + 1):
            updated = {row["client_id"] for row in s.results(r) if row["status"] == "update"}
            assert updated == set(DEVICES), f"round {r} ran with {sorted(updated)} only"
    for cid in DEVICES:
        want, got = reference.weights[cid], outcome.weights[cid]
        assert len(got) == len(want) > 0
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{cid}'s final model differs from the reference")


def points() -> list[str]:
    return [f"{r}:{stage}" for r, stage in enumerate(STAGES, start=1)]


async def test_plaintext_restart_at_every_stage_ends_with_the_uninterrupted_model(
    tmp_path: Path, device_data: dict[str, tuple[np.ndarray, np.ndarray]]
) -> None:
    (tmp_path / "ref").mkdir()
    (tmp_path / "crash").mkdir()
    reference = await federate(tmp_path / "ref", device_data, [])
    check(reference, reference, points=0)
    crashed = await federate(tmp_path / "crash", device_data, points())
    check(crashed, reference, points=ROUNDS)
    with Store(crashed.state / "coordinator.sqlite") as b:  # rounds aggregated before a restart too
        times = {r.round_id: r.metrics.get("round_s") for r in b.rounds()}
        assert all(isinstance(t, float) and t > 0 for t in times.values()), times
    with Store(reference.state / "coordinator.sqlite") as a, Store(crashed.state / "coordinator.sqlite") as b:
        ra, rb = a.latest_model(0), b.latest_model(0)
        assert ra is not None and rb is not None and ra[0] == rb[0] == ROUNDS
        for x, y in zip(ra[1], rb[1], strict=True):
            np.testing.assert_array_equal(x, y)


async def test_fedsdk_restart_at_every_stage_ends_with_the_uninterrupted_model(
    tmp_path: Path, device_data: dict[str, tuple[np.ndarray, np.ndarray]]
) -> None:
    with generate_backend("packed", key_bits=1024) as he:
        public = save_he(tmp_path / "he-public", he, include_secret=False)
        secret = save_he(tmp_path / "he-device", he, include_secret=True)
    args = ["--strategy", "fedsdk", "--model", "mlp16", "--he", str(public), "--target-round", "100000"]
    (tmp_path / "ref").mkdir()
    (tmp_path / "crash").mkdir()
    reference = await federate(tmp_path / "ref", device_data, [], args, secret)
    check(reference, reference, points=0)
    crashed = await federate(tmp_path / "crash", device_data, points(), args, secret)
    check(crashed, reference, points=ROUNDS)
