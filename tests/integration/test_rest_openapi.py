"""The coordinator's REST API against its OpenAPI description (``fedsdk_coordinator/openapi.json``).

The description is a valid OpenAPI 3.1 document and names exactly the application's routes. Then a real
federation (mosquitto, the coordinator application, FedClients on the digits data, two rounds) runs while
every endpoint is fetched over and over, and once more at the end, with a malformed message published on a
device's upstream topic: every response (status, content type, JSON body) must be one the description
allows. Three runs: the ``plaintext`` strategy (no clustering), and the clustered, encrypted ``fedsdk`` one
on three IID devices (one cluster: the split is refused as too weak) and on four devices whose digits are
split by label into two groups (two clusters). The schemas forbid keys
they do not name, so a field added, dropped or retyped in a handler fails here until the description says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from openapi_spec_validator import validate as validate_spec

from brokers import require_mosquitto, start_mosquitto
from engines import digit_devices, http_coordinator
from fedsdk.crypto import generate_backend
from fedsdk.hekeys import save_he
from fedsdk.model.data import load_digits, partition_iid, partition_label_skew
from fedsdk.protocol import topics as T
from fedsdk_coordinator import CoordinatorConfig, RoundConfig, create_app
from fedsdk_coordinator.app import ENGINE
from fedsdk_coordinator.rest import openapi_document
from webui import raw_publish

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(120)]

SPEC = openapi_document()
# Every GET, with the concrete paths it is fetched at (a parametrised path at a cluster that exists and one
# that does not; ``/api/rounds`` also with ``since`` and with a bad ``since``).
FETCHED = {
    "/": ["/"],
    "/dashboard.js": ["/dashboard.js"],
    "/dashboard.css": ["/dashboard.css"],
    "/api/health": ["/api/health"],
    "/api/clients": ["/api/clients"],
    "/api/rounds": ["/api/rounds", "/api/rounds?since=2", "/api/rounds?since=two"],
    "/api/evaluation": ["/api/evaluation"],
    "/api/clusters": ["/api/clusters"],
    "/api/clusters/{cluster}/model.onnx": ["/api/clusters/0/model.onnx", "/api/clusters/7/model.onnx"],
    "/api/openapi.json": ["/api/openapi.json"],
    "/metrics": ["/metrics"],
}


@pytest.fixture(scope="module", autouse=True)
def _need_mosquitto() -> None:
    require_mosquitto()


def response_validator(template: str, status: int, content_type: str) -> Draft202012Validator | None:
    """The JSON Schema the description gives a response (None for a non-JSON body); fails the test when the
    description allows no such status or content type."""
    responses = SPEC["paths"][template]["get"]["responses"]
    assert str(status) in responses, f"GET {template}: status {status} is not described"
    content = responses[str(status)]["content"]
    assert content_type in content, f"GET {template} {status}: {content_type} is not described"
    if content_type != "application/json":
        return None
    return Draft202012Validator({**content[content_type]["schema"], "components": SPEC["components"]})


async def check(http: TestClient[Any, Any], template: str, path: str) -> tuple[int, Any]:
    """Fetch ``path`` and validate the response against ``template``'s description; (status, JSON body)."""
    resp = await http.get(path)
    content_type = resp.headers["Content-Type"].split(";")[0].strip()
    body = await resp.read()
    validator = response_validator(template, resp.status, content_type)
    if validator is None:
        return resp.status, None
    data = await resp.json()
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    assert not errors, f"GET {path}: {errors[0].message} at {list(errors[0].absolute_path)}; {body[:300]!r}"
    return resp.status, data


def test_the_description_is_valid_openapi_and_names_every_route(tmp_path: Path) -> None:
    validate_spec(SPEC)
    assert SPEC["openapi"].startswith("3.")
    app = create_app(
        CoordinatorConfig(rounds=RoundConfig(), state_dir=tmp_path, broker_url="mqtt://127.0.0.1:1")
    )
    routes = {r.canonical for r in app.router.resources() if any(x.method == "GET" for x in r)}
    assert routes == set(SPEC["paths"]) == set(FETCHED)


def test_a_drifted_response_fails_validation() -> None:
    health = {
        "state": "running", "phase": "training", "epoch": "e", "strategy": "fedsdk", "round": 1,
        "current_round": 2, "rounds_planned": 3, "online": 2, "clusters": {"d0": 0}, "silhouette": None,
        "rejected": {}, "rejected_frames": {"bad_magic": 1}, "device_failures": {}, "refused": {},
        "detail": "", "late": 0, "resent": 0, "models_relayed": 0,
        "model_rounds_lost": 0,
        "transport": {k: 0 for k in SPEC["components"]["schemas"]["TransportStats"]["required"]},
    }  # fmt: skip
    validator = response_validator("/api/health", 200, "application/json")
    assert validator is not None
    validator.validate(health)
    drifts = [
        {**health, "new_field": 1},  # a field the description does not name
        {k: v for k, v in health.items() if k != "online"},  # a field dropped
        {**health, "round": "1"},  # a type changed
        {**health, "rejected": {"bad_topic": "many"}},
        {**health, "transport": {**health["transport"], "new_counter": 1}},
    ]
    for drifted in drifts:
        with pytest.raises(ValidationError):
            validator.validate(drifted)


@pytest.mark.parametrize(
    ("strategy", "devices", "groups"), [("plaintext", 3, 0), ("fedsdk", 3, 0), ("fedsdk", 4, 2)]
)
async def test_every_response_of_a_real_federation_matches_the_description(
    tmp_path: Path, strategy: str, devices: int, groups: int
) -> None:
    public = device_keys = None
    if strategy != "plaintext":
        # small keys: the responses' shapes do not depend on them
        with generate_backend("packed", key_bits=1024) as full:
            public = save_he(tmp_path / "he-public", full, include_secret=False)
            device_keys = save_he(tmp_path / "he-device", full, include_secret=True)
    digits = load_digits(shape="flat")
    part = (
        partition_label_skew(digits.y_train, devices, n_groups=groups, seed=0)
        if groups
        else partition_iid(digits.y_train, devices, seed=0)
    )
    fed = f"oa{secrets.token_hex(3)}"
    rounds = RoundConfig(
        federation=fed,
        rounds=2,
        min_clients=2,
        start_clients=devices,
        strategy=strategy,
        farewell_s=3.0,
        min_aggregate=2,  # two label groups of two devices: two clusters
    )
    fetched: dict[str, int] = {}
    statuses: dict[str, set[int]] = {}

    async def fetch_all(http: TestClient[Any, Any]) -> dict[str, Any]:
        out = {}
        for template, paths in FETCHED.items():
            for path in paths:
                status, data = await check(http, template, path)
                fetched[path] = fetched.get(path, 0) + 1
                statuses.setdefault(path, set()).add(status)
                out[path] = data
        return out

    with start_mosquitto(tmp_path / "mosq") as broker:
        async with http_coordinator(tmp_path, broker, rounds, he_dir=public) as http:
            engine = http.app[ENGINE]
            before = await fetch_all(http)  # waiting for devices: empty lists, no clustering yet
            assert before["/api/clients"] == [] and before["/api/rounds"] == []
            assert before["/api/clusters"]["decision"]["status"] == (
                "not_clustered" if strategy == "plaintext" else "pending"
            )
            frame = b"not a fedsdk frame: forty-two bytes and more of plain text"
            await raw_publish(broker.host, broker.port, T.up(fed, "d9", T.HELLO), frame)

            async def poll() -> None:
                while True:
                    await fetch_all(http)
                    await asyncio.sleep(0.05)

            poller = asyncio.create_task(poll())
            clients = digit_devices(
                broker, engine, digits, part, he_dir=device_keys, eval_data=(digits.x_test, digits.y_test)
            )
            try:
                async with contextlib.AsyncExitStack() as stack:
                    for c in clients:
                        await stack.enter_async_context(c)
                    summaries = await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), 60)
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            assert all(s.state == "finished" for s in summaries), summaries
            for _ in range(100):  # a device's goodbye reaches the coordinator after its run returned
                if engine.health()["online"] == 0:
                    break
                await asyncio.sleep(0.05)
            after = await fetch_all(http)
    assert all(fetched[p] >= 2 for paths in FETCHED.values() for p in paths), fetched
    assert statuses["/api/rounds?since=two"] == {400}
    assert statuses["/api/clusters/0/model.onnx"] == ({200} if strategy == "plaintext" else {409})
    health, clusters = after["/api/health"], after["/api/clusters"]
    assert health["round"] == health["current_round"] == health["rounds_planned"] == 2
    assert health["phase"] == "finished" and health["online"] == 0
    assert health["rejected_frames"] == {"bad_magic": 1}
    assert {r["round_id"] for r in after["/api/rounds?since=2"]} == {2}  # one record per cluster
    assert all(not c["online"] for c in after["/api/clients"])  # every device said goodbye
    members = sorted(m for c in clusters["clusters"] for m in c["members"])
    assert members == [f"d{i}" for i in range(devices)]
    decision = clusters["decision"]
    if strategy == "plaintext":
        assert not clusters["clustered"] and decision["status"] == "not_clustered"
    else:
        assert clusters["clustered"] and decision["status"] == "decided" and decision["devices"] == devices
        assert decision["decided_at"] is not None and decision["reason"]
        by_member = {m: c["cluster_id"] for c in clusters["clusters"] for m in c["members"]}
        assert by_member == health["clusters"]
        assert all(c["exemplar"] in c["members"] for c in clusters["clusters"])
    if groups:  # two groups of labels: two clusters, the split kept
        assert decision["fallback"] is None and decision["n_clusters"] == len(clusters["clusters"]) == groups
        assert decision["silhouette"] >= decision["min_silhouette"] and decision["best_split"] is None
    elif (
        strategy != "plaintext"
    ):  # IID devices: one cluster (a split too weak, or one leaving a device alone)
        assert decision["fallback"] in ("weak_structure", "no_split") and decision["n_clusters"] == 1
        if decision["fallback"] == "weak_structure":
            assert decision["best_split"]["silhouette"] < decision["min_silhouette"]
        assert decision["steps"][0]["path"] == "" and not decision["steps"][0]["accepted"]
    # each cluster's latest federated accuracy (on every held-out digit: a label-skewed cluster knows half)
    latest = [c["latest"] for c in clusters["clusters"]]
    assert all(x["round"] == 2 and x["metric"] == "accuracy" for x in latest), latest
    assert all(0.3 < x["value"] <= 1 for x in latest), latest
