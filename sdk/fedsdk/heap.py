"""Keep Python's cyclic garbage collector off a device's round.

A device process holds some 50 thousand long-lived objects that the collector tracks (the imported modules
of numpy, onnxruntime, cryptography and paho, the keys, the obfuscator tables). Every full (oldest
generation) collection walks all of them: measured at 12–29 ms of CPU on one core of the benchmark machine
with 50 k objects and nothing to free, so 0.2–0.4 s on a device 15× slower, and it falls inside whatever
step allocated last (training, encryption, decryption). :func:`freeze_long_lived` collects once, then moves
everything alive at that moment to the collector's permanent generation (:func:`gc.freeze`, the technique
CPython documents for long-lived processes), so that later collections walk only what the rounds create
(a few thousand objects). Frozen objects are still freed by reference counting; only a reference cycle
formed among objects that were alive at the freeze would stay until the process exits.

``fedsdk join`` calls it once its client is connected; an application embedding :class:`~fedsdk.FedClient`
may call it after its own start-up for the same effect.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_long_lived"]


def freeze_long_lived() -> int:
    """Collect, then freeze every object alive now; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
