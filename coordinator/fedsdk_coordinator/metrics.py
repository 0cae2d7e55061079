"""The coordinator's Prometheus metrics at ``/metrics``, through ``prometheus_client``.

One collector reads the federation at scrape time (the engine's health, the transport's counters, the
store's finished rounds), so nothing is counted twice and a restarted coordinator reports what its store
holds. Each application has its own registry, so several coordinators in one process (the tests) do not
collide. No series carries a model value: only counts, durations, ratios and the devices' federated
evaluation.

:data:`SERIES` is the list the operations guide documents (``docs/operations.md``, "Metrics") and the test
checks against a real scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from fedsdk_coordinator.evaluation import METRICS
from fedsdk_coordinator.store import Store

__all__ = ["HE_BUCKETS", "ROUND_BUCKETS", "SERIES", "FederationCollector"]

# name (as exposed), type, help
SERIES: tuple[tuple[str, str, str], ...] = (
    ("fedsdk_round", "gauge", "rounds the federation has completed"),
    ("fedsdk_rounds_total", "counter", "cluster rounds finished, by state (done, failed)"),
    ("fedsdk_clients_online", "gauge", "devices online"),
    ("fedsdk_updates_accepted_total", "counter", "updates aggregated, over finished rounds and clusters"),
    ("fedsdk_late_updates_total", "counter", "replies and reports for a round no longer open"),
    ("fedsdk_models_relayed_total", "counter", "sealed models relayed to devices that lacked them (HE)"),
    (
        "fedsdk_model_rounds_lost_total",
        "counter",
        "rounds of progress given up because no online device held the cluster's model (HE)",
    ),
    ("fedsdk_rejected_messages_total", "counter", "messages refused by the protocol checks, by code"),
    ("fedsdk_rejected_frames_total", "counter", "frames the transport refused before reassembly, by code"),
    ("fedsdk_dropped_messages_total", "counter", "messages the transport dropped, by reason"),
    ("fedsdk_device_failures_total", "counter", "rounds a device answered with an error, by code"),
    (
        "fedsdk_device_declines_total",
        "counter",
        "tasks a device declined (a run condition did not hold), by code",
    ),
    ("fedsdk_transport_bytes_total", "counter", "bytes the coordinator's MQTT link moved, by direction"),
    ("fedsdk_round_seconds", "histogram", "duration of finished cluster rounds, tasks out to reports in"),
    ("fedsdk_encrypted_ratio", "gauge", "mean share of each update sent encrypted, last round per cluster"),
    ("fedsdk_aggregate_seconds", "gauge", "time to sum the ciphertexts, last round per cluster (HE only)"),
    (
        "fedsdk_aggregate_duration_seconds",
        "histogram",
        "time to sum the ciphertexts, every finished HE cluster round",
    ),
    (
        "fedsdk_device_he_seconds",
        "histogram",
        "devices' HE time per update, by step (encrypt, decrypt), finished HE rounds",
    ),
    ("fedsdk_federated_metric", "gauge", "the devices' evaluation of their cluster's model, last round"),
    (
        "fedsdk_test_accuracy",
        "gauge",
        "the coordinator's own evaluation (plaintext strategies with eval data)",
    ),
)

ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a device's HE time per step, from the metrics of its update and its report: the keys summed for each step
HE_STEPS = {"encrypt": ("encode_s", "encrypt_s"), "decrypt": ("decrypt_s",)}


def _help(name: str) -> str:
    return next(h for n, _, h in SERIES if n == name)


def _buckets(values: list[float], bounds: tuple[float, ...]) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` buckets of ``values``, ending with ``+Inf``."""
    buckets: list[tuple[str, float]] = [(str(b), sum(v <= b for v in values)) for b in bounds]
    return [*buckets, ("+Inf", len(values))]


def _counter(name: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    """A counter family exposed as ``name`` (prometheus_client adds the ``_total``)."""
    return CounterMetricFamily(name.removesuffix("_total"), _help(name), labels=list(labels))


class FederationCollector(Collector):
    """Reads one coordinator's state at every scrape."""

    def __init__(self, health: Callable[[], dict[str, Any]], store: Store, transport: Any) -> None:
        self._health, self._store, self._transport = health, store, transport
        # each finished HE round's devices' HE times, read from the store once: a round is done for good
        self._he_times: dict[tuple[int, int], dict[str, list[float]]] = {}

    def collect(self) -> Iterator[Metric]:
        h = self._health()
        yield GaugeMetricFamily("fedsdk_round", _help("fedsdk_round"), value=h["round"])
        yield GaugeMetricFamily("fedsdk_clients_online", _help("fedsdk_clients_online"), value=h["online"])
        late = _counter("fedsdk_late_updates_total")
        late.add_metric([], h["late"])
        yield late
        for name, key in (
            ("fedsdk_models_relayed_total", "models_relayed"),
            ("fedsdk_model_rounds_lost_total", "model_rounds_lost"),
        ):
            family = _counter(name)
            family.add_metric([], h[key])
            yield family
        for name, counts in (
            ("fedsdk_rejected_messages_total", h["rejected"]),
            ("fedsdk_device_failures_total", h["device_failures"]),
            ("fedsdk_device_declines_total", h["device_declines"]),
        ):
            family = _counter(name, ("code",))
            for code, n in sorted(counts.items()):
                family.add_metric([code], n)
            yield family
        yield from self._transport_series()
        yield from self._round_series()

    def _transport_series(self) -> Iterator[Metric]:
        transport = self._transport
        frames = _counter("fedsdk_rejected_frames_total", ("code",))
        dropped = _counter("fedsdk_dropped_messages_total", ("reason",))
        moved = _counter("fedsdk_transport_bytes_total", ("direction",))
        for code, n in sorted(transport.frame_rejections.items()):
            frames.add_metric([code], n)
        stats = transport.stats
        dropped.add_metric(["incomplete"], stats["dropped_incomplete"])
        dropped.add_metric(["overflow"], stats["dropped_overflow"])
        moved.add_metric(["in"], stats["bytes_in"])
        moved.add_metric(["out"], stats["bytes_out"])
        yield from (frames, dropped, moved)

    def _round_series(self) -> Iterator[Metric]:
        rounds = self._store.rounds()
        done = [r for r in rounds if r.state == "done"]
        by_state = _counter("fedsdk_rounds_total", ("state",))
        for state in ("done", "failed"):
            by_state.add_metric([state], sum(r.state == state for r in rounds))
        yield by_state
        accepted = _counter("fedsdk_updates_accepted_total")
        accepted.add_metric([], sum(r.num_clients for r in done))
        yield accepted
        seconds = [float(r.metrics["round_s"]) for r in done if "round_s" in r.metrics]
        yield HistogramMetricFamily(
            "fedsdk_round_seconds",
            _help("fedsdk_round_seconds"),
            buckets=_buckets(seconds, ROUND_BUCKETS),
            sum_value=sum(seconds),
        )
        he_done = [r for r in done if float(r.metrics.get("encrypted_ratio", 0.0)) > 0]
        summed = [float(r.metrics["aggregate_s"]) for r in he_done if "aggregate_s" in r.metrics]
        yield HistogramMetricFamily(
            "fedsdk_aggregate_duration_seconds",
            _help("fedsdk_aggregate_duration_seconds"),
            buckets=_buckets(summed, HE_BUCKETS),
            sum_value=sum(summed),
        )
        yield self._device_he(he_done)
        latest = {r.cluster_id: r for r in done}  # store.rounds() is in round order
        for name, key in (
            ("fedsdk_encrypted_ratio", "encrypted_ratio"),
            ("fedsdk_aggregate_seconds", "aggregate_s"),
        ):
            family = GaugeMetricFamily(name, _help(name), labels=["cluster"])
            for k, r in sorted(latest.items()):
                if key in r.metrics:
                    family.add_metric([str(k)], float(r.metrics[key]))
            yield family
        federated = GaugeMetricFamily(
            "fedsdk_federated_metric", _help("fedsdk_federated_metric"), labels=["cluster", "metric"]
        )
        for k, r in sorted(latest.items()):
            for metric in METRICS:
                if f"device_{metric}" in r.metrics:
                    federated.add_metric([str(k), metric], float(r.metrics[f"device_{metric}"]))
        yield federated
        own = GaugeMetricFamily("fedsdk_test_accuracy", _help("fedsdk_test_accuracy"))
        if done and "test_accuracy" in done[-1].metrics:
            own.add_metric([], float(done[-1].metrics["test_accuracy"]))
        yield own

    def _device_he(self, he_done: list[Any]) -> Metric:
        """``fedsdk_device_he_seconds``: every device's encrypt and decrypt time in the finished HE rounds."""
        for r in he_done:
            key = (r.round_id, r.cluster_id)
            if key not in self._he_times:
                times: dict[str, list[float]] = {step: [] for step in HE_STEPS}
                for result in self._store.results(r.round_id, r.cluster_id):
                    m = result["metrics"]
                    for step, keys in HE_STEPS.items():
                        if any(k in m for k in keys):
                            times[step].append(sum(float(m.get(k, 0.0)) for k in keys))
                self._he_times[key] = times
        family = HistogramMetricFamily(
            "fedsdk_device_he_seconds", _help("fedsdk_device_he_seconds"), labels=["step"]
        )
        for step in HE_STEPS:
            values = [v for times in self._he_times.values() for v in times[step]]
            family.add_metric([step], _buckets(values, HE_BUCKETS), sum_value=sum(values))
        return family
