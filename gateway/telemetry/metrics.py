"""GatewayMetrics: every exported metric, built against an injected CollectorRegistry.

Labels come from closed sets only: configured model and class names and the Outcome enum (an
unconfigured model is counted as model=""). Queue depth and in-flight counts are read from the
store at scrape time by a collector, so the request path never updates a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.telemetry.recent import REFUSALS, RecentRefusals
from gateway.upstream.backends import ModelPool
from policies.circuit import CircuitState
from policies.fairness import shares as fair_shares
from policies.outcomes import Outcome
from policies.quotas import Quota, borrowed
from policies.saturation import saturation
from policies.wait import QueueStats, Throughput

# `*_created` series double the exposition for no use here (Prometheus handles counter resets).
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client

_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_COST_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 50_000)
_RETRY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
Exemplar = dict[str, str] | None  # a trace id a histogram keeps beside a bucket (OpenMetrics)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "gateway_requests",
            "Requests by how they ended.",
            ["model", "priority", "outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "gateway_retries",
            "Requests that say they retry a refused or failed one (x-stainless-retry-count or "
            "X-Retry-Attempt above 0), counted as they arrive.",
            ["model", "priority"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time from arrival until a backend slot was granted, for requests that got one.",
            ["model", "priority"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.predicted_wait = Histogram(
            "gateway_admission_predicted_wait_seconds",
            "The queue wait admission predicted, at its current confidence, for requests it admitted "
            "into the queue (a sample: at most one a second per class): compare with "
            "gateway_queue_wait_seconds.",
            ["model", "priority"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.admitted_queued = Counter(
            "gateway_admission_queued",
            "Admitted requests that waited in the queue: with gateway_requests_total{outcome="
            '"deadline_expired_in_queue"}, the share of them that expired there.',
            ["model", "priority"],
            registry=registry,
        )
        self.confidence = Gauge(
            "gateway_admission_confidence",
            "The probability with which an admitted request must be predicted to leave the queue in "
            "time, as calibrated against what happened (admission.target_expiry).",
            ["model", "priority"],
            registry=registry,
        )
        self.upstream_latency = Histogram(
            "gateway_upstream_latency_seconds",
            "Time from sending a request to a backend until its answer was complete.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.retry_after = Histogram(
            "gateway_retry_after_seconds",
            "Retry-After advice given with 429 and 503 answers.",
            ["model", "priority"],
            buckets=_RETRY_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "gateway_batch_size",
            "Batch items per upstream call of a model the gateway batches (gateway-side batching).",
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.batch_wait = Histogram(
            "gateway_batch_wait_seconds",
            "Time a request of a model the gateway batches was held for companions while a slot was "
            "free (0 for one that was not; included in gateway_queue_wait_seconds).",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.request_cost = Histogram(
            "gateway_request_cost",
            "Work units each request was priced at on arrival: 1, its batch items, or its estimated "
            "tokens (cost: tokens).",
            ["model"],
            buckets=_COST_BUCKETS,
            registry=registry,
        )
        self.cost_model_error = Gauge(
            "gateway_cost_model_error",
            "Median relative error |estimated - actual| / actual of the recent token cost estimates "
            "(cost: tokens), from the usage the answers carry.",
            ["model"],
            registry=registry,
        )

        self.store_up = Gauge(
            "gateway_store_up",
            "1 while the queue store is usable (Redis answers, or the store is in memory).",
            registry=registry,
        )
        self.signal_up = Gauge(
            "gateway_signal_up",
            "1 while a metrics source (a backend's /metrics, kueue) answers; 0 once stale.",
            ["source"],
            registry=registry,
        )
        # The name the seed's sidecar exported, kept for the dashboards and alerts built on it.
        self.pending_workloads = Gauge(
            "gpu_queue_waiting_workloads",
            "Workloads pending admission in the serving ClusterQueue, as Kueue reports them.",
            ["cluster_queue"],
            registry=registry,
        )
        # Label children by label values: `.labels()` takes a lock and validates on every call.
        self._children: dict[tuple[object, ...], Any] = {}
        self.recent = RecentRefusals()
        """The last minute's refusals and the last advice, for the status page."""

    def _child(self, metric: Counter | Gauge | Histogram, *values: str) -> Any:
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def count(self, model: str, priority: str, outcome: Outcome) -> None:
        self._child(self.requests, model, priority, outcome.value).inc()
        if outcome in REFUSALS:
            self.recent.count(model, priority, outcome.value)

    def count_retry(self, model: str, priority: str) -> None:
        self._child(self.retries, model, priority).inc()

    def observe_batch(self, model: str, items: float) -> None:
        """One upstream call of a model the gateway batches: its batch items."""
        self._child(self.batch_size, model).observe(items)

    def observe_cost(self, model: str, cost: float) -> None:
        self._child(self.request_cost, model).observe(cost)

    def set_cost_model_error(self, model: str, error: float) -> None:
        self._child(self.cost_model_error, model).set(error)

    def observe_batch_wait(self, model: str, seconds: float) -> None:
        """A request of a model the gateway batches got its slot after `seconds` held for companions."""
        self._child(self.batch_wait, model).observe(seconds)

    def observe_queue_wait(self, model: str, priority: str, seconds: float, trace: Exemplar = None) -> None:
        self._child(self.queue_wait, model, priority).observe(seconds, trace)

    def count_admitted_into_queue(self, model: str, priority: str) -> None:
        self._child(self.admitted_queued, model, priority).inc()

    def observe_predicted_wait(self, model: str, priority: str, seconds: float) -> None:
        """The predicted wait of a sampled request admitted into the queue."""
        self._child(self.predicted_wait, model, priority).observe(seconds)

    def set_confidence(self, model: str, priority: str, confidence: float) -> None:
        self._child(self.confidence, model, priority).set(confidence)

    def observe_upstream(self, model: str, seconds: float, trace: Exemplar = None) -> None:
        self._child(self.upstream_latency, model).observe(seconds, trace)

    def observe_retry_after(self, model: str, priority: str, seconds: float) -> None:
        self._child(self.retry_after, model, priority).observe(seconds)
        self.recent.advised(model, priority, seconds)

    def watch_pools(
        self,
        pools: Sequence[ModelPool],
        priorities: Sequence[str],
        store: QueueView,
        clock: Callable[[], float],
        quotas: Mapping[str, Quota] | None = None,
    ) -> None:
        """Export queue depth, slots in use and the pool's measured speeds, read at each scrape."""
        self.registry.register(_PoolCollector(pools, priorities, store, clock, dict(quotas or {})))

    def watch_queued_bytes(self, models: Sequence[str], held: Mapping[str, int]) -> None:
        """Export the request-body bytes this replica holds for queued requests, read at each scrape."""
        self.registry.register(_QueuedBytesCollector(models, held))

    def watch_loops(self, supervisors: Sequence[LoopView]) -> None:
        """Export whether each supervised background loop runs, and its restarts, read at each scrape."""
        self.registry.register(_LoopCollector(supervisors))


class LoopView(Protocol):
    """A supervisor, as metrics read it; loop names are fixed in the code, a closed set."""

    def loops_up(self) -> Mapping[str, bool]: ...
    def restarts(self) -> Mapping[str, int]: ...


class _LoopCollector(Collector):
    def __init__(self, supervisors: Sequence[LoopView]) -> None:
        self._supervisors = supervisors

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gateway_loop_up",
            "1 while every background loop of the name runs; 0 while one waits to be restarted.",
            labels=["loop"],
        )
        restarts = CounterMetricFamily(
            "gateway_loop_restarts", "Restarts of a background loop after it crashed.", labels=["loop"]
        )
        for supervisor in self._supervisors:
            for name, running in supervisor.loops_up().items():
                up.add_metric([name], 1.0 if running else 0.0)
            for name, count in supervisor.restarts().items():
                restarts.add_metric([name], count)
        yield from (up, restarts)

    def describe(self) -> Iterable[Metric]:
        return []


class _QueuedBytesCollector(Collector):
    def __init__(self, models: Sequence[str], held: Mapping[str, int]) -> None:
        self._models = models
        self._held = held

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gateway_queued_body_bytes",
            "Request-body bytes this replica holds for queued requests (limits.max_queued_bytes).",
            labels=["model"],
        )
        for model in self._models:
            family.add_metric([model], self._held.get(model, 0))
        yield family

    def describe(self) -> Iterable[Metric]:
        return []


class QueueView(Protocol):
    def stats(self, model: str) -> QueueStats: ...
    def throughput(self, model: str, now: float) -> Throughput: ...


class _PoolCollector(Collector):
    def __init__(
        self,
        pools: Sequence[ModelPool],
        priorities: Sequence[str],
        store: QueueView,
        clock: Callable[[], float],
        quotas: dict[str, Quota],
    ) -> None:
        self._quotas = quotas
        self._pools = pools
        self._priorities = priorities
        self._store = store
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "gateway_queue_depth", "Requests waiting for a slot.", labels=["model", "priority"]
        )
        inflight = GaugeMetricFamily(
            "gateway_inflight_requests", "Backend slots this gateway holds.", labels=["model"]
        )
        ready = GaugeMetricFamily(
            "gateway_backend_ready",
            "1 when the backend passes its health checks and its circuit is not open.",
            labels=["model", "backend"],
        )
        circuit = GaugeMetricFamily(
            "gateway_backend_circuit_state",
            "1 for the state the backend's circuit is in (passive health), 0 for the others.",
            labels=["model", "backend", "state"],
        )
        slots = GaugeMetricFamily(
            "gateway_backend_slots",
            "Requests the gateway may have in flight on the backend (configured or discovered).",
            labels=["model", "backend"],
        )
        saturated = GaugeMetricFamily(
            "gateway_backend_saturation",
            "Requests running and waiting on the backend per slot, by its own report while fresh.",
            labels=["model", "backend"],
        )
        reported = GaugeMetricFamily(
            "gateway_backend_queue",
            "Requests the backend reports waiting inside it (its own metrics).",
            labels=["model", "backend"],
        )
        service = GaugeMetricFamily(
            "gateway_service_time_seconds",
            "Measured mean time a backend slot is held per request (EWMA).",
            labels=["model"],
        )
        drain = GaugeMetricFamily(
            "gateway_queue_drain_rate",
            "Slot hand-overs per second while requests wait (measured, or slots / service time).",
            labels=["model"],
        )
        shares = GaugeMetricFamily(
            "gateway_tenant_share",
            "Each tenant's share of the work a class was granted slots over the last seconds "
            '(forgotten like the arrival rates); tenant="-" for requests of no configured tenant.',
            labels=["model", "priority", "tenant"],
        )
        borrowed_work = GaugeMetricFamily(
            "gateway_tenant_borrowed_work",
            "Work a tenant with a quota runs beyond it, on capacity others lend (policies.quotas).",
            labels=["model", "tenant"],
        )
        arrivals = GaugeMetricFamily(
            "gateway_priority_arrival_rate",
            "Requests of a class arriving per second, admitted or not (forgotten over seconds).",
            labels=["model", "priority"],
        )
        now = self._clock()
        for pool in self._pools:
            stats = self._store.stats(pool.name)
            throughput = self._store.throughput(pool.name, now)
            for priority, queued, offered in zip(
                self._priorities, stats.queued_by_band, throughput.offered_rate_by_band, strict=True
            ):
                depth.add_metric([pool.name, priority], queued)
                arrivals.add_metric([pool.name, priority], offered)
            for tenant in self._quotas:
                borrowed_work.add_metric(
                    [pool.name, tenant], borrowed(tenant, stats.inflight_by_tenant, self._quotas)
                )
            for priority, by_tenant in zip(self._priorities, throughput.tenant_granted_by_band, strict=False):
                for tenant, share in fair_shares(by_tenant).items():
                    shares.add_metric([pool.name, priority, tenant or "-"], share)
            inflight.add_metric([pool.name], sum(b.inflight for b in pool.backends))
            for backend in pool.backends:
                labels = [pool.name, backend.url]
                ready.add_metric(labels, 1.0 if backend.ready else 0.0)
                for state in CircuitState:
                    circuit.add_metric([*labels, state.value], 1.0 if backend.circuit.state is state else 0.0)
                slots.add_metric(labels, backend.max_concurrency)
                reported.add_metric(labels, backend.external_waiting)
                saturated.add_metric(
                    labels,
                    saturation(
                        backend.inflight,
                        backend.max_concurrency,
                        backend.reported_waiting,
                        backend.reported_running,
                        backend.signal_up,
                    ),
                )
            service.add_metric([pool.name], throughput.service_time_s)
            drain.add_metric([pool.name], throughput.drain_rate_per_s)
        yield from (
            depth,
            inflight,
            ready,
            circuit,
            slots,
            saturated,
            reported,
            service,
            drain,
            arrivals,
            shares,
            borrowed_work,
        )

    def describe(self) -> Iterable[Metric]:
        return []
