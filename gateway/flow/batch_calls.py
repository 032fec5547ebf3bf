"""Gateway-side micro-batching of KServe v2 inference: requests that share a slot share one call,
whatever their ingress (HTTP: gateway.http.batches; gRPC: gateway.grpc.answer).

A mergeable request (gateway.tensors.batch, on a model with `batching`) queues with its merge key;
the store hands one slot to the head of a flow and the tickets with its key right behind it, up to
the model's batch size (gateway.queues.base). Each member's work (`BatchMember`) joins the slot's
`BatchRound` inside the grant; the round starts once every ticket granted the slot has joined
(`Slot.awaiting`), merges the members' tensors, sends one request, splits the answer and gives each
member its rows. Its rules:
- requests merge only with requests sent with the same query and headers (trace ids aside): the
  merged call goes up with its first member's;
- a member alone on its slot sends its own request, byte for byte;
- the slot is released once, when the backend is done with the merged call (each member's
  `on_done` runs then, and the store takes the first);
- an upstream failure reaches exactly the round's members: an error answer is passed to each as
  it came, a failed exchange is each one's 502/504;
- a member whose client leaves, or whose budget runs out, is answered alone; the call goes on
  for the others, and is abandoned (as its backend's `on_abandon` says) only once all have left;
- on the Redis store only one replica's tickets merge (the bodies are there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from gateway.queues.base import Slot
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.tracing import batch_trace
from gateway.tensors.batch import HEADER_LENGTH, Part, SplitError, header_length_of, merged, split
from gateway.upstream.backends import ModelPool
from gateway.upstream.client import RawHeaders, downstream_response_headers
from gateway.upstream.exchange import Forwarder, UpstreamExchange, UpstreamRequest
from gateway.upstream.reply import ConnectFailed, UpstreamError
from policies.outcomes import Outcome

log = logging.getLogger("gateway.batches")


# Fields the round sets itself: the merged call's header length, and no compression (the gateway
# must read the answer to split it; its members get it plain).
_SET_BY_THE_ROUND = frozenset({HEADER_LENGTH, b"accept-encoding"})
# Fields that differ from request to request by nature, not in what the backend is asked: a
# merged call carries its first member's.
PER_REQUEST = _SET_BY_THE_ROUND | {
    b"x-request-id",
    b"traceparent",
    b"tracestate",
    b"x-forwarded-for",
    b"forwarded",
    b"x-real-ip",
}


@dataclass(frozen=True, slots=True)
class Answered:
    status: int
    headers: RawHeaders
    body: bytes


@dataclass(frozen=True, slots=True)
class Failed:
    outcome: Outcome
    detail: str | None = None
    retry_after_s: float | None = None


class Batches:
    """The rounds being formed on this gateway's slots; one per gateway."""

    def __init__(
        self,
        forwarder: Forwarder,
        metrics: GatewayMetrics,
        no_backend_retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.forwarder = forwarder
        self.metrics = metrics
        self.no_backend_retry_s = no_backend_retry_s
        self.clock = clock
        self._forming: dict[Slot, BatchRound] = {}
        self._running: set[asyncio.Task[None]] = set()

    def member(
        self, pool: ModelPool, request: UpstreamRequest, part: Part, budget_s: float | None
    ) -> BatchMember:
        """The work of a mergeable request that will hold (or share) a slot of `pool`."""
        exchange = self.forwarder.exchange(pool, request, budget_s)
        budget_at = None if budget_s is None else self.clock() + budget_s
        return BatchMember(self, pool, replace(request, body=b""), exchange, part, budget_at)

    def join(self, slot: Slot, member: BatchMember) -> None:
        """Inside the grant: `member` is one of the tickets `slot` was handed to."""
        forming = self._forming.get(slot)
        if forming is None:
            forming = self._forming[slot] = BatchRound(self, slot, member.pool)
            # After the grant's callback: every ticket it hands the slot to has joined by then.
            asyncio.get_running_loop().call_soon(forming.start)
        forming.join(member)

    def started(self, batch: BatchRound) -> None:
        del self._forming[batch.slot]

    def run(self, relay: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(relay)
        self._running.add(task)
        task.add_done_callback(self._running.discard)


class BatchMember:
    """A mergeable request's work (a gateway.flow.admitted.SlotWork): alone, its own exchange; in a
    batch, its share of the round's."""

    __slots__ = (
        "_batches", "budget_at", "clock", "exchange", "gone", "joined_at", "on_done", "part", "pool",
        "request", "result", "round", "solo",
    )  # fmt: skip

    def __init__(
        self,
        batches: Batches,
        pool: ModelPool,
        request: UpstreamRequest,
        exchange: UpstreamExchange,
        part: Part,
        budget_at: float | None,
    ) -> None:
        self._batches = batches
        self.clock = batches.clock
        self.pool = pool
        self.request = request
        """Its request without the body (the merged request's template)."""
        self.exchange = exchange
        self.part = part
        self.budget_at = budget_at
        self.on_done: Callable[[float | None], None] | None = None
        self.round: BatchRound | None = None
        self.result: asyncio.Future[Answered | Failed] | None = None
        self.solo = False
        self.gone = False
        self.joined_at = 0.0

    def start_at_grant(self, slot: Slot) -> None:
        if slot.batch:
            self._batches.join(slot, self)
            return
        self.solo = True
        self.exchange.on_done = self.on_done
        self._batches.metrics.observe_batch(self.pool.name, self.part.rows)
        self.exchange.start_at_grant(slot)

    def prepare(self) -> None:
        self.exchange.prepare()  # alone it is sent as it came; in a batch the round is serialized

    def close(self) -> bool:
        if self.solo:
            return self.exchange.close()
        if self.round is None:
            return False
        self.round.leave(self)
        return True


class BatchRound:
    """One slot's batch: formed in the grant, started once complete, ended when its call ends."""

    def __init__(self, batches: Batches, slot: Slot, pool: ModelPool) -> None:
        self._batches = batches
        self.slot = slot
        self._pool = pool
        self.members: list[BatchMember] = []
        self._exchange: UpstreamExchange | None = None
        self.started_at = 0.0
        self._formed_ns = time.time_ns()  # the slot's grant: where a traced batch's span starts

    def upstream_s(self) -> float:
        """The merged call's time with its backend: to its end, or so far."""
        exchange = self._exchange
        if exchange is None:
            return 0.0
        return exchange.elapsed_s if exchange.elapsed_s is not None else exchange.running_for_s()

    def join(self, member: BatchMember) -> None:
        member.round = self
        member.result = asyncio.get_running_loop().create_future()
        member.joined_at = self._batches.clock()
        self.members.append(member)

    def leave(self, member: BatchMember) -> None:
        member.gone = True
        if self._exchange is not None and all(m.gone for m in self.members):
            self._exchange.close()  # nobody waits for it now: it ends as its backend's on_abandon says

    def start(self) -> None:
        slot = self.slot
        if slot.awaiting:  # granted tickets whose waiters this replica has not told yet
            slot.on_settled = self.start
            return
        batches = self._batches
        batches.started(self)
        live = [m for m in self.members if not m.gone]
        if not live:
            self._done(None)  # all left before it started: nothing was sent
            return
        try:
            exchange = self._started(live)
        except Exception:  # a loop callback: nobody else would answer the members or free the slot
            log.exception("a batch of %d on %s could not start", len(live), slot.backend.url)
            self._answer(live, [Failed(Outcome.UPSTREAM_ERROR)] * len(live))
            if self._exchange is None or not self._exchange.close():
                self._done(None)  # nothing was sent: no on_done will come
            return
        batches.run(self._relay(exchange, live))

    def _started(self, live: list[BatchMember]) -> UpstreamExchange:
        """The round's one exchange, for the merged request of `live`, started on the slot."""
        batches, parts = self._batches, [m.part for m in live]
        body, header_length = merged(parts)
        template = live[0].request
        headers = [(k, v) for k, v in template.headers if k not in _SET_BY_THE_ROUND]
        if header_length is not None:
            headers.append((HEADER_LENGTH, str(header_length).encode()))
        exchange = self._exchange = batches.forwarder.exchange(
            self._pool, replace(template, headers=headers, body=body), None
        )
        exchange.on_done = self._done
        self.started_at = batches.clock()
        rows = sum(p.rows for p in parts)
        attributes = {"gateway.batch.members": len(live), "gateway.batch.rows": rows}
        exchange.trace = batch_trace([m.exchange.trace for m in live], self._formed_ns, attributes)
        batches.metrics.observe_batch(self._pool.name, rows)
        exchange.start_at_grant(self.slot)
        return exchange

    async def _relay(self, exchange: UpstreamExchange, live: list[BatchMember]) -> None:
        parts = [m.part for m in live]
        results: list[Answered | Failed]
        try:
            reply = exchange.reply or await exchange.start()
            await reply.head()
            body = await reply.read()
            headers = downstream_response_headers(reply.headers)
            if reply.status != 200:  # the backend's own error, to each member as it came
                results = [Answered(reply.status, headers, body)] * len(live)
            else:
                results = _split_answer(body, headers, parts)
        except ConnectFailed:
            results = [Failed(Outcome.NO_BACKEND, retry_after_s=self._batches.no_backend_retry_s)] * len(live)
        except TimeoutError:
            results = [Failed(Outcome.UPSTREAM_TIMEOUT)] * len(live)
        except UpstreamError as error:
            log.warning("backend %s failed a batch of %d: %s", self.slot.backend.url, len(live), error)
            results = [Failed(Outcome.UPSTREAM_ERROR)] * len(live)
        except Exception:  # whatever it is, no member may be left waiting for an answer
            log.exception("a batch of %d on %s failed", len(live), self.slot.backend.url)
            results = [Failed(Outcome.UPSTREAM_ERROR)] * len(live)
        self._answer(live, results)

    @staticmethod
    def _answer(live: list[BatchMember], results: list[Answered | Failed]) -> None:
        for member, result in zip(live, results, strict=True):
            if member.result is not None and not member.result.done():
                member.result.set_result(result)

    def _done(self, service_s: float | None) -> None:
        """The backend is done with the call (or none was made): every member's slot goes back."""
        for member in self.members:
            if member.on_done is not None:
                member.on_done(service_s)


def _split_answer(body: bytes, headers: RawHeaders, parts: list[Part]) -> list[Answered | Failed]:
    try:
        pieces = split(body, header_length_of(headers), parts)
    except SplitError as error:
        log.warning("a batched answer could not be split: %s", error)
        return [Failed(Outcome.UPSTREAM_ERROR, f"the batched answer could not be split: {error}")] * len(
            parts
        )
    common = [(k, v) for k, v in headers if k != HEADER_LENGTH]
    answers: list[Answered | Failed] = []
    for piece, header_length in pieces:
        own = common if header_length is None else [*common, (HEADER_LENGTH, str(header_length).encode())]
        answers.append(Answered(200, own, piece))
    return answers
