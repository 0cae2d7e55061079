"""The rule table: :data:`RULES` maps an ONNX operator to its :data:`Rule`, and :func:`_rule` registers one.

The family modules register into it when imported; :mod:`fedsdk_coordinator.models.rules` imports all of
them, so the table is complete whenever it is reached through that package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedsdk_coordinator.models.graphwriter import GraphWriter

__all__ = ["RULES", "Grads", "Node", "Rule"]

Grads = list[str | None]


@dataclass
class Node:
    """A forward node as the rules see it."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


Rule = Callable[[GraphWriter, Node, Sequence[str | None], Sequence[bool]], Grads]
RULES: dict[str, Rule] = {}


def _rule(*ops: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def _none(node: Node) -> Grads:
    return [None] * len(node.inputs)
