"""AdmissionController: admit a request, hold it while it waits for a slot, and give the slot back.

The wait races three things: the grant, the request's leave-by time (its class's max wait, or its
budget less the expected service time) and the client's disconnect. Whichever comes first ends
it; a ticket that leaves is withdrawn (the store finishes that step even if this task is cancelled),
and a slot granted in the same instant goes straight back to the pool. A Lease is released exactly
once.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial

from gateway.flow.batch_holds import BatchHolds
from gateway.flow.model_admission import ModelAdmission
from gateway.flow.queued_bytes import QueuedBytes
from gateway.flow.quota_waits import QuotaWaits
from gateway.flow.return_schedules import ReturnSchedules
from gateway.flow.signal_view import NoSignals, SignalView
from gateway.flow.verdicts import Lease, Refusal
from gateway.flow.waiting import wait_for_slot
from gateway.flow.windows import WindowClock
from gateway.queues.base import Batching, Flow, Full, Granted, Queued, RequestQueue, Slot, Unavailable
from gateway.settings import PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from policies.admission import (
    AdmissionConfig,
    AdmissionRequest,
    Reject,
    allowed_wait_s,
    budget_hopeless,
    min_budget_s,
    offer_reach,
    refuse,
)
from policies.outcomes import Outcome
from policies.queued_bytes import ByteLimits, bytes_excess_wait_s, model_bound_binds
from policies.quotas import Quota
from policies.retry_after import retry_after_s
from policies.sequences import SequenceRef
from policies.shedding import BacklogLimits, first_shed_band, shed_excess_wait_s
from policies.wait import QueueStats, Throughput

_DEFAULT_ADMISSION = AdmissionConfig()
BUDGET_RULE = "X-Request-Timeout-Ms"
"""The rule a refusal names when the client's own budget was what could not be met."""


class AdmissionController:
    def __init__(
        self,
        store: RequestQueue,
        priorities: Sequence[PriorityClass],
        metrics: GatewayMetrics,
        *,
        admission: AdmissionConfig = _DEFAULT_ADMISSION,
        signals: SignalView | None = None,
        backlog_limits: BacklogLimits | None = None,
        queued_bytes: QueuedBytes | None = None,
        rates_seen_s: float = 2.0,
        settled_seen_s: float = 30.0,
        windows: WindowClock | None = None,
        quotas: Mapping[str, Quota] | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._store = store
        self._holds = BatchHolds(store, clock)
        self._queued_bytes = queued_bytes if queued_bytes is not None else QueuedBytes(ByteLimits(1 << 62))
        self._signals = signals if signals is not None else NoSignals()
        self._backlog_limits = backlog_limits
        self._class_names = [p.name for p in priorities]
        self._max_wait_s = [p.max_wait_ms / 1000 for p in priorities]
        self._metrics = metrics
        self._admission = admission
        self._clock = self.clock = clock
        self._jitter = jitter
        self._models: dict[str, ModelAdmission] = {}
        self._rates_seen_s = rates_seen_s
        """How far back the arrival-rate estimates remember (settings.estimation.rate_window_s)."""
        self._settled_seen_s = settled_seen_s
        """And the settled-times rate (settings.estimation.settled_window_s)."""
        self._windows = windows if windows is not None and windows.restricts else None
        self._quota_waits = QuotaWaits(quotas or {})

    def reload_waits(self, priorities: Sequence[PriorityClass]) -> None:
        """Each class's `max_wait_ms` from now on (a config reload; the classes stay the same)."""
        assert [p.name for p in priorities] == self._class_names, "a reload keeps the classes"
        self._max_wait_s = [p.max_wait_ms / 1000 for p in priorities]

    async def acquire(
        self,
        flow: Flow,
        cost: float,
        budget_s: float | None,
        until_disconnect: Callable[[], Awaitable[object]],
        on_grant: Callable[[Slot], None] | None = None,
        batching: Batching | None = None,
        body_bytes: int = 0,
        kind: str = "",
        exemplar: dict[str, str] | None = None,
        sequence: SequenceRef | None = None,
    ) -> Lease | Refusal:
        """A slot for a request of `flow` that costs `cost` work units, or the reason it gets none.

        `until_disconnect` is called once the request is queued (not when it is refused or
        granted at once) and awaited while it waits: it returns when the client goes away.
        `on_grant` runs inside the store's grant when a queued request gets its slot (see Ticket),
        and before anything else when it gets one at the offer.
        `body_bytes` (its body, held in this replica) counts against the queued-bytes bound until
        it leaves the queue. `kind`: the request's kind (policies.request_kinds), for its service time.
        `exemplar`: its trace id, where traced and sampled, kept beside its queue wait's bucket.
        `sequence`: the sequence it belongs to, whose backend the store pins it to.
        """
        model, band = flow.model, flow.band
        arrived_at = self._clock()
        share = self._admission_of(model).room_share(band, cost)
        request = AdmissionRequest(band, self._max_wait_s[band], budget_s, cost, flow.tenant, share, kind)
        throughput = self._store.throughput(model, arrived_at)
        if budget_hopeless(request, throughput):  # first: no wait, for a window or else, helps it
            return self._hopeless(model, request, throughput)
        if self._windows is not None and (closed := self._windows.closed_for(band, flow.tenant)):
            closed_s, window = closed
            return self._refusal(model, band, Outcome.OUTSIDE_WINDOW, closed_s, f"windows[{window}]")
        external = int(self._signals.external_waiting(model)) * throughput.handover_cost
        if (shed := self._shed(model, request, throughput, external)) is not None:
            return shed
        if self._quota_waits.applies(flow.tenant) and (over := self._over_quota(request, throughput, flow)):
            return over
        if body_bytes and (excess := self._queued_bytes.hold(model, body_bytes)) > 0:
            # No room to queue its body; a slot free this moment it may still take (a limit of no
            # work ahead), since bodies count only while they wait.
            now = await self._slot_now(flow, request, arrived_at, batching, on_grant, exemplar, sequence)
            return (
                self._too_many_bytes(model, request, throughput, excess, body_bytes) if now is None else now
            )
        try:
            return await self._queue(
                flow,
                request,
                throughput,
                external,
                arrived_at,
                until_disconnect,
                on_grant,
                batching,
                exemplar,
                sequence,
            )
        finally:
            if body_bytes:
                self._queued_bytes.give_back(model, body_bytes)

    async def _queue(
        self,
        flow: Flow,
        request: AdmissionRequest,
        throughput: Throughput,
        external: float,
        arrived_at: float,
        until_disconnect: Callable[[], Awaitable[object]],
        on_grant: Callable[[Slot], None] | None,
        batching: Batching | None,
        exemplar: dict[str, str] | None = None,
        sequence: SequenceRef | None = None,
    ) -> Lease | Refusal:
        """Offer the request to the store and, if it is queued, wait for its slot."""
        model, band, cost = flow.model, flow.band, request.cost
        allowed_s = allowed_wait_s(request, throughput)
        stats = self._store.stats(model)
        admission = self._admission_of(model)
        limit = admission.limit(request, stats, throughput, external, arrived_at)
        reach = offer_reach(request, throughput)
        # A held batch leaves while its most urgent member still has a service time to spare
        # beyond its allowed wait: a batch is served more slowly than one request.
        leave_by = arrived_at + allowed_s - throughput.service_time_s
        if batching is not None and batching.max_delay_s > 0:
            batching = self._holds.decide(flow, batching, cost, leave_by, stats.free_for(band))
        offering = self._store.offer(
            flow, cost, allowed_s, limit, arrived_at, batching, on_grant, request.kind, reach, sequence
        )
        offer = await (offering if batching is None else self._holds.offering(flow, batching, offering))
        if isinstance(offer, Full) and not offer.at_cap and offer.stats != stats:
            # The limit was read from a view the store has moved on from (a Redis replica's is the
            # one its last script brought: between its own requests, seconds old). Read again from
            # the view the refusal brought, and offer once more where that one admits.
            fresh = offer.stats
            limit = admission.limit(request, fresh, throughput, external, arrived_at)
            if fresh.work_before_grant(band, flow.tenant, throughput.handover_cost, cost, reach) <= limit:
                stats = fresh
                offering = self._store.offer(
                    flow, cost, allowed_s, limit, arrived_at, batching, on_grant, request.kind, reach,
                    sequence,
                )  # fmt: skip
                offer = await (
                    offering if batching is None else self._holds.offering(flow, batching, offering)
                )
        if isinstance(offer, Granted):
            return self._granted_now(offer.slot, flow, on_grant, exemplar)
        if isinstance(offer, Full):
            stats = replace(offer.stats, external_waiting=external) if external else offer.stats
            if offer.at_cap:
                reject = self._advise(model, request, stats, throughput, reason=Outcome.QUEUE_FULL)
                rule = f"models[{model}].max_queued_work"
            else:
                reject = self._advise(model, request, stats, throughput)
                rule = self._bound(request, reject.reason, allowed_s)
            return self._refusal(model, band, reject.reason, reject.retry_after_s, rule)
        if isinstance(offer, Unavailable):
            return Refusal(Outcome.STORE_UNAVAILABLE, offer.retry_after_s)

        class_name = self._class_names[band]
        try:  # whatever raises, no ticket stays queued for a caller that is gone
            if batching is not None and batching.hold:
                self._holds.held(offer.ticket, batching, leave_by)
            self._metrics.count_admitted_into_queue(model, class_name)
            observe = partial(self._metrics.observe_predicted_wait, model, class_name)
            confidence = admission.confidence(band, flow.tenant)
            admission.predictions.sample_wait(band, stats, throughput, arrived_at, confidence, observe)
        except BaseException:
            await self._store.withdraw(offer.ticket, Outcome.CLIENT_DISCONNECTED)
            raise
        result = await wait_for_slot(self._store, offer.ticket, allowed_s, until_disconnect)
        waited_s = self._clock() - arrived_at
        # A request displaced as overdue was admitted on a wait it would not have had: a miss, as
        # an expiry is, for the calibration of the admission margin.
        overdue = result is Outcome.DISPLACED and offer.ticket.overdue
        if isinstance(result, Slot) or result is Outcome.DEADLINE_EXPIRED_IN_QUEUE or overdue:
            confidence = admission.settled(band, flow.tenant, expired=not isinstance(result, Slot))
            self._metrics.set_confidence(model, self._class_names[band], confidence)
        if isinstance(result, Slot):
            self._metrics.observe_queue_wait(model, self._class_names[band], waited_s, exemplar)
            if batching is None:
                return Lease(result, waited_s)
            batch_wait_s = waited_s if batching.hold else 0.0
            self._metrics.observe_batch_wait(model, batch_wait_s)
            return Lease(result, waited_s, batch_wait_s)
        if result is Outcome.DEADLINE_EXPIRED_IN_QUEUE or result is Outcome.DISPLACED:
            throughput = self._store.throughput(model, self._clock())
            reject = self._advise(model, request, self._store.stats(model), throughput, reason=result)
            if result is Outcome.DISPLACED and not overdue:
                rule = f"models[{model}].max_queued_work"
            else:  # expired, or would have: the allowance it could not be served within
                rule = self._bound(request, Outcome.DEADLINE_EXPIRED_IN_QUEUE, allowed_s)
            return self._refusal(model, band, result, reject.retry_after_s, rule)
        return Refusal(result)

    async def _slot_now(
        self,
        flow: Flow,
        request: AdmissionRequest,
        arrived_at: float,
        batching: Batching | None,
        on_grant: Callable[[Slot], None] | None,
        exemplar: dict[str, str] | None = None,
        sequence: SequenceRef | None = None,
    ) -> Lease | None:
        """A slot free this moment, or None: the offer's limit of no work ahead keeps it from queuing."""
        offer = await self._store.offer(
            flow, request.cost, 0.0, 0.0, arrived_at, batching, kind=request.kind, sequence=sequence
        )
        if isinstance(offer, Granted):
            return self._granted_now(offer.slot, flow, on_grant, exemplar)
        if isinstance(offer, Queued):  # not for a limit of 0, unless a store rounds it differently
            await self._store.withdraw(offer.ticket, Outcome.QUEUE_FULL)
        return None

    def _granted_now(
        self, slot: Slot, flow: Flow, on_grant: Callable[[Slot], None] | None, exemplar: dict[str, str] | None
    ) -> Lease:
        """A slot granted at the offer: its hook runs first, as a queued one's does in the grant, so
        that the caller holds the slot before anything else here may raise."""
        if on_grant is not None:
            on_grant(slot)
        self._metrics.observe_queue_wait(flow.model, self._class_names[flow.band], 0.0, exemplar)
        return Lease(slot, 0.0)

    async def release(self, lease: Lease, service_s: float | None = None) -> None:
        """Give the slot back (idempotent); `service_s` feeds the service-time estimate."""
        if lease.slot.released:
            return
        if service_s is not None:
            self._store.record_service(lease.slot.model, service_s, lease.slot)
        await self._store.release(lease.slot, self._clock())

    def release_soon(self, slot: Slot, service_s: float | None = None) -> bool:
        """`release` for synchronous callbacks, once the answer is complete; True if a waiter took it."""
        if slot.released:
            return False
        if service_s is not None:
            self._store.record_service(slot.model, service_s, slot)
        return self._store.release_soon(slot, self._clock())

    def _hopeless(self, model: str, request: AdmissionRequest, throughput: Throughput) -> Refusal:
        """No Retry-After: the budget is too small for any load; the body says what would do now."""
        stats = self._store.stats(model)
        need_s = min_budget_s(stats, throughput, request.band, self._admission.safety_sigmas)
        detail = f"at least {math.ceil(need_s * 1000)} ms would do now"
        return Refusal(Outcome.BUDGET_TOO_SMALL, None, detail, BUDGET_RULE)

    def _too_many_bytes(
        self, model: str, request: AdmissionRequest, throughput: Throughput, excess: int, body_bytes: int
    ) -> Refusal:
        """queue_full for a body the queued-bytes bound has no room for, with the time the queue
        needs to hand out enough bodies."""
        queued_work = sum(self._store.stats(model).queued_work_by_band)
        held = self._queued_bytes.held.get(model, 0)
        excess_s = bytes_excess_wait_s(excess, held, queued_work, throughput.drain_rate_per_s)
        advice = self._book_return(model, request, excess_s, throughput, drains=False)
        limits = self._queued_bytes.limits
        own = model_bound_binds(limits, self._queued_bytes.held, model, body_bytes)
        rule = f"models[{model}].max_queued_bytes" if own else "limits.max_queued_bytes"
        return self._refusal(model, request.band, Outcome.QUEUE_FULL, advice, rule)

    def _over_quota(self, request: AdmissionRequest, throughput: Throughput, flow: Flow) -> Refusal | None:
        """Refuse at once what the tenant's capped quota keeps waiting past its allowance."""
        excess_s = self._quota_waits.excess_s(request, self._store.stats(flow.model), throughput)
        if excess_s <= 0:
            return None
        rule = f"tenants[{flow.tenant}].quota"
        if math.isinf(excess_s):  # above what the tenant may ever run: coming back cannot help
            detail = f"it costs {request.cost:g}, at most {self._quota_waits.cap(flow.tenant):g} may run"
            return Refusal(Outcome.COST_ABOVE_QUOTA, None, detail, rule)
        drain = self._quota_waits.drain_rate_per_s(flow.tenant, throughput)
        advice = retry_after_s(excess_s, drain, self._jitter(), self._admission.retry)
        budget_binds = allowed_wait_s(request, throughput) < request.max_queue_wait_s
        outcome = Outcome.DEADLINE_UNMEETABLE if budget_binds else Outcome.QUEUE_FULL
        return self._refusal(flow.model, request.band, outcome, advice, rule)

    def _shed(
        self, model: str, request: AdmissionRequest, throughput: Throughput, external: float
    ) -> Refusal | None:
        """Refuse at once a class the cluster backlog sheds, with the cluster's wait added."""
        backlog = self._signals.backlog()
        if backlog is None or self._backlog_limits is None:
            return None
        first = first_shed_band(backlog, self._backlog_limits, len(self._class_names))
        if first is None or request.band < first:
            return None
        stats = replace(self._store.stats(model), external_waiting=external)
        excess_s = refuse(request, stats, throughput, self._jitter(), self._admission).excess_wait_s
        # Booked for the time it is told (after the cluster's wait, which the band's drain does not
        # shorten): where its return will land.
        advice = self._book_return(model, request, shed_excess_wait_s(excess_s, backlog), throughput, False)
        return self._refusal(model, request.band, Outcome.CLUSTER_BACKLOGGED, advice, "kueue")

    def _advise(
        self,
        model: str,
        request: AdmissionRequest,
        stats: QueueStats,
        throughput: Throughput,
        *,
        reason: Outcome | None = None,
    ) -> Reject:
        """The refusal, with Retry-After the time its return is booked for (see ReturnSchedules)."""
        return self._admission_of(model).advise(request, stats, throughput, self._clock(), reason=reason)

    def _admission_of(self, model: str) -> ModelAdmission:
        admission = self._models.get(model)
        if admission is None:
            returns = ReturnSchedules(
                len(self._class_names), self._admission.retry, self._rates_seen_s, self._settled_seen_s
            ).shared_as(model, self._store.shared_returns)
            admission = self._models[model] = ModelAdmission(
                len(self._class_names), self._admission, returns, self._jitter
            )
        return admission

    def _book_return(
        self,
        model: str,
        request: AdmissionRequest,
        excess_s: float,
        throughput: Throughput,
        drains: bool = True,
    ) -> float:
        return self._admission_of(model).book_return(request, excess_s, throughput, self._clock(), drains)

    def _bound(self, request: AdmissionRequest, outcome: Outcome, allowed_s: float) -> str:
        """Which limit refused the request: its budget (less the service time), or its class's
        longest wait, whichever was the tighter (`allowed_s`)."""
        if outcome is Outcome.DEADLINE_UNMEETABLE or allowed_s < request.max_queue_wait_s:
            return BUDGET_RULE
        return f"priorities[{self._class_names[request.band]}].max_wait_ms"

    def _refusal(
        self, model: str, band: int, outcome: Outcome, retry_after_s: float, rule: str | None = None
    ) -> Refusal:
        self._metrics.observe_retry_after(model, self._class_names[band], retry_after_s)
        return Refusal(outcome, retry_after_s, rule=rule)
