"""Settings of how the gateway decides: admission, Retry-After, signals, health, estimation and
autoscaling hints."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from gateway.settings.base import Frozen, PositiveMs, http_url
from policies.retry_after import RetryAfterConfig


class RetryAfter(Frozen):
    min_ms: PositiveMs = 10.0
    max_ms: PositiveMs = 60_000.0
    jitter: float = Field(0.1, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _min_below_max(self) -> RetryAfter:
        if self.min_ms > self.max_ms:
            raise ValueError("min_ms must not exceed max_ms")
        return self

    def policy(self) -> RetryAfterConfig:
        return RetryAfterConfig(min_s=self.min_ms / 1000, max_s=self.max_ms / 1000, jitter=self.jitter)


class Admission(Frozen):
    safety_sigmas: float = Field(2.0, ge=0.0, le=10.0)
    """Where the queue wait's margin starts, in standard deviations (the normal quantile: 2 ->
    admit when the work ahead drains in time with probability 0.977); calibration moves it."""
    target_expiry: float = Field(0.01, gt=0.0, lt=0.5)
    """The share of admitted requests that queued which may expire in the queue: the queue
    wait's margin is calibrated against outcomes to hold it."""
    room_for_costliest: float = Field(0.5, ge=0.0, le=1.0)
    """The share of a contended queue's room (its work limit beyond one hand-over) the costliest
    requests may fill; cheaper ones fill more, by their rank among recent costs (1: cost-blind)."""


class Signals(Frozen):
    scrape_interval_ms: PositiveMs = 1000.0
    scrape_timeout_ms: PositiveMs = 800.0
    stale_after_failures: int = Field(3, ge=1)
    """A source that fails this many scrapes in a row is stale: decisions stop using it."""
    discovery_interval_ms: PositiveMs = 10_000.0
    """How often Triton backends' model config is read again."""
    endpoints_interval_ms: PositiveMs = 5_000.0
    """How often `discover: dns` backends' names are resolved again (each within `health.timeout_ms`)."""


class Kueue(Frozen):
    url: str
    """The Kueue controller's metrics endpoint, usually https://...:8443/metrics."""
    cluster_queue: str
    """The ClusterQueue the serving fleet is admitted through."""
    bearer_token_file: str | None = None
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    backlog_pending_workloads: float = Field(10.0, gt=0)
    """The queue counts as backlogged above this many pending (active) workloads ..."""
    backlog_admission_wait_p95_s: float = Field(120.0, gt=0)
    """... or when the admission wait's p95 over the last scrape interval exceeds this."""

    _check_url = field_validator("url")(http_url)


class Health(Frozen):
    interval_ms: PositiveMs = 1000.0
    timeout_ms: PositiveMs = 1000.0
    failures_to_down: int = Field(2, ge=1)
    """Failed probes in a row before a backend counts as down (a refused connection counts at once)."""
    passive_failures_to_open: int = Field(5, ge=1)
    """Data-path failures in a row (timeouts, stalled or cut-off answers, 502/503/504) that open a
    backend's circuit: it gets no new requests though its health checks pass."""
    stall_timeout_ms: PositiveMs = 30_000.0
    """A backend with requests in flight that sends no byte of any answer for this long is failing."""
    cooldown_ms: PositiveMs = 5_000.0
    """An open circuit half-opens after this long: one trial request decides whether it closes."""


class Estimation(Frozen):
    service_time_weight: float = Field(0.1, gt=0, le=1)
    """EWMA weight of each new service-time sample."""
    drain_window_s: float = Field(2.0, gt=0)
    """Seconds of backlog over which the drain rate is averaged (exponentially forgotten)."""
    rate_window_s: float = Field(2.0, gt=0)
    """Time constant of the arrival-rate estimates."""
    settled_window_s: float = Field(30.0, gt=0)
    """Time constant of the arrival rate of settled times (while nothing was refused): the load
    Retry-After expects back once an overload is over."""
    drain_stale_after_s: float = Field(10.0, gt=0)
    """A drain rate measured longer ago than this falls back to slots / service time."""
    handover_cost_weight: float = Field(0.01, ge=0, le=1)
    """EWMA weight of each hand-over's work in the mean work per hand-over (0 keeps it at 1); until
    1 / weight hand-overs are seen, their plain mean. It remembers about a hundred hand-overs:
    admission counts the hand-overs its wait holds and multiplies them by this mean, so it must
    not swing with the last few. At 0.1, with 8-item batches among single items, it rose by a
    third after each batch, and admission let in, just then, the batches' flow's requests that expired."""


class Autoscaling(Frozen):
    """The replica-count hint exported for the autoscaler (gateway_desired_replicas)."""

    target_wait_ms: PositiveMs = 100.0
    """The mean queue wait the fleet should keep to."""
    target_p_wait: float | None = Field(None, gt=0, le=1)
    """Optionally also: the largest acceptable probability of waiting at all."""
    max_utilization: float = Field(0.8, gt=0, le=1)
    window_s: float = Field(30.0, gt=0)
    """Arrival rates are averaged over this long (exponentially forgotten)."""
    scale_down_window_s: float = Field(300.0, ge=0)
    """A lower answer is published only after it has held this long (no flapping)."""
    interval_ms: PositiveMs = 1000.0
