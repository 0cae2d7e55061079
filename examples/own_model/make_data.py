"""Sensor readings for the example: one CSV file per device, 12 features and a class label (numpy only).

Five Raspberry Pis record 12 sensor features while a machine runs in one of 3 states (idle, normal,
faulty). Each state has its own mean reading; each device sees the states in its own proportions and has a
calibration offset of its own, so no two devices hold the same distribution. ``pi-06`` lost a sensor: its
files have 11 features, and the federation refuses it when it joins. ``test.csv`` is held back to score
the exported model.

    python make_data.py [--out data] [--samples 300] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FEATURES, STATES = 12, 3


def readings(
    rng: np.random.Generator, n: int, mix: np.ndarray, offset: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    centres = np.random.default_rng(1234).normal(scale=1.0, size=(STATES, FEATURES))
    y = rng.choice(STATES, size=n, p=mix)
    x = centres[y] + offset + rng.normal(scale=1.5, size=(n, FEATURES))
    return x, y


def write_csv(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    header = ",".join([*(f"s{k:02d}" for k in range(1, x.shape[1] + 1)), "label"])
    table = np.column_stack([x, y])
    np.savetxt(path, table, delimiter=",", header=header, comments="", fmt=[*["%.5f"] * x.shape[1], "%d"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data")
    p.add_argument("--samples", type=int, default=300, help="per device")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    for k in range(1, 7):
        mix = rng.dirichlet(np.full(STATES, 2.0))
        x, y = readings(rng, args.samples, mix, rng.normal(scale=0.3, size=FEATURES))
        if k == 6:
            x = x[:, :11]  # a sensor missing
        write_csv(out / f"pi-{k:02d}.csv", x, y)
    x, y = readings(rng, 600, np.full(STATES, 1 / STATES), np.zeros(FEATURES))
    write_csv(out / "test.csv", x, y)
    print(f"wrote pi-01.csv … pi-06.csv ({args.samples} samples each) and test.csv to {out}/")


if __name__ == "__main__":
    main()
