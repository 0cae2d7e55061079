"""Layer specifications, the model spec, presets and parameter initialisation (numpy only).

A model is a plain list of layers applied in order to a batch ``x`` of shape ``(N, *input_shape)`` and
ending in ``num_classes`` logits. The specs are frozen dataclasses with PyTorch's argument names and
conventions, so a spec reads like the ``torch.nn.Sequential`` it is equivalent to:

* ``Linear(in_features, out_features)``: weight ``(out, in)``, ``y = x Wᵀ + b`` (``torch.nn.Linear``).
* ``Conv2d(in_channels, out_channels, kernel_size, stride, padding)``: weight ``(out, in, kh, kw)``, NCHW,
  zero padding, cross-correlation (``torch.nn.Conv2d`` with ``groups=1``, ``dilation=1``).
* ``MaxPool2d`` / ``AvgPool2d``: floor output size; ``stride`` defaults to the kernel size; ``AvgPool2d``
  counts padded zeros in the divisor unless ``count_include_pad=False`` (PyTorch's default is ``True``).
* ``Flatten`` keeps the batch axis; ``ReLU``; ``Dropout(p)`` is inverted dropout (kept units scaled by
  ``1/(1-p)`` at training time, identity at evaluation).

Parameters are named like a PyTorch ``state_dict`` (``"<layer index>.weight"``, ``"<layer index>.bias"``)
so weights can be moved between the two without renaming.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from fedsdk.errors import ConfigError

__all__ = [
    "AvgPool2d",
    "Conv2d",
    "Dropout",
    "Flatten",
    "Layer",
    "Linear",
    "MaxPool2d",
    "ModelSpec",
    "ReLU",
    "init_params",
    "lenet",
    "mlp",
    "preset",
]

Shape = tuple[int, ...]


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (int(value), int(value))
    if (
        isinstance(value, Sequence)
        and len(value) == 2
        and all(isinstance(v, (int, np.integer)) for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise ConfigError(f"{name} must be an int or a pair of ints, got {value!r}")


def _pool_out(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


@dataclass(frozen=True)
class Linear:
    """Fully connected layer on ``(N, in_features)``; weight ``(out, in)`` like ``torch.nn.Linear``."""

    in_features: int
    out_features: int
    bias: bool = True
    kind: ClassVar[str] = "Linear"

    def __post_init__(self) -> None:
        if self.in_features < 1 or self.out_features < 1:
            raise ConfigError(f"Linear needs positive sizes, got {self.in_features}->{self.out_features}")

    def param_shapes(self) -> list[Shape]:
        w = (self.out_features, self.in_features)
        return [w, (self.out_features,)] if self.bias else [w]

    def output_shape(self, shape: Shape) -> Shape:
        if shape != (self.in_features,):
            fix = f"set in_features to {shape[0]}" if len(shape) == 1 else "put a Flatten before it"
            raise ConfigError(
                f"Linear(in_features={self.in_features}) cannot take per-sample shape {shape}: {fix}"
            )
        return (self.out_features,)


@dataclass(frozen=True)
class Conv2d:
    """2-D convolution (cross-correlation), NCHW, zero padding, ``groups=1``; like ``torch.nn.Conv2d``."""

    in_channels: int
    out_channels: int
    kernel_size: int | tuple[int, int]
    stride: int | tuple[int, int] = 1
    padding: int | tuple[int, int] = 0
    bias: bool = True
    kind: ClassVar[str] = "Conv2d"

    def __post_init__(self) -> None:
        for name in ("kernel_size", "stride", "padding"):
            object.__setattr__(self, name, _pair(getattr(self, name), f"Conv2d.{name}"))
        if self.in_channels < 1 or self.out_channels < 1:
            raise ConfigError("Conv2d needs positive channel counts")
        if min(self.kernels) < 1 or min(self.strides) < 1 or min(self.pads) < 0:
            raise ConfigError(f"Conv2d has a bad kernel/stride/padding: {self}")

    @property
    def kernels(self) -> tuple[int, int]:
        return self.kernel_size  # type: ignore[return-value]  # normalised to a pair in __post_init__

    @property
    def strides(self) -> tuple[int, int]:
        return self.stride  # type: ignore[return-value]

    @property
    def pads(self) -> tuple[int, int]:
        return self.padding  # type: ignore[return-value]

    def param_shapes(self) -> list[Shape]:
        w = (self.out_channels, self.in_channels, *self.kernels)
        return [w, (self.out_channels,)] if self.bias else [w]

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 3 or shape[0] != self.in_channels:
            fix = (
                f"set in_channels to {shape[0]}" if len(shape) == 3 else "it needs (channels, height, width)"
            )
            raise ConfigError(
                f"Conv2d(in_channels={self.in_channels}) cannot take per-sample shape {shape}: {fix}"
            )
        out = tuple(_pool_out(shape[1 + i], self.kernels[i], self.strides[i], self.pads[i]) for i in (0, 1))
        if min(out) < 1:
            raise ConfigError(f"Conv2d output would be empty for input {shape}")
        return (self.out_channels, *out)


@dataclass(frozen=True)
class _Pool2d:
    kernel_size: int | tuple[int, int]
    stride: int | tuple[int, int] | None = None
    padding: int | tuple[int, int] = 0

    def __post_init__(self) -> None:
        kernel = _pair(self.kernel_size, "kernel_size")
        object.__setattr__(self, "kernel_size", kernel)
        object.__setattr__(self, "stride", kernel if self.stride is None else _pair(self.stride, "stride"))
        object.__setattr__(self, "padding", _pair(self.padding, "padding"))
        if min(self.kernels) < 1 or min(self.strides) < 1 or min(self.pads) < 0:
            raise ConfigError(f"bad pooling kernel/stride/padding: {self}")
        if any(2 * p > k for p, k in zip(self.pads, self.kernels)):
            raise ConfigError(f"pooling padding must be at most half the kernel (as in PyTorch): {self}")

    @property
    def kernels(self) -> tuple[int, int]:
        return self.kernel_size  # type: ignore[return-value]

    @property
    def strides(self) -> tuple[int, int]:
        return self.stride  # type: ignore[return-value]

    @property
    def pads(self) -> tuple[int, int]:
        return self.padding  # type: ignore[return-value]

    def param_shapes(self) -> list[Shape]:
        return []

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 3:
            raise ConfigError(f"{type(self).__name__} needs a (C, H, W) input, got {shape}")
        out = tuple(_pool_out(shape[1 + i], self.kernels[i], self.strides[i], self.pads[i]) for i in (0, 1))
        if min(out) < 1:
            raise ConfigError(f"{type(self).__name__} output would be empty for input {shape}")
        return (shape[0], *out)


@dataclass(frozen=True)
class MaxPool2d(_Pool2d):
    """Max pooling, floor mode; ``stride`` defaults to ``kernel_size`` (``torch.nn.MaxPool2d``)."""

    kind: ClassVar[str] = "MaxPool2d"


@dataclass(frozen=True)
class AvgPool2d(_Pool2d):
    """Average pooling, floor mode (``torch.nn.AvgPool2d``, same ``count_include_pad`` default)."""

    count_include_pad: bool = True
    kind: ClassVar[str] = "AvgPool2d"


@dataclass(frozen=True)
class Flatten:
    """Flattens every axis but the batch axis (``torch.nn.Flatten()``)."""

    kind: ClassVar[str] = "Flatten"

    def param_shapes(self) -> list[Shape]:
        return []

    def output_shape(self, shape: Shape) -> Shape:
        return (math.prod(shape),)


@dataclass(frozen=True)
class ReLU:
    """``max(x, 0)``; the gradient at exactly 0 is taken as 0 (as PyTorch does)."""

    kind: ClassVar[str] = "ReLU"

    def param_shapes(self) -> list[Shape]:
        return []

    def output_shape(self, shape: Shape) -> Shape:
        return shape


@dataclass(frozen=True)
class Dropout:
    """Inverted dropout with drop probability ``p`` (``torch.nn.Dropout``); identity when evaluating."""

    p: float = 0.5
    kind: ClassVar[str] = "Dropout"

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.p) < 1.0:
            raise ConfigError(f"Dropout p must be in [0, 1), got {self.p}")
        object.__setattr__(self, "p", float(self.p))

    def param_shapes(self) -> list[Shape]:
        return []

    def output_shape(self, shape: Shape) -> Shape:
        return shape


Layer = Linear | Conv2d | MaxPool2d | AvgPool2d | Flatten | ReLU | Dropout
_KINDS: dict[str, type] = {c.kind: c for c in (Linear, Conv2d, MaxPool2d, AvgPool2d, Flatten, ReLU, Dropout)}


def _layer_to_dict(layer: Layer) -> dict[str, Any]:
    data = {f.name: getattr(layer, f.name) for f in fields(layer)}
    for key, value in data.items():
        if isinstance(value, tuple):
            data[key] = list(value)
    return {"type": layer.kind, **data}


@dataclass(frozen=True)
class ModelSpec:
    """A layer list, the per-sample input shape (``(64,)`` or ``(1, 8, 8)``) and the number of classes.

    Constructing a spec checks that the shapes chain and that the last layer yields ``(num_classes,)``
    logits; a bad spec raises :class:`~fedsdk.errors.ConfigError`.
    """

    layers: tuple[Layer, ...]
    input_shape: tuple[int, ...]
    num_classes: int
    shapes: tuple[Shape, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        if not self.layers:
            raise ConfigError("a model needs at least one layer")
        if any(not isinstance(layer, tuple(_KINDS.values())) for layer in self.layers):
            raise ConfigError(f"layers must be fedsdk.model layer specs, got {self.layers!r}")
        if not self.input_shape or min(self.input_shape) < 1:
            raise ConfigError(f"bad input shape {self.input_shape}")
        if self.num_classes < 2:
            raise ConfigError("num_classes must be at least 2")
        shapes = [self.input_shape]
        for i, layer in enumerate(self.layers):
            try:
                shapes.append(layer.output_shape(shapes[-1]))
            except ConfigError as exc:
                raise ConfigError(f"layers[{i}] ({layer.kind}): {exc}") from exc
        if shapes[-1] != (self.num_classes,):
            raise ConfigError(
                f"the model ends in shape {shapes[-1]}, expected ({self.num_classes},) logits: the last "
                f"layer must give num_classes = {self.num_classes} outputs (or set num_classes to match it)"
            )
        object.__setattr__(self, "shapes", tuple(shapes))

    @property
    def param_names(self) -> tuple[str, ...]:
        names: list[str] = []
        for i, layer in enumerate(self.layers):
            shapes = layer.param_shapes()
            names += [f"{i}.weight", f"{i}.bias"][: len(shapes)]
        return tuple(names)

    @property
    def param_shapes(self) -> tuple[Shape, ...]:
        return tuple(s for layer in self.layers for s in layer.param_shapes())

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"input_shape": [...], "num_classes": n, "layers": [{"type": ...}, ...]}``."""
        return {
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "layers": [_layer_to_dict(layer) for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """The inverse of :meth:`to_dict`; its errors name the layer and the accepted names (``specfile``)."""
        from fedsdk_coordinator.models.specfile import spec_from_dict

        return spec_from_dict(data)


def mlp(input_dim: int = 64, hidden: Sequence[int] = (64,), num_classes: int = 10) -> ModelSpec:
    """Multi-layer perceptron ``Linear → ReLU → … → Linear`` on flat inputs."""
    layers: list[Layer] = []
    width = input_dim
    for h in hidden:
        layers += [Linear(width, h), ReLU()]
        width = h
    layers.append(Linear(width, num_classes))
    return ModelSpec(tuple(layers), (input_dim,), num_classes)


def lenet(in_channels: int = 1, image_size: int = 8, num_classes: int = 10) -> ModelSpec:
    """A LeNet-5-style CNN (LeCun et al. 1998: 6 and 16 feature maps, 120 and 84 hidden units).

    Sized for small images (8x8 digits): 3x3 convolutions with padding 1 keep the size, each of the two
    2x2 max-pools halves it, so ``image_size`` must be a multiple of 4. Max pooling and ReLU replace the
    original subsampling and tanh, as modern reimplementations do.
    """
    if image_size < 4 or image_size % 4:
        raise ConfigError(f"lenet needs an image size that is a positive multiple of 4, got {image_size}")
    side = image_size // 4
    layers: tuple[Layer, ...] = (
        Conv2d(in_channels, 6, 3, padding=1),
        ReLU(),
        MaxPool2d(2),
        Conv2d(6, 16, 3, padding=1),
        ReLU(),
        MaxPool2d(2),
        Flatten(),
        Linear(16 * side * side, 120),
        ReLU(),
        Linear(120, 84),
        ReLU(),
        Linear(84, num_classes),
    )
    return ModelSpec(layers, (in_channels, image_size, image_size), num_classes)


def preset(name: str) -> ModelSpec:
    """A preset by name: ``mlp`` (64 hidden units), ``mlpN`` (N hidden units, e.g. ``mlp16`` for the
    per-value HE baselines), ``cnn`` or ``lenet`` (:func:`lenet`)."""
    if name == "mlp":
        return mlp()
    if name.startswith("mlp") and name[3:].isdigit() and int(name[3:]) > 0:
        return mlp(hidden=(int(name[3:]),))
    if name in ("cnn", "lenet"):
        return lenet()
    raise ConfigError(f"unknown model {name!r}: choose mlp, mlpN or cnn")


def init_params(spec: ModelSpec, seed: int) -> list[np.ndarray]:
    """Initial float32 parameters in ``spec.param_names`` order.

    Weights of every layer except the last parametrised one use He (Kaiming) normal initialisation,
    ``N(0, 2/fan_in)`` (He et al. 2015, eq. 10), since they feed ReLUs; the last layer, which produces the
    logits, uses Glorot (Xavier) uniform, ``U(±sqrt(6/(fan_in+fan_out)))`` (Glorot & Bengio 2010, eq. 16).
    ``fan_in`` is ``in_features`` or ``in_channels·kh·kw``. Biases start at zero.
    """
    rng = np.random.default_rng(seed)
    weighted = [i for i, layer in enumerate(spec.layers) if layer.param_shapes()]
    params: list[np.ndarray] = []
    for i in weighted:
        shapes = spec.layers[i].param_shapes()
        w_shape = shapes[0]
        fan_in = math.prod(w_shape[1:])
        fan_out = w_shape[0] * math.prod(w_shape[2:])
        if i == weighted[-1]:
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            params.append(rng.uniform(-limit, limit, size=w_shape).astype(np.float32))
        else:
            params.append((rng.standard_normal(w_shape) * math.sqrt(2.0 / fan_in)).astype(np.float32))
        params += [np.zeros(s, dtype=np.float32) for s in shapes[1:]]
    return params
