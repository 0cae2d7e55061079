"""Build the training-step and evaluation ONNX graphs of a :class:`ModelSpec` (coordinator side; needs onnx).

ONNX Runtime's on-device training package is no longer published, so the training step is an ordinary
inference graph that *also* computes the gradients: the forward pass, the softmax cross-entropy loss (mean
over the batch) and the backward pass, each written out in standard ONNX operators (opset 17, IR version
8, so onnxruntime ≥ 1.16 and the older builds shipped by Termux and Raspberry Pi OS load it). The optimiser
step runs in numpy on the returned gradients (:mod:`fedsdk.model.optim`).

Backward pass, per layer, with ``dY`` the gradient of the loss with respect to the layer's output and
``N`` the batch size (the formulas are the standard reverse-mode rules; Goodfellow et al., *Deep Learning*,
§6.5 and §9; Dumoulin & Visin 2016 for the convolution/transposed-convolution relation):

* loss ``L = mean_n(-log softmax(z_n)[y_n])``: ``dZ = (softmax(z) − onehot(y)) / N``.
* Linear ``Y = X Wᵀ + b``: ``dW = dYᵀ X``, ``db = Σ_n dY``, ``dX = dY W``.
* Conv2d (stride ``s``, padding ``p``): ``db = Σ_{n,h,w} dY``; ``dX`` is the transposed convolution of
  ``dY`` with the same weight and ``output_padding = (H + 2p − k) mod s`` so it has the input's size;
  ``dW[o,i,a,b] = Σ_{n,h,w} dY[n,o,h,w] · Xpad[n,i,s·h+a,s·w+b]``, computed as one convolution of
  ``X`` with the batch axis as channels (``Xᵀ: (C_in, N, H, W)``) by ``dY`` as the kernel
  (``dYᵀ: (C_out, N, H_o, W_o)``) with dilation ``s`` and padding ``p``, cropped to ``k×k`` and transposed.
* ReLU: ``dX = dY · [Y > 0]`` (gradient 0 at 0, as in PyTorch).
* MaxPool2d: the forward pass also returns the argmax indices (flat over the whole tensor); ``dX`` is
  ``dY`` scatter-*added* at those indices, so overlapping windows (stride < kernel) accumulate correctly.
* AvgPool2d: ``dX`` is the depthwise transposed convolution of ``dY`` (divided by each window's element
  count) with a ones kernel; the divisor is ``kh·kw`` or, with ``count_include_pad=False``, the number of
  unpadded elements, computed once at build time because per-sample shapes are static.
* Flatten: ``dX = reshape(dY)``. Dropout: ``dX = dY · mask``.

Gradients of the input of the first parametrised layer are never formed (nothing upstream needs them).

**Dropout randomness.** The training graph contains no random operator: each Dropout layer becomes a graph
input ``dropout_mask.<layer>`` of shape ``(N, *features)`` holding ``0`` or ``1/(1-p)`` (inverted dropout).
The executor draws the masks with numpy from the trainer's seeded generator, so a training run is
reproducible from its seed, the forward and backward pass use the same mask by construction, and a
gradient check can pass a fixed mask. The drop probabilities are stored in the graph's metadata
(``fedsdk.dropout``) so the bytes alone describe the graph.

**Parameters are graph inputs**, not initializers: the graph bytes stay a few kB and the weights travel as
numpy arrays. The only initializers are small shape/index constants and average-pooling kernels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsdk.errors import ConfigError
from fedsdk.model.bundle import EVAL_OUTPUT, GRAD_PREFIX, MASK_PREFIX, META_DROPOUT, GraphBundle
from fedsdk_coordinator.models.graphwriter import IR_VERSION, OPSET, GraphWriter, softmax_cross_entropy
from fedsdk_coordinator.models.layers import (
    AvgPool2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
)

__all__ = ["IR_VERSION", "OPSET", "build_graphs"]

_DTYPES = {"float32": np.float32, "float64": np.float64}


def _import_onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:  # the device install does not carry onnx
        raise ConfigError(
            "building training graphs needs the 'onnx' package: pip install 'fedsdk[coordinator]'"
        ) from exc
    return onnx


@dataclass
class _Saved:
    """What the backward pass of one layer needs from its forward pass."""

    x: str
    y: str
    indices: str = ""
    mask: str = ""


class _Graph(GraphWriter):
    """The builder's writer: names without prefix (a spec has no names of its own to collide with)."""

    def __init__(self, onnx: Any, dtype: type) -> None:
        super().__init__(onnx, dtype, prefix="")


def _forward(g: _Graph, spec: ModelSpec, x: str, train: bool) -> tuple[str, list[_Saved], dict[str, float]]:
    h = x
    saved: list[_Saved] = []
    masks: dict[str, float] = {}
    params = iter(spec.param_names)
    first_param_layer = next(
        (i for i, layer in enumerate(spec.layers) if layer.param_shapes()), len(spec.layers)
    )
    for i, layer in enumerate(spec.layers):
        names = [next(params) for _ in layer.param_shapes()]
        s = _Saved(x=h, y="")
        if isinstance(layer, Linear):
            h = g.op("Gemm", [h, *names], transB=1)
        elif isinstance(layer, Conv2d):
            ph, pw = layer.pads
            h = g.op(
                "Conv",
                [h, *names],
                kernel_shape=list(layer.kernels),
                strides=list(layer.strides),
                pads=[ph, pw, ph, pw],
            )
        elif isinstance(layer, MaxPool2d):
            ph, pw = layer.pads
            attrs: dict[str, Any] = {
                "kernel_shape": list(layer.kernels),
                "strides": list(layer.strides),
                "pads": [ph, pw, ph, pw],
            }
            if train and i > first_param_layer:  # argmax indices only where a gradient flows back
                h, s.indices = g.op("MaxPool", [h], n_out=2, **attrs)
            else:
                h = g.op("MaxPool", [h], **attrs)
        elif isinstance(layer, AvgPool2d):
            ph, pw = layer.pads
            h = g.op(
                "AveragePool",
                [h],
                kernel_shape=list(layer.kernels),
                strides=list(layer.strides),
                pads=[ph, pw, ph, pw],
                count_include_pad=int(layer.count_include_pad),
            )
        elif isinstance(layer, Flatten):
            h = g.op("Flatten", [h], axis=1)
        elif isinstance(layer, ReLU):
            h = g.op("Relu", [h])
        elif isinstance(layer, Dropout):
            if train and layer.p > 0.0:
                s.mask = f"{MASK_PREFIX}{i}"
                masks[s.mask] = layer.p
                h = g.op("Mul", [h, s.mask])
        else:  # pragma: no cover - ModelSpec validates layer types
            raise ConfigError(f"unsupported layer {layer!r}")
        s.y = h
        saved.append(s)
    return h, saved, masks


def _avgpool_divisor(layer: AvgPool2d, in_hw: tuple[int, ...], out_hw: tuple[int, ...]) -> np.ndarray:
    """Per-output-position divisor of AveragePool (ONNX semantics, floor mode)."""
    (kh, kw), (sh, sw), (ph, pw) = layer.kernels, layer.strides, layer.pads
    if layer.count_include_pad or (ph == 0 and pw == 0):
        return np.full(out_hw, float(kh * kw))
    rows = [min(o * sh - ph + kh, in_hw[0]) - max(o * sh - ph, 0) for o in range(out_hw[0])]
    cols = [min(o * sw - pw + kw, in_hw[1]) - max(o * sw - pw, 0) for o in range(out_hw[1])]
    return np.outer(rows, cols).astype(np.float64)


def _backward(g: _Graph, spec: ModelSpec, saved: list[_Saved], dy: str) -> dict[str, str]:
    """Emit the backward pass; returns ``{param name: gradient tensor name}``."""
    owners = [i for i, layer in enumerate(spec.layers) for _ in layer.param_shapes()]
    if not owners:
        return {}
    first_param_layer = owners[0]
    names_of: dict[int, list[str]] = {}
    for name, i in zip(spec.param_names, owners):
        names_of.setdefault(i, []).append(name)
    grads: dict[str, str] = {}
    for i in range(len(spec.layers) - 1, first_param_layer - 1, -1):
        layer, s, in_shape = spec.layers[i], saved[i], spec.shapes[i]
        out_shape = spec.shapes[i + 1]
        need_dx = i > first_param_layer
        pnames = names_of.get(i, [])
        dx = dy
        if isinstance(layer, Linear):
            grads[pnames[0]] = g.op("Gemm", [dy, s.x], transA=1, out=GRAD_PREFIX + pnames[0])
            if layer.bias:
                grads[pnames[1]] = g.op(
                    "ReduceSum", [dy, g.const([0])], keepdims=0, out=GRAD_PREFIX + pnames[1]
                )
            if need_dx:
                dx = g.op("MatMul", [dy, pnames[0]])
        elif isinstance(layer, Conv2d):
            (kh, kw), (sh, sw), (ph, pw) = layer.kernels, layer.strides, layer.pads
            (_, hi, wi), (_, ho, wo) = in_shape, out_shape
            xt = g.op("Transpose", [s.x], perm=[1, 0, 2, 3])
            dyt = g.op("Transpose", [dy], perm=[1, 0, 2, 3])
            corr = g.op("Conv", [xt, dyt], dilations=[sh, sw], pads=[ph, pw, ph, pw], kernel_shape=[ho, wo])
            full_h, full_w = hi + 2 * ph - sh * (ho - 1), wi + 2 * pw - sw * (wo - 1)
            if (full_h, full_w) != (kh, kw):
                corr = g.op("Slice", [corr, g.const([0, 0]), g.const([kh, kw]), g.const([2, 3])])
            grads[pnames[0]] = g.op("Transpose", [corr], perm=[1, 0, 2, 3], out=GRAD_PREFIX + pnames[0])
            if layer.bias:
                grads[pnames[1]] = g.op(
                    "ReduceSum", [dy, g.const([0, 2, 3])], keepdims=0, out=GRAD_PREFIX + pnames[1]
                )
            if need_dx:
                opad = [(hi + 2 * ph - kh) % sh, (wi + 2 * pw - kw) % sw]
                dx = g.op(
                    "ConvTranspose",
                    [dy, pnames[0]],
                    kernel_shape=[kh, kw],
                    strides=[sh, sw],
                    pads=[ph, pw, ph, pw],
                    output_padding=opad,
                )
        elif isinstance(layer, MaxPool2d):
            zeros = g.op(
                "ConstantOfShape",
                [g.op("Shape", [s.x])],
                value=g.onnx.numpy_helper.from_array(np.zeros(1, g.np_dtype)),
            )
            flat = [g.op("Reshape", [t, g.const([-1])]) for t in (zeros, s.indices, dy)]
            scattered = g.op("ScatterElements", flat, axis=0, reduction="add")
            dx = g.op("Reshape", [scattered, g.const([-1, *in_shape])])
        elif isinstance(layer, AvgPool2d):
            (kh, kw), (sh, sw), (ph, pw) = layer.kernels, layer.strides, layer.pads
            channels, hi, wi = in_shape
            divisor = _avgpool_divisor(layer, (hi, wi), out_shape[1:])
            if np.all(divisor == divisor.flat[0]):
                scaled, kernel = dy, np.full((channels, 1, kh, kw), 1.0 / divisor.flat[0])
            else:
                scaled, kernel = g.op("Mul", [dy, g.fconst(1.0 / divisor)]), np.ones((channels, 1, kh, kw))
            opad = [(hi + 2 * ph - kh) % sh, (wi + 2 * pw - kw) % sw]
            dx = g.op(
                "ConvTranspose",
                [scaled, g.fconst(kernel)],
                kernel_shape=[kh, kw],
                strides=[sh, sw],
                pads=[ph, pw, ph, pw],
                output_padding=opad,
                group=channels,
            )
        elif isinstance(layer, Flatten):
            dx = g.op("Reshape", [dy, g.const([-1, *in_shape])])
        elif isinstance(layer, ReLU):
            zero = g.fconst(0.0)
            dx = g.op("Where", [g.op("Greater", [s.y, zero]), dy, zero])
        elif isinstance(layer, Dropout):
            dx = g.op("Mul", [dy, s.mask]) if s.mask else dy
        dy = dx
    return grads


def build_graphs(spec: ModelSpec, *, dtype: str = "float32") -> GraphBundle:
    """Build the training-step graph and the evaluation graph of ``spec`` (see the module docstring).

    ``dtype="float64"`` builds double-precision graphs for gradient checking; stock onnxruntime has no
    double CPU kernels for Conv, ConvTranspose and AveragePool, so it is refused for specs that use them.
    """
    onnx = _import_onnx()
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if dtype == "float64" and any(isinstance(layer, (Conv2d, AvgPool2d)) for layer in spec.layers):
        raise ConfigError("float64 graphs cannot contain Conv2d/AvgPool2d (no double kernels in onnxruntime)")
    vi = onnx.helper.make_tensor_value_info
    meta = {"fedsdk.spec": json.dumps(spec.to_dict(), sort_keys=True)}

    def param_inputs(elem: int) -> list[Any]:
        return [vi(n, elem, list(s)) for n, s in zip(spec.param_names, spec.param_shapes)]

    # training graph
    g = _Graph(onnx, _DTYPES[dtype])
    logits, saved, masks = _forward(g, spec, "x", train=True)
    loss, dlogits = softmax_cross_entropy(g, logits, "y", spec.num_classes)
    grads = _backward(g, spec, saved, dlogits)
    inputs = [vi("x", g.elem, ["N", *spec.input_shape]), vi("y", onnx.TensorProto.INT64, ["N"])]
    inputs += param_inputs(g.elem)
    inputs += [vi(m, g.elem, ["N", *spec.shapes[int(m[len(MASK_PREFIX) :])]]) for m in masks]
    outputs = [vi(loss, g.elem, [])]
    outputs += [vi(grads[n], g.elem, list(s)) for n, s in zip(spec.param_names, spec.param_shapes)]
    train = g.model_bytes(inputs, outputs, "fedsdk_train_step", {**meta, META_DROPOUT: json.dumps(masks)})

    # evaluation graph
    e = _Graph(onnx, _DTYPES[dtype])
    logits, _, _ = _forward(e, spec, "x", train=False)
    if e.nodes and e.nodes[-1].output[0] == logits:
        e.nodes[-1].output[0] = EVAL_OUTPUT
    else:  # the model ends in a layer that is the identity at evaluation time (Dropout)
        e.op("Identity", [logits], out=EVAL_OUTPUT)
    inputs = [vi("x", e.elem, ["N", *spec.input_shape]), *param_inputs(e.elem)]
    evaluation = e.model_bytes(
        inputs, [vi(EVAL_OUTPUT, e.elem, ["N", spec.num_classes])], "fedsdk_eval", meta
    )
    return GraphBundle(
        train_graph=train,
        eval_graph=evaluation,
        param_names=spec.param_names,
        param_shapes=spec.param_shapes,
        input_shape=spec.input_shape,
        num_classes=spec.num_classes,
    )
