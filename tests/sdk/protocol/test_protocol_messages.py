"""Message construction: every field checked and normalised in __post_init__, ValidationError only."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pytest

from fedsdk.errors import ConfigError, ValidationError
from fedsdk.protocol import (
    SCHEMA_VERSION,
    Aggregate,
    Bye,
    Error,
    FrozenMap,
    Hello,
    Limits,
    MessageKind,
    Status,
    Task,
    Update,
    encode,
    message_class,
    register,
)
from fedsdk.protocol.fields import Wire


def rejects(code: str, factory: Any, *args: Any, **kwargs: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        factory(*args, **kwargs)
    assert info.value.code == code, info.value
    return info.value


def task(**kw: Any) -> Task:
    args: dict[str, Any] = {
        "federation": "fed",
        "round_id": 1,
        "cluster_id": 0,
        "deadline_s": 30.0,
        "param_names": ("w",),
        "weights": (np.zeros((2, 2), np.float32),),
    }
    args.update(kw)
    return Task(**args)


def update(**kw: Any) -> Update:
    args: dict[str, Any] = {
        "client_id": "dev1",
        "round_id": 1,
        "cluster_id": 0,
        "num_samples": 10,
        "delta": (np.zeros(3, np.float32),),
    }
    args.update(kw)
    return Update(**args)


def test_frozen_and_normalised() -> None:
    w = np.ones(3, np.float32)
    t = task(param_names=["w"], weights=[w], config={"lr": 0.1})
    assert isinstance(t.param_names, tuple) and isinstance(t.weights, tuple)
    assert isinstance(t.config, FrozenMap)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.round_id = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        t.config["lr"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        t.config._data = {}  # type: ignore[misc]
    with pytest.raises(ValueError):
        t.weights[0][0] = 5.0
    w[0] = 7.0  # the caller's writable array was copied
    assert t.weights[0][0] == 1.0
    assert t.schema_version == SCHEMA_VERSION == 1
    with pytest.raises(TypeError):
        hash(t)


def test_read_only_arrays_are_not_copied() -> None:
    w = np.ones(1000, np.float32)
    w.flags.writeable = False
    assert update(delta=(w,)).delta[0] is w


def test_metrics_are_floats_and_maps_keep_scalar_types() -> None:
    u = update(metrics={"loss": 1, "acc": np.float32(0.5)})
    assert u.metrics == {"loss": 1.0, "acc": 0.5}
    assert all(type(v) is float for v in u.metrics.values())
    h = Hello("d", 1, "0.1.0", {"cores": np.int64(4), "on_ac": np.bool_(True), "freq": 1.5, "arch": "arm"})
    assert [type(v) for v in h.device.values()] == [int, bool, float, str]
    rejects("bad_field", update, metrics={"ok": True})
    rejects("bad_field", update, metrics={"x": "1"})
    rejects("non_finite", update, metrics={"x": math.nan})
    rejects("non_finite", update, metrics={"x": 10**400})
    rejects("bad_field", Hello, "d", 1, "0.1.0", {"x": None})
    rejects("bad_field", Hello, "d", 1, "0.1.0", {"x": [1]})
    rejects("bad_field", Hello, "d", 1, "0.1.0", {"x": 2**63})
    rejects("bad_field", Hello, "d", 1, "0.1.0", {"x": "y" * 1025})
    rejects("bad_field", Hello, "d", 1, "0.1.0", {f"k{i}": i for i in range(257)})
    rejects("bad_field", Hello, "d", 1, "0.1.0", {"bad key": 1})
    rejects("bad_field", Hello, "d", 1, "0.1.0", [("a", 1)])
    rejects("non_finite", Hello, "d", 1, "0.1.0", {"t": math.inf})


@pytest.mark.parametrize("bad", ["", "a/b", "a+b", "#", "a b", "x" * 65, "dev\n", "é", 5, None, b"dev"])
def test_ids(bad: Any) -> None:
    rejects("bad_field", Hello, bad, 1, "0.1.0")
    rejects("bad_field", task, federation=bad)
    rejects("bad_field", Status, "online", bad)
    rejects("bad_field", Error, "d", 1, bad, "r")
    if bad != "":
        rejects("bad_field", update, nonce=bad)
        rejects("bad_field", task, model_id=bad)


def test_id_alphabet_accepted() -> None:
    Hello("A-z_0.9", 1, "1!2.0+local.3")
    assert update(nonce="").nonce == ""


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("round_id", -1),
        ("round_id", 2**31),
        ("round_id", True),
        ("round_id", 1.0),
        ("round_id", "1"),
        ("cluster_id", -1),
        ("cluster_id", 2**31),
        ("num_samples", 0),
        ("num_samples", 10**9 + 1),
        ("num_samples", None),
    ],
)
def test_int_ranges(field: str, value: Any) -> None:
    rejects("bad_field", update, **{field: value})


def test_int_bounds_accepted() -> None:
    u = update(round_id=2**31 - 1, cluster_id=np.int64(7), num_samples=10**9)
    assert type(u.cluster_id) is int


def test_floats() -> None:
    rejects("bad_field", task, deadline_s=0.0)
    rejects("bad_field", task, deadline_s=-1)
    rejects("non_finite", task, deadline_s=math.inf)
    rejects("non_finite", task, deadline_s=math.nan)
    rejects("bad_field", task, deadline_s="5")
    rejects("bad_field", task, deadline_s=True)
    assert task(deadline_s=5).deadline_s == 5.0 and type(task(deadline_s=5).deadline_s) is float
    rejects("bad_field", Hello, "d", 1, "0.1.0", he_values_per_s=0.0)
    rejects("non_finite", Hello, "d", 1, "0.1.0", uplink_bytes_per_s=math.inf)
    assert Hello("d", 1, "0.1.0", he_values_per_s=None).he_values_per_s is None


@pytest.mark.parametrize("dtype", ["float16", "complex64", "int8", "uint16", "object", "U3"])
def test_array_dtype_whitelist(dtype: str) -> None:
    rejects("bad_dtype", update, delta=(np.zeros(2, dtype=dtype),))
    rejects("bad_dtype", task, weights=(np.zeros(2, dtype=dtype),))


def test_structured_dtype_rejected() -> None:
    rejects("bad_dtype", update, delta=(np.zeros(2, dtype=[("a", "f4")]),))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_non_finite_arrays(value: float, dtype: str) -> None:
    a = np.zeros((4, 4), dtype)
    a[2, 3] = value
    rejects("non_finite", update, delta=(np.zeros(2, np.float32), a))
    rejects("non_finite", Aggregate, 1, 0, (a,), 1, 1)


def test_arrays_container() -> None:
    rejects("bad_field", update, delta=np.zeros(3, np.float32))
    rejects("bad_field", update, delta=([1.0, 2.0],))
    rejects("bad_field", update, delta="abc")
    assert update(delta=()).delta == ()


def test_task_specific() -> None:
    rejects("bad_field", task, param_names=("a", "b"))
    rejects("bad_field", task, param_names=("w", "w"), weights=(np.zeros(1), np.zeros(1)))
    rejects("bad_field", task, param_names=("",))
    rejects("bad_field", task, param_names="w")
    rejects("bad_field", task, param_names=("x" * 257,))
    assert task(param_names=("/fc1/Gemm:0",)).param_names == ("/fc1/Gemm:0",)
    rejects("bad_field", task, train_graph="onnx")
    assert task(train_graph=bytearray(b"ab")).train_graph == b"ab"
    assert task(config={"opt": "sgd", "nesterov": False}).config["nesterov"] is False


def test_aggregate_specific() -> None:
    rejects("bad_field", Aggregate, 1, 0, (), 0, 0)
    rejects("bad_field", Aggregate, 1, 0, (), 3, 2)  # fewer samples than clients
    assert Aggregate(1, 0, (), 3, 3).total_samples == 3


def test_error_status_bye_text() -> None:
    Error("d", 1, "timeout", "line one\n\tline two é 中")
    rejects("bad_field", Error, "d", 1, "oom", "forged\rline")
    rejects("bad_field", Error, "d", 1, "oom", "esc\x1b[31m")
    rejects("bad_field", Error, "d", 1, "oom", "c1\x85")
    rejects("bad_field", Error, "d", 1, "oom", "\ud800")
    rejects("bad_field", Error, "d", 1, "oom", "x" * 4097)
    rejects("bad_field", Error, "d", 1, "oom", None)
    for state in ("online", "running", "finished", "offline"):
        Status(state, "ep")
    rejects("bad_field", Status, "paused", "ep")
    rejects("bad_field", Status, None, "ep")
    rejects("bad_field", Bye, "d", reason=3)


def test_registry() -> None:
    assert message_class(int(MessageKind.UPDATE)) is Update
    assert message_class(MessageKind.BYE) is Bye
    for kind in (0, 200, -1, None):
        rejects("bad_kind", message_class, kind)
    from fedsdk.protocol import (
        DecryptShare,
        EncryptedAggregate,
        EncryptedUpdate,
        MaskedUpdate,
        MaskKeys,
        MaskRelay,
        MaskRoster,
        MaskShares,
        ModelRequest,
        Report,
        SealedModel,
        ShareBundle,
        Sketch,
        UnmaskRequest,
        UnmaskShares,
    )

    classes = (
        Hello,
        Task,
        Update,
        Aggregate,
        Error,
        Status,
        Bye,
        EncryptedUpdate,
        EncryptedAggregate,
        Sketch,
        Report,
        DecryptShare,
        ShareBundle,
        ModelRequest,
        SealedModel,
        MaskKeys,
        MaskRoster,
        MaskShares,
        MaskRelay,
        UnmaskRequest,
        UnmaskShares,
        MaskedUpdate,
    )
    kinds = {int(cls.KIND) for cls in classes}
    assert kinds == {int(k) for k in MessageKind}


def test_register_checks_wire_layout() -> None:
    @dataclasses.dataclass(frozen=True, eq=False, repr=False)
    class Broken(Bye):
        WIRE: ClassVar[Mapping[str, Wire]] = {"client_id": Wire.STR}  # forgets 'reason'

    with pytest.raises(TypeError):
        register(Broken)

    @dataclasses.dataclass(frozen=True, eq=False, repr=False)
    class Clash(Bye):
        pass

    with pytest.raises(TypeError):
        register(Clash)  # kind BYE is taken by Bye


def test_encode_refuses_unregistered() -> None:
    rejects("bad_kind", encode, "not a message")

    @dataclasses.dataclass(frozen=True, eq=False, repr=False)
    class Copy(Bye):
        pass

    rejects("bad_kind", encode, Copy("d"))


@pytest.mark.parametrize("name", ["max_message_bytes", "max_header_bytes", "max_arrays", "max_array_elems"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_limits_validated(name: str, bad: Any) -> None:
    with pytest.raises(ConfigError):
        Limits(**{name: bad})


def test_frozen_map() -> None:
    m = FrozenMap({"a": 1})
    assert m == {"a": 1} and hash(m) == hash(FrozenMap({"a": 1})) and len(m) == 1 and list(m) == ["a"]
    assert "FrozenMap" in repr(m)
