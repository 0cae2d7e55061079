"""Cooperative decryption, the coordinator's side: split each round's decryption among a cluster's devices
and relay their sealed shares (key mode ``shared``, strategy ``fedsdk``; the device's side and the
protocol are in ``fedsdk.coop`` and ``fedsdk.crypto.shares``).

Why: with shared keys every device used to decrypt the whole union of its cluster's masks, so after the
aggregate the slowest device spent ``U / d_slowest`` decrypting before it could report; in the system
scenario of the fleet benchmark that was the whole gap to plaintext (docs/results/fleet-scenarios.md).
Split in proportion to the devices' decryption speeds, the cluster decrypts the union once, in about
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
  cores), relaying one by one left the devices 0.12-0.23 s waiting for shares
  (docs/results/fleet-scenarios.md).
* **The last devices to finish get no part.** A device prepares the openings of its part while it waits for
  the aggregate (``fedsdk.client.decryption``), and the bundle waits for its share: a device that sends its
  update last has no wait to prepare in, so its part is prepared and opened after the aggregate, while the
  whole cluster waits for its share. The devices whose updates arrive in the last ``LATE_SLACK`` (10 %) of
  the round's collection (measured by the coordinator each round every participant replied to, the median
  of the last five: :attr:`Measured.slack`) therefore decrypt nothing for the others, at most a quarter of
  the cluster (``LATE_MOST``, the latest first): in a fleet of like devices nearly every one arrives late,
  and the few a little earlier would otherwise decrypt the whole union. They open the bundle like
  everyone. Until every device's arrival is measured, its training time stands for it (within
  ``LATE_MARGIN``, 10 %, of the slowest one's).
  Measured in the fleet benchmark's system scenario (``mlp``, 4,810 parameters, 20 devices, ms after the
  aggregate went out, rounds 2-30): the slowest devices (k = 45) took 15 ms after the aggregate to finish
  preparing and their share reached the coordinator last, at 30 ms (2048-bit keys, seed 2, timestamps added
  for the measurement); with no part for them (then chosen by training time), the path from the aggregate to
  the last report fell from 65, 70, 67 and 82 ms to 54, 53, 54 and 51 (2048 bits seeds 1, 2 and 3, 3072 bits
  seed 1; docs/results/fleet.md). A wider margin (no part for every device training at 60 % of the slowest's
  time or more) left too few devices holding the decryption and gained nothing more.
* Why arrival and not training time: devices of one speed train on different amounts of data and the
  measured times are noisy, so the training times of the slowest class spread wider than any margin. In the
  fleet benchmark's system scenario (2026-11-28, seed 1, 2048-bit keys, ``mlp``) the least of the four
  slowest devices' measured training times was 0.70 of the slowest's in the median round (0.61 at least),
  so with the 10 % margin those four held a part in 6, 7, 17 and 27 of 30 rounds, and the bundle waited
  for their late openings: the last share reached the coordinator 18 ms (median; at most 85) after its
  device had the aggregate. Chosen by arrival (the same four held a part in 1, 12, 12 and 15 rounds, those
  in which they had time to prepare it), 13 ms (at most 31), and the bundle went out 3 ms earlier (median
  37.6 ms after the aggregate against 40.5; timestamps added for the measurement and not kept).
* A cluster of one device gets no split: there is nothing to share.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping

__all__ = ["LATE_MARGIN", "LATE_MOST", "LATE_SLACK", "last_to_finish", "share_split"]

LATE_SLACK = 0.1  # a device whose update arrives in the last 10 % of the round's collection gets no part
LATE_MARGIN = 0.1  # until that is measured: a device training within 10 % of the slowest one's time
LATE_MOST = 0.25  # but at most this fraction of the cluster's devices, the latest first


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
    train_s: Mapping[str, float],
    slack: Mapping[str, float | None] | None = None,
    *,
    margin: float = LATE_MARGIN,
    late_slack: float = LATE_SLACK,
    most: float = LATE_MOST,
) -> set[str]:
    """The devices that send their update last, at most ``most`` (a fraction) of all, the latest first.

    Where every device's ``slack`` is measured (:attr:`Measured.slack`: how early its update arrives, as a
    fraction of the round's collection), those below ``late_slack``; before that, those whose measured
    training time is within ``margin`` (a fraction) of the slowest one's. None while nothing is measured."""
    cap = int(most * len(train_s))
    if slack is not None and train_s and all(slack.get(c) is not None for c in train_s):
        known = {c: float(slack[c] or 0.0) for c in train_s}
        near = sorted((c for c, s in known.items() if s < late_slack), key=lambda c: (known[c], c))
        return set(near[:cap])
    top = max(train_s.values(), default=0.0)
    if top <= 0:
        return set()
    near = sorted((c for c, t in train_s.items() if t >= (1.0 - margin) * top), key=lambda c: -train_s[c])
    return set(near[:cap])
