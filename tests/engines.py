"""A RoundEngine for tests that drive it by hand: a small MLP, a fresh store, publications dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsdk.client import FedClient
from fedsdk.crypto import HEBackend
from fedsdk_coordinator.models import build_graphs, init_params, mlp
from fedsdk_coordinator.rounds import RoundConfig, RoundEngine
from fedsdk_coordinator.store import Store

SPEC = mlp(hidden=(8,))


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
    """A plain-TCP FedClient of ``engine``'s federation on ``broker`` (no uplink probe)."""
    return FedClient(
        broker.url,
        client_id=cid,
        federation=engine.config.federation,
        data=data,
        insecure=True,
        probe_bytes=0,
        **options,
    )
