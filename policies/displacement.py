"""Which queued requests can no longer be served in time? Displacement of queued work.

More urgent work that arrives goes ahead of every less urgent request already queued. A queued
request is *overdue* once admission would refuse it where it now stands: the requests certainly
ahead of it (every more urgent band's queued requests and, within a flow that leaves in arrival
order, its own flow's requests queued before it) and its own need n hand-overs, and the pool,
handing over mu a second while busy (`displacement_handovers_per_s`: at least what its slots
hand over on their mean service time), is expected to make mu T of them in the time left T; it is
overdue when n + z cv sqrt(n) > mu T, admission's test (policies.admission.most_within) at its
starting margin z (`OVERDUE_SIGMAS`), the count's spread from the measured service times (cv 0:
slots that hand over like clocks, 1: like a Poisson stream, and 1 until measured). Such a request
is told at once (429 `displaced`) instead of expiring in the queue later.

What is ahead is counted in requests, not in work: in a pool of slots each request takes one
hand-over whatever its cost. Work divided by the pool's mean work per hand-over would count a
class of large requests (16-item batch jobs behind 1-item interactive ones) several hand-overs
per request and displace requests that would have been served. Where requests are batched, one
hand-over carries up to `per_handover` of them, and the count is divided by it.

An owner reclaiming its quota pushes borrowers back the same way: while a tenant under its quota
has work queued no new borrowing starts (policies.quotas), so the owners' queued work that will run
within their quotas is certainly ahead of every request of a tenant that owns no quota, in any
band (`owners_ahead`), and an owner's arrival checks those requests too.

Where admission also counts what will still arrive ahead of a request (the urgent bands' rate, the
other flows' turns), displacement counts only what is queued: a displaced request is lost to its
client for good, so one that might still be served stays, and one the arrivals still to come push
out expires at its leave-by time, as before. So only tenants without a quota count as borrowers
here: one over its quota runs within it again as its own requests finish, and then waits for no
owner.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from policies.admission import AdmissionConfig, most_within
from policies.wait import Throughput


class Queued(NamedTuple):
    """A queued request as displacement at the cap weighs it."""

    band: int
    borrower: bool
    """Its tenant owns no quota, while others do: what it runs is borrowed."""
    score: float
    """Its ordering score in its flow (higher: later in line)."""
    sequence: int
    """The order it was queued in (ties of score: the later goes first)."""
    cost: float


OVERDUE_SIGMAS = AdmissionConfig().safety_sigmas
"""The margin, in standard deviations, of the count of hand-overs: admission's starting one."""
OVERDUE_CHECKED = 8
"""Queued requests of each flow a store checks on an urgent arrival, newest first: where the new
arrival bites first, at a bounded cost per arrival."""


def requests_per_handover(batch_max_cost: float | None) -> int:
    """The most requests one hand-over carries: a batch's (each request costs at least one unit,
    so a batch of `batch_max_cost` holds at most that many), else one."""
    return 1 if batch_max_cost is None else max(1, int(batch_max_cost))


def displacement_handovers_per_s(throughput: Throughput) -> float:
    """The hand-overs a second displacement counts on: the larger of the drain of the last seconds
    of backlog and what the whole pool's slots hand over over the memory of the service times
    (Little's law, `Throughput.capacity_by_band`). A displaced request is lost to its client for
    good, and its time left spans seconds: where a few long requests happen to hold most slots at
    once, the last seconds' drain reads a fraction of what the slots hand over in that time
    (measured in the simulator, lognormal service of cv 1.5: 26 a second where 4 slots of 25 ms
    give 160), and displacement on it took requests that, left queued, were served in time."""
    capacity = throughput.capacity_by_band[0] if throughput.capacity_by_band else 0.0
    return max(throughput.drain_rate_per_s, capacity) / throughput.handover_cost


def overdue(
    now: float, leave_by: float, handovers_ahead: float, handovers_per_s: float, service_cv: float
) -> bool:
    """Whether a request with `handovers_ahead` certainly ahead of it cannot get a slot by
    `leave_by`, at admission's margin, from a pool that hands over `handovers_per_s` while busy
    with service times of coefficient of variation `service_cv`."""
    if handovers_per_s <= 0 or math.isinf(leave_by):
        return False
    left_s = leave_by - now
    if left_s <= 0:
        return True
    needed = handovers_ahead + 1  # its own hand-over too
    return needed > most_within(handovers_per_s * left_s, OVERDUE_SIGMAS * service_cv)


def overdue_in_flow(
    now: float,
    urgent_requests: float,
    flow_requests: int,
    newest_first: Iterable[tuple[float, int]],
    handovers_per_s: float,
    service_cv: float,
    *,
    in_arrival_order: bool = True,
) -> list[int]:
    """The positions (0: the newest) of the flow's queued requests, given newest first as
    (leave_by, per_handover: the most requests a hand-over of it carries, 1 unbatched), that are
    overdue. `urgent_requests`: the requests certainly ahead from elsewhere (the more urgent bands'
    queued ones); `flow_requests`: all the flow's queued requests. With `in_arrival_order` (FIFO
    within the flow) the flow's older requests count as ahead of each one; otherwise (EDF) only
    the urgent ones do."""
    found: list[int] = []
    for position, (leave_by, per_handover) in enumerate(newest_first):
        older = flow_requests - position - 1 if in_arrival_order else 0
        ahead = (urgent_requests + max(older, 0)) / max(per_handover, 1)
        if overdue(now, leave_by, ahead, handovers_per_s, service_cv):
            found.append(position)
    return found


def owners_ahead(owners: Iterable[tuple[float, Sequence[tuple[float, int]]]], bands: int) -> list[float]:
    """Per band b, the owners' queued requests in bands b and less urgent that will run within
    their quotas (more urgent bands' requests count ahead anyway). `owners`: each owner's room
    under its quota (its quota less its work in flight) and its queued (work, requests) per band;
    its work is taken most urgent first, as it is granted, and a band's share of it counted in
    that band's requests at their mean cost."""
    ahead = [0.0] * bands
    for room, queued in owners:
        before = 0.0
        for band in range(bands):
            work, requests = queued[band]
            within = max(0.0, min(room, before + work) - min(room, before))  # of this band's work
            if work > 0:
                runs = within / work * requests
                for counted in range(band + 1):
                    ahead[counted] += runs
            before += work
    return ahead


def cap_victims(queued: Sequence[Queued], arriving_band: int, excess: float) -> list[int]:
    """Which queued requests (indexes into `queued`) make room for `excess` more work at the
    model's queue cap for an arrival of `arriving_band`: the least urgent band's first, in a band
    the borrowers' before the owners', each the newest first; only bands less urgent than the
    arrival's. Nothing when even all of those would not make the room."""
    order = sorted(
        (i for i, q in enumerate(queued) if q.band > arriving_band),
        key=lambda i: (-queued[i].band, queued[i].borrower is False, -queued[i].score, -queued[i].sequence),
    )
    victims: list[int] = []
    for index in order:
        if excess <= 0:
            break
        victims.append(index)
        excess -= queued[index].cost
    return victims if excess <= 0 else []
