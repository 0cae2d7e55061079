"""The device's heap settling (fedsdk.heap): long-lived objects leave the collector, new garbage does not."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from fedsdk.heap import freeze_long_lived


@pytest.fixture
def thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # give the other tests their usual collector back


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_objects_alive_at_the_freeze_leave_the_collector_and_later_cycles_are_still_freed(
    thawed: None,
) -> None:
    before = _Node()
    frozen = freeze_long_lived()
    assert frozen >= 1000  # the interpreter and the imported modules alone are thousands of objects
    assert frozen == gc.get_freeze_count()
    assert not any(o is before for o in gc.get_objects()), "an object alive at the freeze is not scanned"
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle formed after the freeze: only the collector can free it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
    assert gc.get_freeze_count() == frozen
