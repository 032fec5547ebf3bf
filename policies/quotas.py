"""May a tenant's request start now? Quotas that lend what their owners leave unused and take it back.

In Kueue's terms (ClusterQueues in a cohort): each tenant may have a quota, work in flight per model
pool that is its own (`nominal`); what it leaves unused, up to its `lending_limit`, and the pool's
capacity beyond all quotas, others may borrow, each up to its own `borrowing_limit` beyond its
quota. A tenant without a quota owns nothing and runs on what can be borrowed. The rules kept:

- Within its quota a tenant always may start (the pool's slots permitting).
- Beyond it, a request starts only if the tenant's borrowed work stays within its borrowing limit,
  all borrowed work together stays within what is lendable now (the unused quotas, each within its
  lending limit, and the capacity no quota covers), and no owner is waiting: while a tenant under
  its quota has work queued, no new borrowing starts. Reclaim thus happens as borrowed requests
  finish; a running request is never stopped for it.
- Without quotas configured nothing is ever held back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Quota:
    nominal: float
    """Work in flight (per model pool) that is the tenant's own."""
    borrowing_limit: float = math.inf
    """The most work beyond `nominal` it may borrow."""
    lending_limit: float = math.inf
    """The most of its unused `nominal` others may borrow."""


def borrowed(tenant: str, inflight: Mapping[str, float], quotas: Mapping[str, Quota]) -> float:
    """The work `tenant` runs beyond its quota (all it runs, without one)."""
    quota = quotas.get(tenant)
    return max(0.0, inflight.get(tenant, 0.0) - (quota.nominal if quota else 0.0))


def lendable(inflight: Mapping[str, float], quotas: Mapping[str, Quota], capacity: float) -> float:
    """What all borrowers together may hold: the owners' unused quotas, each within its lending
    limit, and the `capacity` (the pool's work in flight at most) that no quota covers."""
    unowned = max(0.0, capacity - sum(q.nominal for q in quotas.values()))
    unused = sum(
        min(q.lending_limit, max(0.0, q.nominal - inflight.get(owner, 0.0))) for owner, q in quotas.items()
    )
    return unowned + unused


def work_capacity(slots: int, work_per_slot: float, cost: float) -> float:
    """The pool's capacity in cost units, for the part of it no quota covers: its `slots` times
    the work a slot takes at a time (the measured mean per hand-over, `work_per_slot`), and never
    less than `cost` a slot. Quotas count work (batch items, tokens), the pool counts slots; a
    request takes one slot whatever it costs, so a request alone on a pool no owner waits for may
    start, even before any work per slot has been measured."""
    return slots * max(work_per_slot, cost)


def may_start(
    tenant: str,
    cost: float,
    inflight: Mapping[str, float],
    quotas: Mapping[str, Quota],
    slots: int,
    work_per_slot: float,
    owner_waiting: bool,
) -> bool:
    """Whether a request of `tenant` and `cost` may take a slot now, given the work each tenant has
    in flight, the quotas, the pool's `slots` and the work a slot takes (`work_capacity`), and
    whether a tenant under its quota has work queued (`owner_waiting`)."""
    if not quotas:
        return True
    quota = quotas.get(tenant)
    running = inflight.get(tenant, 0.0)
    if quota is not None and running + cost <= quota.nominal:
        return True
    if owner_waiting:
        return False
    after = {**inflight, tenant: running + cost}
    if borrowed(tenant, after, quotas) > (quota.borrowing_limit if quota else math.inf):
        return False
    total_borrowed = sum(borrowed(name, after, quotas) for name in after)
    return total_borrowed <= lendable(after, quotas, work_capacity(slots, work_per_slot, cost))


def owner_waiting(
    queued_heads: Iterable[tuple[str, float]], inflight: Mapping[str, float], quotas: Mapping[str, Quota]
) -> bool:
    """Whether, among the (tenant, cost) of the queued flows' heads, one would run within its
    tenant's quota: an owner waits, and no new borrowing starts (may_start's `owner_waiting`)."""
    return any(
        under_quota(tenant, cost, inflight, quotas) for tenant, cost in queued_heads if tenant in quotas
    )


def under_quota(tenant: str, cost: float, inflight: Mapping[str, float], quotas: Mapping[str, Quota]) -> bool:
    """Whether a request of `tenant` and `cost` would run within its own quota: an owner."""
    quota = quotas.get(tenant)
    return quota is not None and inflight.get(tenant, 0.0) + cost <= quota.nominal


def quota_wait_s(
    tenant: str,
    cost: float,
    queued_ahead: float,
    inflight: Mapping[str, float],
    quotas: Mapping[str, Quota],
    service_time_s: float,
) -> float:
    """The wait a request of `tenant` and `cost` has by its own quota alone, where the quota caps
    what the tenant may run (a finite borrowing limit): its work in flight and its `queued_ahead`
    must first come down to what leaves room for it under the cap, and at most the cap of its work
    runs at once, each request for about `service_time_s`. 0 where it may borrow without bound
    (what it waits for then is the pool, which admission predicts); inf where the cap is below its
    cost (it can never start)."""
    quota = quotas.get(tenant)
    if quota is None or math.isinf(quota.borrowing_limit):
        return 0.0
    cap = run_cap(quota)
    if cap < cost:
        return math.inf
    must_finish = inflight.get(tenant, 0.0) + queued_ahead + cost - cap
    return max(0.0, must_finish) / cap * service_time_s


def run_cap(quota: Quota) -> float:
    """The most work its tenant may run at once: its quota and all it may borrow."""
    return quota.nominal + quota.borrowing_limit
