"""What the coordinator measures of each device, from its hello, its replies and its reports (DESIGN.md
step 3: budgets from real timings), and the :class:`~fedsdk_coordinator.budgets.DeviceCapacity` the budget
policies read. Plain data and pure functions: the round engine keeps one :class:`Measured` per device and
the store keeps them across a restart (``as_dict``/``from_dict``).

Decision: a measured speed or time is the **median of the device's last** :data:`RECENT` **observations**,
not a running mean. Budgets are planned from these figures, and in a cluster with a cap on the union the
slowest device's figure sets every device's budget (budgets.py), so one slow round (a busy core, a
garbage collection, a Wi-Fi hiccup) moved by a running mean of weight 0.5 cut the encryption of the whole
cluster in the next round. Measured in the fleet benchmark (system scenario, model ``mlp``, 4,810
parameters, 2048-bit keys, seed 2): one such round in 29 left every device at a budget of 0.64 (docs/
results/fleet.md). A median ignores one or two outliers in five and follows a lasting change after three
rounds (the running mean was then still an eighth of the step short).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedsdk.crypto import HEBackend
from fedsdk.protocol import EncryptedUpdate, MaskedUpdate, Report, Update
from fedsdk_coordinator.budgets import DeviceCapacity

__all__ = ["RECENT", "Measured", "capacity", "record_report", "record_slack", "record_update"]

RECENT = 5  # observations a measured figure is the median of


@dataclass
class Measured:
    """What the coordinator has measured of a device."""

    he_values_per_s: float | None = None
    uplink_bytes_per_s: float | None = None
    train_s: float = 0.0
    compute: float | None = None
    pool_values: int = 0  # values the device's obfuscator pool held when its last encryption started
    warm_values_per_s: float | None = None  # encryption throughput with every obfuscator from the pool
    decrypt_values_per_s: float | None = None  # of an aggregate's union (key mode shared), from reports
    select_s: float | None = None  # most seen for sensitivity + mask solver + leakage check (budget < 1)
    # how early its update arrives: (last update's arrival - its own) / last update's arrival, both timed
    # from the round's tasks, in rounds every participant replied to (record_slack; coop.py)
    slack: float | None = None
    recent: dict[str, list[float]] = field(default_factory=dict)  # the last observations, per figure

    def observe(self, name: str, value: float) -> None:
        """Record an observation of ``name``; the figure becomes the median of its last :data:`RECENT`
        (module docstring). What the device announced in its hello is replaced by the first."""
        seen = self.recent.setdefault(name, [])
        seen.append(float(value))
        del seen[:-RECENT]
        setattr(self, name, statistics.median(seen))

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["recent"] = {k: list(v) for k, v in self.recent.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measured:
        kept = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        recent = kept.get("recent")  # absent in a store written before it was kept
        kept["recent"] = (
            {
                str(k): [float(x) for x in v if isinstance(x, int | float)][-RECENT:]
                for k, v in recent.items()
                if isinstance(v, list) and k in cls.__dataclass_fields__
            }
            if isinstance(recent, dict)
            else {}
        )
        return cls(**kept)


def record_update(m: Measured, msg: Update | EncryptedUpdate | MaskedUpdate, he: HEBackend | None) -> None:
    """Learn from the timings an accepted update reports."""
    train_s = msg.metrics.get("train_s", 0.0)  # finite (protocol), but a device may send anything
    if train_s > 0:
        m.observe("train_s", train_s)
    sensitivity_s = msg.metrics.get("sensitivity_s", 0.0)
    if sensitivity_s > 0:  # the device chose a partial mask (a budget of 1 skips the choice)
        # The largest seen, not a running mean: the choice's cost varies with the budget (the solver,
        # the leakage check), and an underestimate buys budgets below 1 that lengthen the round. Once
        # the whole update is the faster plan the device stops choosing, so the estimate stays.
        took = sensitivity_s + max(msg.metrics.get("mask_s", 0.0), 0.0)
        m.select_s = max(m.select_s or 0.0, took)
    enc_s = msg.metrics.get("encrypt_s", 0.0)
    if isinstance(msg, EncryptedUpdate) and he is not None and enc_s > 0:
        encrypted = int(msg.pack_mask.sum())
        cold = encrypted - int(msg.metrics.get("from_pool", 0.0))
        if cold > 0:
            m.observe("he_values_per_s", cold * he.pack_size / enc_s)
        elif encrypted > 0:  # all from the pool: the warm cost, and what the pool could give
            m.observe("warm_values_per_s", encrypted * he.pack_size / enc_s)
        m.pool_values = int(msg.metrics.get("pool_ready", 0.0)) * he.pack_size


def record_slack(measured: dict[str, Measured], reply_s: Mapping[str, float]) -> None:
    """Learn how early each device's update arrives in a round (:attr:`Measured.slack`) from ``reply_s``,
    the seconds from the round's tasks to each update's arrival. Only for a round every participant
    replied to and with at least two updates: in a round the deadline cut, the last update is not the
    slowest device's."""
    if len(reply_s) < 2:
        return
    last = max(reply_s.values())
    if last <= 0:
        return
    for cid, t in reply_s.items():
        measured.setdefault(cid, Measured()).observe("slack", (last - t) / last)


def record_report(
    m: Measured,
    report: Report,
    reply: Any,
    *,
    he: HEBackend | None,
    decrypts: bool,
    union_packs: int,
) -> None:
    """Learn the device's uplink (from its update's size and upload time) and, when devices decrypt
    aggregates (``decrypts``: key mode shared), its decryption throughput, from its report of a round."""
    up_s = report.metrics.get("upload_s", 0.0)
    if isinstance(reply, EncryptedUpdate) and up_s > 0:
        m.observe("uplink_bytes_per_s", (len(reply.ciphertexts) + len(reply.plaintexts)) / up_s)
    dec_s = report.metrics.get("decrypt_s", 0.0)
    decrypted = report.metrics.get("decrypted_packs", float(union_packs))  # fewer with coop.py
    if he is not None and decrypts and decrypted > 0 and dec_s > 0:
        m.observe("decrypt_values_per_s", decrypted * he.pack_size / dec_s)


def capacity(client_id: str, m: Measured | None) -> DeviceCapacity:
    """The budget policies' view of a device, with defaults for what is not measured yet."""
    m = m or Measured()
    return DeviceCapacity(
        client_id,
        uplink_bytes_per_s=m.uplink_bytes_per_s or 1e6,  # until measured: 1 MB/s
        he_values_per_s=m.he_values_per_s or 100.0,  # until measured: phe's per-value speed
        train_s=m.train_s,
        compute=m.compute,
        pool_values=m.pool_values,
        warm_values_per_s=m.warm_values_per_s,
        decrypt_values_per_s=m.decrypt_values_per_s,
        select_s=m.select_s or 0.0,
    )
