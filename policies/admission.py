"""Accept this request now? Deadline-aware admission against the predicted queue wait.

A request may wait in the queue at most its class's `max_queue_wait_s`, and, when the client sent
a budget, at most that budget less the expected service time (a request that starts later cannot
finish in time, so a slot spent on it is wasted). Admission refuses at arrival when the predicted
wait exceeds that allowance. The same allowance sets when a queued request must leave the queue.

The check is also expressed as a position limit (`max_positions`), so that a store can make the
check and the insert it guards one atomic operation: wait <= allowed  <=>  positions <= limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.outcomes import Outcome
from policies.retry_after import RetryAfterConfig, retry_after_s
from policies.wait import (
    QueueStats,
    Throughput,
    band_drain_rate_per_s,
    offered_load,
    positions_to_drain,
)


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    band: int
    """Index of the priority class, 0 the most urgent."""
    max_queue_wait_s: float
    """The class's bound on time in the gateway's queue."""
    budget_s: float | None = None
    """The client's whole remaining budget (queue wait plus service), if it sent one."""


@dataclass(frozen=True, slots=True)
class Admit:
    predicted_wait_s: float


@dataclass(frozen=True, slots=True)
class Reject:
    reason: Outcome
    retry_after_s: float
    predicted_wait_s: float


def allowed_wait_s(request: AdmissionRequest, service_time_s: float) -> float:
    """The longest this request may wait for a slot; negative when even an idle pool is too slow."""
    allowed = request.max_queue_wait_s
    if request.budget_s is not None:
        allowed = min(allowed, request.budget_s - service_time_s)
    return allowed


def budget_binds(request: AdmissionRequest, service_time_s: float) -> bool:
    """Whether the client's budget, rather than the class limit, bounds the wait."""
    return request.budget_s is not None and request.budget_s - service_time_s < request.max_queue_wait_s


def max_positions(request: AdmissionRequest, throughput: Throughput) -> int:
    """The most slot hand-overs the request may wait for; -1 when it cannot be served in time at all."""
    allowed = allowed_wait_s(request, throughput.service_time_s)
    if allowed < 0:
        return -1
    return math.floor(allowed * band_drain_rate_per_s(throughput, request.band))


def decide(
    request: AdmissionRequest,
    stats: QueueStats,
    throughput: Throughput,
    jitter_u: float,
    retry: RetryAfterConfig,
) -> Admit | Reject:
    """Admit when the predicted wait fits the allowance, else Reject with a computed Retry-After."""
    positions = positions_to_drain(stats, request.band)
    drain = band_drain_rate_per_s(throughput, request.band)
    wait_s = positions / drain
    if positions <= max_positions(request, throughput):
        return Admit(predicted_wait_s=wait_s)
    return refuse(request, stats, throughput, jitter_u, retry, wait_s=wait_s)


def refuse(
    request: AdmissionRequest,
    stats: QueueStats,
    throughput: Throughput,
    jitter_u: float,
    retry: RetryAfterConfig,
    *,
    wait_s: float | None = None,
    reason: Outcome | None = None,
) -> Reject:
    """The refusal for `request` in the current state, with Retry-After from the drain rate.

    `reason` overrides the one derived from the limits (a request that expired in the queue).
    """
    drain = band_drain_rate_per_s(throughput, request.band)
    if wait_s is None:
        wait_s = positions_to_drain(stats, request.band) / drain
    allowed = allowed_wait_s(request, throughput.service_time_s)
    if reason is None:
        binds = budget_binds(request, throughput.service_time_s)
        reason = Outcome.DEADLINE_UNMEETABLE if binds else Outcome.QUEUE_FULL
    advice = retry_after_s(
        excess_wait_s=wait_s - max(allowed, 0.0),
        band_drain_rate_per_s=drain,
        offered_load=offered_load(throughput, request.band),
        jitter_u=jitter_u,
        config=retry,
    )
    return Reject(reason=reason, retry_after_s=advice, predicted_wait_s=wait_s)
