"""The capacity plan: replicas for the targets, the wait after growth, and the effect of a burst.

The numbers come from `policies.capacity`: M/M/c (Erlang C), or M/G/c by Allen-Cunneen when the
service time's coefficient of variation is not 1. A plan answers three questions, each at the
replicas running now or, when that count is not given, at the recommended one:

(a) how many replicas meet the wait targets under the utilization ceiling;
(b) what the wait becomes when capacity grows by a factor (x1.5 by default);
(c) what a burst of N replicas' worth of extra arrivals (N = 50 by default: "a 50-GPU burst")
    does to the wait, and how many replicas would ride it out; and, read the other way, what N
    more replicas do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.tools.planning.trace import TraceWorkload, Workload
from policies.capacity import Recommendation, Targets, WaitEstimate, mgc, replicas_for

MAX_REPLICAS = 100_000


@dataclass(frozen=True, slots=True)
class Scenario:
    replicas: int
    estimate: WaitEstimate


@dataclass(frozen=True, slots=True)
class Burst:
    replicas: int
    """Its size: this many replicas' worth of extra arrivals (and, in the other reading, added)."""
    extra_arrival_rate: float
    during: Scenario
    backlog_growth_rate: float
    """Requests per time unit the backlog grows by while the burst lasts; 0 when absorbed."""
    drain_rate_after: float
    """Requests per time unit the backlog shrinks by once the burst ends: the spare capacity."""
    needed: Recommendation
    with_added: Scenario
    """The other reading: as many replicas added, at the usual arrival rate."""


@dataclass(frozen=True, slots=True)
class Plan:
    workload: Workload
    trace: TraceWorkload | None
    targets: Targets
    slots_per_replica: int
    percentile: float
    unit: str
    current: int | None
    recommendation: Recommendation
    one_fewer: Scenario | None
    rows: tuple[Scenario, ...]
    growth: float
    before: Scenario
    after: Scenario
    burst: Burst

    @property
    def stretch(self) -> float:
        """Allen-Cunneen's factor on the M/M/c wait: (1 + cv^2) / 2."""
        return (1.0 + self.workload.service_cv**2) / 2.0

    @property
    def pct_label(self) -> str:
        return f"p{self.percentile:g}"

    @property
    def model(self) -> str:
        if self.workload.service_cv == 1.0:
            return "M/M/c (Erlang C)"
        return "M/G/c (Allen-Cunneen approximation over Erlang C)"


def build_plan(
    workload: Workload,
    targets: Targets,
    *,
    trace: TraceWorkload | None = None,
    slots_per_replica: int = 1,
    percentile: float = 95.0,
    unit: str = "s",
    current: int | None = None,
    growth: float = 1.5,
    burst_replicas: int = 50,
) -> Plan:
    """The answers to (a), (b) and (c) for `workload`, each at the replicas running now (`current`)
    or, when that is not given, at the recommended count."""

    def at(replicas: int, arrival_rate: float = workload.arrival_rate) -> Scenario:
        servers = replicas * slots_per_replica
        return Scenario(replicas, mgc(arrival_rate, workload.service_rate, servers, workload.service_cv))

    def recommend(arrival_rate: float) -> Recommendation:
        return replicas_for(
            arrival_rate,
            workload.service_rate,
            targets,
            service_cv=workload.service_cv,
            servers_per_replica=slots_per_replica,
            max_replicas=MAX_REPLICAS,
        )

    recommendation = recommend(workload.arrival_rate)
    base = current if current is not None else recommendation.replicas
    grown = min(MAX_REPLICAS, math.ceil(base * growth))
    extra = burst_replicas * slots_per_replica * workload.service_rate
    capacity = base * slots_per_replica * workload.service_rate
    burst = Burst(
        replicas=burst_replicas,
        extra_arrival_rate=extra,
        during=at(base, workload.arrival_rate + extra),
        backlog_growth_rate=max(0.0, workload.arrival_rate + extra - capacity),
        drain_rate_after=max(0.0, capacity - workload.arrival_rate),
        needed=recommend(workload.arrival_rate + extra),
        with_added=at(base + burst_replicas),
    )
    shown = {recommendation.replicas + step for step in range(-3, 4)} | {base, grown}
    return Plan(
        workload=workload,
        trace=trace,
        targets=targets,
        slots_per_replica=slots_per_replica,
        percentile=percentile,
        unit=unit,
        current=current,
        recommendation=recommendation,
        one_fewer=at(recommendation.replicas - 1) if recommendation.replicas > 1 else None,
        rows=tuple(at(count) for count in sorted(shown) if 1 <= count <= MAX_REPLICAS),
        growth=growth,
        before=at(base),
        after=at(grown),
        burst=burst,
    )
