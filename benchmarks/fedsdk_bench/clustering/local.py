"""Arm (d), ``local``: every device trains alone on its D, no federation, in this process.

Same model, initial weights, learning rate, momentum and batch size as the federation, for as many epochs
as the federation gives the device (rounds × epochs), in the federation's rhythm: the momentum restarts
every ``epochs`` epochs, as it does at each round on a device (:class:`fedsdk.model.OnnxTrainer`). After
every epoch the model is scored on H, and the epoch with the best H accuracy is kept (the first of equals):
the same information a device's personal choice has. That model is scored on E.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsdk.model import OnnxModel
from fedsdk.model.optim import SGD
from fedsdk_bench.clustering.data import DeviceData

__all__ = ["LocalSettings", "train_alone"]


@dataclass(frozen=True)
class LocalSettings:
    rounds: int
    epochs: int
    lr: float
    momentum: float
    batch_size: int
    seed: int


def train_alone(
    model: OnnxModel, initial: Sequence[np.ndarray], dev: DeviceData, s: LocalSettings, index: int
) -> dict[str, Any]:
    """Train ``dev`` alone (module docstring); its accuracy on E (``d``), on H, and the epoch kept."""
    x, y = model.check_batch(dev.train[0].reshape((-1, *model.input_shape)), dev.train[1])
    assert y is not None
    xh = dev.held_out[0].reshape((-1, *model.input_shape))
    xe = dev.scoring[0].reshape((-1, *model.input_shape))
    params = [p.copy() for p in model.check_params(initial)]
    rng = np.random.default_rng([s.seed, index])
    best_h, best_epoch, best = -1.0, 0, [p.copy() for p in params]
    epoch = 0
    for _ in range(s.rounds):
        opt = SGD(s.lr, s.momentum)
        for _ in range(s.epochs):
            order = rng.permutation(len(x))
            for lo in range(0, len(x), s.batch_size):
                idx = order[lo : lo + s.batch_size]
                _, grads = model.raw_train_step(params, x[idx], y[idx], rng=rng)
                opt.step(params, grads)
            epoch += 1
            acc_h = model.evaluate(params, xh, dev.held_out[1])[1]
            if acc_h > best_h:
                best_h, best_epoch, best = acc_h, epoch, [p.copy() for p in params]
    return {
        "d": model.evaluate(best, xe, dev.scoring[1])[1],
        "h": best_h,
        "epoch": best_epoch,
        "epochs": epoch,
    }
