"""Admission in the simulator: the gateway's own, on simulated time.

An arrival of a class with a `max_wait_s` is admitted as the gateway admits it: the limit comes
from gateway/flow/predictions.py (policies.admission.work_limit reading the pool: how long each
slot in use has run, and the service times measured as they end), and the store's check is
policies.wait.work_before_grant against it, as gateway/queues/memory/store.py makes it. The speeds it
reads are measured as the gateway measures them: the memory store's counters (offered, admitted,
handed over, drained while backlogged) fed to gateway/queues/estimates.py, from the operator's
expected service time on. The confidence asked of each flow is the gateway's own
(gateway/flow/calibration.py), steered by the same outcomes: an admitted request that queued is
served, or expires in the queue. Readings run whole at once: simulated time does not move while they run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.flow.model_admission import ModelAdmission
from gateway.flow.return_schedules import ReturnSchedules
from gateway.queues.estimates import PoolEstimates, StoreCounters
from gateway.settings import Estimation
from policies.admission import AdmissionConfig, AdmissionRequest, allowed_wait_s, offer_reach
from policies.steps import Steps, finished
from policies.wait import QueueStats, Throughput


@dataclass(frozen=True, slots=True)
class Admission:
    """Admission on: what the gateway is told before it has measured anything, and its settings."""

    expected_service_s: float
    """The operator's `expected_service_ms`: the prior of the measured service times."""
    config: AdmissionConfig = field(default_factory=AdmissionConfig)
    estimation: Estimation = field(default_factory=Estimation)


def _at_once(steps: Steps[float], on_value: Callable[[float], None]) -> None:
    on_value(finished(steps))


class Admitting:
    """One simulated pool's admission state: its counters and estimates, its readings, the slots
    in use with when each was handed over, and each band's confidence."""

    def __init__(
        self,
        admission: Admission,
        bands: int,
        slots: int,
        reserved: tuple[int, ...],
        jitter: Callable[[], float],
    ) -> None:
        self.slots, self.reserved = slots, reserved
        estimation = admission.estimation
        self.estimates = PoolEstimates(bands, admission.expected_service_s, estimation)
        self.counters = StoreCounters.empty(bands)
        config = admission.config
        returns = ReturnSchedules(bands, config.retry, estimation.rate_window_s, estimation.settled_window_s)
        self.model = ModelAdmission(bands, config, returns, jitter, run_steps=_at_once)
        self.started_at: list[float] = []
        """When each slot in use was handed over."""
        self.backlogged_handover_at: float | None = None
        """As the memory store's ModelQueue: set after a hand-over of a freed slot that left
        requests waiting, so that the gap to the next one is a sample of the drain rate."""

    def throughput(self, now: float) -> Throughput:
        return self.estimates.throughput(self.slots, now, self.reserved)

    def arrived(self, band: int, cost: float, now: float) -> None:
        """Count an arrival's work as offered (the memory store's offer_nowait)."""
        self.estimates.observe(self.counters, now)  # closes the counting interval before this one
        self.counters.offered_work[band] += cost

    def request(
        self, band: int, max_wait_s: float, deadline_s: float | None, cost: float, tenant: str
    ) -> AdmissionRequest:
        """An arrival as the controller puts it to admission, its share of the room by its cost's rank."""
        share = self.model.room_share(band, cost)
        return AdmissionRequest(band, max_wait_s, deadline_s, cost, tenant, share)

    def admitted_until(self, request: AdmissionRequest, stats: QueueStats, now: float) -> float:
        """When `request`, arriving at `now` to a pool in `stats`, must leave the queue if it is
        admitted; -inf when admission refuses it."""
        throughput, band = self.throughput(now), request.band
        limit = self.model.limit(request, stats, throughput, 0.0, now)
        reach = offer_reach(request, throughput)
        checked = stats.work_before_grant(band, request.tenant, throughput.handover_cost, request.cost, reach)
        if limit < 0 or checked > limit:
            return -math.inf
        return now + allowed_wait_s(request, throughput)

    def admitted(self, band: int, tenant: str, cost: float) -> None:
        """Count an admitted arrival's work (the memory store's offer_nowait)."""
        self.counters.count_admitted(band, tenant, cost)

    def handed_over(
        self, now: float, band: int, tenant: str, cost: float, queued: bool, released: int, backlog: bool
    ) -> None:
        """A slot handed over at `now`: to a request that `queued` (else granted on arrival), the
        `released`th hand-over (from 1) since a slot freed (0: not on a freed slot's account), with
        requests still waiting after it (`backlog`). Counted as MemoryQueue._dispatch counts: only
        the freed slot's own hand-over is a sample of the drain rate."""
        self.started_at.append(now)
        counters = self.counters
        counters.count_granted(band, tenant, cost)
        if not queued:
            return
        counters.handovers += 1
        counters.handed_work += cost
        if released == 1 and self.backlogged_handover_at is not None:
            counters.drained_work += cost
            counters.drained_s += now - self.backlogged_handover_at
            counters.drained_at = now
        self.backlogged_handover_at = now if (released and backlog) else None

    def queue_emptied(self) -> None:
        self.backlogged_handover_at = None

    def ended(self, started_at: float, service_s: float) -> None:
        self.started_at.remove(started_at)
        self.estimates.record_service(service_s)

    def advise(self, request: AdmissionRequest, stats: QueueStats, now: float) -> float:
        """The Retry-After a refused request is told, its return booked (ModelAdmission.advise)."""
        return self.model.advise(request, stats, self.throughput(now), now).retry_after_s

    def settled(self, band: int, tenant: str, expired: bool) -> None:
        """An admitted request of the flow that queued left the queue: `expired`, or with its slot."""
        self.model.settled(band, tenant, expired)
