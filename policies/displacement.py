"""Which queued requests can no longer be served in time? Displacement of queued work.

More urgent work that arrives goes ahead of every less urgent request already queued. A queued
request is *overdue* once even a favourable drain cannot hand it a slot by its leave-by time: the
work certainly ahead of it (every more urgent band's queued work and, within a flow that leaves in
arrival order, its own flow's requests queued before it) needs n hand-overs, and the pool, handing
over mu a second while busy, makes n of them within the time left T only if n <= mu T +
`sigmas` sqrt(mu T) (the count of hand-overs of busy slots wavers like a Poisson count, or less).
Such a request is told at once (429 `displaced`) instead of expiring in the queue later.

An owner reclaiming its quota pushes borrowers back the same way: while a tenant under its quota
has work queued no new borrowing starts (policies.quotas), so the owners' queued work that will run
within their quotas is certainly ahead of every request of a tenant that owns no quota, in any
band (`owners_ahead`), and an owner's arrival checks those requests too.

The test is lenient on purpose: it ignores the arrivals still to come and the other flows of the
request's band, and allows the drain its luck. A request that might still be served is not
displaced; one it does not catch expires at its leave-by time, as before. So only tenants without
a quota count as borrowers here: one over its quota runs within it again as its own requests
finish, and then waits for no owner.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

OVERDUE_SIGMAS = 3.0
OVERDUE_CHECKED = 8
"""Queued requests of each flow a store checks on an urgent arrival, newest first: where the new
arrival bites first, at a bounded cost per arrival."""


def overdue(
    now: float, leave_by: float, work_ahead: float, handovers_per_s: float, handover_cost: float = 1.0
) -> bool:
    """Whether a request with `work_ahead` certainly ahead of it cannot get a slot by `leave_by`
    from a pool that hands over `handovers_per_s` (of `handover_cost` work each) while busy."""
    if handovers_per_s <= 0 or math.isinf(leave_by):
        return False
    left_s = leave_by - now
    if left_s <= 0:
        return True
    needed = work_ahead / handover_cost + 1  # its own hand-over too
    expected = handovers_per_s * left_s
    return needed > expected + OVERDUE_SIGMAS * math.sqrt(expected)


def overdue_in_flow(
    now: float,
    urgent_work: float,
    flow_work: float,
    newest_first: Iterable[tuple[float, float]],
    handovers_per_s: float,
    handover_cost: float = 1.0,
    *,
    in_arrival_order: bool = True,
) -> list[int]:
    """The positions (0: the newest) of the flow's queued requests, given newest first as (cost,
    leave_by), that are overdue. `urgent_work`: the more urgent bands' queued work; `flow_work`:
    all the flow's queued work. With `in_arrival_order` (FIFO within the flow) the flow's older
    requests count as ahead of each one; otherwise (EDF) only the urgent work does."""
    found: list[int] = []
    behind_and_own = 0.0
    for position, (cost, leave_by) in enumerate(newest_first):
        behind_and_own += cost
        ahead = urgent_work + (flow_work - behind_and_own if in_arrival_order else 0.0)
        if overdue(now, leave_by, max(ahead, 0.0), handovers_per_s, handover_cost):
            found.append(position)
    return found


def owners_ahead(owners: Iterable[tuple[float, Sequence[float]]], bands: int) -> list[float]:
    """Per band b, the owners' queued work in bands b and less urgent that will run within their
    quotas (more urgent bands' work counts ahead anyway). `owners`: each owner's room under its
    quota (its quota less its work in flight) and its queued work per band; its work is taken
    most urgent first, as it is granted."""
    ahead = [0.0] * bands
    for room, queued in owners:
        within = min(room, sum(queued))
        before = 0.0
        for band in range(bands):
            ahead[band] += max(0.0, within - min(room, before))
            before += queued[band]
    return ahead
