"""Every gradient rule against central finite differences, without PyTorch (these run in CI), and a mutation
check: each rule with an injected bug (its gradients scaled by 1.5) must fail the same comparison.

Each case is a small ONNX graph written with ``onnx.helper`` that puts the operator on the path from
parameters to the output; BatchNormalization and LayerNormalization, which the import writes as primitives,
have cases of their own, and their evaluation graphs are compared with onnxruntime's operators. The check
perturbs one parameter at a time along a random unit direction and compares ``(L(w + εv) − L(w − εv)) / 2ε``
(the training graph's own loss, float32) with ``⟨∇L, v⟩``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
helper = onnx.helper

from fedsdk.errors import ConfigError  # noqa: E402
from fedsdk.model import OnnxModel  # noqa: E402
from fedsdk_coordinator.models import import_onnx, supported_ops  # noqa: E402
from fedsdk_coordinator.models import rules as rules_module  # noqa: E402

F = onnx.TensorProto.FLOAT


@dataclass
class Case:
    name: str
    x_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    nodes: list[Any]
    params: dict[str, tuple[int, ...]]
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    task: str = "classification"
    ops: tuple[str, ...] = ()  # the rules this case exercises (default: its name)
    x_ints: int = 0  # x holds integer ids below this (embeddings)
    opset: int = 17
    values: dict[str, np.ndarray] = field(default_factory=dict)  # parameters not drawn at random


def n(op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> Any:
    return helper.make_node(op, inputs, outputs, **attrs)


def head(h: str, features: int, classes: int = 3) -> list[Any]:
    """Flatten ``h`` and a Gemm to ``classes`` logits (parameters ``hw``, ``hb``)."""
    return [n("Flatten", [h], ["hf"], axis=1), n("Gemm", ["hf", "hw", "hb"], ["out"], transB=1)]


def dense(op: str, **attrs: Any) -> Case:
    """x (4, 6) -> Gemm -> op -> Gemm -> 3 logits."""
    return Case(
        op,
        (6,),
        (3,),
        [n("Gemm", ["x", "w1", "b1"], ["h1"], transB=1), n(op, ["h1"], ["h2"], **attrs), *head("h2", 5)],
        {"w1": (5, 6), "b1": (5,), "hw": (3, 5), "hb": (3,)},
    )


def conv_case(
    name: str, node: Any, channels: int, hw: tuple[int, ...], out_features: int, **extra: Any
) -> Case:
    spatial = len(hw)
    return Case(
        name,
        (2, *hw),
        (3,),
        [
            n("Conv", ["x", "cw", "cb"], ["c1"], kernel_shape=[3] * spatial, pads=[1] * (2 * spatial)),
            n("Tanh", ["c1"], ["c2"]),
            node,
            *head("p", out_features),
        ],
        {
            "cw": (channels, 2, *([3] * spatial)),
            "cb": (channels,),
            "hw": (3, out_features),
            "hb": (3,),
            **extra,
        },
        ops=(name.split(":")[0], "Conv", "Tanh"),
    )


def conv_weight_case(
    name: str, x_shape: tuple[int, ...], wshape: tuple[int, ...], out_spatial: tuple[int, ...], **attrs: Any
) -> Case:
    """x -> Conv without bias -> Tanh -> head: the Conv rule returns only the weight's gradient, so the
    mutation check tests that one form (:func:`rules.conv_weight_form`)."""
    features = wshape[0] * int(np.prod(out_spatial))
    return Case(
        name,
        x_shape,
        (3,),
        [
            n("Conv", ["x", "cw"], ["c1"], kernel_shape=list(wshape[2:]), **attrs),
            n("Tanh", ["c1"], ["c2"]),
            *head("c2", features),
        ],
        {"cw": wshape, "hw": (3, features), "hb": (3,)},
        ops=("Conv",),
    )


# name: (the weight-gradient form, the case)
CONV_FORMS = {
    c.name: (form, c)
    for form, c in [
        (
            "shift",
            conv_weight_case(
                "Conv:shift",
                (4, 7, 6),
                (5, 4, 2, 2),
                (4, 5),
                pads=[1, 0, 0, 1],
                strides=[2, 1],
                dilations=[1, 2],
            ),
        ),
        ("shift", conv_weight_case("Conv:shift1d", (3, 11), (4, 3, 3), (6,), pads=[1, 1], strides=[2])),
        ("shift", conv_weight_case("Conv:shift3d", (8, 3, 3, 3), (2, 8, 2, 2, 2), (2, 2, 2))),
        (
            "im2col",
            conv_weight_case(
                "Conv:im2col", (2, 6, 6), (3, 2, 3, 3), (3, 3), pads=[1, 1, 1, 1], strides=[2, 2]
            ),
        ),
        (
            "im2col",
            conv_weight_case(
                "Conv:im2col-groups",
                (4, 5, 5),
                (6, 2, 2, 2),
                (5, 3),
                group=2,
                dilations=[2, 2],
                pads=[1, 0, 1, 0],
            ),
        ),
        ("im2col", conv_weight_case("Conv:1x1", (3, 5, 5), (4, 3, 1, 1), (5, 5))),
        ("im2col", conv_weight_case("Conv:1x1-strided", (3, 5, 5), (4, 3, 1, 1), (3, 5), strides=[2, 1])),
        ("im2col", conv_weight_case("Conv:1x1-padded", (3, 4, 4), (2, 3, 1, 1), (5, 5), pads=[1, 1, 0, 0])),
    ]
}


def cases() -> list[Case]:
    out = [dense(op) for op in ("Relu", "Sigmoid", "Tanh", "HardSwish", "Neg", "Identity")]
    out.append(dense("LeakyRelu", alpha=0.2))
    steep = dense("LeakyRelu", alpha=1.5)  # outside [0, 1]: the Where form
    steep.name = "LeakyRelu:steep"
    out.append(steep)
    out.append(dense("HardSigmoid", alpha=0.3, beta=0.4))
    clip = dense("Clip")
    clip.nodes[1] = n("Clip", ["h1", "lo", "hi"], ["h2"])
    clip.consts = {"lo": np.array(-0.5, np.float32), "hi": np.array(0.6, np.float32)}
    out.append(clip)
    floor = dense("Clip")
    floor.name = "Clip:min"
    floor.nodes[1] = n("Clip", ["h1", "lo"], ["h2"])
    floor.consts = {"lo": np.array(-0.2, np.float32)}
    out.append(floor)
    for op in ("Add", "Sub", "Mul", "Div"):  # broadcasting: (4, 5) with (1, 5), a parameter
        c = dense(op)
        c.nodes[1] = n(op, ["h1", "p"], ["h2"])
        c.params["p"] = (1, 5)
        c.name = f"{op}:broadcast"
        c.ops = (op,)
        out.append(c)
    gemm = Case(
        "Gemm:trans",
        (6,),
        (3,),
        [
            n("Gemm", ["x", "w1", "b1"], ["h1"], alpha=0.7, beta=1.3),  # w1 (6, 5), not transposed
            n("Tanh", ["h1"], ["h2"]),
            n("Gemm", ["h2", "w2", "b2"], ["out"], transA=0, transB=1, alpha=1.1),
        ],
        {"w1": (6, 5), "b1": (5,), "w2": (3, 5), "b2": (3,)},
        ops=("Gemm",),
    )
    gemm_ta = Case(
        "Gemm:transA",
        (6,),
        (3,),
        [
            n("Transpose", ["x"], ["xt"], perm=[1, 0]),
            n("Gemm", ["xt", "w1", "b1"], ["h1"], transA=1, transB=1),
            n("Tanh", ["h1"], ["h2"]),
            n("Transpose", ["h2"], ["h2t"], perm=[1, 0]),
            n("Gemm", ["h2t", "w2"], ["out"], transA=1),
        ],
        {"w1": (5, 6), "b1": (1, 5), "w2": (5, 3)},
        ops=("Gemm", "Transpose"),
    )
    matmul = Case(
        "MatMul",
        (3, 6),
        (3,),
        [
            n("MatMul", ["x", "w1"], ["h1"]),  # (4, 3, 6) @ (6, 5)
            n("Add", ["h1", "b1"], ["h2"]),
            n("Tanh", ["h2"], ["h3"]),
            n("MatMul", ["w0", "h3"], ["h4"]),  # (2, 3) @ (4, 3, 5): a broadcast left operand
            *head("h4", 10),
        ],
        {"w1": (6, 5), "b1": (5,), "w0": (2, 3), "hw": (3, 10), "hb": (3,)},
        ops=("MatMul", "Add"),
    )
    shapes = Case(
        "Reshape",
        (6,),
        (3,),
        [
            n("Gemm", ["x", "w1", "b1"], ["h1"], transB=1),
            n("Reshape", ["h1", "s1"], ["h2"]),  # (4, 2, 4)
            n("Transpose", ["h2"], ["h3"], perm=[0, 2, 1]),
            n("Unsqueeze", ["h3", "ax"], ["h4"]),
            n("Squeeze", ["h4", "ax"], ["h5"]),
            n("Concat", ["h5", "h3"], ["h6"], axis=-1),  # (4, 4, 4): one tensor used twice
            n("Tanh", ["h6"], ["h7"]),
            *head("h7", 16),
        ],
        {"w1": (8, 6), "b1": (8,), "hw": (3, 16), "hb": (3,)},
        consts={"s1": np.array([-1, 2, 4], np.int64), "ax": np.array([1], np.int64)},
        ops=("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Concat", "Flatten"),
    )
    out += [gemm, gemm_ta, matmul, shapes]
    grouped = Case(
        "Conv:groups",
        (4, 7, 7),
        (3,),
        [
            n("Conv", ["x", "cw", "cb"], ["c1"], kernel_shape=[3, 3], pads=[1, 0, 1, 2], strides=[2, 1]),
            n("Tanh", ["c1"], ["c2"]),
            n(
                "Conv",
                ["c2", "dw"],
                ["c3"],
                kernel_shape=[3, 3],
                group=6,
                dilations=[2, 1],
                pads=[2, 1, 2, 1],
            ),
            n("Conv", ["c3", "pw", "pb"], ["c4"], kernel_shape=[1, 1], group=2, strides=[2, 2]),
            *head("c4", 4 * 2 * 4),
        ],
        {
            "cw": (6, 4, 3, 3),
            "cb": (6,),
            "dw": (6, 1, 3, 3),
            "pw": (4, 3, 1, 1),
            "pb": (4,),
            "hw": (3, 32),
            "hb": (3,),
        },
        ops=("Conv",),
    )
    conv1d = Case(
        "Conv:1d",
        (3, 11),
        (3,),
        [
            n("Conv", ["x", "cw", "cb"], ["c1"], kernel_shape=[3], pads=[1, 1], strides=[2]),
            n("LeakyRelu", ["c1"], ["c2"], alpha=0.1),
            n("Conv", ["c2", "dw"], ["c3"], kernel_shape=[3], group=4, dilations=[2], pads=[2, 2]),
            *head("c3", 4 * 6),
        ],
        {"cw": (4, 3, 3), "cb": (4,), "dw": (4, 1, 3), "hw": (3, 24), "hb": (3,)},
        ops=("Conv",),
    )
    out += [grouped, conv1d, *(c for _, c in CONV_FORMS.values())]
    out.append(
        conv_case(
            "MaxPool",
            n("MaxPool", ["c2"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
            4,
            (6, 6),
            4 * 9,
        )
    )
    out.append(  # windows that tile the input: no indices output, the first maximum
        conv_case(
            "MaxPool:tiles",
            n("MaxPool", ["c2"], ["p"], kernel_shape=[2, 3], strides=[2, 3]),
            4,
            (6, 6),
            4 * 6,
        )
    )
    out.append(
        conv_case(
            "AveragePool:pads",
            n("AveragePool", ["c2"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
            4,
            (6, 6),
            4 * 9,
        )
    )
    out.append(
        conv_case(
            "AveragePool:count_pad",
            n(
                "AveragePool",
                ["c2"],
                ["p"],
                kernel_shape=[2, 2],
                strides=[2, 2],
                count_include_pad=1,
                pads=[0, 0, 1, 1],
            ),
            4,
            (5, 5),
            4 * 9,
        )
    )
    out.append(conv_case("GlobalAveragePool", n("GlobalAveragePool", ["c2"], ["p"]), 4, (5, 5), 4))
    out.append(conv_case("ReduceMean", n("ReduceMean", ["c2"], ["p"], axes=[2, 3], keepdims=0), 4, (5, 5), 4))
    out.append(
        Case(
            "Gather",
            (5,),
            (3,),
            [
                n("Cast", ["x"], ["ids"], to=onnx.TensorProto.INT64),
                n("Gather", ["emb", "ids"], ["e"]),  # (4, 5, 3), some ids repeated
                n("Tanh", ["e"], ["t"]),
                *head("t", 15),
            ],
            {"emb": (7, 3), "hw": (3, 15), "hb": (3,)},
            x_ints=7,
            ops=("Gather",),
        )
    )
    sqrt = dense("Sqrt")  # on Sigmoid's output: positive
    sqrt.nodes[1:2] = [n("Sigmoid", ["h1"], ["s1"]), n("Sqrt", ["s1"], ["h2"])]
    out.append(sqrt)
    out += normalization_cases()
    for task in ("regression", "multilabel"):
        c = dense("Tanh")
        c.name, c.task, c.ops = f"loss:{task}", task, ("Tanh", "Gemm")
        out.append(c)
    return out


def batchnorm_case() -> Case:
    """Conv -> Tanh -> BatchNormalization (parameters ``s``, ``b``; running statistics ``m``, ``v``)."""
    case = conv_case(
        "BatchNormalization",
        n("BatchNormalization", ["c2", "s", "b", "m", "v"], ["p"], epsilon=1e-3),
        4,
        (5, 5),
        4 * 25,
        s=(4,),
        b=(4,),
    )
    case.consts = {
        "m": np.array([0.3, -0.2, 0.1, 0.0], np.float32),
        "v": np.array([0.5, 1.5, 0.8, 2.0], np.float32),
    }
    case.ops = ("BatchNormalization",)
    return case


def normalization_cases() -> list[Case]:
    bn1d = dense("BatchNormalization")  # on (N, C)
    bn1d.name = "BatchNormalization:2d"
    bn1d.nodes[1] = n("BatchNormalization", ["h1", "s", "b", "m", "v"], ["h2"])
    bn1d.params.update({"s": (5,), "b": (5,)})
    bn1d.consts = {
        "m": np.linspace(-0.3, 0.3, 5, dtype=np.float32),
        "v": np.linspace(0.5, 2, 5, dtype=np.float32),
    }
    ln = Case(
        "LayerNormalization",
        (6,),
        (3,),
        [
            n("Gemm", ["x", "w1", "b1"], ["h1"], transB=1),
            n("Reshape", ["h1", "s1"], ["h2"]),  # (N, 2, 4)
            n("LayerNormalization", ["h2", "g", "be"], ["h3"], axis=-1, epsilon=1e-3),
            n("Tanh", ["h3"], ["h4"]),
            *head("h4", 8),
        ],
        {"w1": (8, 6), "b1": (8,), "g": (4,), "be": (4,), "hw": (3, 8), "hb": (3,)},
        consts={"s1": np.array([-1, 2, 4], np.int64)},
    )
    # over two axes, no bias, its Mean and InvStdDev outputs used
    ln2 = Case(
        "LayerNormalization:axes",
        (6,),
        (3,),
        [
            n("Gemm", ["x", "w1", "b1"], ["h1"], transB=1),
            n("Reshape", ["h1", "s1"], ["h2"]),  # (N, 2, 2, 3)
            n("LayerNormalization", ["h2", "g"], ["h3", "mu", "isd"], axis=2),
            n("Mul", ["h3", "isd"], ["h4"]),
            n("Add", ["h4", "mu"], ["h5"]),
            *head("h5", 12),
        ],
        {"w1": (12, 6), "b1": (12,), "g": (2, 3), "hw": (3, 12), "hb": (3,)},
        consts={"s1": np.array([-1, 2, 2, 3], np.int64)},
        ops=("LayerNormalization",),
    )
    return [batchnorm_case(), bn1d, ln, ln2]


CASES = cases()


def model_bytes(case: Case, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    inits = [
        onnx.numpy_helper.from_array(
            case.values[k] if k in case.values else rng.normal(scale=0.7, size=s).astype(np.float32), k
        )
        for k, s in case.params.items()
    ]
    inits += [onnx.numpy_helper.from_array(v, k) for k, v in case.consts.items()]
    graph = helper.make_graph(
        case.nodes,
        case.name,
        [helper.make_tensor_value_info("x", F, ["N", *case.x_shape])],
        [helper.make_tensor_value_info("out", F, ["N", *case.out_shape])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    return model.SerializeToString()


def batch(case: Case, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if case.x_ints:
        x = rng.integers(0, case.x_ints, size=(4, *case.x_shape)).astype(np.float32)
    else:
        x = rng.normal(size=(4, *case.x_shape)).astype(np.float32)
    if case.task == "classification":
        return x, rng.integers(0, case.out_shape[0], size=4).astype(np.int64)
    if case.task == "multilabel":
        return x, (rng.random((4, *case.out_shape)) < 0.5).astype(np.float32)
    return x, rng.normal(size=(4, *case.out_shape)).astype(np.float32)


def worst_mismatch(case: Case, eps: float = 1e-2) -> float:
    """The largest relative gap, over parameters, between the graph's directional derivative and the
    central difference of its loss."""
    imported = import_onnx(model_bytes(case), task=case.task)
    om = OnnxModel.from_bundle(imported.bundle)
    x, y = batch(case)
    weights = imported.weights
    _, grads = om.train_step(weights, x, y)
    rng = np.random.default_rng(2)
    worst = 0.0
    for k, (w, g) in enumerate(zip(weights, grads, strict=True)):
        v = rng.normal(size=w.shape)
        v /= np.linalg.norm(v)
        plus = [p.copy() for p in weights]
        minus = [p.copy() for p in weights]
        plus[k] = (w + eps * v).astype(np.float32)
        minus[k] = (w - eps * v).astype(np.float32)
        fd = (om.train_step(plus, x, y)[0] - om.train_step(minus, x, y)[0]) / (2 * eps)
        an = float(np.sum(g.astype(np.float64) * v))
        worst = max(worst, abs(fd - an) / max(abs(an), abs(fd), 1e-3))
    return worst


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_matches_finite_differences(case: Case) -> None:
    assert worst_mismatch(case) < 2e-2


def test_every_rule_has_a_case() -> None:
    covered = {op for c in CASES for op in (c.ops or (c.name.split(":")[0],))}
    assert set(rules_module.RULES) <= covered, sorted(set(rules_module.RULES) - covered)


MUTATED = [
    (op, c)
    for c in CASES
    for op in (c.ops or (c.name.split(":")[0],))
    if op in rules_module.RULES and (op != "Identity" or c.name == "Identity")
]


@pytest.mark.parametrize(("op", "case"), MUTATED, ids=[f"{op}-{c.name}" for op, c in MUTATED])
def test_an_injected_bug_in_the_rule_is_caught(op: str, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scale every gradient the rule returns by 1.5: every case using the operator must then fail, so each
    branch of a rule that some case takes is checked."""
    original = rules_module.RULES[op]

    def mutated(w: Any, node: Any, dys: Any, need: Any) -> list[str | None]:
        grads = original(w, node, dys, need)
        return [None if g is None else w.op("Mul", [g, w.fconst(1.5)]) for g in grads]

    monkeypatch.setitem(rules_module.RULES, op, mutated)
    assert worst_mismatch(case) > 0.1


def test_an_operator_without_a_rule_is_refused_at_import_with_the_node_and_the_list() -> None:
    case = dense("Erf")
    with pytest.raises(ConfigError) as err:
        import_onnx(model_bytes(case), task="classification")
    text = str(err.value)
    assert (
        "Erf" in text
        and "no gradient rule" in text
        and "Conv" in text
        and all(op in text for op in supported_ops())
    )


NORMS = [c for c in CASES if c.name.split(":")[0] in ("BatchNormalization", "LayerNormalization")]


@pytest.mark.parametrize("case", NORMS, ids=[c.name for c in NORMS])
def test_normalizations_evaluate_as_onnxruntime_operators_do(case: Case) -> None:
    """The primitives the import writes equal onnxruntime's BatchNormalization and LayerNormalization."""
    ort = pytest.importorskip("onnxruntime")
    data = model_bytes(case)
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": batch(case)[0]})[0]
    imported = import_onnx(data, task=case.task)
    have = OnnxModel.from_bundle(imported.bundle).logits(imported.weights, batch(case)[0])
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)
    ops = {node.op_type for node in onnx.load_from_string(imported.bundle.eval_graph).graph.node}
    assert not ops & {"BatchNormalization", "LayerNormalization"}


def test_batchnorm_statistics_are_constants_and_scale_and_bias_parameters() -> None:
    case = batchnorm_case()
    imported = import_onnx(model_bytes(case), task="classification")
    assert imported.bundle.param_names == ("cw", "cb", "s", "b", "hw", "hb")
    for graph in (imported.bundle.train_graph, imported.bundle.eval_graph):
        inits = {
            i.name: onnx.numpy_helper.to_array(i) for i in onnx.load_from_string(graph).graph.initializer
        }
        for stat in ("m", "v"):
            np.testing.assert_array_equal(inits[stat], case.consts[stat])


def test_batchnorm_in_training_mode_is_refused() -> None:
    case = batchnorm_case()
    case.nodes[2] = n("BatchNormalization", ["c2", "s", "b", "m", "v"], ["p", "rm", "rv"], training_mode=1)
    with pytest.raises(ConfigError, match="training mode"):
        import_onnx(model_bytes(case), task="classification")


@pytest.mark.parametrize("opset", [13, 15, 18, 20])
def test_other_opsets_are_converted(opset: int) -> None:
    case = dense("Relu")
    case.opset = opset
    imported = import_onnx(model_bytes(case), task="classification")
    assert imported.opset == opset
    assert worst_mismatch(case) < 2e-2


def test_files_that_cannot_work_are_refused_on_the_coordinator() -> None:
    case = dense("Relu")
    with pytest.raises(ConfigError, match="task"):
        import_onnx(model_bytes(case), task="ranking")
    with pytest.raises(ConfigError, match="cannot read"):
        import_onnx(b"not a model")
    case.opset = 11
    with pytest.raises(ConfigError, match="opset 11"):
        import_onnx(model_bytes(case))


def train_ops(case: Case) -> list[Any]:
    graph = onnx.load_from_string(import_onnx(model_bytes(case), task=case.task).bundle.train_graph).graph
    return list(graph.node)


@pytest.mark.parametrize(("name", "outputs"), [("MaxPool", 2), ("MaxPool:tiles", 1)])
def test_maxpool_keeps_indices_only_where_its_windows_do_not_tile(name: str, outputs: int) -> None:
    case = next(c for c in CASES if c.name == name)
    pools = [node for node in train_ops(case) if node.op_type == "MaxPool"]
    assert [len(node.output) for node in pools] == [outputs]


def head_grad(y: np.ndarray, hw: np.ndarray, hb: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """dL/dy for ``head`` (Flatten, Gemm with transB) and the mean softmax cross-entropy."""
    z = y.reshape(len(y), -1) @ hw.T + hb
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), labels] -= 1.0
    return ((p / len(y)) @ hw).reshape(y.shape)


def first_max_pool(t: np.ndarray, k: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """2-D max pool with kernel == stride over (C, H, W), floor mode: the values and a mask marking the
    first maximum of each window in row-major order (PyTorch's choice among ties)."""
    c, h, w = t.shape
    oh, ow = h // k[0], w // k[1]
    win = t[:, : oh * k[0], : ow * k[1]].reshape(c, oh, k[0], ow, k[1]).transpose(0, 1, 3, 2, 4)
    flat = win.reshape(c, oh, ow, -1)
    hot = np.eye(k[0] * k[1])[flat.argmax(axis=-1)].reshape(c, oh, ow, *k).transpose(0, 1, 3, 2, 4)
    mask = np.zeros_like(t)
    mask[:, : oh * k[0], : ow * k[1]] = hot.reshape(c, oh * k[0], ow * k[1])
    return flat.max(axis=-1), mask


TIE_VALUES = np.array(
    [[[0, 1, 1, 0, 2, 2], [1, 0, 2, 2, 2, 2], [0, 0, -1, 0, 1, 0], [0, 0, 1, -1, 1, 1]]] * 2
)
TIES = {  # name: (node from h to p, reference y = f(t), reference mask dy -> dt)
    "Relu": (n("Relu", ["h"], ["p"]), lambda t: (np.maximum(t, 0), (t > 0).astype(float))),
    "Clip": (
        n("Clip", ["h", "lo", "hi"], ["p"]),
        lambda t: (np.clip(t, 0.0, 1.0), ((t >= 0) & (t <= 1)).astype(float)),
    ),
    "MaxPool:tiles": (n("MaxPool", ["h"], ["p"], kernel_shape=[2, 2], strides=[2, 2]), None),
    "MaxPool:indices": (
        n("MaxPool", ["h"], ["p"], kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 1, 1]),
        None,
    ),
}


@pytest.mark.parametrize("name", list(TIES))
def test_ties_follow_pytorch(name: str) -> None:
    """At kinks and among equal maxima the gradient is PyTorch's: Relu 0 at 0, Clip 1 at its bounds, the
    first maximum of a MaxPool window in row-major order. ``h = x + t`` with x = 0, so dL/dt is the batch
    sum of dL/dh."""
    node, reference = TIES[name]
    t = TIE_VALUES.astype(np.float32)
    if reference is None:  # MaxPool; the padded variant pads the bottom and right edges with -inf
        padded = np.pad(t, [(0, 0), (0, 1), (0, 1)], constant_values=-np.inf) if "indices" in name else t
        y, mask = first_max_pool(padded, (2, 2))
        mask = mask[:, : t.shape[1], : t.shape[2]]
        ref = lambda d: np.repeat(np.repeat(d, 2, axis=-2), 2, axis=-1) * mask  # noqa: E731
    else:
        y, m = reference(t)
        ref = lambda d: d * m  # noqa: E731
    features = int(np.prod(y.shape))
    case = Case(
        name,
        t.shape,
        (3,),
        [n("Add", ["x", "t"], ["h"]), node, *head("p", features)],
        {"t": t.shape, "hw": (3, features), "hb": (3,)},
        consts={"lo": np.array(0.0, np.float32), "hi": np.array(1.0, np.float32)},
        values={"t": t},
    )
    imported = import_onnx(model_bytes(case), task=case.task)
    weights = dict(zip(imported.bundle.param_names, imported.weights, strict=True))
    x, labels = batch(case)
    x = np.zeros_like(x)
    _, grads = OnnxModel.from_bundle(imported.bundle).train_step(imported.weights, x, labels)
    dy = head_grad(np.broadcast_to(y, (len(x), *y.shape)), weights["hw"], weights["hb"], labels)
    want = ref(dy).sum(axis=0)
    np.testing.assert_allclose(grads[imported.bundle.param_names.index("t")], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CONV_FORMS))
def test_each_conv_weight_form_has_its_case(name: str) -> None:
    form, case = CONV_FORMS[name]
    conv = case.nodes[0]
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    assert rules_module.conv_weight_form(case.params["cw"], group) == form
