"""Training: SGD semantics, loss reduction, digits accuracy, the trainer's reproducibility and results."""

from __future__ import annotations

import numpy as np
import pytest

from fedsdk.errors import ConfigError, TrainingError
from fedsdk.model import SGD, GraphBundle, OnnxModel, OnnxTrainer, Trainer, TrainResult
from fedsdk.model.data import load_digits
from fedsdk_coordinator.models import build_graphs, init_params, lenet, mlp


@pytest.fixture(scope="module")
def mlp_bundle() -> GraphBundle:
    return build_graphs(mlp())


@pytest.fixture(scope="module")
def lenet_bundle() -> GraphBundle:
    return build_graphs(lenet())


def _reference_sgd(ws, gs_seq, lr, mu, wd, nesterov):  # type: ignore[no-untyped-def]
    """The update rule written out in float64, one variable at a time (PyTorch's documented algorithm)."""
    ws = [w.astype(np.float64) for w in ws]
    bufs = None
    for gs in gs_seq:
        ds = [g + wd * w for g, w in zip(gs, ws)]
        if mu:
            bufs = [d.copy() for d in ds] if bufs is None else [mu * b + d for b, d in zip(bufs, ds)]
            ds = [d + mu * b for d, b in zip(ds, bufs)] if nesterov else bufs
        ws = [w - lr * d for w, d in zip(ws, ds)]
    return ws


@pytest.mark.parametrize(("mu", "wd", "nesterov"), [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 1e-2, True)])
def test_sgd_follows_the_momentum_rule(mu: float, wd: float, nesterov: bool) -> None:
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)]
    gs_seq = [[rng.standard_normal(w.shape).astype(np.float32) for w in ws] for _ in range(4)]
    params = [w.copy() for w in ws]
    opt = SGD(0.1, mu, wd, nesterov=nesterov)
    for gs in gs_seq:
        frozen = [g.copy() for g in gs]
        opt.step(params, gs)
        assert all(np.array_equal(a, b) for a, b in zip(gs, frozen))  # gradients are not modified
    want = _reference_sgd(ws, gs_seq, 0.1, mu, wd, nesterov)
    for got, w in zip(params, want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    opt.reset()
    before = [p.copy() for p in params]
    opt.step(params, gs_seq[0])  # after a reset the first step is plain SGD on d = g + wd*w
    for b, p, g in zip(before, params, gs_seq[0]):
        np.testing.assert_allclose(
            p, b - 0.1 * (g + wd * b) * (1 + (mu if nesterov else 0)), rtol=1e-5, atol=1e-6
        )


def test_sgd_matches_torch_when_available() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((5, 3)).astype(np.float32)
    grads = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(5)]
    tw = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    topt = torch.optim.SGD([tw], lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
    ours = [w0.copy()]
    opt = SGD(0.05, 0.9, 1e-3, nesterov=True)
    for g in grads:
        tw.grad = torch.from_numpy(g.copy())
        topt.step()
        opt.step(ours, [g])
    np.testing.assert_allclose(ours[0], tw.detach().numpy(), rtol=1e-6, atol=1e-6)


BAD_SGD = [
    ({"lr": 0}, "lr"),
    ({"lr": 0.1, "momentum": 1.0}, "momentum"),
    ({"lr": 0.1, "weight_decay": -1}, "weight_decay"),
    ({"lr": 0.1, "nesterov": True}, "nesterov"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_SGD)
def test_sgd_rejects_bad_hyperparameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SGD(**kwargs)


def test_cnn_train_steps_reduce_loss_on_a_fixed_batch(lenet_bundle: GraphBundle) -> None:
    model = OnnxModel.from_bundle(lenet_bundle)
    data = load_digits("image")
    x, y = data.x_train[:64], data.y_train[:64]
    params = init_params(lenet(), 0)
    opt = SGD(0.05, 0.9)
    first, _ = model.train_step(params, x, y)
    losses = []
    for _ in range(30):
        loss, grads = model.train_step(params, x, y)
        opt.step(params, grads)
        losses.append(loss)
    assert losses[0] == first
    assert losses[-1] < 0.25 * first
    # one plain gradient step with a small rate lowers the loss (first-order descent)
    params = init_params(lenet(), 0)
    loss0, grads = model.train_step(params, x, y)
    SGD(0.01).step(params, grads)
    assert model.train_step(params, x, y)[0] < loss0


def test_mlp_reaches_90_percent_on_digits(mlp_bundle: GraphBundle) -> None:
    data = load_digits("flat")
    model = OnnxModel.from_bundle(mlp_bundle)
    trainer = OnnxTrainer(model, data.x_train, data.y_train, epochs=3, eval_data=(data.x_test, data.y_test))
    result = trainer.fit(init_params(mlp(), 0))
    loss, acc = trainer.evaluate(result.weights)
    assert acc > 0.9, (loss, acc)
    assert result.loss < 1.0 and result.steps == 3 * 45


def test_trainer_results_and_reproducibility(lenet_bundle: GraphBundle) -> None:
    data = load_digits("image")
    x, y = data.x_train[:100], data.y_train[:100]
    trainer = OnnxTrainer(OnnxModel.from_bundle(lenet_bundle), x, y, batch_size=32, epochs=2, seed=7)
    assert isinstance(trainer, Trainer) and trainer.num_samples == 100
    w0 = init_params(lenet(), 0)
    w0_copy = [w.copy() for w in w0]
    r1 = trainer.fit(w0)
    assert isinstance(r1, TrainResult)
    assert all(np.array_equal(a, b) for a, b in zip(w0, w0_copy))  # caller's weights untouched
    assert r1.steps == 2 * 4 and r1.num_samples == 100 and r1.seconds > 0 and np.isfinite(r1.loss)
    assert [w.shape for w in r1.weights] == [g.shape for g in r1.gradients] == [w.shape for w in w0]
    assert all(w.dtype == np.float32 for w in r1.weights + r1.gradients)
    # the second fit uses seed + 1: a different shuffle, hence different weights
    r2 = trainer.fit(w0)
    assert not np.array_equal(r1.weights[0], r2.weights[0])
    # an explicit seed replays a round exactly; a fresh trainer with the same seed replays the sequence
    assert all(np.array_equal(a, b) for a, b in zip(trainer.fit(w0, seed=7).weights, r1.weights))
    fresh = OnnxTrainer(OnnxModel.from_bundle(lenet_bundle), x, y, batch_size=32, epochs=2, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.fit(w0).weights, r1.weights))
    assert all(np.array_equal(a, b) for a, b in zip(fresh.fit(w0).weights, r2.weights))


def test_reported_gradient_is_the_sample_weighted_mean_over_steps(mlp_bundle: GraphBundle) -> None:
    data = load_digits("flat")
    x, y = data.x_train[:70], data.y_train[:70]
    model = OnnxModel.from_bundle(mlp_bundle)
    # lr tiny and no momentum: weights barely move, so the mean of minibatch gradients ≈ full-batch gradient
    trainer = OnnxTrainer(model, x, y, lr=1e-7, momentum=0.0, batch_size=32)
    w0 = init_params(mlp(), 0)
    result = trainer.fit(w0)
    full_loss, full_grads = model.train_step(w0, x, y)
    assert result.steps == 3  # 32 + 32 + 6
    assert result.loss == pytest.approx(full_loss, rel=1e-4)
    for g, f in zip(result.gradients, full_grads):
        np.testing.assert_allclose(g, f, rtol=1e-3, atol=1e-6)


def test_momentum_is_reset_between_fits(mlp_bundle: GraphBundle) -> None:
    data = load_digits("flat")
    trainer = OnnxTrainer(OnnxModel.from_bundle(mlp_bundle), data.x_train[:64], data.y_train[:64])
    w0 = init_params(mlp(), 0)
    a = trainer.fit(w0, seed=1)
    trainer.fit(w0, seed=2)  # would leave a momentum buffer behind if it were kept
    b = trainer.fit(w0, seed=1)
    assert all(np.array_equal(p, q) for p, q in zip(a.weights, b.weights))


def test_divergence_raises_training_error(mlp_bundle: GraphBundle) -> None:
    data = load_digits("flat")
    trainer = OnnxTrainer(OnnxModel.from_bundle(mlp_bundle), data.x_train * 1e4, data.y_train, lr=1e6)
    with pytest.raises(TrainingError, match=r"not finite|non-finite"):
        trainer.fit(init_params(mlp(), 0))


def test_trainer_rejects_bad_settings(mlp_bundle: GraphBundle) -> None:
    model = OnnxModel.from_bundle(mlp_bundle)
    data = load_digits("flat")
    with pytest.raises(ConfigError):
        OnnxTrainer(model, data.x_train, data.y_train, batch_size=0)
    with pytest.raises(ConfigError):
        OnnxTrainer(model, data.x_train, data.y_train, lr=-1.0)
    with pytest.raises(TrainingError, match="x has shape"):
        OnnxTrainer(model, data.x_train.reshape(-1, 1, 8, 8), data.y_train)


def test_graphs_agree_with_pytorch_when_available(lenet_bundle: GraphBundle) -> None:
    torch = pytest.importorskip("torch")
    from fedsdk_coordinator.models.torch_bridge import from_torch, to_torch

    spec = lenet()
    params = init_params(spec, 3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    loss, grads = OnnxModel.from_bundle(lenet_bundle).train_step(params, x, y)
    net = to_torch(spec, params)
    assert all(np.array_equal(a, b) for a, b in zip(from_torch(net, spec), params))
    t_loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
    t_loss.backward()
    assert loss == pytest.approx(t_loss.item(), rel=1e-5)
    named = dict(net.named_parameters())
    for name, g in zip(spec.param_names, grads):
        np.testing.assert_allclose(g, named[name].grad.numpy(), rtol=1e-4, atol=1e-5 * float(np.abs(g).max()))
