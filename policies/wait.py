"""How long will a request wait for a slot? Predicted queue wait under strict priority.

Everything is counted in work units, a request's cost (1 for a plain request; batch items or
tokens where requests differ in size): queues hold work, the pool drains work per second, and
arrival rates are work per second. With every cost 1 work is a count of requests.

A request of band b waits until the work queued ahead of it (in bands 0..b, most urgent first) has
been handed slots (of its own band, what comes before its flow's turn: policies.fairness), and
then for one hand-over of its own. Slots hand work over at the pool's drain
rate, but work of more urgent bands that arrives meanwhile jumps ahead, so band b only sees what
the urgent bands leave over: mu_b = mu - sum(admitted rate of bands < b), floored so that an
estimate never says "never" while the urgent bands are merely busy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.fairness import FairTurns, arrivals_in_turn, turn_ahead
from policies.service_times import ServiceTimes

# The least share of the drain rate a band is assumed to keep, so that noisy rate estimates of the
# urgent bands cannot drive the prediction to infinity.
MIN_DRAIN_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class QueueStats:
    """What the queue holds right now for one model."""

    queued_by_band: tuple[int, ...]
    """Requests waiting, per band."""
    free_slots: int
    queued_work_by_band: tuple[float, ...] = ()
    """Work waiting, per band; the request counts when not given (every cost 1)."""
    external_waiting: float = 0.0
    """Work the backends report queued inside them (sent by others): ahead of every band."""
    started_at: tuple[float, ...] = ()
    """When each slot in use was handed to its request, on the caller's clock (the ages of the
    work in flight, from which its residual times follow)."""
    started_kinds: tuple[str, ...] = ()
    """The kind of request (policies.request_kinds) each slot in use serves, in `started_at`'s
    order ("" where not told); empty where the store does not keep them."""
    inflight_by_tenant: Mapping[str, float] = field(default_factory=dict, compare=False)
    """Work each tenant has in flight, where the store counts it (with quotas)."""
    free_by_band: tuple[int, ...] = ()
    """The free slots each band may take, where more urgent classes reserve some
    (policies.reservations); every band may take `free_slots` when not given."""
    fair_turns: tuple[FairTurns | None, ...] = field(default=(), compare=False)
    """Per band, its fair-queuing state while flows wait in it (None where none does; empty under
    EDF ordering): a request waits for its flow's turn, not for the whole band."""
    pinned_by_band: tuple[int, ...] = ()
    """Of the requests waiting, per band, those of pinned sequences (policies.sequences): each
    waits for its own backend's slot; none when not given."""

    def free_for(self, band: int) -> int:
        """The free slots a request of `band` may take."""
        return self.free_by_band[band] if self.free_by_band else self.free_slots

    def work(self, band: int) -> float:
        return (self.queued_work_by_band or self.queued_by_band)[band]

    def work_ahead(self, band: int, tenant: str | None = None, slack: float = 1.0) -> float:
        """The queued work handed slots before a new request of `band`: the more urgent bands',
        and its own band's up to its turn (policies.fairness) when its `tenant` is given and the
        band is fair-queued, else all of it. `slack`: the work of one request."""
        urgent = sum(self.work(b) for b in range(band))
        turns = self.fair_turns[band] if self.fair_turns else None
        if tenant is None or turns is None:
            return urgent + self.work(band)
        return urgent + turn_ahead(turns, tenant, slack)

    def work_before_grant(
        self, band: int, tenant: str | None, handover_cost: float, cost: float, reach: Mapping[str, float]
    ) -> float:
        """What a store checks an offer of `band`, `tenant`, `cost` and `reach` against its limit
        with, as these statistics show the queue (module `work_before_grant`)."""
        free = self.free_for(band)
        ahead = queued_ahead(self.work_ahead(band, tenant, handover_cost), free, self.only_pinned_ahead(band))
        arriving = self.arriving_ahead(band, tenant, handover_cost, reach)
        return work_before_grant(ahead, free, handover_cost, cost, arriving)

    def only_pinned_ahead(self, band: int) -> bool:
        """Whether every request waiting in `band` and the more urgent ones is a pinned sequence's."""
        pinned = self.pinned_by_band
        return bool(pinned) and all(self.queued_by_band[b] == pinned[b] for b in range(band + 1))

    def arriving_ahead(
        self, band: int, tenant: str | None, slack: float, reach: Mapping[str, float]
    ) -> float:
        """The work the other flows of a fair-queued `band` will still send ahead of a new request
        of `tenant`, each at most its `reach` (policies.fairness.arrivals_in_turn, `arrival_reach`);
        0 where the band is not fair-queued or nothing waits in it."""
        turns = self.fair_turns[band] if self.fair_turns else None
        if tenant is None or turns is None or not reach:
            return 0.0
        return arrivals_in_turn(turns, tenant, slack, reach)


@dataclass(frozen=True, slots=True)
class Throughput:
    """Measured speeds of one model's pool."""

    service_time_s: float
    """Mean time a slot is held for one hand-over (send, backend work, answer back)."""
    drain_rate_per_s: float
    """Work per second handed slots while every slot is busy."""
    admitted_rate_by_band: tuple[float, ...]
    """Admitted work per second, per band."""
    offered_rate_by_band: tuple[float, ...]
    """All arriving work per second (admitted or not), per band."""
    service_spread_s: float = 0.0
    """Standard deviation of the service time."""
    service_cv: float = 1.0
    """The service time's coefficient of variation (spread over mean); 1, as for exponential
    service times, until enough have been measured to tell."""
    handover_cost: float = 1.0
    """Mean work a slot takes per hand-over (1 while every cost is 1)."""
    service_times: ServiceTimes | None = field(default=None, compare=False)
    """The measured distribution of service times (live: it goes on learning), where kept."""
    service_times_by_kind: Mapping[str, ServiceTimes] = field(default_factory=dict, compare=False)
    """The same per kind of request (policies.request_kinds), where kept."""
    sustained_rate_by_band: tuple[float, ...] | None = None
    """Admitted work per second per band as the slow estimate alone reads it (`admitted_rate_by_band`
    is the larger of it and the fast one): the level that holds beyond `fast_memory_s`. None: the
    same as `admitted_rate_by_band`."""
    fast_memory_s: float = 0.0
    """How far back the fast estimate remembers (its time constant)."""
    tenant_rate_by_band: tuple[Mapping[str, float], ...] = field(default=(), compare=False)
    """Per band, the work per second admitted for each tenant flow recently ("" for the unnamed
    flow), read a little up while its estimate is young (what it may send): the rate its arrivals
    take turns ahead of others' (policies.fairness.arrivals_in_turn); empty where not kept."""
    tenant_granted_by_band: tuple[Mapping[str, float], ...] = field(default=(), compare=False)
    """Per band, the work per second granted slots for each tenant flow recently: what each gets
    (the shares reported); empty where not kept."""
    settled_rate_by_band: tuple[float | None, ...] | None = None
    """Per band, the work per second that arrived while the band refused none of it, over a long
    memory: the load of settled times, expected back after an overload. None where not kept, or
    for a band not yet seen settled."""
    capacity_by_band: tuple[float, ...] = ()
    """Per band, the work per second the slots it may hold (policies.reservations) hand over while
    every one is busy, over the memory of the service times: those slots over their mean
    (Little's law); band 0's is the whole pool's. It is the drain to expect once an overload is
    over, where `drain_rate_per_s` reads the last seconds of backlog, which on a pool of long and
    short requests are those its long ones held. Empty where not kept."""


def work_to_drain(
    stats: QueueStats,
    band: int,
    handover_cost: float = 1.0,
    tenant: str | None = None,
    cost: float | None = None,
    arriving: float = 0.0,
) -> float:
    """The work that must be handed slots before a new request of `band` (of `tenant`'s flow, when
    given) gets one, its own hand-over included (0: a slot is free and nothing waits ahead of it):
    what the store checks (`work_before_grant`), with the work waiting inside the backends
    (`external_waiting`) ahead of it too. Given the request's `cost`, its own part is the room it
    takes in the queue (`room_taken`): what admission checks against the work limit; else one
    hand-over. `arriving`: the work other flows will still send ahead of its turn
    (`QueueStats.arriving_ahead`)."""
    ahead = stats.work_ahead(band, tenant, handover_cost) + stats.external_waiting
    own = handover_cost if cost is None else cost
    return work_before_grant(ahead, stats.free_for(band), handover_cost, own, arriving)


def arrival_reach(
    throughput: Throughput, band: int, tenant: str | None, horizon_s: float
) -> dict[str, float]:
    """The most work each other flow of `band` may send within `horizon_s` at the rate it was
    recently admitted (tenant -> rate times the horizon): what a request of `tenant` offers the
    store with, which counts what of it goes ahead of its turn (policies.fairness.arrivals_in_turn).
    Empty for an unnamed flow, a horizon of none, or where the rates are not kept."""
    if tenant is None or horizon_s <= 0 or not throughput.tenant_rate_by_band:
        return {}
    rates = throughput.tenant_rate_by_band[band]
    # A flow long quiet, whose estimate decays for minutes, would cost the store's check a read.
    least = NEGLIGIBLE_REACH * throughput.handover_cost
    return {
        name: most for name, rate in rates.items() if name != tenant and (most := rate * horizon_s) >= least
    }


NEGLIGIBLE_REACH = 1e-3
"""A thousandth of a hand-over's work: what a flow that may send less within a request's allowance
adds to its wait is left out of the offer's reach."""


def room_taken(queued_ahead: float, handover_cost: float, cost: float) -> float:
    """The room a request of `cost` takes in the work limit of its queue.

    Behind queued work, its whole cost (one hand-over at least, which it needs to start): a queue
    near its limit keeps its room for the work that fits in it, so that under overload a long
    request is refused where short ones still fit, not whichever happens to arrive first. With
    nothing queued ahead, one hand-over whatever it costs: there is no queue for it to crowd, and
    refusing it would refuse work a plain queue serves in time.
    """
    return max(handover_cost, cost) if queued_ahead > 0 else handover_cost


def queued_ahead(work_ahead: float, free_slots: int, only_pinned_ahead: bool) -> float:
    """The queued work a new request waits behind: none with a slot free for it where every
    request queued ahead is a pinned sequence's (policies.sequences), waiting for a slot on its own
    backend, which is full (dispatch hands a pinned request the slot its backend frees at once).

    The Redis store checks the same in its offer script (gateway/queues/redis/lua/offer.lua)."""
    return 0.0 if free_slots > 0 and only_pinned_ahead else work_ahead


def work_before_grant(
    queued_ahead: float, free_slots: int, handover_cost: float, cost: float, arriving: float = 0.0
) -> float:
    """What a store checks against an offer's `max_work`: the work queued ahead of it, what the
    band's other flows will still send ahead of its turn within its allowance (`arriving`,
    policies.fairness.arrivals_in_turn) and the room it takes (`room_taken`); none with a slot
    free and nothing queued ahead (it is granted now, before anything arrives).

    The Redis store checks the same in its offer script (gateway/queues/redis/lua/offer.lua), atomically.
    """
    if queued_ahead > 0 or free_slots == 0:
        return queued_ahead + arriving + room_taken(queued_ahead, handover_cost, cost)
    return 0.0


def band_drain_rate_per_s(throughput: Throughput, band: int) -> float:
    """The rate at which slots reach `band`: the pool's drain rate less what more urgent bands take."""
    return drain_left_to_band(throughput.drain_rate_per_s, sum(throughput.admitted_rate_by_band[:band]))


def drain_left_to_band(drain_per_s: float, urgent_per_s: float) -> float:
    """What a pool draining `drain_per_s` leaves a band while more urgent ones take `urgent_per_s`:
    never below MIN_DRAIN_SHARE of it."""
    return max(drain_per_s - urgent_per_s, MIN_DRAIN_SHARE * drain_per_s)


def urgent_rate_over(throughput: Throughput, band: int, horizon_s: float) -> float:
    """The work per second more urgent bands than `band` are expected to take over the next
    `horizon_s`: the quick level (the larger of the fast and the slow estimate) for as long as the
    fast one remembers, the slow one's beyond. A few urgent arrivals close together swing the fast
    estimate several-fold; they weigh on the next fraction of a second, not on the whole of a long
    allowance. A step to overload is believed by both at once (policies.estimators.rate_jump)."""
    quick = sum(throughput.admitted_rate_by_band[:band])
    sustained = throughput.sustained_rate_by_band
    near_s = throughput.fast_memory_s
    if sustained is None or horizon_s <= near_s:
        return quick
    return (quick * near_s + sum(sustained[:band]) * (horizon_s - near_s)) / horizon_s


def band_count_variance_rate(throughput: Throughput, band: int) -> float:
    """Variance per second of the work handed to `band` while it waits.

    The pool's slots hand over like renewal processes: over a long time t, k slots of mean service
    m and coefficient of variation cv hand over mu * t times with variance mu * t * cv**2 (1 for
    exponential service times, near 0 for a model whose every call takes the same time). The
    urgent bands' admitted arrivals, taken as Poisson, take hand-overs away with variance equal to
    their mean. Each hand-over carries `handover_cost` of work, which scales both variances by it.
    """
    urgent_rate = sum(throughput.admitted_rate_by_band[:band])
    return throughput.handover_cost * (throughput.drain_rate_per_s * throughput.service_cv**2 + urgent_rate)


def predicted_wait_s(stats: QueueStats, throughput: Throughput, band: int) -> float:
    """Expected seconds in the queue for a request of `band` arriving now."""
    work = work_to_drain(stats, band, throughput.handover_cost)
    if work == 0:
        return 0.0
    return work / band_drain_rate_per_s(throughput, band)


def offered_load(throughput: Throughput, band: int) -> float:
    """The band's arrivals (admitted or not) per hand-over it gets: above 1 it cannot all be served."""
    return throughput.offered_rate_by_band[band] / band_drain_rate_per_s(throughput, band)


def drain_rate_from_slots(slots: int, service_time_s: float, handover_cost: float = 1.0) -> float:
    """The drain rate implied by the slot count and service time, used until one is measured."""
    return max(slots, 1) * handover_cost / service_time_s


DRAIN_PRIOR_S = 0.1
"""Seconds of backlog the slots' bound counts for when blended with the measured hand-overs."""


def pool_drain_rate_per_s(
    handed_work: float, backlog_s: float, slots: int, service_time_s: float, handover_cost: float = 1.0
) -> float:
    """The pool's drain rate from `handed_work` seen handed over in `backlog_s` seconds of backlog.

    Each slot holds one request for the service time on average, so by Little's law hand-overs
    cannot outpace slots / service time for long. The measurement is blended with that bound, which
    counts as DRAIN_PRIOR_S seconds of observation, and capped by it:
    - with little backlog seen, one odd gap (the first after a restart, or after Redis came back)
      cannot swing the estimate to a tiny rate that would refuse everything;
    - after an idle spell the first hand-overs come as fast as the requests that filled the slots
      arrived (under a sudden overload, three times the real rate); believed, they would fill the
      queue with requests that then expire in it.
    Once seconds of backlog have been seen the measurement dominates (a 2 s window gives the bound
    5%), so a pool slowed by other clients' traffic is seen as slow. Nothing seen: the bound.
    """
    ceiling = drain_rate_from_slots(slots, service_time_s, handover_cost)
    blended = (handed_work + ceiling * DRAIN_PRIOR_S) / (backlog_s + DRAIN_PRIOR_S)
    return min(blended, ceiling)
