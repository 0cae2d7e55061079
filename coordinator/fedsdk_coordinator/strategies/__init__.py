"""The strategies a federation can run, side by side in the benchmarks; one module each, one interface
(:mod:`fedsdk_coordinator.strategies.base`) that the round engine calls at its steps.

| name         | HE backend | clustering | budgets            | mask                          |
|--------------|------------|------------|--------------------|-------------------------------|
| ``plaintext``  | none       | optional   | -                  | none                          |
| ``plain-he``   | paillier   | no         | 1 (everything)     | all values                    |
| ``maskcrypt``  | paillier   | no         | one uniform α      | top-α packs; global mask = union |
| ``sensecrypt`` | paillier   | yes        | paper 000 §3.2     | eq. 4-9 per value             |
| ``fedsdk``     | packed     | yes        | deadline (ours)    | eq. 4-9 per pack filled to α, consensus |

A new strategy is a subclass of :class:`Strategy` (or :class:`HEStrategy` when devices encrypt) in a module
of its own, registered with :func:`register`; ``RoundConfig(strategy=its name)`` runs it. Nothing in the
engine names a strategy.
"""

from __future__ import annotations

from fedsdk.errors import ConfigError
from fedsdk_coordinator.strategies.base import Aggregated, AggregationInputs, ClusterPlan, Strategy
from fedsdk_coordinator.strategies.fedsdk import FedSDK
from fedsdk_coordinator.strategies.he import HEStrategy
from fedsdk_coordinator.strategies.maskcrypt import MaskCrypt
from fedsdk_coordinator.strategies.plain_he import PlainHE
from fedsdk_coordinator.strategies.plaintext import FedAvg
from fedsdk_coordinator.strategies.sensecrypt import SenseCrypt

__all__ = [
    "STRATEGIES",
    "Aggregated",
    "AggregationInputs",
    "ClusterPlan",
    "HEStrategy",
    "Strategy",
    "register",
    "strategy",
]

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` runnable by its ``name`` (usable as a class decorator). A second class under a name
    already taken is a ConfigError; registering the same class again is harmless."""
    held = STRATEGIES.get(cls.name)
    if held is not None and held is not cls:
        raise ConfigError(f"strategy {cls.name!r} is already registered ({held.__module__}.{held.__name__})")
    STRATEGIES[cls.name] = cls
    return cls


for _cls in (FedAvg, PlainHE, MaskCrypt, SenseCrypt, FedSDK):
    register(_cls)


def strategy(name: str) -> type[Strategy]:
    """The strategy class registered under ``name``."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}") from None
