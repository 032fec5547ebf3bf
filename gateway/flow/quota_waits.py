"""Refuse at arrival what a tenant's hard quota would keep waiting past its allowance.

Admission predicts the pool's drain. A tenant whose quota caps what it runs (a finite borrowing
limit) waits for its own work as well, however fast the pool turns over for others: admitted on
the pool's prediction, its requests would expire in the queue. The wait its quota adds is
policies.quotas.quota_wait_s, read from the store's view (the tenant's work in flight, and its
work queued ahead in its own and the more urgent bands where they are fair-queued).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from policies.admission import AdmissionRequest, allowed_wait_s
from policies.quotas import Quota, quota_wait_s, run_cap
from policies.wait import QueueStats, Throughput


class QuotaWaits:
    def __init__(self, quotas: Mapping[str, Quota]) -> None:
        self._capped = {tenant: q for tenant, q in quotas.items() if not math.isinf(q.borrowing_limit)}

    def applies(self, tenant: str) -> bool:
        return tenant in self._capped

    def excess_s(self, request: AdmissionRequest, stats: QueueStats, throughput: Throughput) -> float:
        """How much longer than allowed the request would wait by its tenant's quota alone (not
        positive: it fits)."""
        tenant = request.tenant or ""
        turns = stats.fair_turns[: request.band + 1] if stats.fair_turns else ()
        ahead = sum(t.queued.get(tenant, 0.0) for t in turns if t is not None)
        wait = quota_wait_s(
            tenant, request.cost, ahead, stats.inflight_by_tenant, self._capped, throughput.service_time_s
        )
        return wait - allowed_wait_s(request, throughput)

    def cap(self, tenant: str) -> float:
        """The most work the tenant may run at once."""
        return run_cap(self._capped[tenant])

    def drain_rate_per_s(self, tenant: str, throughput: Throughput) -> float:
        """How fast the tenant's own work comes down at most: its cap of work each service time."""
        return self.cap(tenant) / throughput.service_time_s
