"""The simulator's view of the tenants' quotas: the work each tenant runs, read by policies.quotas
where the memory store reads its running slots (gateway/queues/memory/model_queue.py)."""

from __future__ import annotations

from collections.abc import Mapping

from policies.dispatch import QuotaState
from policies.quotas import Quota, quota_wait_s


class QuotaBook:
    def __init__(self, quotas: Mapping[str, Quota], capacity: int) -> None:
        self.quotas = dict(quotas)
        self.capacity = capacity
        self.inflight: dict[str, float] = {}

    def state(self, work_per_slot: float) -> QuotaState:
        """What dispatch reads of the quotas now, a slot taking `work_per_slot` (the memory store's
        measured work per hand-over)."""
        return QuotaState(self.quotas, self.inflight, self.capacity, work_per_slot)

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
