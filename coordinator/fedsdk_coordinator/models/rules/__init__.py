"""Gradient rules: for one ONNX node, the nodes that compute its inputs' gradients from its outputs'.

Every rule has the signature ``rule(w, node, dys, need) -> grads``: ``w`` is the :class:`GraphWriter`,
``node`` the forward node (:class:`Node`: op type, input and output names, attributes), ``dys`` the
gradient tensor of each output (``None`` where no gradient flows), ``need`` which inputs want a gradient;
it returns one gradient tensor name (or ``None``) per input. Only default-domain operators that
onnxruntime runs on the CPU at opset 17 are emitted.

The formulas are the standard reverse-mode rules (Goodfellow et al., *Deep Learning*, §6.5; Griewank &
Walther, *Evaluating Derivatives*, 2008) with PyTorch's conventions at the points where a function has no
derivative, so that gradients match ``torch.autograd`` exactly. One module per operator family, each with
its formulas in its docstring:

* :mod:`.shape`: Identity, Flatten, Reshape, Squeeze, Unsqueeze, Transpose, Concat;
* :mod:`.elementwise`: Add, Sub, Mul, Div, Neg, Sqrt (broadcasting);
* :mod:`.activations`: Relu, LeakyRelu, Sigmoid, Tanh, Clip, HardSigmoid, HardSwish;
* :mod:`.linear`: Gemm, MatMul;
* :mod:`.conv`: Conv (:func:`conv_weight_form`), and the window geometry pooling shares;
* :mod:`.pooling`: MaxPool (:func:`maxpool_tiles`), AveragePool, GlobalAveragePool, ReduceMean;
* :mod:`.embedding`: Gather on a parameter.

BatchNormalization and LayerNormalization have no rule of their own: the importer writes them with Add,
Sub, Mul, Div, Sqrt, Reshape and ReduceMean (``fedsdk_coordinator.models.importer``), so their gradients
are those rules'.

The table :data:`RULES` lives in :mod:`.registry`; each family module registers its rules when it is
imported, and this package imports every family below, so the table is complete as soon as anything is
imported from ``fedsdk_coordinator.models.rules``. Names with a leading underscore are shared between the
package's modules only.
"""

from __future__ import annotations

# every family module, imported for the rules it registers (no operator is registered twice)
from fedsdk_coordinator.models.rules import (  # noqa: F401
    activations,
    conv,
    elementwise,
    embedding,
    linear,
    pooling,
    shape,
)
from fedsdk_coordinator.models.rules.conv import conv_weight_form
from fedsdk_coordinator.models.rules.pooling import maxpool_tiles
from fedsdk_coordinator.models.rules.registry import RULES, Node, Rule

__all__ = ["RULES", "Node", "Rule", "conv_weight_form", "maxpool_tiles"]
