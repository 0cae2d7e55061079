"""The clustering benchmark's scenarios and each device's data: training share D, held-out H, scoring set E.

Scenarios over the shipped digits (8×8 images, 64 values flat):

* ``rot4-8``, ``rot4-16``: 8 or 16 devices, an IID split of the training digits, device ``i`` rotated by
  90°·(i mod 4); truth group ``i mod 4``.
* ``mix2x2``: 8 devices, :func:`~fedsdk.model.data.partition_label_skew` with 2 label groups (``i mod 2``)
  × a rotation of 0° or 90° by ``(i // 2) mod 2``; truth = label group × 2 + rotation group (4 groups of 2).
* ``dir0.1``, ``dir1.0`` (12 devices), ``dir0.3`` (16): :func:`~fedsdk.model.data.partition_dirichlet`
  (``min_size=20``), no rotation; no truth.
* ``iid``: 12 devices, :func:`~fedsdk.model.data.partition_iid`; truth: one group.
* Group scenarios (``Layout.sizes``: the first ``sizes[0]`` devices are group 0, the next ``sizes[1]``
  group 1, ...), IID split unless the groups have label sets, each group transformed alike:
  ``unequal`` (7/3/2 devices at 0°/90°/180°), ``rot10-20-30`` and ``rot0-15-30`` (4 devices per angle,
  :func:`rotate_by`, bilinear), ``noise`` (4 clean, 4 with Gaussian pixel noise σ = 0.3, clipped to
  [0, 1]), ``shift`` (4 as they are, 4 moved one pixel right and down), ``overlap`` (4 devices on digits
  0-6, 4 on 3-9: each class is dealt among the devices whose set holds it) and ``late`` (4 at 0°, 4 at
  90°, and one at 180° that joins after round 1: ``Layout.late``).

A device's share of the training digits is split at random: 80 % D, which it trains on, and 20 % H, its
held-out data (``HELD_OUT``; what ``fedsdk join --eval-split 0.2`` does on a real device). H is the device's
``eval_data``: it reports on it and chooses its personal model on it. E, the device's **test distribution**,
is the digits test set transformed like the device, with classes weighted like its share: ``|test| · n_c / n``
samples of class ``c`` (largest remainders), drawn without replacement while the class's test images last,
then with. E is never given to the device: the benchmark scores every arm (local training included, which
also trains on D and keeps its best epoch on H) on E alone. Noise is drawn once per image (D, H and E alike).
All randomness comes from the seed (and the device's index).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

import fedsdk.model.data as data
from fedsdk.errors import ConfigError
from fedsdk_bench.fleet.scenarios import DeviceProfile, Scenario

__all__ = [
    "HELD_OUT",
    "SCENARIOS",
    "DeviceData",
    "Layout",
    "fleet_scenario",
    "hold_out",
    "layout",
    "prepare",
    "rotate",
    "rotate_by",
    "scoring_set",
    "transform",
    "write_files",
]

SIDE = 8  # the digits are 8×8


@dataclass(frozen=True)
class Layout:
    """One scenario: how many devices, how the training digits are split and how each device's digits are
    transformed (module docstring)."""

    name: str
    title: str
    n_devices: int
    partition: Literal["iid", "label-skew", "dirichlet", "label-sets"]
    # quarter turns i mod 4 or (i // 2) mod 2, or per group (angles)
    rotation: Literal["none", "rot4", "rot2-pairs", "groups"]
    alpha: float | None = None  # Dirichlet concentration
    truth: bool = True  # whether the scenario has ground-truth groups (ARI is reported)
    sizes: tuple[int, ...] = ()  # devices per group, in order (group scenarios)
    angles: tuple[float, ...] = ()  # per group: rotation in degrees
    noise: tuple[float, ...] = ()  # per group: Gaussian pixel noise σ
    shift: tuple[int, ...] = ()  # per group: pixels moved right and down
    label_sets: tuple[tuple[int, ...], ...] = ()  # per group: its classes (partition "label-sets")
    late: int = 0  # the last ``late`` devices join after round 1

    def group_of(self, i: int) -> int:
        """Device ``i``'s group in a group scenario."""
        edge = 0
        for g, size in enumerate(self.sizes):
            edge += size
            if i < edge:
                return g
        raise ConfigError(f"{self.name}: device {i} beyond the groups' {edge} devices")

    def quarter_turns(self, i: int) -> int:
        """Device ``i``'s rotation, in quarter turns (0 for group scenarios: see :meth:`angle`)."""
        if self.rotation == "rot4":
            return i % 4
        if self.rotation == "rot2-pairs":
            return (i // 2) % 2
        return 0

    def angle(self, i: int) -> float:
        """Device ``i``'s rotation in degrees."""
        if self.rotation == "groups" and self.angles:
            return float(self.angles[self.group_of(i)])
        return 90.0 * self.quarter_turns(i)

    def groups(self, label_groups: list[int]) -> list[int] | None:
        """The truth group of every device (None without truth), given the partition's label groups."""
        if not self.truth:
            return None
        n = self.n_devices
        if self.sizes:
            return [self.group_of(i) for i in range(n)]
        if self.rotation == "rot4":
            return [i % 4 for i in range(n)]
        if self.rotation == "rot2-pairs":
            return [label_groups[i] * 2 + self.quarter_turns(i) for i in range(n)]
        return [0] * n

    def late_devices(self) -> tuple[int, ...]:
        """Indices of the devices that join after round 1."""
        return tuple(range(self.n_devices - self.late, self.n_devices))


def _grouped(name: str, title: str, sizes: tuple[int, ...], **kw: object) -> Layout:
    partition = "label-sets" if kw.get("label_sets") else "iid"
    return Layout(name, title, sum(sizes), partition, "groups", sizes=sizes, **kw)  # type: ignore[arg-type]


SCENARIOS: dict[str, Layout] = {
    s.name: s
    for s in (
        Layout("rot4-8", "8 devices, IID, rotated by 90°·(i mod 4)", 8, "iid", "rot4"),
        Layout("rot4-16", "16 devices, IID, rotated by 90°·(i mod 4)", 16, "iid", "rot4"),
        Layout("mix2x2", "8 devices, 2 label groups × rotation 0°/90°", 8, "label-skew", "rot2-pairs"),
        Layout("dir0.1", "12 devices, Dirichlet α = 0.1", 12, "dirichlet", "none", 0.1, truth=False),
        Layout("dir1.0", "12 devices, Dirichlet α = 1.0", 12, "dirichlet", "none", 1.0, truth=False),
        Layout("iid", "12 devices, IID", 12, "iid", "none"),
        _grouped("unequal", "12 devices in groups of 7/3/2 at 0°/90°/180°", (7, 3, 2), angles=(0, 90, 180)),
        _grouped("rot10-20-30", "12 devices, 4 each at 10°/20°/30°", (4, 4, 4), angles=(10, 20, 30)),
        _grouped("rot0-15-30", "12 devices, 4 each at 0°/15°/30°", (4, 4, 4), angles=(0, 15, 30)),
        _grouped("noise", "8 devices, 4 clean and 4 with pixel noise σ 0.3", (4, 4), noise=(0.0, 0.3)),
        _grouped("shift", "8 devices, 4 as they are and 4 moved 1 pixel", (4, 4), shift=(0, 1)),
        _grouped(
            "overlap",
            "8 devices, 4 on digits 0-6 and 4 on 3-9",
            (4, 4),
            label_sets=(tuple(range(7)), tuple(range(3, 10))),
        ),
        _grouped(
            "late",
            "9 devices, 4 at 0° and 4 at 90°, one at 180° joining after round 1",
            (4, 4, 1),
            angles=(0, 90, 180),
            late=1,
        ),
        Layout("dir0.3", "16 devices, Dirichlet α = 0.3", 16, "dirichlet", "none", 0.3, truth=False),
    )
}


def layout(name: str) -> Layout:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ConfigError(f"unknown scenario {name!r}: choose from {', '.join(SCENARIOS)}") from None


def rotate(x: np.ndarray, k: int) -> np.ndarray:
    """Flat 8×8 images ``x`` (n, 64) turned by ``k`` quarter turns (``np.rot90`` on axes (1, 2)), flat."""
    images = np.asarray(x).reshape(-1, SIDE, SIDE)
    return np.ascontiguousarray(np.rot90(images, k % 4, axes=(1, 2)).reshape(len(images), SIDE * SIDE))


def rotate_by(x: np.ndarray, degrees: float) -> np.ndarray:
    """Flat 8×8 images ``x`` turned by ``degrees`` (multiples of 90°: exactly, as :func:`rotate`; others:
    bilinear, ``scipy.ndimage.rotate`` in the image plane, same size, zero fill)."""
    if float(degrees) % 90.0 == 0.0:
        return rotate(x, round(float(degrees) / 90.0))
    from scipy.ndimage import rotate as nd_rotate

    images = np.asarray(x, dtype=np.float32).reshape(-1, SIDE, SIDE)
    turned = nd_rotate(images, float(degrees), axes=(1, 2), reshape=False, order=1, mode="constant")
    return np.ascontiguousarray(turned.reshape(len(images), SIDE * SIDE), dtype=np.float32)


def transform(sc: Layout, i: int, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Device ``i``'s view of flat images ``x``: rotated, moved and noised as its group is."""
    out = rotate_by(x, sc.angle(i))
    g = sc.group_of(i) if sc.sizes else None
    if g is not None and sc.shift and sc.shift[g]:
        s = int(sc.shift[g])
        images = np.zeros_like(out.reshape(-1, SIDE, SIDE))
        images[:, s:, s:] = out.reshape(-1, SIDE, SIDE)[:, : SIDE - s, : SIDE - s]
        out = images.reshape(len(out), SIDE * SIDE)
    if g is not None and sc.noise and sc.noise[g] > 0:
        out = np.clip(out + rng.normal(0.0, sc.noise[g], out.shape), 0.0, 1.0)
    return np.ascontiguousarray(out, dtype=np.float32)


def _shares(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split in proportion to ``weights`` (largest remainders: the parts add up to ``total``)."""
    exact = total * weights / weights.sum()
    parts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - parts), kind="stable")
    parts[order[: total - int(parts.sum())]] += 1
    return parts


def _draw(pool: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    """``m`` indices from the shuffled ``pool``: without replacement while it lasts, then with."""
    if m <= len(pool):
        return pool[:m]
    return np.concatenate([pool, rng.choice(pool, m - len(pool), replace=True)])


#: Share of a device's training digits it keeps back as its held-out data H (as ``fedsdk join --eval-split``).
HELD_OUT = 0.2


def scoring_set(y_train: np.ndarray, y_test: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices into the test set for E: ``len(y_test)`` samples, classes in proportion to their counts in
    ``y_train`` (largest remainders), each class drawn from its shuffled test images without replacement
    while they last, then with."""
    n_classes = int(max(y_train.max(), y_test.max())) + 1
    counts = np.bincount(y_train, minlength=n_classes).astype(np.float64)
    per_class = _shares(len(y_test), counts)
    parts = [
        _draw(rng.permutation(np.flatnonzero(y_test == c)), int(per_class[c]), rng)
        for c in np.flatnonzero(per_class)
    ]
    return np.concatenate(parts).astype(np.int64)


def hold_out(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Positions of a device's ``n`` training digits it trains on (D) and keeps back (H, ``HELD_OUT``, at
    least one), both sorted."""
    order = rng.permutation(n)
    k = max(1, round(HELD_OUT * n))
    return np.sort(order[k:]), np.sort(order[:k])


@dataclass(frozen=True, eq=False)
class DeviceData:
    """One device of a scenario and seed: its truth group, rotation, D, H and E (x flat, already rotated)."""

    client_id: str
    group: int | None
    quarter_turns: int
    train: tuple[np.ndarray, np.ndarray]
    held_out: tuple[np.ndarray, np.ndarray]  # H, the device's eval_data
    scoring: tuple[np.ndarray, np.ndarray]  # E, never given to the device
    join_after: int = 0  # the round after which it joins (0: from the start)


def _label_sets(sc: Layout, y: np.ndarray, seed: int) -> data.Partition:
    """Each class's shuffled samples dealt round-robin among the devices whose group's set holds it."""
    rng = np.random.default_rng(seed)
    groups = [sc.group_of(i) for i in range(sc.n_devices)]
    parts: list[list[np.ndarray]] = [[] for _ in range(sc.n_devices)]
    for c in np.unique(y):
        holders = [i for i, g in enumerate(groups) if int(c) in sc.label_sets[g]]
        order = rng.permutation(np.flatnonzero(y == c))
        for j, dev in enumerate(holders):
            parts[dev].append(order[j :: len(holders)])
    indices = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
    return data.Partition(indices=indices, groups=groups, kind="label-sets")


def _partition(sc: Layout, y: np.ndarray, seed: int) -> data.Partition:
    if sc.partition == "label-skew":
        return data.partition_label_skew(y, sc.n_devices, n_groups=2, seed=seed)
    if sc.partition == "dirichlet":
        assert sc.alpha is not None
        return data.partition_dirichlet(y, sc.n_devices, sc.alpha, seed, min_size=20)
    if sc.partition == "label-sets":
        return _label_sets(sc, y, seed)
    return data.partition_iid(y, sc.n_devices, seed=seed)


def prepare(sc: Layout, seed: int) -> list[DeviceData]:
    """Every device's data for scenario ``sc`` and ``seed`` (module docstring)."""
    digits = data.load_digits(shape="flat")
    part = _partition(sc, digits.y_train, seed)
    truth = sc.groups(list(part.groups))
    late = set(sc.late_devices())
    out = []
    for i, idx in enumerate(part.indices):
        rng = np.random.default_rng([seed, i])
        e = scoring_set(digits.y_train[idx], digits.y_test, rng)
        d, h = hold_out(len(idx), rng)
        noise = np.random.default_rng([seed, i, 1])
        out.append(
            DeviceData(
                client_id=f"dev-{i:02d}",
                group=None if truth is None else truth[i],
                quarter_turns=sc.quarter_turns(i),
                train=(transform(sc, i, digits.x_train[idx[d]], noise), digits.y_train[idx[d]]),
                held_out=(transform(sc, i, digits.x_train[idx[h]], noise), digits.y_train[idx[h]]),
                scoring=(transform(sc, i, digits.x_test[e], noise), digits.y_test[e]),
                join_after=1 if i in late else 0,
            )
        )
    return out


def write_files(devices: list[DeviceData], folder: Path) -> dict[str, dict[str, str]]:
    """D, H and E of every device as ``.npz`` files in ``folder``; their paths per device, as the fleet
    runner takes them (``data``, ``eval``, ``score``)."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, str]] = {}
    for d in devices:
        paths = {
            "data": folder / f"{d.client_id}.npz",
            "eval": folder / f"{d.client_id}-held-out.npz",
            "score": folder / f"{d.client_id}-scoring.npz",
        }
        for key, xy in (("data", d.train), ("eval", d.held_out), ("score", d.scoring)):
            data.save_npz(paths[key], *xy)
        files[d.client_id] = {k: str(p) for k, p in paths.items()}
        files[d.client_id]["samples"] = str(len(d.train[1]))
    return files


def fleet_scenario(sc: Layout, devices: list[DeviceData]) -> Scenario:
    """The fleet runner's view of the scenario: devices all alike (speed factor 1, uplink not limited)."""
    profiles = tuple(
        DeviceProfile(d.client_id, d.group or 0, cpus=1.0, speed_factor=1.0, uplink_bytes_per_s=None)
        for d in devices
    )
    groups = len({p.group for p in profiles})
    partition: Literal["iid", "label-skew"] = "iid" if sc.partition == "iid" else "label-skew"
    return Scenario(sc.name, sc.title, partition, groups, profiles, "clustering benchmark")
