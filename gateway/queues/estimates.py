"""The measured speeds of one model's pool: one algorithm for every store.

A store only counts: cumulative, never-decayed totals of the work offered, admitted and handed over
(`StoreCounters`), the one thing it can keep atomically (the Redis store in its Lua scripts, the
memory store in plain additions). `PoolEstimates` turns successive readings of those totals into
rates with the pure estimators of policies.estimators and policies.wait, identically for both
stores: the Redis store feeds it the readings each script returns, on Redis's clock; the memory
store its own, on the event loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.settings import Estimation
from policies.estimators import (
    COUNTING_INTERVAL_S,
    ObservedRate,
    blend_rate,
    coefficient_of_variation,
    counter_increase,
    ewma,
    rate_jump,
    rate_upper_bound,
    settled_rate,
    unbiased_rate,
)
from policies.request_kinds import MAX_KINDS
from policies.reservations import slots_held_at_most
from policies.service_times import FIRST_EDGE_S, ServiceTimes
from policies.wait import Throughput, drain_rate_from_slots, pool_drain_rate_per_s

# Readings closer together than this are not blended yet: the counts accumulate into one interval.
TICK_S = COUNTING_INTERVAL_S
# Deviations a counting interval must exceed the current level by to be taken as a step up.
JUMP_Z = 6.0
REACH_Z = 2.0
"""How far up a flow's admitted rate is read for what it may still send ahead of another's turn
(Throughput.tenant_rate_by_band). Only while its estimate is young does it matter: in steady
state what a flow may send ahead is bound by its weight of the other's turn, which its queue
already fills. A quarter second into a 1:8 flood on Redis the heavier flow's rate read 61-74 of
its 100 a second, and the lighter one's requests admitted then (3-6 of them) expired."""


@dataclass(slots=True)
class StoreCounters:
    """What a store has counted for one model since it started (totals, in work units)."""

    offered_work: list[float]
    """Per band: work that arrived, admitted or not."""
    admitted_work: list[float]
    drained_work: float = 0.0
    """Work handed over at hand-overs that came while requests were waiting since the last one."""
    drained_s: float = 0.0
    """The gaps before those hand-overs: seconds of backlog observed."""
    drained_at: float = float("-inf")
    """When the last such hand-over was counted, on the store's clock."""
    handovers: int = 0
    handed_work: float = 0.0
    granted_by_flow: dict[tuple[int, str], float] = field(default_factory=dict)
    """Work granted slots (at once or from the queue), per (band, tenant) flow."""
    admitted_by_flow: dict[tuple[int, str], float] = field(default_factory=dict)
    """Work admitted (granted at once or queued), per (band, tenant) flow."""

    @classmethod
    def empty(cls, bands: int) -> StoreCounters:
        return cls([0.0] * bands, [0.0] * bands)

    def count_admitted(self, band: int, tenant: str, cost: float) -> None:
        """An arrival of the (band, tenant) flow admitted: granted at once or queued."""
        self.admitted_work[band] += cost
        self.admitted_by_flow[band, tenant] = self.admitted_by_flow.get((band, tenant), 0.0) + cost

    def count_granted(self, band: int, tenant: str, cost: float) -> None:
        """A slot granted to the (band, tenant) flow, at once or from the queue."""
        self.granted_by_flow[band, tenant] = self.granted_by_flow.get((band, tenant), 0.0) + cost


@dataclass(slots=True)
class _Rates:
    offered: list[float]
    admitted_slow: list[float]
    admitted_fast: list[float]
    settled: list[ObservedRate]
    drain: ObservedRate
    handover_cost: float = 1.0
    handovers_seen: float = 0.0
    last: StoreCounters | None = None
    last_at: float | None = None
    first_at: float | None = None
    """When the first totals were taken in: the rates' memory starts there, from 0."""
    drained_at: float = float("-inf")
    admitted_by_flow: FlowRates = field(default_factory=lambda: FlowRates())
    """Work per second admitted for each flow: what it queues (or starts at once), and so what it
    may still send ahead of another flow's turn. Its grants would read a flood's flow at its share
    of the pool while its queue fills at its whole rate."""
    granted_by_flow: FlowRates = field(default_factory=lambda: FlowRates())
    """Work per second granted slots for each flow: what it gets (the shares reported)."""
    snapshot: Throughput | None = field(default=None)


@dataclass(slots=True)
class FlowRates:
    """Each flow's work per second, forgotten like the arrival rates (`slow`) and as fast as the
    quick ones (`fast`: a flood's flows are seen at their rate within a second, while the slow
    estimate still ramps up and admission would let a light tenant's requests in behind arrivals
    it did not count; they expired in the queue); and when each began, for the correction of the
    0 its estimates start from (`since`)."""

    slow: dict[tuple[int, str], float] = field(default_factory=dict)
    fast: dict[tuple[int, str], float] = field(default_factory=dict)
    since: dict[tuple[int, str], float] = field(default_factory=dict)
    """When each flow's totals were last taken in before it first showed: its estimates start
    there, from 0. The pool's first totals may be long before (a replica's first view of a shared
    store comes at its start, not at the flood's). A flow that floods again after a long rest is
    read from its first start: its estimates have decayed, not started over, and are not corrected
    for the rest (open: a restart would read a sparse flow's every request as a flood)."""

    def observe(
        self, flow: tuple[int, str], work: float, elapsed_s: float, last_at: float, taus: tuple[float, float]
    ) -> None:
        """`work` of `flow` over the `elapsed_s` since the totals taken in at `last_at`."""
        slow_tau_s, fast_tau_s = taus
        self.since.setdefault(flow, last_at)
        self.slow[flow] = blend_rate(self.slow.get(flow, 0.0), work, elapsed_s, slow_tau_s)
        self.fast[flow] = blend_rate(self.fast.get(flow, 0.0), work, elapsed_s, fast_tau_s)


def rate_taus(config: Estimation) -> tuple[float, float]:
    """Time constants of the slow and the fast arrival-rate estimates."""
    return config.rate_window_s, config.rate_window_s / 4


class PoolEstimates:
    """Service time, drain rate, work per hand-over and per-band arrival rates of one model.

    The drain rate is measured from the gaps between slot hand-overs while requests were waiting
    the whole time, bounded by slots / service time (policies.wait.pool_drain_rate_per_s); without a
    recent measurement it is that bound.

    Admitted rates feed the drain left to less urgent bands, so they are read as the larger of a
    slow and a fast estimate: quick to believe that urgent traffic rose (a low request admitted
    on a stale, low estimate would expire in the queue), slow to believe that it fell. A counting
    interval with far more admissions than the estimates explain (policies.estimators.rate_jump)
    sets both to its own rate at once: the onset of an overload is believed within ~50 ms.

    Service times are measured where the requests are sent (every replica measures the same
    backends), so they are fed one by one. Reading the estimates is on every request's path, so the
    Throughput snapshot is rebuilt only when something in it changed.
    """

    def __init__(self, bands: int, expected_service_s: float, config: Estimation) -> None:
        self._config = config
        self._slow_tau_s, self._fast_tau_s = rate_taus(config)
        self.service_time_s = expected_service_s
        self.service_spread_s = 0.0
        """Standard deviation of the service time (EWMA of squared deviations)."""
        self._service_variance = 0.0
        self._service_samples = 0
        self.service_times = ServiceTimes(expected_service_s)
        """Their distribution: what admission reads the residual times of the work in flight from."""
        self.service_times_by_kind: dict[str, ServiceTimes] = {}
        """The same per kind of request (policies.request_kinds)."""
        settled = [ObservedRate(config.settled_window_s)] * bands
        self._rates = _Rates(
            [0.0] * bands, [0.0] * bands, [0.0] * bands, settled, ObservedRate(config.drain_window_s)
        )
        self._snapshot_key: tuple[int, bool, tuple[int, ...]] = (0, False, ())

    def record_service(self, service_s: float, kind: str = "") -> None:
        """Count a service time, of a request of `kind` ("": of no kind told, or a batch)."""
        weight = self._config.service_time_weight
        deviation = service_s - self.service_time_s
        self._service_variance = ewma(self._service_variance, deviation * deviation, weight)
        self.service_spread_s = self._service_variance**0.5
        self.service_time_s = ewma(self.service_time_s, service_s, weight)
        self._service_samples += 1
        self.service_times.record(service_s)
        if kind:
            self._record_kind(service_s, kind)
        self._rates.snapshot = None

    def _record_kind(self, service_s: float, kind: str) -> None:
        by_kind = self.service_times_by_kind
        times = by_kind.get(kind)
        if times is None:
            if len(by_kind) >= MAX_KINDS:
                return
            # Its own from the first sample: the prior weighs next to nothing, and a kind is read as
            # the model's until it has KIND_TRUSTED_SAMPLES anyway.
            times = by_kind[kind] = ServiceTimes(
                service_s if service_s > 0 else FIRST_EDGE_S, prior_weight=1e-3
            )
        times.record(service_s)

    @property
    def handover_cost(self) -> float:
        """Mean work a slot takes per hand-over."""
        return self._rates.handover_cost

    @property
    def service_cv(self) -> float:
        weight = self._config.service_time_weight
        return coefficient_of_variation(
            self.service_time_s, self.service_spread_s, self._service_samples, weight
        )

    def observe(self, counters: StoreCounters, now: float) -> None:
        """Take in the store's totals as read at `now` (its clock); blends once per TICK_S."""
        rates = self._rates
        last = rates.last
        if last is None or rates.last_at is None:
            rates.last, rates.last_at, rates.first_at = _copy(counters), now, now
            rates.drained_at = counters.drained_at
            return
        elapsed_s = now - rates.last_at
        if elapsed_s < TICK_S:
            return
        for band in range(len(rates.offered)):
            offered = counter_increase(last.offered_work[band], counters.offered_work[band])
            admitted = counter_increase(last.admitted_work[band], counters.admitted_work[band])
            rates.offered[band] = blend_rate(rates.offered[band], offered, elapsed_s, self._slow_tau_s)
            rates.settled[band] = settled_rate(rates.settled[band], offered, offered - admitted, elapsed_s)
            # A step is judged on counts of requests (Poisson), not on work.
            cost = rates.handover_cost
            level = max(rates.admitted_slow[band], rates.admitted_fast[band]) / cost
            jump = rate_jump(level, round(admitted / cost), elapsed_s, JUMP_Z)
            rates.admitted_slow[band] = blend_rate(
                rates.admitted_slow[band], admitted, elapsed_s, self._slow_tau_s
            )
            rates.admitted_fast[band] = blend_rate(
                rates.admitted_fast[band], admitted, elapsed_s, self._fast_tau_s
            )
            if jump is not None:
                jump *= cost
                rates.admitted_slow[band] = max(rates.admitted_slow[band], jump)
                rates.admitted_fast[band] = max(rates.admitted_fast[band], jump)
        drained_s = counter_increase(last.drained_s, counters.drained_s)
        if drained_s > 0:
            rates.drain = rates.drain.observe(
                counter_increase(last.drained_work, counters.drained_work), drained_s
            )
            rates.drained_at = counters.drained_at
        taus = (self._slow_tau_s, self._fast_tau_s)
        for totals, before, flow_rates in (
            (counters.admitted_by_flow, last.admitted_by_flow, rates.admitted_by_flow),
            (counters.granted_by_flow, last.granted_by_flow, rates.granted_by_flow),
        ):
            for flow, total in totals.items():
                work = counter_increase(before.get(flow, 0.0), total)
                flow_rates.observe(flow, work, elapsed_s, rates.last_at, taus)
        handovers = counter_increase(last.handovers, counters.handovers)
        if handovers > 0 and self._config.handover_cost_weight > 0:
            # A plain mean of the hand-overs seen until the memory is full, an EWMA remembering
            # about 1 / weight hand-overs after: the prior of 1 goes with the first hand-over.
            per_handover = counter_increase(last.handed_work, counters.handed_work) / handovers
            remembered = min(rates.handovers_seen, 1 / self._config.handover_cost_weight)
            rates.handover_cost = ewma(
                rates.handover_cost, per_handover, handovers / (remembered + handovers)
            )
            rates.handovers_seen += handovers
        rates.last, rates.last_at = _copy(counters), now
        rates.snapshot = None

    def throughput(self, slots: int, now: float, reserved_by_band: tuple[int, ...] = ()) -> Throughput:
        """The pool's speeds at `now`; `reserved_by_band`: the slots each class reserves from the
        less urgent ones (none if empty)."""
        rates = self._rates
        drain_fresh = now - rates.drained_at <= self._config.drain_stale_after_s
        key = (slots, drain_fresh, reserved_by_band)
        if rates.snapshot is None or key != self._snapshot_key:
            seen = (rates.drain.events, rates.drain.observed_s) if drain_fresh else (0.0, 0.0)
            drain = pool_drain_rate_per_s(*seen, slots, self.service_time_s, rates.handover_cost)
            rates.snapshot = Throughput(
                service_time_s=self.service_time_s,
                drain_rate_per_s=drain,
                admitted_rate_by_band=tuple(map(max, rates.admitted_slow, rates.admitted_fast)),
                offered_rate_by_band=tuple(rates.offered),
                service_spread_s=self.service_spread_s,
                service_cv=self.service_cv,
                handover_cost=rates.handover_cost,
                service_times=self.service_times,
                service_times_by_kind=self.service_times_by_kind,
                sustained_rate_by_band=tuple(rates.admitted_slow),
                fast_memory_s=self._fast_tau_s,
                settled_rate_by_band=_settled(rates.settled),
                capacity_by_band=self._capacity_by_band(slots, reserved_by_band),
                tenant_rate_by_band=self._by_band(rates.admitted_by_flow, upper_z=REACH_Z),
                tenant_granted_by_band=self._by_band(rates.granted_by_flow),
            )
            self._snapshot_key = key
        return rates.snapshot

    def _by_band(self, flow_rates: FlowRates, upper_z: float = 0.0) -> tuple[dict[str, float], ...]:
        """Each band's recent work per second by tenant (admitted, or granted): the quick level, the
        larger of the slow and the fast estimate (as for the bands' arrival rates), each corrected
        for the 0 it started from. Uncorrected, and read from grants (a flood's flow is granted its
        share while it queues its whole rate), a flood's flows read at a fraction of what they send
        ahead of others' turns for the first seconds, and a lighter tenant admitted then expired in
        the queue (the twin, weights 1:8 from the start: 45 of 112 admitted; 1:3, 15 of 241).
        `upper_z`: read that many standard deviations up (REACH_Z), the count's over the little
        the estimate has seen (`rate_upper_bound`)."""
        rates = self._rates
        by_band: list[dict[str, float]] = [{} for _ in rates.offered]
        for (band, tenant), slow in flow_rates.slow.items():
            fast = flow_rates.fast.get((band, tenant), 0.0)
            since = flow_rates.since.get((band, tenant), rates.first_at)
            age_s = 0.0 if since is None or rates.last_at is None else rates.last_at - since
            level = max(
                unbiased_rate(slow, age_s, self._slow_tau_s), unbiased_rate(fast, age_s, self._fast_tau_s)
            )
            if upper_z:
                window_s = min(age_s, 2 * self._fast_tau_s)  # the fast estimate's, about
                level = rate_upper_bound(level, window_s, rates.handover_cost, upper_z)
            by_band[band][tenant] = level
        return tuple(by_band)

    def _capacity_by_band(self, slots: int, reserved_by_band: tuple[int, ...]) -> tuple[float, ...]:
        mean_s = max(self.service_times.mean_s, FIRST_EDGE_S)
        cost = self._rates.handover_cost
        bands = len(self._rates.offered)
        held = [slots_held_at_most(b, slots, reserved_by_band) for b in range(bands)]
        return tuple(drain_rate_from_slots(n, mean_s, cost) if n else 0.0 for n in held)


def _settled(rates: list[ObservedRate]) -> tuple[float | None, ...]:
    return tuple(rate.per_s for rate in rates)


def _copy(counters: StoreCounters) -> StoreCounters:
    return StoreCounters(
        list(counters.offered_work),
        list(counters.admitted_work),
        counters.drained_work,
        counters.drained_s,
        counters.drained_at,
        counters.handovers,
        counters.handed_work,
        dict(counters.granted_by_flow),
        dict(counters.admitted_by_flow),
    )
