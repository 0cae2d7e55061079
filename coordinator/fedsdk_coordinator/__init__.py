"""fedsdk_coordinator: what the laptop runs (the aiohttp application, rounds, aggregation, state, the key
server, provisioning, model import and graph building, the operator's commands and attack audits).

The top-level names load on first use (PEP 562), so ``fedsdk_coordinator.models`` or ``.pki`` can be used
without importing the web application and its dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsdk_coordinator.aggregate import AggregateResult, fedavg
    from fedsdk_coordinator.app import CoordinatorConfig, create_app
    from fedsdk_coordinator.broker import EmbeddedBroker, EmbeddedBrokerConfig
    from fedsdk_coordinator.rounds import RoundConfig, RoundEngine
    from fedsdk_coordinator.store import Store

_WHERE = {
    "AggregateResult": "aggregate",
    "fedavg": "aggregate",
    "CoordinatorConfig": "app",
    "create_app": "app",
    "EmbeddedBroker": "broker",
    "EmbeddedBrokerConfig": "broker",
    "RoundConfig": "rounds",
    "RoundEngine": "rounds",
    "Store": "store",
}

__all__ = [
    "AggregateResult",
    "CoordinatorConfig",
    "EmbeddedBroker",
    "EmbeddedBrokerConfig",
    "RoundConfig",
    "RoundEngine",
    "Store",
    "create_app",
    "fedavg",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fedsdk_coordinator' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fedsdk_coordinator.{module}"), name)
