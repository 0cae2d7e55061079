"""Engines and devices for tests: a RoundEngine driven by hand (a small MLP, a fresh store, publications
recorded), coordinators on a real broker, FedClients of their federation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp.test_utils import TestClient, TestServer

from fedsdk.client import FedClient
from fedsdk.crypto import HEBackend, generate_backend
from fedsdk.hekeys import load_he, save_he
from fedsdk.model.data import load_digits, partition_iid
from fedsdk.protocol import (
    Aggregate,
    BaseMessage,
    EncryptedAggregate,
    Hello,
    MaskKeys,
    MaskShares,
    Sketch,
    Task,
    UnmaskRequest,
    UnmaskShares,
    decode,
    encode,
)
from fedsdk.protocol import topics as T
from fedsdk.secagg.keys import Context
from fedsdk_coordinator.app import ENGINE, CoordinatorConfig, create_app
from fedsdk_coordinator.models import build_graphs, init_params, mlp
from fedsdk_coordinator.rounds import RoundConfig, RoundEngine
from fedsdk_coordinator.secagg import MaskingRound
from fedsdk_coordinator.store import Store

SPEC = mlp(hidden=(8,))
SKETCH_DIM = 8  # the hand-driven engine's sketch size


def make_engine(tmp_path: Path, he: HEBackend | None, **config: Any) -> RoundEngine:
    """An engine over ``SPEC`` with ``RoundConfig(**config)`` (a ConfigError comes from here)."""

    async def publish(topic: str, payload: bytes, *, retain: bool = False) -> None:
        pass

    return RoundEngine(
        RoundConfig(**config),
        store=Store(tmp_path / "s.sqlite"),
        bundle=build_graphs(SPEC),
        initial_weights=init_params(SPEC, seed=0),
        eval_data=None,
        publish=publish,
        he=he,
    )


def device(broker: Any, engine: RoundEngine, cid: str, data: Any, **options: Any) -> FedClient:
    """A plain-TCP FedClient of ``engine``'s federation on ``broker`` (no uplink probe), that takes part in
    sums as small as the coordinator forms (``min_aggregate``, as an operator sets both)."""
    options.setdefault("min_aggregate", engine.config.min_aggregate)
    return FedClient(
        broker.url,
        client_id=cid,
        federation=engine.config.federation,
        data=data,
        insecure=True,
        probe_bytes=0,
        **options,
    )


@asynccontextmanager
async def http_coordinator(
    tmp_path: Path, broker: Any, rounds: RoundConfig, *, he_dir: Path | None = None
) -> AsyncIterator[TestClient[Any, Any]]:
    """The coordinator application (model ``mlp``, plain TCP to ``broker``) serving ``rounds``; an HTTP
    client of it (``http.app[ENGINE]`` is its engine)."""
    config = CoordinatorConfig(
        rounds=rounds, state_dir=tmp_path / "state", model="mlp", broker_url=broker.url, insecure=True,
        he_dir=he_dir,
    )  # fmt: skip
    async with TestClient(TestServer(create_app(config))) as http:
        yield http


@asynccontextmanager
async def coordinator(
    tmp_path: Path, broker: Any, rounds: RoundConfig, *, he_dir: Path | None = None
) -> AsyncIterator[RoundEngine]:
    """As :func:`http_coordinator`; its engine."""
    async with http_coordinator(tmp_path, broker, rounds, he_dir=he_dir) as http:
        yield http.app[ENGINE]


def digit_devices(
    broker: Any, engine: RoundEngine, digits: Any, part: Any, *, he_dir: Path | None = None, **options: Any
) -> list[FedClient]:
    """One device per partition of ``digits``' training set, ``d0``, ``d1``, ..., each with its own copy of
    the HE key in ``he_dir``."""
    return [
        device(
            broker,
            engine,
            f"d{i}",
            (digits.x_train[idx], digits.y_train[idx]),
            he=load_he(he_dir) if he_dir is not None else None,
            **options,
        )
        for i, idx in enumerate(part.indices)
    ]


async def run_device(client: FedClient, *, timeout: float = 120.0, delay: float = 0.0) -> Any:
    """Open ``client`` (after ``delay`` seconds) and run it to its end: its summary."""
    await asyncio.sleep(delay)
    async with client:
        return await client.run(timeout=timeout)


async def until(cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Wait (polling) until ``cond()`` is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def he_key_dirs(tmp_path: Path, key_bits: int = 1024) -> tuple[Path, Path]:
    """A new packed-Paillier key saved twice under ``tmp_path``: the public folder a coordinator takes and
    the folder with the secret key every device of a ``shared``-mode federation holds."""
    with generate_backend("packed", key_bits=key_bits) as full:
        return (
            save_he(tmp_path / "he-public", full, include_secret=False),
            save_he(tmp_path / "he-device", full, include_secret=True),
        )


def he_rounds(federation: str, **options: Any) -> RoundConfig:
    """A small unclustered ``fedsdk`` federation of devices that join one by one (a round needs one device;
    ``options`` override): what the model-relay tests run."""
    config: dict[str, Any] = dict(
        strategy="fedsdk", rounds=2, min_clients=1, start_clients=1, deadline_s=20.0, seed=1,
        clustering=False, farewell_s=2.0, join_timeout_s=60.0,
        secagg=False,  # a round of one device has no sum to mask
    )  # fmt: skip
    return RoundConfig(federation=federation, **{**config, **options})


def digit_shards(n: int, seed: int = 0) -> list[tuple[Any, Any]]:
    """The digits' training set split IID into ``n`` shards ``(x, y)``."""
    digits = load_digits(shape="flat")
    part = partition_iid(digits.y_train, n, seed=seed)
    return [(digits.x_train[idx], digits.y_train[idx]) for idx in part.indices]


def slowed(client: FedClient, delay_s: float, bases: dict[int, list[np.ndarray]] | None = None) -> None:
    """``client`` takes ``delay_s`` more to train (rounds last long enough to join or stop a device between
    them) and, with ``bases``, records the model each round trains from."""
    fit = client._fit

    def slow_fit(task: Any, base: list[np.ndarray], fit: Any = fit) -> Any:
        if bases is not None:
            bases[task.round_id] = [np.array(w, copy=True) for w in base]
        time.sleep(delay_s)  # in the executor
        return fit(task, base)

    client._fit = slow_fit  # type: ignore[method-assign]


class Driven:
    """One coordinator instance on a store file, driven by hand: devices speak through ``RoundEngine.handle``
    and the engine publishes into a list; ``crash()`` ends it the way ``kill -9`` would."""

    def __init__(
        self, path: Path, *, federation: str, rounds: int = 2, he: HEBackend | None = None, **kw: Any
    ) -> None:
        self.federation = federation
        self.published: list[tuple[str, BaseMessage, bytes]] = []
        self.store = Store(path)
        config = RoundConfig(
            federation=federation,
            rounds=rounds,
            min_clients=kw.pop("min_clients", 3),
            start_clients=3,
            deadline_s=3600.0,
            join_timeout_s=3600.0,
            report_timeout_s=kw.pop("report_timeout_s", 0.2),
            sketch_dim=SKETCH_DIM,
            strategy=kw.pop("strategy", "plaintext"),
            farewell_s=0.0,  # the simulated devices never say goodbye
            # the simulated devices' replies are built by hand, unmasked unless a test asks (a masked
            # round's devices: tests/coordinator/test_secagg_engine.py)
            secagg=kw.pop("secagg", False),
            **kw,
        )
        self.engine = RoundEngine(
            config,
            store=self.store,
            bundle=build_graphs(SPEC),
            initial_weights=init_params(SPEC, seed=0),
            eval_data=None,
            publish=self._publish,
            he=he,
        )
        self.task: asyncio.Task[None] | None = None

    async def _publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.published.append((topic, decode(payload), payload))

    def start(self) -> None:
        self.task = asyncio.create_task(self.engine.run())

    def hello(self, *cids: str) -> None:
        for cid in cids:
            self.engine.handle(T.up(self.federation, cid, T.HELLO), encode(Hello(cid, 10, "0.1.0")))

    def send(self, cid: str, msg: BaseMessage) -> bytes:
        kind = T.SKETCH if isinstance(msg, Sketch) else T.UPDATE
        payload = encode(msg)
        self.engine.handle(T.up(self.federation, cid, kind), payload)
        return payload

    def tasks(self, round_id: int) -> dict[str, list[Task]]:
        out: dict[str, list[Task]] = {}
        for topic, msg, _ in self.published:
            if isinstance(msg, Task) and msg.round_id == round_id:
                out.setdefault(topic.rsplit("/", 1)[1], []).append(msg)
        return out

    def aggregates(self) -> list[tuple[BaseMessage, bytes]]:
        return [(m, raw) for _, m, raw in self.published if isinstance(m, Aggregate | EncryptedAggregate)]

    async def until(self, cond: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.task is None or not self.task.done(), f"the engine stopped: {self.engine.state}"
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)

    async def crash(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.store.close()

    async def finish(self, timeout: float = 60.0) -> None:
        await asyncio.wait_for(self.engine.finished.wait(), timeout)
        assert self.task is not None
        await self.task
        self.store.close()


def observed_correction(seen: Iterable[Any], federation: str, round_id: int, cluster_id: int) -> list[Any]:
    """The correction terms of a masked round as the masking messages in ``seen`` give them (the keys,
    shares and unmask shares the devices sent, the sum the coordinator named on the cluster topic): what
    removes the masks from the sum of the masked updates an observer saw, whichever coordinator instance
    formed it (``fedsdk_coordinator.secagg``, run again here on the observed messages)."""
    msgs = [
        m
        for m in seen
        if getattr(m, "round_id", None) == round_id and getattr(m, "cluster_id", None) == cluster_id
    ]
    (request,) = {m.session: m for m in msgs if isinstance(m, UnmaskRequest)}.values()
    mine = [m for m in msgs if getattr(m, "session", None) == request.session]
    keys = [m for m in mine if isinstance(m, MaskKeys)]
    m = MaskingRound(
        Context(federation, round_id, cluster_id, request.session), frozenset(k.client_id for k in keys), 2
    )
    for k in keys:
        m.take_keys(k)
    m.fix_members()
    for sh in mine:
        if isinstance(sh, MaskShares):
            m.take_shares(sh)
    m.fix_partners()
    m.name_sum(set(request.survivors))
    for u in mine:
        if isinstance(u, UnmaskShares):
            m.take_unmask(u)
    return m.correction()
