"""Cooperative decryption, the coordinator's side: split each round's decryption among a cluster's devices
and relay their sealed shares (key mode ``shared``, strategy ``fedsdk``; the device's side and the
protocol are in ``fedsdk.coop`` and ``fedsdk.crypto.shares``).

Why: with shared keys every device used to decrypt the whole union of its cluster's masks, so after the
aggregate the slowest device spent ``U / d_slowest`` decrypting before it could report; in the system
scenario of the fleet benchmark that was the whole gap to plaintext (docs/benchmarks.md). Split in
proportion to the devices' decryption speeds, the cluster decrypts the union once, in about
``U / Σ d_i``, and each device's share of it is what the deadline budgets count (budgets.py).

Decisions:

* The split is by *fraction of the union's ranks* and goes out with the task, before the union exists,
  so it costs no extra message; :func:`fedsdk.coop.share_ranks` turns it into the same partition on
  every device.
* Weights: the measured decryption speed (``decrypt_values_per_s``, from the devices' reports), else the
  measured encryption speed (both are modular exponentiations, so they scale alike across devices), else
  equal shares. A device whose speed is unknown gets the median of the known ones.
* The coordinator relays a share only from a participant of the round, once, on the cluster topic and not
  retained (the retained message there is the aggregate). It cannot open a share (AES-GCM under a key
  derived from the HE secret key) and does not try; its checks are on the envelope: round, cluster,
  sender, pack indices within the model.
* Relayed in **one bundle** (``ShareBundle``: each share's sender, packs and sealed bytes as received,
  without its envelope, which every device would otherwise decode once per share): when every device
  with a non-empty part has shared, or ``share_wait_s / 2`` after the aggregate went out, whichever is
  first; a share arriving after that goes out at once. A device needs every part anyway, so holding them
  costs it nothing, while relaying each one would cost every device one message per device of its
  cluster: measured in the fleet benchmark's system scenario (20 devices in 4 worker processes on 2
  cores), relaying one by one left the devices 0.12-0.23 s waiting for shares (docs/benchmarks.md).
* **The last devices to finish get no part.** A device prepares the openings of its part while it waits for
  the aggregate (``fedsdk.client.decryption``), and the bundle waits for its share: a device that sends its
  update last has no wait to prepare in, so its part is prepared and opened after the aggregate, while the
  whole cluster waits for its share. The devices whose measured training time is within ``LATE_MARGIN``
  (10 %) of the slowest one's therefore decrypt nothing for the others, at most a quarter of the cluster
  (``LATE_MOST``, the slowest first): in a fleet of like devices nearly every one trains within 10 % of the
  slowest, and the few a little faster would otherwise decrypt the whole union. They open the bundle like
  everyone. Measured in the fleet benchmark's system scenario (``mlp``, 4,810 parameters, 20 devices, ms
  after the aggregate went out, rounds 2-30): the slowest devices (k = 45) took 15 ms after the aggregate to
  finish preparing and their share reached the coordinator last, at 30 ms (2048-bit keys, seed 2, timestamps
  added for the measurement); with no part for them, the path from the aggregate to the last report fell
  from 65, 70, 67 and 82 ms to 54, 53, 54 and 51 (2048 bits seeds 1, 2 and 3, 3072 bits seed 1;
  docs/benchmarks.md). A wider margin (no part for every device training at 60 % of the slowest's time or
  more) left too few devices holding the decryption and gained nothing more.
* A cluster of one device gets no split: there is nothing to share.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping

__all__ = ["LATE_MARGIN", "LATE_MOST", "last_to_finish", "share_split"]

LATE_MARGIN = 0.1  # a device training within 10 % of the slowest one's time gets no part (module docstring)
LATE_MOST = 0.25  # but at most this fraction of the cluster's devices, the slowest first


def share_split(
    speeds: Mapping[str, float | None], late: Collection[str] = ()
) -> dict[str, tuple[float, float]]:
    """Contiguous fractions ``[lo, hi)`` of [0, 1) per device, in client-id order, each proportional to the
    device's speed (unknown: the median of the known speeds; none known: equal); the devices in ``late``
    (:func:`last_to_finish`) get an empty part, unless that would leave no device a part. Empty for fewer
    than two devices."""
    if len(speeds) < 2:
        return {}
    known = [float(v) for v in speeds.values() if v is not None and v > 0]
    fill = statistics.median(known) if known else 1.0
    weights = {c: (float(v) if v is not None and v > 0 else fill) for c, v in speeds.items()}
    if set(weights) - set(late):
        weights.update({c: 0.0 for c in late if c in weights})
    total = sum(weights.values())
    ids = sorted(weights)
    last = max(i for i, c in enumerate(ids) if weights[c] > 0)  # its part ends at 1.0 exactly
    out: dict[str, tuple[float, float]] = {}
    acc = 0.0
    for i, cid in enumerate(ids):
        hi = 1.0 if i >= last else min(1.0, acc + weights[cid] / total)
        out[cid] = (acc, hi)
        acc = hi
    return out


def last_to_finish(
    train_s: Mapping[str, float], margin: float = LATE_MARGIN, most: float = LATE_MOST
) -> set[str]:
    """The devices that send their update last: those whose measured training time is within ``margin``
    (a fraction) of the slowest one's, at most ``most`` (a fraction) of all, the slowest first. None while
    nothing is measured."""
    top = max(train_s.values(), default=0.0)
    if top <= 0:
        return set()
    near = sorted((c for c, t in train_s.items() if t >= (1.0 - margin) * top), key=lambda c: -train_s[c])
    return set(near[: int(most * len(train_s))])
