"""The admitted call: one request's way through admission to a backend slot and back, for any ingress.

It admits the request through the controller, waits for its slot, hands the slot to the request's
upstream work, and lets the ingress relay the answer while it holds the slot. Its rules:
- the slot is released exactly once: by the work's `on_done`, inside the callback in which the
  backend is done with the request (never when only the client is), or at once when no work was
  started on it, whatever was cancelled or raised;
- the work starts inside the store's grant (`start_at_grant`), so the next request is on its way
  in the same callback that freed the slot;
- the outcome is counted exactly once: the refusal, or what the relay ended with;
- the drain's cut (gateway.flow.drain: a cancellation it takes back) is counted `draining`: a
  queued call is withdrawn and refused, one with a slot ends as the ingress answers the cut.

The ingress (HTTP: gateway.http.relay; gRPC later) supplies the client's side as an `Ingress`; the
upstream work is gateway.upstream.exchange's. Neither is imported here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.flow.controller import AdmissionController
from gateway.flow.drain import DRAINING_RETRY_S, Drain
from gateway.flow.queued_requests import QueuedRequest, QueuedRequests
from gateway.flow.verdicts import Lease, Refusal
from gateway.queues.base import STORE_PROBE_INTERVAL_S, Batching, Flow, Slot
from gateway.telemetry.access_log import AccessRecord
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.tracing import RequestTrace
from gateway.upstream.backends import ModelPool
from policies.outcomes import Outcome
from policies.sequences import SequenceRef


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Who asks, how urgently, and with what budget (each ingress reads it from its own headers)."""

    priority: str
    band: int
    tenant: str | None
    budget_s: float | None
    flow_tenant: str = ""
    """The tenant whose flow the request joins: a configured tenant's name, or "" for the one
    default flow (an unchecked X-Tenant value never makes a flow of its own)."""
    retry: bool = False
    """The client says this is a retry (of a refused or failed request)."""
    sequence: SequenceRef | None = None
    """The sequence it belongs to (policies.sequences), read from its parameters by its ingress."""


class SlotWork(Protocol):
    """What a slot is held for: the request's exchange with its backend."""

    on_done: Callable[[float | None], None] | None
    """Set by the call when its slot is granted: run once, when the backend is done, with the
    service time to learn from; the call clears it then."""

    def prepare(self) -> None:
        """The request waits in the queue: get ready to start, off the grant's path (a request
        refused at arrival is never prepared)."""
        ...

    def start_at_grant(self, slot: Slot) -> None:
        """`slot` is this request's (perhaps shared with a batch): start at once if that needs no await."""
        ...

    def close(self) -> bool:
        """End the work as its backend's abandon rule says; False when none was ever started (no
        `on_done` will come)."""
        ...


class Ingress(Protocol):
    """The client's side of an admitted call."""

    def until_disconnect(self) -> Awaitable[object]:
        """Return when the client goes away (awaited only while queued)."""
        ...

    async def answer(self, lease: Lease) -> Outcome:
        """Relay the backend's answer (the slot is held meanwhile); how it ended."""
        ...

    async def refuse(self, refusal: Refusal) -> None:
        """Tell the client it gets no slot, and why."""
        ...


class Admission:
    """The admitted calls' shared parts: one per gateway, used by every ingress."""

    def __init__(
        self,
        controller: AdmissionController,
        metrics: GatewayMetrics,
        drain: Drain,
        *,
        no_backend_retry_s: float,
        ready_again_in_s: Callable[[ModelPool], float] | None = None,
    ) -> None:
        self.controller = controller
        self.metrics = metrics
        self.drain = drain
        self.no_backend_retry_s = no_backend_retry_s
        self._ready_again_in_s = ready_again_in_s
        self.queued = QueuedRequests()
        """The requests queued here, by id (the status page looks them up)."""

    def no_backend_retry(self, pool: ModelPool) -> float:
        """Retry-After when no backend of `pool` is ready: when one may be again, if known."""
        if self._ready_again_in_s is None:
            return self.no_backend_retry_s
        return self._ready_again_in_s(pool)


def _acquire(
    controller: AdmissionController,
    model: str,
    meta: RequestMeta,
    until_disconnect: Callable[[], Awaitable[object]],
    on_grant: Callable[[Slot], None],
    body_bytes: int,
    cost: float,
    batching: Batching | None,
    kind: str,
    trace: RequestTrace | None,
) -> Awaitable[Lease | Refusal]:
    # The one call into the controller's queue protocol (returned, not awaited: no extra frame).
    flow = Flow(model, meta.band, meta.flow_tenant)
    exemplar = trace.exemplar if trace is not None else None
    return controller.acquire(
        flow, cost, meta.budget_s, until_disconnect, on_grant, batching, body_bytes, kind, exemplar,
        meta.sequence,
    )  # fmt: skip


class AdmittedCall:
    """One request holding (or waiting for) a backend slot. Use it once: `await call.run()`."""

    __slots__ = (
        "_access",
        "_admission",
        "_batching",
        "_body_bytes",
        "_cost",
        "_granted_ns",
        "_ingress",
        "_kind",
        "_meta",
        "_pool",
        "_queued",
        "_released",
        "_slot",
        "_trace",
        "_work",
    )  # fmt: skip

    def __init__(
        self,
        admission: Admission,
        pool: ModelPool,
        meta: RequestMeta,
        work: SlotWork,
        ingress: Ingress,
        *,
        body_bytes: int = 0,
        cost: float = 1.0,
        batching: Batching | None = None,
        kind: str = "",
        access: AccessRecord | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        """`body_bytes`: the request's body, which this replica holds while the request is queued;
        `cost`: its work units (1, its batch items, or its tokens, as its model prices requests);
        `batching`: what it may share a slot with (its work then serves a batch); `kind`: its kind
        of request (policies.request_kinds), whose service times admission reads for it; `access`:
        its access line's record, told how it ended; `trace`: its trace, given its admission and
        queue wait."""
        self._access = access
        self._admission = admission
        self._batching = batching
        self._body_bytes = body_bytes
        self._cost = cost
        self._kind = kind
        self._pool = pool
        self._meta = meta
        self._work = work
        self._ingress = ingress
        self._slot: Slot | None = None
        self._released = False
        self._queued: QueuedRequest | None = None
        self._trace = trace
        self._granted_ns = 0
        """When its slot was granted (traced requests only): where its queue wait ends."""

    async def run(self) -> None:
        """Admit, wait, relay, release; count the outcome."""
        admission, pool = self._admission, self._pool
        started_ns = time.time_ns() if self._trace is not None else 0
        traced = False
        if self._meta.retry:
            admission.metrics.count_retry(pool.name, self._meta.priority)
        if admission.drain.draining:
            refusal = Refusal(Outcome.DRAINING, DRAINING_RETRY_S)
        elif not pool.any_ready:
            refusal = Refusal(Outcome.NO_BACKEND, admission.no_backend_retry(pool))
        else:
            try:
                lease = await _acquire(
                    admission.controller,
                    pool.name,
                    self._meta,
                    self._while_queued,
                    self._granted,
                    self._body_bytes,
                    self._cost,
                    self._batching,
                    self._kind,
                    self._trace,
                )
            except BaseException as error:
                self._left_queue()
                self._close()  # granted (perhaps started from the hook), then cancelled before it ran
                if not (isinstance(error, asyncio.CancelledError) and admission.drain.absorb_cut()):
                    self._count(Outcome.CLIENT_DISCONNECTED)  # it left without an answer of ours
                    raise
                refusal = Refusal(Outcome.DRAINING, DRAINING_RETRY_S)  # cut by the drain while queued
            else:
                self._left_queue()
                if self._trace is not None:
                    traced = True
                    self._traced(started_ns, lease)
                if isinstance(lease, Lease):  # its hook ran, at the grant or at once (see acquire)
                    outcome = Outcome.CLIENT_DISCONNECTED  # unless the relay returns: nobody was answered
                    try:
                        outcome = await self._ingress.answer(lease)
                    except asyncio.CancelledError:
                        if not admission.drain.absorb_cut():
                            raise
                        outcome = Outcome.DRAINING  # cut by the drain while its answer was written
                    finally:
                        self._close()  # cut-short work ends by its backend's on_abandon, then frees the slot
                        self._count(outcome)
                    return
                self._close()
                refusal = lease
                if refusal.outcome is Outcome.NO_BACKEND:
                    refusal = Refusal(Outcome.NO_BACKEND, admission.no_backend_retry(pool))
                elif refusal.outcome is Outcome.STORE_UNAVAILABLE and refusal.retry_after_s is None:
                    # Its wait ended as the shared store went away: back once the store is probed.
                    refusal = Refusal(Outcome.STORE_UNAVAILABLE, STORE_PROBE_INTERVAL_S)
        if self._trace is not None and not traced:
            self._traced(started_ns, refusal)  # refused before admission was asked, or cut while queued
        self._count(refusal.outcome)  # before the answer: whoever reads the answer sees it counted
        if self._access is not None and refusal.rule is not None:
            self._access.rule = refusal.rule
        try:
            await self._ingress.refuse(refusal)
        except asyncio.CancelledError:
            # The drain's cut while a client slow to read took its refusal: counted, and not
            # answered again (its endpoint would, as draining).
            if not admission.drain.absorb_cut():
                raise

    def _while_queued(self) -> Awaitable[object]:
        """Called once the request is queued, and awaited until it leaves the queue: its work gets
        ready meanwhile, and the wait ends early if the client goes away."""
        self._work.prepare()
        if (access := self._access) is not None:
            meta = self._meta
            self._queued = QueuedRequest(
                access.request_id,
                self._pool.name,
                meta.band,
                meta.priority,
                meta.flow_tenant,
                self._cost,
                self._admission.controller.clock(),
                meta.budget_s,
                None if meta.sequence is None else meta.sequence.key,
            )
            self._admission.queued.add(self._queued)
        return self._ingress.until_disconnect()

    def _traced(self, started_ns: int, verdict: Lease | Refusal) -> None:
        """The admission decision (on the server span) and the queue wait (a span), in the request's trace."""
        assert self._trace is not None
        meta = self._meta
        attributes: dict[str, object] = {
            "gateway.model": self._pool.name,
            "gateway.class": meta.priority,
            "gateway.tenant": meta.flow_tenant or "-",
            "gateway.cost": self._cost,
        }
        now_ns = time.time_ns()
        if isinstance(verdict, Refusal):
            attributes["gateway.decision"] = "refused"
            attributes["gateway.reason"] = verdict.outcome.value
            if verdict.rule is not None:
                attributes["gateway.rule"] = verdict.rule
            if verdict.retry_after_s is not None:
                attributes["gateway.retry_after_s"] = verdict.retry_after_s
            self._trace.admission(attributes, refused=True, started_ns=started_ns)
            return
        attributes["gateway.decision"] = "admitted"
        granted_ns = self._granted_ns or now_ns
        queued_ns = max(started_ns, granted_ns - int(verdict.queue_wait_s * 1e9))
        self._trace.admission(attributes, refused=False, started_ns=started_ns, ended_ns=queued_ns)
        if verdict.queue_wait_s > 0:
            self._trace.queued(queued_ns, granted_ns)

    def _left_queue(self) -> None:
        if self._queued is not None:
            self._admission.queued.discard(self._queued)
            self._queued = None

    def _count(self, outcome: Outcome) -> None:
        self._admission.metrics.count(self._pool.name, self._meta.priority, outcome)
        if (access := self._access) is not None:
            access.outcome = outcome.value

    def _granted(self, slot: Slot) -> None:
        """The grant hook: runs inside the store's grant, before this call's task does."""
        self._slot = slot
        if self._trace is not None:
            self._granted_ns = time.time_ns()
        self._work.on_done = self._release
        self._work.start_at_grant(slot)

    def _close(self) -> None:
        if not self._work.close():
            self._release(None)  # nothing was started on the slot: nothing to wait for

    def _release(self, service_s: float | None) -> None:
        """Give the slot back, once: the work's `on_done`, or `_close` when no work started."""
        # No other end will come: the work lets go of the call, so that neither waits for the
        # cycle collector (every request would otherwise leave a cycle behind for it).
        self._work.on_done = None
        slot = self._slot
        if slot is None or self._released:
            return
        self._released = True
        self._admission.controller.release_soon(slot, service_s)
