"""The simulator's view of the tenants' quotas: the work each tenant runs, read by policies.quotas
where the memory store reads its running slots (gateway/queues/memory_pool.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from policies.quotas import Quota, may_start, owner_waiting, quota_wait_s


class QuotaBook:
    def __init__(self, quotas: Mapping[str, Quota], capacity: int) -> None:
        self.quotas = dict(quotas)
        self.capacity = capacity
        self.inflight: dict[str, float] = {}

    def may_start(self, tenant: str, cost: float, queued_heads: Iterable[tuple[str, float]]) -> bool:
        """Whether a request of `tenant` and `cost` may take a slot now, given the (tenant, cost)
        of every queued flow's head (an owner among them under its quota stops new borrowing)."""
        waiting = owner_waiting(queued_heads, self.inflight, self.quotas)
        return may_start(tenant, cost, self.inflight, self.quotas, self.capacity, 1.0, waiting)

    def wait_s(self, tenant: str, cost: float, queued_ahead: float, service_time_s: float) -> float:
        """The wait the tenant's own capped quota gives a request (policies.quotas.quota_wait_s)."""
        return quota_wait_s(tenant, cost, queued_ahead, self.inflight, self.quotas, service_time_s)

    def start(self, tenant: str, cost: float) -> None:
        self.inflight[tenant] = self.inflight.get(tenant, 0.0) + cost

    def finish(self, tenant: str, cost: float) -> None:
        left = self.inflight[tenant] - cost
        if left > 1e-9 * max(1.0, cost):
            self.inflight[tenant] = left
        else:
            del self.inflight[tenant]  # no float residue once it runs nothing
