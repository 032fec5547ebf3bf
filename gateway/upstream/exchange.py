"""The upstream exchange: one request's trip to a backend, prepared while it waits, started the
moment it has a slot, and ended exactly once.

Its rules:
- the request is built and serialized while it waits (`prepare`, for a pool of one backend), so the
  grant only writes it; one refused at arrival is never built;
- `start_at_grant` runs inside the store's grant: it writes the request on an idle pooled
  connection at once, without awaiting; without one, the relay's `start` opens a connection;
- `on_done` runs once, inside the callback in which the backend is done with the request (its
  answer ended, or its connection closed: gateway.upstream.reply), with the service time to learn
  from; a backend that could not be reached, or that closed without answering, is marked
  unreachable before that, so that the freed slot is not handed to a waiter for it;
- how it ended is judged for passive health (policies.circuit: `on_verdict`) in that same callback,
  before the slot goes back too, so that a circuit that opens takes its backend out of dispatch
  first; while sent, it is in its backend's `in_flight`, which the stall watch reads;
- `close` leaves the exchange to end as the backend's `on_abandon` says.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from gateway.telemetry.tracing import upstream_attributes
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.client import RawHeaders
from gateway.upstream.http1 import UpstreamClient, serialize_request
from gateway.upstream.origin import OnAbandon, origin_of
from gateway.upstream.priority import with_priority
from gateway.upstream.reply import (
    BackendGone,
    BackendStalled,
    ConnectFailed,
    Reply,
    UpstreamBroken,
    UpstreamTimeout,
)
from policies.circuit import Ending, Verdict, verdict_of

# Answers up to this size with a Content-Length are read whole, so the slot frees before the
# client write; longer or open-ended ones (SSE) stream chunk by chunk.
BUFFER_LIMIT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """A client's request as a backend gets it, before the backend's own model name is put in."""

    method: str
    path: str
    query: bytes
    headers: RawHeaders
    """Already free of hop-by-hop fields (gateway.upstream.client.upstream_request_headers)."""
    body: bytes
    model_in_body: bool = False
    """The body's `model` names the model (OpenAI), rather than the path (KServe)."""
    priority: str = ""
    """The class it is served at, for backends told it (gateway.upstream.priority)."""


RequestOrBuilder = UpstreamRequest | Callable[[], UpstreamRequest]


class OnBackend(Protocol):
    """A slot, as an exchange sees it: where it is."""

    @property
    def backend(self) -> BackendState: ...


class Forwarder:
    """The exchanges' shared parts: the client, the clock, and where a failed backend is reported
    (`on_unreachable`) and how each exchange ended (`on_verdict`, for passive health)."""

    def __init__(
        self,
        client: UpstreamClient,
        *,
        on_unreachable: Callable[[ModelPool, BackendState], None],
        observe_upstream_s: Callable[[str, float, dict[str, str] | None], None],
        on_verdict: Callable[[ModelPool, BackendState, Verdict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.on_unreachable = on_unreachable
        self.on_verdict = on_verdict
        self.observe_upstream_s = observe_upstream_s
        self.clock = clock

    def exchange(
        self, pool: ModelPool, request: RequestOrBuilder, budget_s: float | None
    ) -> UpstreamExchange:
        """The exchange for a request that will hold a slot of `pool` (see UpstreamExchange)."""
        return UpstreamExchange(self, pool, request, budget_s)

    async def fetch(
        self, pool: ModelPool, backend: BackendState, request: UpstreamRequest
    ) -> tuple[Reply, bytes]:
        """A control-plane request (metadata, readiness): no slot held, read whole, cut off on exit."""
        reply = Reply(
            asyncio.get_running_loop(),
            pool.upstream_timeout_s,
            head_only=request.method == "HEAD",
            whole_up_to_bytes=BUFFER_LIMIT_BYTES,
            on_abandon=OnAbandon.ABORT,  # no slot waits for it: end it with its reader
        )
        try:
            origin = origin_of(backend.url, backend.connection)
            await self.client.send(origin, serialized(request, backend), reply)
            await reply.head()
            body = await reply.read()
        finally:
            reply.give_up(UpstreamBroken("abandoned"))
        return reply, body


class UpstreamExchange:
    """One request's exchange with the backend its slot is on; see the module docstring."""

    __slots__ = (
        "_backend",
        "_body_in_wire",
        "_budget_at",
        "_build_request",
        "_forwarder",
        "_pool",
        "_prepared",
        "_request",
        "_traced_wire",
        "elapsed_s",
        "on_done",
        "reply",
        "started_at",
        "trace",
    )

    def __init__(
        self,
        forwarder: Forwarder,
        pool: ModelPool,
        request: RequestOrBuilder,
        budget_s: float | None,
    ) -> None:
        """`request`: the request, or how to build it once it is queued or granted (a request
        refused at arrival, most of them under overload, is never built)."""
        self._forwarder = forwarder
        self._pool = pool
        if isinstance(request, UpstreamRequest):
            self._request: UpstreamRequest | None = request
            self._build_request: Callable[[], UpstreamRequest] | None = None
        else:
            self._request, self._build_request = None, request
        self._budget_at = None if budget_s is None else forwarder.clock() + budget_s
        self._backend: BackendState | None = None
        self._prepared: tuple[BackendState, bytes] | None = None
        self._body_in_wire = 0
        """The body's length when it is held only at the end of the prepared wire."""
        self.on_done: Callable[[float | None], None] | None = None
        self.trace: UpstreamTrace | None = None
        """Where the request is traced: the upstream call becomes a span, its context sent along."""
        self._traced_wire: bytes | None = None
        self.reply: Reply | None = None
        """Set once the request is sent (or being sent)."""
        self.started_at = 0.0
        self.elapsed_s: float | None = None
        """From sending to the backend's end of it."""

    def prepare(self) -> None:
        """The request waits for a slot: build it now, off the hand-over's path, and serialize it
        for a pool of one backend (the usual case; with more, the grant picks the backend)."""
        if len(self._pool.backends) == 1:
            self._wire(self._pool.backends[0])
        else:
            self._built()

    @property
    def backend(self) -> BackendState:
        """The backend of the slot (only once it has one)."""
        assert self._backend is not None, "an exchange has a backend from its grant"
        return self._backend

    def running_for_s(self) -> float:
        return self._forwarder.clock() - self.started_at

    def start_at_grant(self, slot: OnBackend) -> None:
        """The slot is this request's: send at once when a pooled connection to its backend is idle."""
        self._backend = backend = slot.backend
        origin = origin_of(backend.url, backend.connection)
        self._forwarder.client.try_send(origin, self._sent_wire(backend), self._new_reply)

    async def start(self) -> Reply:
        """Send on a pooled or new connection (after `start_at_grant` found none idle)."""
        backend = self.backend
        reply = self._new_reply()
        try:
            await self._forwarder.client.send(
                origin_of(backend.url, backend.connection), self._sent_wire(backend), reply
            )
        except ConnectFailed as error:
            reply.abort(error)  # ends it now: the backend is marked unreachable, then the slot frees
            raise
        return reply

    def close(self) -> bool:
        """Done with the exchange: one still running ends as its backend's `on_abandon` says (and
        then calls `on_done`); False when nothing was sent, so no `on_done` will come."""
        if self.reply is None:
            return False
        self.reply.give_up(UpstreamBroken("abandoned"))
        return True

    def _new_reply(self) -> Reply:
        self.started_at = now = self._forwarder.clock()
        backend = self.backend
        reply = self.reply = Reply(
            asyncio.get_running_loop(),
            self._pool.upstream_timeout_s,
            head_only=self._built().method == "HEAD",
            whole_up_to_bytes=BUFFER_LIMIT_BYTES,
            on_abandon=backend.on_abandon,
            give_up_after_s=None if self._budget_at is None else self._budget_at - now,
            in_flight=backend.in_flight,
        )
        reply.on_complete = self._finished
        backend.in_flight.add(reply, now)
        return reply

    def _finished(self) -> None:
        """The backend is done with the request: record its time, then let the slot go."""
        forwarder, reply = self._forwarder, self.reply
        self.elapsed_s = forwarder.clock() - self.started_at
        assert reply is not None, "on_complete is set on the reply it completes"
        backend = self.backend
        backend.in_flight.discard(reply)
        service_s: float | None = None
        try:
            # Before the slot goes back, or its release would hand it to a waiter for this backend.
            if isinstance(reply.error, ConnectFailed | BackendGone):
                forwarder.on_unreachable(self._pool, backend)
            if forwarder.on_verdict is not None:
                verdict = verdict_of(ending(reply), reply.status)
                if verdict is not None:
                    forwarder.on_verdict(self._pool, backend, verdict)
            if self._budget_at is not None:
                count_deadline(backend, reply, forwarder.clock() <= self._budget_at, self.started_at)
            if reply.complete:
                exemplar = self.trace.exemplar if self.trace is not None else None
                forwarder.observe_upstream_s(self._pool.name, self.elapsed_s, exemplar)
                if reply.status < 400:
                    service_s = self.elapsed_s
            elif isinstance(reply.given_up, TimeoutError) and not isinstance(reply.given_up, BackendStalled):
                service_s = self.elapsed_s  # cut short: the service took at least this long
            if self.trace is not None:
                failed = None if reply.complete else type(reply.error or reply.given_up).__name__
                self.trace.upstream_ended(reply.status if reply.complete else None, failed)
        finally:  # whatever the bookkeeping raised, the backend is done: its slot goes back
            on_done, self.on_done = self.on_done, None  # once; and the exchange lets go of its caller
            if on_done is not None:
                on_done(service_s)

    def _sent_wire(self, backend: BackendState) -> bytes:
        """The wire as sent: traced, it carries the upstream span's context as `traceparent` (in
        place of the client's, which names the client's span, not the gateway's call)."""
        wire = self._wire(backend)
        if self.trace is None:
            return wire
        if self._traced_wire is None:
            request = self._built()
            served = backend.served_model or backend.model
            attributes = upstream_attributes(request.method, backend.url, request.path, served)
            parent = self.trace.upstream_started(attributes)
            self._traced_wire = with_field(wire, b"traceparent", parent.encode("ascii"))
        return self._traced_wire

    def _wire(self, backend: BackendState) -> bytes:
        """The request as `backend` gets it (kept for the backend it was last made for).

        A queued request holds one copy of its body: once it is on the wire, as sent under the
        client's model name, the request keeps no other (bodies can be tens of MiB); a wire for
        another backend takes it back from there.
        """
        prepared, request = self._prepared, self._built()
        if prepared is not None:
            if prepared[0] is backend:
                return prepared[1]
            if self._body_in_wire:
                request = replace(request, body=prepared[1][-self._body_in_wire :])
        wire = serialized(request, backend)
        self._prepared = (backend, wire)
        if request.body and not rewrites_body(backend):
            self._body_in_wire, self._request = len(request.body), replace(request, body=b"")
        else:  # the wire's body is rewritten (OpenAI's `model`), or there is none
            self._body_in_wire, self._request = 0, request
        return wire

    def _built(self) -> UpstreamRequest:
        request = self._request
        if request is None:
            assert self._build_request is not None, "an exchange has its request or how to build it"
            request = self._request = self._build_request()
            self._build_request = None  # it holds the body, which the wire is to hold alone
        return request


class UpstreamTrace(Protocol):
    """The upstream call's span (gateway.telemetry.tracing.RequestTrace)."""

    def upstream_started(self, attributes: dict[str, object]) -> str: ...
    def upstream_ended(self, status: int | None, error: str | None = None) -> None: ...
    @property
    def exemplar(self) -> dict[str, str] | None: ...


def with_field(wire: bytes, name: bytes, value: bytes) -> bytes:
    """A serialized request with header field `name` set to `value` (any of the same name dropped)."""
    head, blank, body = wire.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    prefix = name.lower() + b":"
    kept = [lines[0], *(line for line in lines[1:] if not line.lower().startswith(prefix))]
    return b"\r\n".join([*kept, name + b": " + value]) + blank + body


def count_deadline(backend: BackendState, reply: Reply, in_time: bool, sent_at: float) -> None:
    """Count a request with a deadline, sent at `sent_at`, as kept or missed on its backend; one
    that ended otherwise (its client left, the backend failed) says nothing of the deadlines the
    backend keeps, nor does one sent before its limit last moved (BackendState.limit_moved_at)."""
    if sent_at < backend.limit_moved_at:
        return
    if reply.complete and reply.status < 400:
        if in_time:
            backend.deadlines_kept += 1
        else:
            backend.deadlines_missed += 1
    elif isinstance(reply.given_up, TimeoutError) and not isinstance(reply.given_up, BackendStalled):
        backend.deadlines_missed += 1  # cut at the deadline, still running


def ending(reply: Reply) -> Ending:
    """How a finished exchange ended, for passive health."""
    if reply.complete:
        return Ending.ANSWERED
    if isinstance(reply.error, UpstreamTimeout):
        return Ending.TIMED_OUT
    if isinstance(reply.error, ConnectFailed):
        return Ending.UNREACHABLE
    if reply.given_up is not None:
        return Ending.ABANDONED  # ended by our close, or cut while nobody waited for it
    return Ending.CUT_OFF


def rewrites_body(backend: BackendState) -> bool:
    """Whether a body goes to `backend` other than the client sent it."""
    return backend.served_model != backend.model or backend.forward_priority is not None


def serialized(request: UpstreamRequest, backend: BackendState) -> bytes:
    """`request` on the wire to `backend`, under the backend's own name for the model, told the
    request's class where the backend wants it."""
    target, body, headers = request.path, request.body, request.headers
    if backend.served_model != backend.model:
        target, body = served_names(target, body, backend.model, backend.served_model, request.model_in_body)
    if backend.forward_priority is not None and body:
        headers, body = with_priority(
            backend.forward_priority, request.priority, headers, body, model_in_body=request.model_in_body
        )
    if request.query:
        target += "?" + request.query.decode("latin-1")
    return serialize_request(request.method, target, origin_of(backend.url), headers, body)


def served_names(target: str, body: bytes, model: str, served: str, model_in_body: bool) -> tuple[str, bytes]:
    """The path and body with the gateway's model name replaced by the backend's own.

    KServe names the model in the path; OpenAI in the body's `model`, which is then written anew
    (only for backends configured with a different `served_model`).
    """
    prefix = f"/v2/models/{model}"
    if target == prefix or target.startswith(prefix + "/"):
        return f"/v2/models/{served}" + target[len(prefix) :], body
    if model_in_body and body:
        payload = json.loads(body)
        payload["model"] = served
        return target, json.dumps(payload).encode()
    return target, body
