"""AdmissionController: admit a request, hold it while it waits for a slot, and give the slot back.

The wait races three things: the grant, the request's leave-by time (its class's max wait, or its
budget less the expected service time) and the client's disconnect. Whichever comes first ends
it; a ticket that leaves is withdrawn (the store finishes that step even if this task is cancelled),
and a slot granted in the same instant goes straight back to the pool. A Lease is released exactly
once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gateway.queues.base import Full, Granted, RequestQueue, Slot, Ticket, Unavailable
from gateway.settings import PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from policies.admission import AdmissionConfig, AdmissionRequest, allowed_wait_s, max_positions, refuse
from policies.outcomes import Outcome

_DEFAULT_ADMISSION = AdmissionConfig()


@dataclass(slots=True, eq=False)
class Lease:
    slot: Slot
    queue_wait_s: float


@dataclass(frozen=True, slots=True)
class Refusal:
    outcome: Outcome
    retry_after_s: float | None = None


class AdmissionController:
    def __init__(
        self,
        store: RequestQueue,
        priorities: Sequence[PriorityClass],
        metrics: GatewayMetrics,
        *,
        admission: AdmissionConfig = _DEFAULT_ADMISSION,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._store = store
        self._class_names = [p.name for p in priorities]
        self._max_wait_s = [p.max_wait_ms / 1000 for p in priorities]
        self._metrics = metrics
        self._admission = admission
        self._clock = clock
        self._jitter = jitter

    async def acquire(
        self,
        model: str,
        band: int,
        budget_s: float | None,
        until_disconnect: Callable[[], Awaitable[object]],
    ) -> Lease | Refusal:
        """A slot for a request of `band`, or the reason it gets none.

        `until_disconnect` returns when the client goes away; it is awaited only while queued.
        """
        arrived_at = self._clock()
        request = AdmissionRequest(band=band, max_queue_wait_s=self._max_wait_s[band], budget_s=budget_s)
        throughput = self._store.throughput(model, arrived_at)
        allowed_s = allowed_wait_s(request, throughput, self._admission.safety_sigmas)
        offer = await self._store.offer(
            model, band, allowed_s, max_positions(request, throughput, self._admission), arrived_at
        )
        if isinstance(offer, Granted):
            self._metrics.observe_queue_wait(model, self._class_names[band], 0.0)
            return Lease(offer.slot, 0.0)
        if isinstance(offer, Full):
            reject = refuse(request, offer.stats, throughput, self._jitter(), self._admission)
            return self._refusal(model, band, reject.reason, reject.retry_after_s)
        if isinstance(offer, Unavailable):
            return Refusal(Outcome.STORE_UNAVAILABLE, offer.retry_after_s)

        result = await self._wait(offer.ticket, allowed_s, until_disconnect)
        waited_s = self._clock() - arrived_at
        if isinstance(result, Slot):
            self._metrics.observe_queue_wait(model, self._class_names[band], waited_s)
            return Lease(result, waited_s)
        if result is Outcome.DEADLINE_EXPIRED_IN_QUEUE:
            now = self._clock()
            reject = refuse(
                request,
                self._store.stats(model),
                self._store.throughput(model, now),
                self._jitter(),
                self._admission,
                reason=result,
            )
            return self._refusal(model, band, result, reject.retry_after_s)
        return Refusal(result)

    async def release(self, lease: Lease, service_s: float | None = None) -> None:
        """Give the slot back (idempotent); `service_s` feeds the service-time estimate."""
        if lease.slot.released:
            return
        if service_s is not None:
            self._store.record_service(lease.slot.model, service_s)
        await self._store.release(lease.slot, self._clock())

    def release_soon(self, lease: Lease, service_s: float | None = None) -> bool:
        """`release` for synchronous callbacks: the moment the backend's answer is complete.

        True when the slot went straight to a waiting request.
        """
        if lease.slot.released:
            return False
        if service_s is not None:
            self._store.record_service(lease.slot.model, service_s)
        return self._store.release_soon(lease.slot, self._clock())

    def _refusal(self, model: str, band: int, outcome: Outcome, retry_after_s: float) -> Refusal:
        self._metrics.observe_retry_after(model, self._class_names[band], retry_after_s)
        return Refusal(outcome, retry_after_s)

    async def _wait(
        self,
        ticket: Ticket,
        timeout_s: float,
        until_disconnect: Callable[[], Awaitable[object]],
    ) -> Slot | Outcome:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(0.0, timeout_s), ticket.interrupt, Outcome.DEADLINE_EXPIRED_IN_QUEUE)
        watcher = asyncio.ensure_future(until_disconnect())
        watcher.add_done_callback(lambda _: ticket.interrupt(Outcome.CLIENT_DISCONNECTED))
        result: Slot | Outcome = Outcome.CLIENT_DISCONNECTED
        try:
            result = await ticket.wakeup
            return result
        finally:
            timer.cancel()
            watcher.cancel()
            if not isinstance(result, Slot):
                await self._store.withdraw(ticket, result)
