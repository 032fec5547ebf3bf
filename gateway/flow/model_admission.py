"""One model's admission state, in one place: what admission reads and keeps of a model between
its requests, and the three questions it answers with it.

It keeps:
- the work limits read from the state of the pool (gateway/flow/predictions.py);
- each flow's calibrated confidence (policies.calibration). A flow is a (band, tenant): the flows
  of one band share a pool but not their errors. Under fair queuing a tenant of costly requests
  waits for its turn behind the others' work, and its predicted waits err more than theirs;
  calibrated per band, the many cheap requests served in time loosened the margin for all, and
  the costly tenant's admitted requests expired ten times as often as the target (8-item batches
  against single items, weighted 1:3: 10% of its admitted requests expired where the band as a
  whole stayed under 1%). A flow not seen yet starts from its band's, which every outcome in the
  band steers, and which the metric shows. Flows are the configured tenants' and one for the rest,
  so they are bounded;
- each band's recent costs, whose rank sets a request's share of a contended queue's room
  (policies.cost_ranks);
- the return schedules Retry-After books (gateway/flow/return_schedules.py).

It answers: the limit a request's offer is checked against (`limit`), the refusal with its
Retry-After (`advise`), and what an outcome teaches (`settled`). The controller keeps one per model
(gateway/flow/controller.py); the simulator one for its pool (gateway/tools/simulate/admitting.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gateway.flow.predictions import Predictions
from gateway.flow.return_schedules import ReturnSchedules
from gateway.flow.stepwise import StepRunner, run_stepwise
from policies.admission import AdmissionConfig, AdmissionRequest, Reject, refuse
from policies.calibration import confidence_after, starting_confidence
from policies.cost_ranks import CostRanks, room_share
from policies.outcomes import Outcome
from policies.wait import QueueStats, Throughput


class ModelAdmission:
    def __init__(
        self,
        bands: int,
        config: AdmissionConfig,
        returns: ReturnSchedules,
        jitter: Callable[[], float],
        run_steps: StepRunner[float] = run_stepwise,
    ) -> None:
        self.config = config
        self.predictions = Predictions(bands, config, run_steps=run_steps)
        self.returns = returns
        self._jitter = jitter
        start = starting_confidence(config.safety_sigmas, config.calibration)
        self._by_band = [start] * bands
        self._by_flow: dict[tuple[int, str], float] = {}
        self._cost_ranks = [CostRanks() for _ in range(bands)]

    def room_share(self, band: int, cost: float) -> float:
        """The share of a contended queue's room a request of `cost` may fill, by its cost's rank
        among the costs recently offered to its band, which it joins (policies.cost_ranks)."""
        ranks = self._cost_ranks[band]
        rank = ranks.rank(cost)
        ranks.add(cost)
        return room_share(rank, self.config.room_for_costliest)

    def confidence(self, band: int, tenant: str) -> float:
        """The confidence a request of the flow (`tenant`: its flow's, "" for no configured one) is
        admitted at."""
        found = self._by_flow.get((band, tenant))
        return self._by_band[band] if found is None else found

    def band_confidence(self, band: int) -> float:
        return self._by_band[band]

    def settled(self, band: int, tenant: str, expired: bool) -> float:
        """An admitted request of the flow that waited in the queue left it: `expired` (or told it
        would), or with its slot. Returns the band's confidence after it."""
        calibration = self.config.calibration
        flow = (band, tenant)
        self._by_flow[flow] = confidence_after(self.confidence(band, tenant), expired, calibration)
        self._by_band[band] = confidence_after(self._by_band[band], expired, calibration)
        return self._by_band[band]

    def limit(
        self,
        request: AdmissionRequest,
        stats: QueueStats,
        throughput: Throughput,
        external: float,
        now: float,
    ) -> float:
        """The work limit the store checks the request's offer against, at its flow's confidence
        (Predictions.offered_limit)."""
        confidence = self.confidence(request.band, request.tenant or "")
        return self.predictions.offered_limit(request, stats, throughput, external, now, confidence)

    def advise(
        self,
        request: AdmissionRequest,
        stats: QueueStats,
        throughput: Throughput,
        now: float,
        *,
        reason: Outcome | None = None,
    ) -> Reject:
        """The refusal, with Retry-After the time its return is booked for (ReturnSchedules)."""
        confidence = self.confidence(request.band, request.tenant or "")
        read = self.predictions.pool_wait(request.band, stats, throughput, now, confidence)
        reject = refuse(
            request, stats, throughput, self._jitter(), self.config, reason=reason, pool_wait=read
        )
        advice = self.book_return(request, reject.excess_wait_s, throughput, now)
        return replace(reject, retry_after_s=advice)

    def book_return(
        self,
        request: AdmissionRequest,
        excess_s: float,
        throughput: Throughput,
        now: float,
        drains: bool = True,
    ) -> float:
        """Seconds until a refused request should come back, its return booked (ReturnSchedules.advise)."""
        band, cost, jitter_u = request.band, request.cost, self._jitter()
        return self.returns.advise(band, cost, excess_s, throughput, now, jitter_u, drains=drains)
