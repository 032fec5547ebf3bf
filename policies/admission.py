"""Accept this request now? Deadline-aware admission against the predicted queue wait.

A request may wait in the queue at most its class's `max_queue_wait_s`, and, when the client sent
a budget, at most that budget less the time a slot takes to produce its answer (a request that
starts later cannot finish in time, so a slot spent on it is wasted); the service time is taken
as its mean. Admission refuses at arrival when the work
ahead of the request (its own and more urgent bands, in cost units), with the room the request
takes itself, would not be handed slots within that allowance. That room is its whole cost behind
queued work (policies.wait.room_taken): a queue near its limit is kept for the work that fits, so
that under overload long requests are refused where short ones still fit; with nothing queued
ahead it is one hand-over. The same allowance sets when a queued request must leave the queue.

Where the store tells when each slot in use was handed over, the prediction reads the pool
(`work_limit`, policies.handovers): each busy slot hands over when its request ends, which
follows from how long it has run and the measured service times, and more urgent arrivals take
hand-overs first. The request is admitted when the hand-overs within its allowance carry the work
ahead with probability `confidence`, which policies.calibration steers from outcomes; it starts
at the normal quantile of `safety_sigmas`.

Otherwise (`max_work`, and a quick bound where a free slot grants at once) it is a normal
approximation of the drain: the wait for n hand-overs to its band, which receives mu_b of the
pool's mu hand-overs per second, is taken as (n + z * sqrt(n * v / mu_b)) / mu_b, where v is the
variance per second of the count of hand-overs that reach the band (policies.wait.
band_count_variance_rate): the time to count n of them is about n / mu_b, and over that time the
count wavers by sqrt(v * n / mu_b). The variance comes from the backends' service times (a slot
with a steady service time hands over like a clock, one with exponential service times like a
Poisson stream) and from the urgent bands' arrivals, which take hand-overs at random.

Either way the check is expressed as a work limit (`max_work`), so that a store can make the
check and the insert it guards one atomic operation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

from policies.calibration import CalibrationConfig
from policies.cost_ranks import room_limit
from policies.handovers import PoolState, handovers_within_steps, wait_steps
from policies.outcomes import Outcome
from policies.request_kinds import service_of_kind
from policies.retry_after import RetryAfterConfig, retry_after_s
from policies.steps import Steps, finished, known
from policies.wait import (
    MIN_DRAIN_SHARE,
    QueueStats,
    Throughput,
    arrival_reach,
    band_count_variance_rate,
    band_drain_rate_per_s,
    urgent_rate_over,
    work_to_drain,
)


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    safety_sigmas: float = 2.0
    """The queue wait's starting margin, in standard deviations (policies.calibration moves it)."""
    retry: RetryAfterConfig = field(default_factory=RetryAfterConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    room_for_costliest: float = 0.5
    """The share of a contended queue's room the costliest requests may fill (policies.cost_ranks)."""


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    band: int
    """Index of the priority class, 0 the most urgent."""
    max_queue_wait_s: float
    """The class's bound on time in the gateway's queue."""
    budget_s: float | None = None
    """The client's whole remaining budget (queue wait plus service), if it sent one."""
    cost: float = 1.0
    """Its work units."""
    tenant: str | None = None
    """Its flow's tenant, where its band is fair-queued: it waits for its turn (policies.fairness)."""
    room_share: float = 1.0
    """The share of the queue's room beyond one hand-over it may fill, by its cost's rank
    (policies.cost_ranks)."""
    kind: str = ""
    """Its kind (policies.request_kinds), whose service times it sets aside time for."""


@dataclass(frozen=True, slots=True)
class Reject:
    reason: Outcome
    retry_after_s: float
    predicted_wait_s: float
    excess_wait_s: float = 0.0
    """How much longer than allowed it would have waited, with the margin: the least time until
    it fits (where a return schedule starts looking for room)."""


def service_allowance_s(throughput: Throughput, kind: str = "") -> float:
    """The time to set aside for service: its mean, its kind's where known (policies.request_kinds).
    A request is started while its budget leaves room for a typical service; setting aside a high
    quantile instead (mean + 2 deviations is three means for exponential service times) refused
    work that a plain queue served in time, and the queue's margin is what protects the deadline of
    work already admitted."""
    own = service_of_kind(throughput.service_times_by_kind, kind)
    return throughput.service_time_s if own is None else own.mean_s


def allowed_wait_s(request: AdmissionRequest, throughput: Throughput) -> float:
    """The longest this request may wait for a slot; negative when even an idle pool is too slow."""
    allowed = request.max_queue_wait_s
    if request.budget_s is not None:
        allowed = min(allowed, request.budget_s - service_allowance_s(throughput, request.kind))
    return allowed


def offer_reach(request: AdmissionRequest, throughput: Throughput) -> dict[str, float]:
    """The most work each other flow of its band may send within the request's allowance
    (policies.wait.arrival_reach). Admission asks whether the request starts within its allowance,
    and what they send by then ahead of its turn goes first: the request offers with this, and the
    store counts what of it goes ahead of its turn atomically with the work queued ahead
    (policies.wait.work_before_grant), so that the two read one state."""
    return arrival_reach(throughput, request.band, request.tenant, allowed_wait_s(request, throughput))


def arriving_work(request: AdmissionRequest, stats: QueueStats, throughput: Throughput) -> float:
    """What of its `offer_reach` goes ahead of the request's turn, as `stats` show the band."""
    return stats.arriving_ahead(
        request.band, request.tenant, throughput.handover_cost, offer_reach(request, throughput)
    )


def offered_limit(limit: float, request: AdmissionRequest, throughput: Throughput, external: float) -> float:
    """The work limit a store checks the request's offer against (policies.wait.work_before_grant
    with its `offer_reach`), from admission's `limit` (`work_limit`): less the room its cost's
    rank keeps for others (`room_limit`) and the work the backends hold for others (`external`),
    which is ahead of every band while the store counts only its own queue. A negative limit
    (never) stays one."""
    limit = room_limit(limit, throughput.handover_cost, request.room_share)
    return limit if limit < 0 else limit - external


def budget_hopeless(request: AdmissionRequest, throughput: Throughput) -> bool:
    """The client's budget is below the service allowance: no queue, however short, leaves room."""
    return request.budget_s is not None and request.budget_s < service_allowance_s(throughput)


def min_budget_s(stats: QueueStats, throughput: Throughput, band: int, safety_sigmas: float) -> float:
    """The smallest budget admission would accept now for `band`: the service allowance plus the
    cautious wait for the work queued ahead of it."""
    work = work_to_drain(stats, band, throughput.handover_cost)
    wait = cautious_wait_s(work, throughput, band, safety_sigmas) if work > 0 else 0.0
    return service_allowance_s(throughput) + wait


def cautious_wait_s(work: float, throughput: Throughput, band: int, safety_sigmas: float) -> float:
    """The wait for `work` to be handed to `band`, `safety_sigmas` deviations above its mean."""
    band_drain = band_drain_rate_per_s(throughput, band)
    spread = math.sqrt(work * band_count_variance_rate(throughput, band) / band_drain)
    return (work + safety_sigmas * spread) / band_drain


def max_work(
    request: AdmissionRequest,
    throughput: Throughput,
    config: AdmissionConfig,
    queue_sigmas: float | None = None,
) -> float:
    """The most work (the room it takes included) the request may wait to be drained, by the
    normal approximation with `queue_sigmas` of margin (`config.safety_sigmas` if not given); -1
    when it cannot be served in time at all."""
    allowed = allowed_wait_s(request, throughput)
    if allowed < 0:
        return -1.0
    z = config.safety_sigmas if queue_sigmas is None else queue_sigmas
    band_drain = band_drain_rate_per_s(throughput, request.band)
    budget = allowed * band_drain
    spread = max(0.0, z) * math.sqrt(band_count_variance_rate(throughput, request.band) / band_drain)
    return most_within(budget, spread)


def most_within(budget: float, spread: float) -> float:
    """The largest n with n + spread * sqrt(n) <= budget: the most hand-overs (or work) a drain
    that is expected to hand over `budget` carries with a margin of `spread` sqrt(n) (spread = z
    sqrt(v / mu): z deviations of a count with variance v per second at mean rate mu). Admission
    admits work up to it; displacement tells a queued request whose need has grown past it."""
    if spread == 0:
        return budget  # exact, so that work landing right on the limit is admitted
    # A quadratic in sqrt(n), its root written so that it does not cancel when spread**2 dwarfs
    # the budget.
    root = 2 * budget / (spread + math.sqrt(spread * spread + 4 * budget))
    return root * root


def pool_state(
    stats: QueueStats, throughput: Throughput, band: int, now: float, horizon_s: float
) -> PoolState | None:
    """The pool as policies.handovers reads it for `band` at `now`, over the next `horizon_s`; None
    when the store tells neither a free slot nor when a slot in use was handed over."""
    free = max(0, stats.free_for(band))
    if not stats.started_at and free <= 0:
        return None
    slots = len(stats.started_at) + free
    # Urgent work takes hand-overs first, but noisy rate estimates must not take them all.
    most = (1 - MIN_DRAIN_SHARE) * slots / throughput.service_time_s
    urgent = urgent_rate_over(throughput, band, horizon_s) / throughput.handover_cost
    by_kind = throughput.service_times_by_kind
    return PoolState(
        ages_s=tuple(max(0.0, now - started) for started in stats.started_at),
        free_slots=free,
        urgent_rate_per_s=min(urgent, most),
        busy_service=tuple(service_of_kind(by_kind, kind) for kind in stats.started_kinds) if by_kind else (),
    )


def work_limit(
    request: AdmissionRequest,
    stats: QueueStats,
    throughput: Throughput,
    now: float,
    confidence: float,
    config: AdmissionConfig,
) -> float:
    """The most work (the room it takes included) the request may wait to be drained: what the
    hand-overs that reach its band within its allowed wait carry, with probability `confidence`,
    from the state of the pool (how long each request in flight has run, and the measured
    service times); by the normal approximation where the store does not tell. -1 when it cannot
    be served in time at all."""
    return finished(work_limit_steps(request, stats, throughput, now, confidence, config))


def work_limit_steps(
    request: AdmissionRequest,
    stats: QueueStats,
    throughput: Throughput,
    now: float,
    confidence: float,
    config: AdmissionConfig,
) -> Steps[float]:
    """work_limit a step at a time (policies.handovers.handovers_within_steps)."""
    allowed = allowed_wait_s(request, throughput)
    if allowed < 0:
        return known(-1.0)
    state = pool_state(stats, throughput, request.band, now, allowed)
    if state is None or throughput.service_times is None:
        return known(max_work(request, throughput, config, NormalDist().inv_cdf(confidence)))
    handovers = handovers_within_steps(state, throughput.service_times, allowed, confidence)
    return _carried(handovers, throughput.handover_cost)


def _carried(handovers: Steps[int], handover_cost: float) -> Steps[float]:
    """The work `handovers` hand-overs carry."""
    count = yield from handovers
    return count * handover_cost


def confident_wait_s(
    stats: QueueStats, throughput: Throughput, band: int, now: float, confidence: float
) -> float:
    """The wait a request of `band` arriving now has with probability `confidence`, read as
    `work_limit` reads the pool: what admission compared with its allowance."""
    return finished(confident_wait_steps(stats, throughput, band, now, confidence))


def confident_wait_steps(
    stats: QueueStats, throughput: Throughput, band: int, now: float, confidence: float
) -> Steps[float]:
    """confident_wait_s a reading of the pool at a time (policies.handovers.wait_steps)."""
    work = work_to_drain(stats, band, throughput.handover_cost)
    if work <= 0:
        return known(0.0)
    state = pool_state(stats, throughput, band, now, work / band_drain_rate_per_s(throughput, band))
    if state is None or throughput.service_times is None:
        return known(cautious_wait_s(work, throughput, band, NormalDist().inv_cdf(confidence)))
    # The free slots are hand-overs of the state's: count the work ahead and its own, not the
    # work to drain (which takes them off already).
    ahead = sum(stats.work(b) for b in range(band + 1)) + stats.external_waiting
    return wait_steps(state, throughput.service_times, ahead / throughput.handover_cost + 1, confidence)


@dataclass(frozen=True, slots=True)
class PoolWait:
    """The pool's confident wait (`confident_wait_s`) for `work` to drain, as read from its state:
    `work` is work_to_drain's for the band, with one hand-over of its own."""

    work: float
    wait_s: float

    def for_work(self, work: float, band_drain_per_s: float) -> float:
        """The wait for `work` instead: the difference drains at the band's rate."""
        return max(0.0, self.wait_s + (work - self.work) / band_drain_per_s)


RESIDUAL_CV = 1.25
"""Above it, a request in flight has clearly longer left to run than a new one takes: the mean
residual life is mean x (1 + cv^2) / 2, 1.28 means at 1.25 (exponential times, cv 1, are measured
a little either side of 1)."""


def residual_beyond_mean(throughput: Throughput) -> bool:
    """Whether service times vary clearly more than exponential ones (RESIDUAL_CV). Then the
    requests running now, and their ages, tell more about the next hand-overs than the drain rate's
    normal approximation does (an LLM pool whose long generations hold every slot)."""
    return throughput.service_cv > RESIDUAL_CV and throughput.service_times is not None


def refuse(
    request: AdmissionRequest,
    stats: QueueStats,
    throughput: Throughput,
    jitter_u: float,
    config: AdmissionConfig,
    *,
    reason: Outcome | None = None,
    pool_wait: PoolWait | None = None,
) -> Reject:
    """The refusal for `request` in the current state, with Retry-After from the drain rate.

    `reason` overrides the one derived from the limits (a request that expired in the queue).
    `pool_wait`, read from the state of the pool, lengthens the excess where the requests running
    now will hold their slots longer than the drain rate says; it never shortens it.
    """
    drain = band_drain_rate_per_s(throughput, request.band)
    arriving = arriving_work(request, stats, throughput)
    work = work_to_drain(stats, request.band, throughput.handover_cost, request.tenant, None, arriving)
    # It is back in time when the queue has drained to leave room for its whole cost.
    room = work_to_drain(
        stats, request.band, throughput.handover_cost, request.tenant, request.cost, arriving
    )
    allowed = allowed_wait_s(request, throughput)
    if reason is None:
        budget_binds = allowed < request.max_queue_wait_s
        reason = Outcome.DEADLINE_UNMEETABLE if budget_binds else Outcome.QUEUE_FULL
    # Its share of the room is a share of the time beyond one hand-over (limits grow with time).
    allowed = room_limit(allowed, throughput.handover_cost / drain, request.room_share)
    excess_s = cautious_wait_s(room, throughput, request.band, config.safety_sigmas) - max(allowed, 0.0)
    if pool_wait is not None:
        excess_s = max(excess_s, pool_wait.for_work(room, drain) - max(allowed, 0.0))
    advice = retry_after_s(
        excess_wait_s=excess_s,
        band_drain_rate_per_s=drain,
        jitter_u=jitter_u,
        config=config.retry,
    )
    return Reject(reason=reason, retry_after_s=advice, predicted_wait_s=work / drain, excess_wait_s=excess_s)
