"""The REST endpoints beside the round data, and the dashboard's files.

* ``/api/clusters``: the clusters, their members, and the clustering decision (why this many clusters, the
  silhouette, every split question asked with the candidates affinity propagation offered and their
  silhouettes, and for a split refused as too weak the best split's silhouette);
* ``/api/openapi.json``: the OpenAPI 3 description of the whole REST API (``openapi.json`` in this package);
* ``/``, ``/dashboard.js``, ``/dashboard.css``: the live dashboard (``dashboard/`` in this package: static
  files, no build step, no network but this coordinator's REST API). The page is served with the API's
  answers of that moment written into it as a JSON data block (:func:`page_with_state`), so that its first
  paint shows the federation rather than waiting for its first poll.

The handlers read the engine and the store; they change nothing. :func:`add_routes` registers them on the
coordinator's application (:func:`fedsdk_coordinator.app.create_app`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from aiohttp import web

from fedsdk_coordinator.clustering import MIN_SILHOUETTE, Clustering
from fedsdk_coordinator.evaluation import METRICS
from fedsdk_coordinator.rounds import RoundEngine
from fedsdk_coordinator.store import Store

__all__ = ["add_routes", "clusters_view", "openapi_document", "page_with_state"]

log = logging.getLogger(__name__)

# Why a clustered federation has one cluster (``Clustering.fallback``), in words.
FALLBACKS = {
    "too_few": "one or two devices: too few to judge whether their distance is large",
    "no_structure": "every pair of sketches is equally far apart",
    "weak_structure": "the best split's silhouette is below the threshold: no substantial structure",
    "not_converged": "affinity propagation did not converge",
    "no_split": "affinity propagation offered no split that keeps two devices in every cluster",
}
ASSETS = {  # served path -> (file in dashboard/, content type)
    "/": ("index.html", "text/html"),
    "/dashboard.js": ("dashboard.js", "text/javascript"),
    "/dashboard.css": ("dashboard.css", "text/css"),
}
# The page's data block, empty in the file; filled when the page is served.
STATE_BLOCK = '<script type="application/json" id="initial-state"></script>'


def _package_text(*parts: str) -> str:
    return resources.files("fedsdk_coordinator").joinpath(*parts).read_text(encoding="utf-8")


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3 description of the coordinator's REST API, as shipped in the package."""
    doc: dict[str, Any] = json.loads(_package_text("openapi.json"))
    return doc


def _reason(engine: RoundEngine, c: Clustering | None) -> tuple[str, str]:
    """The decision's status and why, in words."""
    if not engine.clustered:
        return "not_clustered", f"the {engine.strategy.name} strategy does not cluster: one federation"
    if c is None:
        if engine.sketch_round is not None:
            return "pending", "the sketch round is collecting the devices' sensitivity sketches"
        return "pending", "no clustering yet: it follows the sketch round"
    if c.fallback is not None:
        return "decided", f"one cluster: {FALLBACKS.get(c.fallback, c.fallback)}"
    sil = "n/a" if c.silhouette is None else f"{c.silhouette:.3f}"
    asked = sum(1 for step in c.steps if step.path)
    inside = f", {asked} split questions asked inside clusters" if asked else ""
    clusters = f"{c.n_clusters} cluster{'' if c.n_clusters == 1 else 's'}"
    return "decided", f"affinity propagation: {clusters}, silhouette {sil}{inside}"


def clusters_view(engine: RoundEngine, store: Store) -> dict[str, Any]:
    """The body of ``/api/clusters`` (see openapi.json, ``Clusters``)."""
    c = engine.clustering
    status, reason = _reason(engine, c)
    clients = [r for r in store.clients() if r.client_id not in engine.refused and "refused" not in r.facts]
    if engine.clustered:
        assigned = dict(engine.clusters)
    else:
        assigned = {r.client_id: 0 for r in clients}
    rounds = store.rounds()
    first_round = [r.started for r in rounds if r.round_id == 1]
    members: dict[int, list[str]] = {k: [] for k in ({0} if c is None else set(c.exemplars))}
    for cid, k in sorted(assigned.items()):
        members.setdefault(k, []).append(cid)
    latest: dict[int, dict[str, Any]] = {}
    for r in rounds:
        if r.state == "done":
            latest[r.cluster_id] = {"round": r.round_id, **_metric(r.metrics)}
    clusters = [
        {
            "cluster_id": k,
            "members": ids,
            "exemplar": None if c is None else c.exemplars.get(k),
            "online": sum(1 for i in ids if i in engine.online),
            "latest": latest.get(k),
        }
        for k, ids in sorted(members.items())
        if ids or c is not None
    ]
    decision = {
        "status": status,
        "reason": reason,
        "fallback": None if c is None else c.fallback,
        "n_clusters": None if c is None else c.n_clusters,
        "silhouette": None if c is None else c.silhouette,
        "min_silhouette": MIN_SILHOUETTE,
        "converged": None if c is None else c.converged,
        "devices": 0 if c is None else len(c.labels),
        "best_split": best_split(c),
        "steps": [] if c is None else [step.as_dict() for step in c.steps],
        "split": engine.split,  # the proposed clusters' trial and its verdicts (engine/trial.py), if any
        # the first training round is planned as soon as the clustering is decided
        "decided_at": min(first_round) if c is not None and first_round else None,
    }
    return {"clustered": bool(engine.clustered), "decision": decision, "clusters": clusters}


def page_with_state(page: str, state: Mapping[str, Any]) -> str:
    """``page`` (index.html) with ``state`` as JSON in its data block (never run: not a script type). ``<``,
    ``>`` and ``&`` are written as JSON escapes, so no value (device ids and reasons are chosen by devices)
    can end the block or open markup."""
    if page.count(STATE_BLOCK) != 1:
        raise ValueError(f"the dashboard page must hold exactly one {STATE_BLOCK}")
    body = json.dumps(state, separators=(",", ":"))
    body = body.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return page.replace(STATE_BLOCK, STATE_BLOCK.replace("></", f">{body}</"))


def _metric(metrics: Any) -> dict[str, Any]:
    """The federated metric of a finished round: name and value (``device_<metric>``), or nothing."""
    for name in METRICS:
        if f"device_{name}" in metrics:
            return {"metric": name, "value": float(metrics[f"device_{name}"])}
    return {}


def best_split(c: Clustering | None) -> dict[str, Any] | None:
    """For a split refused as too weak: the split affinity propagation offered (clusters, silhouette), from
    the clustering's first step."""
    if c is None or c.fallback != "weak_structure" or not c.steps or c.steps[0].best_silhouette is None:
        return None
    return {"n_clusters": c.steps[0].best_clusters, "silhouette": c.steps[0].best_silhouette}


def add_routes(
    app: web.Application,
    engine: Callable[[web.Application], RoundEngine],
    store: Callable[[web.Application], Store],
    state: Callable[[web.Application], dict[str, Any]] | None = None,
) -> None:
    """Register ``/api/clusters``, ``/api/openapi.json`` and the dashboard's files; ``engine(app)`` and
    ``store(app)`` give the running engine and store, ``state(app)`` the API's answers the page is served
    with (``federation``, ``health``, ``clients``, ``clusters``, ``rounds``)."""

    async def clusters(request: web.Request) -> web.Response:
        return web.json_response(clusters_view(engine(request.app), store(request.app)))

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    def asset(name: str, content_type: str) -> Callable[[web.Request], Any]:
        text = _package_text("dashboard", name)

        async def serve(request: web.Request) -> web.Response:
            # The dashboard draws from the REST API on this origin only and never runs inline script.
            body = text
            if name == "index.html" and state is not None:
                try:
                    body = page_with_state(text, {**state(request.app), "at": time.time()})
                except Exception:  # the page still loads, and draws once its first poll is answered
                    log.exception("the dashboard is served without its initial state")
            return web.Response(
                text=body,
                content_type=content_type,
                headers={
                    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
                    "Cache-Control": "no-cache",
                    "X-Content-Type-Options": "nosniff",
                },
            )

        return serve

    for path, (name, content_type) in ASSETS.items():
        app.router.add_get(path, asset(name, content_type))
    app.router.add_get("/api/clusters", clusters)
    app.router.add_get("/api/openapi.json", openapi)
