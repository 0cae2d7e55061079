"""Synthetic sensor readings for the example: one CSV file per device and a test file (numpy only).

A machine runs in one of 3 states (``state``: 0 idle, 1 normal, 2 faulty). Each Raspberry Pi records 12
readings per sample, already standardised (each column has mean about 0 and spread about 1, as
``(value - mean) / std`` gives: keep raw readings of very different scales, such as rpm beside
temperature, off an MLP). Each state shifts the readings by its own pattern; each device sees the states
in its own proportions and has a small calibration offset of its own. The label column comes first, to
show that ``--label-column`` finds it anywhere. The same seed writes the same files.

    python make_data.py [--out data] [--devices 3] [--samples 200] [--seed 7]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

COLUMNS = (
    "temp", "humidity", "vib_x", "vib_y", "vib_z", "current",
    "voltage", "speed", "sound", "pressure", "light", "gas",
)  # fmt: skip
STATES = 3


def readings(
    rng: np.random.Generator, n: int, mix: np.ndarray, offset: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples: states drawn with probabilities ``mix``, readings around each state's pattern."""
    patterns = np.random.default_rng(2024).normal(scale=1.0, size=(STATES, len(COLUMNS)))
    y = rng.choice(STATES, size=n, p=mix)
    x = patterns[y] + offset + rng.normal(scale=1.0, size=(n, len(COLUMNS)))
    return x, y


def write_csv(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    with path.open("w", encoding="utf-8") as fh:
        fh.write(",".join(("state", *COLUMNS)) + "\n")
        for label, row in zip(y, x):
            fh.write(",".join([str(int(label)), *(f"{v:.3f}" for v in row)]) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data")
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--samples", type=int, default=200, help="per device")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    for k in range(1, args.devices + 1):
        mix = rng.dirichlet(np.full(STATES, 4.0))
        x, y = readings(rng, args.samples, mix, rng.normal(scale=0.2, size=len(COLUMNS)))
        write_csv(out / f"pi-{k:02d}.csv", x, y)
    x, y = readings(rng, 300, np.full(STATES, 1 / STATES), np.zeros(len(COLUMNS)))
    write_csv(out / "test.csv", x, y)
    print(f"wrote {args.devices} device files of {args.samples} samples and test.csv (300) to {out}/")


if __name__ == "__main__":
    main()
