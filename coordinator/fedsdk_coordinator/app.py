"""The coordinator as an aiohttp application: ``create_app(config) -> web.Application``.

Startup contexts, in order (each sets up, yields, then cancels and awaits what it started):
1. the SQLite store;
2. the embedded amqtt broker, when no external broker URL is configured;
3. the MQTT link: connects with a retained ``offline`` status as its last will and subscribes to the
   federation's up-topics; a named receive task feeds the round engine; after every reconnect the engine
   re-publishes what may have been lost (:meth:`RoundEngine.link_restored`);
4. the round loop, which resumes the round in progress from the store after a crash (``docs/operations.md``,
   "Crash and restart").

REST (described by ``openapi.json``, served at ``/api/openapi.json``): ``/api/health``, ``/api/clients``,
``/api/rounds``, ``/api/evaluation`` (per cluster, the federated evaluation round by round), ``/api/clusters``
(members and the clustering decision, :mod:`.rest`), ``/api/clusters/<k>/model.onnx`` (a plaintext
federation's cluster model as an ONNX inference graph; 409 under HE, where only devices hold it); Prometheus
text at ``/metrics``; the live dashboard at ``/`` (:mod:`.rest`, files in ``dashboard/``). No globals:
everything lives on the application under typed ``web.AppKey``s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from fedsdk.crypto import HEBackend
from fedsdk.crypto.parallel import process_pool
from fedsdk.errors import ConfigError, StateError, TrainingError, TransportClosed
from fedsdk.hekeys import load_he
from fedsdk.model import OnnxModel
from fedsdk.model.data import fit_to_model, load_data, load_digits
from fedsdk.model.export import write_onnx
from fedsdk.protocol import topics as T
from fedsdk.transport import MqttTransport, TlsConfig, Will
from fedsdk_coordinator.broker import EmbeddedBroker, EmbeddedBrokerConfig
from fedsdk_coordinator.evaluation import by_cluster
from fedsdk_coordinator.metrics import FederationCollector
from fedsdk_coordinator.models.source import ModelSource, load_model
from fedsdk_coordinator.rest import add_routes, clusters_view
from fedsdk_coordinator.rounds import RoundConfig, RoundEngine
from fedsdk_coordinator.store import Store

__all__ = ["ENGINE", "STORE", "CoordinatorConfig", "create_app", "model_for"]

log = logging.getLogger(__name__)

STORE = web.AppKey("store", Store)
ENGINE = web.AppKey("engine", RoundEngine)
BROKER_URL = web.AppKey("broker_url", str)
TRANSPORT = web.AppKey("transport", MqttTransport)
REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything the coordinator needs. ``broker_url=None`` starts the embedded broker."""

    rounds: RoundConfig = field(default_factory=RoundConfig)
    state_dir: Path = Path("fedsdk-state")
    model: str = "mlp"  # a preset name, or an .onnx / .json / .toml file (models/source.py)
    task: str = "classification"  # of an ONNX model: classification | regression | multilabel
    # The coordinator's own evaluation of plaintext models: an .npz/.csv file of samples for this model, or
    # "digits" (the bundled held-out digits, for the presets); None: only the devices' federated evaluation.
    eval_data: str | None = None
    label_columns: tuple[str, ...] = ("label",)  # of a CSV eval_data file
    save_model_dir: Path | None = None  # plaintext: each cluster's final model written here as ONNX
    summary_path: Path | None = None  # the run's summary (state, evaluation per cluster, refused) as JSON
    broker_url: str | None = None
    embedded: EmbeddedBrokerConfig | None = None
    tls: TlsConfig | None = None
    insecure: bool = False
    client_id: str = "coordinator"
    mqtt_timeout: float = 10.0
    he_dir: Path | None = None  # the federation's HE *public* key (he.json, he_public.bin)
    workers: int = 1  # processes for ciphertext sums
    # a NATS broker cluster's URLs: the round's sums come from its aggregation workers (scale.combine)
    aggregation_nats: tuple[str, ...] = ()


CONFIG = web.AppKey("config", CoordinatorConfig)


def model_for(name: str, task: str = "classification", seed: int = 0) -> ModelSource:
    """The model ``--model`` names: a preset, an ONNX file or a spec file (:mod:`.models.source`)."""
    return load_model(name, task=task, seed=seed)


def coordinator_eval_data(
    cfg: CoordinatorConfig, source: ModelSource
) -> tuple[np.ndarray, np.ndarray] | None:
    """The samples ``cfg.eval_data`` names, checked against and shaped for the model (ConfigError if they
    do not fit it)."""
    if cfg.eval_data is None:
        return None
    if cfg.eval_data == "digits":
        digits = load_digits(shape="flat")
        x, y = digits.x_test, digits.y_test
    else:
        x, y = load_data(cfg.eval_data, label_columns=cfg.label_columns)
    model = OnnxModel.from_bundle(source.bundle)
    try:
        return fit_to_model(
            x, y, input_shape=model.input_shape, output_shape=model.output_shape, task=model.task,
            what=f"--eval-data {cfg.eval_data}",
        )  # fmt: skip
    except TrainingError as exc:
        raise ConfigError(str(exc)) from exc


def load_public_he(he_dir: Path | None) -> HEBackend | None:
    """The coordinator's HE material: public only. A secret key file beside it is refused outright."""
    if he_dir is None:
        return None
    if (Path(he_dir) / "he_secret.bin").exists():
        raise ConfigError(f"{he_dir} holds an HE secret key: the coordinator must never have one")
    return load_he(he_dir, secret=False)


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg: CoordinatorConfig = app[CONFIG]
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(cfg.state_dir / "coordinator.sqlite")
    app[STORE] = store
    yield
    store.close()


async def _broker_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg: CoordinatorConfig = app[CONFIG]
    if cfg.broker_url is not None:
        app[BROKER_URL] = cfg.broker_url
        yield
        return
    if cfg.embedded is None:
        raise ConfigError("no broker URL and no embedded broker configuration")
    broker = EmbeddedBroker(cfg.embedded, federation=cfg.rounds.federation, key_mode=cfg.rounds.key_mode)
    async with broker:
        app[BROKER_URL] = _dial_url(cfg.embedded)
        yield


def _dial_url(embedded: EmbeddedBrokerConfig) -> str:
    """The URL the coordinator reaches its embedded broker at: over loopback when the broker listens on
    every interface (0.0.0.0, ::), whose address no certificate names."""
    host = embedded.host.removeprefix("[").removesuffix("]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"{'mqtts' if embedded.tls else 'mqtt'}://{f'[{host}]' if ':' in host else host}:{embedded.port}"


async def _attach_workers(cfg: CoordinatorConfig, engine: RoundEngine, he: Any) -> Any:
    """With ``aggregation_nats``: a NATS connection with the coordinator's certificate and the collector of
    the workers' partial sums, given to the strategy (which then sums nothing itself); else None."""
    if not cfg.aggregation_nats:
        return None
    from fedsdk_coordinator.scale.combine import PartialCollector
    from fedsdk_coordinator.scale.worker import connect_tls

    cert = cfg.tls.cert_file if cfg.tls else None
    key = cfg.tls.key_file if cfg.tls else None
    if cfg.tls is None or cert is None or key is None:
        raise ConfigError("aggregation workers need the coordinator's certificate (--kit, or --cert/--key)")
    nc = await connect_tls(cfg.tls.ca_file, cert, key, "coordinator", cfg.aggregation_nats)
    collector = PartialCollector(nc, cfg.rounds.federation, he, engine.n_values)
    await collector.start()
    engine.strategy.collector = collector
    return nc


async def _mqtt_and_rounds_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg: CoordinatorConfig = app[CONFIG]
    source = model_for(cfg.model, cfg.task, cfg.rounds.seed)
    eval_data = coordinator_eval_data(cfg, source)
    transport_box: list[MqttTransport] = []

    async def publish(topic: str, payload: bytes, *, retain: bool = False) -> None:
        await transport_box[0].publish(topic, payload, retain=retain)

    he = load_public_he(cfg.he_dir)
    # Ciphertext sums run in worker processes (forkserver: safe beside paho's thread), never on the loop;
    # they end with the coordinator even when it is killed outright.
    executor = process_pool(cfg.workers) if he is not None else None
    engine = RoundEngine(
        cfg.rounds,
        store=app[STORE],
        bundle=source.bundle,
        initial_weights=source.weights,
        eval_data=eval_data,
        publish=publish,
        he=he,
        executor=executor,
    )
    will = Will(T.status(cfg.rounds.federation), engine.status_message("offline"), qos=1, retain=True)
    transport = MqttTransport.from_url(
        app[BROKER_URL],
        client_id=cfg.client_id,
        tls=cfg.tls,
        insecure=cfg.insecure,
        will=will,
        timeout=cfg.mqtt_timeout,
    )
    # After a broker restart or a network cut: re-publish the status and the latest aggregates, re-send
    # the open rounds' tasks (anything in flight may be lost; see RoundEngine.link_restored).
    transport.on_reconnect = lambda _n: engine.link_restored()
    engine.link_up = lambda: transport.connected
    transport_box.append(transport)
    app[ENGINE] = engine
    app[TRANSPORT] = transport
    nc = await _attach_workers(cfg, engine, he)
    app[REGISTRY] = CollectorRegistry(auto_describe=False)
    app[REGISTRY].register(FederationCollector(engine.health, app[STORE], transport))
    async with transport:
        await transport.subscribe(T.up_filter(cfg.rounds.federation), qos=1)  # paced, never dropped

        async def receive() -> None:
            try:
                async for msg in transport.messages():
                    engine.handle(msg.topic, msg.payload)
            except TransportClosed:
                pass

        # The loops are owned by this context: cancelled and awaited on cleanup.
        tasks = [
            asyncio.create_task(receive(), name="coordinator-receive"),
            asyncio.create_task(engine.run(), name="coordinator-rounds"),
        ]
        if cfg.save_model_dir is not None or cfg.summary_path is not None:
            tasks.append(asyncio.create_task(_at_finish(engine, app[STORE], cfg), name="at-finish"))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await transport.publish(
                    T.status(cfg.rounds.federation),
                    engine.status_message("offline"),
                    retain=True,
                    timeout=2.0,
                )
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()


async def _at_finish(engine: RoundEngine, store: Store, cfg: CoordinatorConfig) -> None:
    """When the federation has ended: the summary JSON, and (finished, plaintext) each cluster's model in
    ``cluster-<k>.onnx``."""
    await engine.finished.wait()
    if cfg.summary_path is not None:
        health = engine.health()
        summary = {
            "federation": cfg.rounds.federation,
            "state": engine.state,
            "rounds": engine.completed_round,
            "detail": engine.detail,
            "clusters": health["clusters"],
            "evaluation": by_cluster(store.rounds()),
            "refused": health["refused"],
        }
        cfg.summary_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.summary_path.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    if cfg.save_model_dir is None or engine.state != "finished":
        return
    if engine.he is not None:
        log.warning("--save-model: under HE the coordinator holds no model; devices export it")
        return
    for k in sorted(engine.models) or [0]:
        path = write_onnx(cfg.save_model_dir / f"cluster-{k}.onnx", engine.export_model(k))
        log.warning("cluster %d's model written to %s", k, path)


async def _cluster_model(request: web.Request) -> web.Response:
    try:
        cluster = int(request.match_info["cluster"])
        blob = request.app[ENGINE].export_model(cluster)
    except ValueError:
        raise web.HTTPNotFound(text="cluster ids are integers") from None
    except StateError as exc:
        raise web.HTTPConflict(text=str(exc)) from None
    except ConfigError as exc:
        raise web.HTTPNotFound(text=str(exc)) from None
    return web.Response(
        body=blob,
        content_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="cluster-{cluster}.onnx"'},
    )


async def _evaluation(request: web.Request) -> web.Response:
    """Per cluster, round by round: the federated evaluation (:mod:`.evaluation`) and the coordinator's."""
    return web.json_response(by_cluster(request.app[STORE].rounds()))


async def _health(request: web.Request) -> web.Response:
    return web.json_response(_health_body(request.app))


def _health_body(app: web.Application) -> dict[str, Any]:
    engine = app[ENGINE]
    body = engine.health()
    # ``round`` counts rounds completed by every cluster; the round in progress (a cluster may be done
    # with it while another still trains) and the phase say where the federation is now.
    body["rounds_planned"] = engine.config.rounds
    body["current_round"] = max([r.round_id for r in engine.open_rounds.values()], default=0)
    body["current_round"] = max(body["current_round"], engine.completed_round)
    body["phase"] = _phase(engine)
    body["transport"] = app[TRANSPORT].stats
    body["rejected_frames"] = app[TRANSPORT].frame_rejections
    return body


def _phase(engine: RoundEngine) -> str:
    """``sketch`` (the sketch round is open), ``training`` (a round is open), or the engine's state."""
    if engine.state != "running":
        return engine.state
    if engine.sketch_round is not None or (engine.clustered and engine.clustering is None):
        return "sketch"
    return "training"


async def _clients(request: web.Request) -> web.Response:
    return web.json_response(_clients_body(request.app[STORE]))


def _clients_body(store: Store) -> list[dict[str, Any]]:
    return [asdict(c) for c in store.clients()]


async def _rounds(request: web.Request) -> web.Response:
    """Every round record with its devices' results; ``?since=N``: only rounds N and later (the dashboard
    asks for what it does not hold yet)."""
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        raise web.HTTPBadRequest(text="since is a round number") from None
    return web.json_response(_rounds_body(request.app[STORE], since))


def _rounds_body(store: Store, since: int = 0) -> list[dict[str, Any]]:
    out = []
    for r in store.rounds():
        if r.round_id < since:
            continue
        d = asdict(r)
        d["results"] = store.results(r.round_id, r.cluster_id)
        out.append(d)
    return out


def _page_state(app: web.Application) -> dict[str, Any]:
    """What the dashboard page is served with: the federation's name and the answers of ``/api/health``,
    ``/api/clients``, ``/api/clusters`` and ``/api/rounds`` at this moment."""
    return {
        "federation": app[CONFIG].rounds.federation,
        "health": _health_body(app),
        "clients": _clients_body(app[STORE]),
        "clusters": clusters_view(app[ENGINE], app[STORE]),
        "rounds": _rounds_body(app[STORE]),
    }


async def _metrics(request: web.Request) -> web.Response:
    """Prometheus' text format (:mod:`fedsdk_coordinator.metrics`)."""
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: CoordinatorConfig) -> web.Application:
    """Build the coordinator application (tests build it from the same factory)."""
    if config.broker_url is None and config.embedded is None:
        raise ConfigError("give a broker URL or an embedded broker configuration")
    app = web.Application()
    app[CONFIG] = config
    app.cleanup_ctx.append(_store_ctx)
    app.cleanup_ctx.append(_broker_ctx)
    app.cleanup_ctx.append(_mqtt_and_rounds_ctx)
    app.router.add_get("/api/health", _health)
    app.router.add_get("/api/clients", _clients)
    app.router.add_get("/api/rounds", _rounds)
    app.router.add_get("/api/evaluation", _evaluation)
    app.router.add_get("/api/clusters/{cluster}/model.onnx", _cluster_model)
    app.router.add_get("/metrics", _metrics)
    # /api/clusters, the dashboard
    add_routes(app, engine=lambda a: a[ENGINE], store=lambda a: a[STORE], state=_page_state)
    return app
