"""The proxy path: admit, wait for a slot, forward to the backend, stream the answer back.

The slot follows the backend's work: it is given back inside the callback in which the backend is
done with the request (its answer ended, or its connection closed), never when only the client is
done with it. A client that leaves, or a budget that runs out, gets its answer (or none) at once,
while the exchange ends as the backend's `on_abandon` says (gateway.upstream.reply). The store's
grant writes the next waiting request (serialized while it waited) onto an idle connection inside
that same callback: the next request is on its way before this answer is written to its client.
Every request is counted exactly once, with the outcome it ended with.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorStyle, error_response
from gateway.flow.controller import Lease, Refusal
from gateway.http.exchange import RawHeaders, send_response, until_disconnect
from gateway.http.request_meta import RequestMeta
from gateway.queues.base import Slot
from gateway.runtime import Runtime
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.client import downstream_response_headers, upstream_request_headers
from gateway.upstream.http1 import serialize_request
from gateway.upstream.origin import OnAbandon, origin_of
from gateway.upstream.reply import BackendGone, ConnectFailed, Reply, UpstreamBroken, UpstreamError
from policies.outcomes import Outcome

log = logging.getLogger("gateway.proxy")

# Answers up to this size with a Content-Length are read whole, so the slot frees before the
# client write; longer or open-ended ones (SSE) stream chunk by chunk.
_BUFFER_LIMIT_BYTES = 1 << 20


@dataclass(slots=True)
class Exchange:
    """One client request on its way through; `body` is filled in once read."""

    scope: Scope
    receive: Receive
    send: Send
    style: ErrorStyle
    body: bytes = b""


class ClientLeft(Exception):
    """The client went away while its request was with a backend."""


class AdmittedEndpoint:
    """An ASGI endpoint whose requests take backend slots, counted for the graceful drain."""

    def __init__(self, runtime: Runtime, proxy: Proxy) -> None:
        self.runtime = runtime
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runtime.request_started()
        try:
            await self.serve(scope, receive, send)
        finally:
            self.runtime.request_finished()

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class Proxy:
    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._no_backend_retry_s = runtime.settings.health.interval_ms / 1000

    async def fail(
        self,
        exchange: Exchange,
        outcome: Outcome,
        *,
        model: str = "",
        priority: str = "",
        detail: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        """Count `outcome` and answer with its error."""
        self._rt.metrics.count(model, priority, outcome)
        await self._reply_error(exchange, outcome, detail=detail, retry_after_s=retry_after_s)

    async def admitted(self, exchange: Exchange, pool: ModelPool, meta: RequestMeta) -> None:
        """Serve a request that needs a backend slot."""
        rt = self._rt
        if rt.draining:
            await self.fail(
                exchange, Outcome.DRAINING, model=pool.name, priority=meta.priority, retry_after_s=1.0
            )
            return
        if not pool.any_ready:
            await self.fail(
                exchange,
                Outcome.NO_BACKEND,
                model=pool.name,
                priority=meta.priority,
                retry_after_s=self._no_backend_retry_s,
            )
            return
        call = _UpstreamCall(rt, exchange, pool, meta.budget_s)
        try:
            lease = await rt.controller.acquire(
                pool.name,
                meta.band,
                meta.budget_s,
                lambda: until_disconnect(exchange.receive),
                on_grant=call.start_at_grant,
            )
        except BaseException:
            call.close()  # granted (perhaps sent from the hook), then cancelled before it ran
            raise
        if isinstance(lease, Refusal):
            retry_after_s = lease.retry_after_s
            if lease.outcome is Outcome.NO_BACKEND:
                retry_after_s = self._no_backend_retry_s
            await self.fail(
                exchange, lease.outcome, model=pool.name, priority=meta.priority, retry_after_s=retry_after_s
            )
            return
        call.hold(lease.slot)
        try:
            outcome = await self._forward(exchange, pool, lease, call)
        finally:
            call.close()  # an exchange cut short ends by its backend's on_abandon, then frees the slot
        rt.metrics.count(pool.name, meta.priority, outcome)

    async def unmetered(self, exchange: Exchange, pool: ModelPool) -> None:
        """Forward a control-plane request (metadata, config, readiness) without taking a slot."""
        backend = next((b for b in pool.backends if b.ready), None)
        if backend is None:
            await self._reply_error(exchange, Outcome.NO_BACKEND, retry_after_s=self._no_backend_retry_s)
            return
        call = _UpstreamCall(self._rt, exchange, pool, None)
        try:
            reply = await call.start(backend)
            await reply.head()
            body = await reply.read()
        except TimeoutError:
            await self._reply_error(exchange, Outcome.UPSTREAM_TIMEOUT)
            return
        except UpstreamError as error:
            await self._reply_error(exchange, Outcome.UPSTREAM_ERROR, detail=type(error).__name__)
            return
        finally:
            call.close()
        headers = downstream_response_headers(reply.headers)
        headers.append((b"content-length", str(len(body)).encode()))
        await send_response(exchange.send, reply.status, headers, body)

    async def _reply_error(
        self,
        exchange: Exchange,
        outcome: Outcome,
        *,
        detail: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        if outcome is Outcome.CLIENT_DISCONNECTED:
            return  # nobody to answer
        status, headers, body = error_response(
            outcome, exchange.style, detail=detail, retry_after_s=retry_after_s
        )
        if self._rt.draining:
            headers.append((b"connection", b"close"))
        await send_response(exchange.send, status, headers, body)

    async def _forward(
        self, exchange: Exchange, pool: ModelPool, lease: Lease, call: _UpstreamCall
    ) -> Outcome:
        backend = lease.slot.backend
        client_gone: asyncio.Future[None] | None = None
        try:
            reply = call.reply or await call.start(backend)
            client_gone = _watch_disconnect(exchange, reply)
            await reply.head()
            headers = downstream_response_headers(reply.headers)
            length = reply.content_length
            if length is None or length > _BUFFER_LIMIT_BYTES or _is_event_stream(headers):
                return await self._stream(exchange, lease, call, reply, headers)
            body = await reply.read()
        except ClientLeft:
            return Outcome.CLIENT_DISCONNECTED
        except ConnectFailed:  # the backend was marked unreachable before its slot went back
            outcome, retry_after_s = Outcome.NO_BACKEND, self._no_backend_retry_s
        except TimeoutError:
            outcome, retry_after_s = Outcome.UPSTREAM_TIMEOUT, None
        except UpstreamError as error:
            log.warning("backend %s failed: %s", backend.url, error)
            outcome, retry_after_s = Outcome.UPSTREAM_ERROR, None
        else:
            headers += [
                (b"content-length", str(len(body)).encode()),
                _server_timing(lease.queue_wait_s, call.elapsed_s or 0.0),
            ]
            await send_response(exchange.send, reply.status, headers, body)
            return Outcome.OK
        finally:
            if client_gone is not None:
                client_gone.cancel()
        await self._reply_error(exchange, outcome, retry_after_s=retry_after_s)
        return outcome

    async def _stream(
        self,
        exchange: Exchange,
        lease: Lease,
        call: _UpstreamCall,
        reply: Reply,
        headers: RawHeaders,
    ) -> Outcome:
        """Pass the answer through chunk by chunk (SSE stays chunked, nothing is buffered).

        Once the status line is out an upstream failure can no longer become an error status:
        the answer is cut short, so the client sees a broken stream rather than a clean end.
        """
        headers.append(_server_timing(lease.queue_wait_s, self._rt.clock() - call.started_at))
        send = exchange.send
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        try:
            async for chunk in reply.iter_chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except ClientLeft:
            return Outcome.CLIENT_DISCONNECTED
        except (TimeoutError, UpstreamError) as error:
            log.warning("backend %s failed mid-stream: %s", lease.slot.backend.url, error)
            outcome = Outcome.UPSTREAM_TIMEOUT if isinstance(error, TimeoutError) else Outcome.UPSTREAM_ERROR
            return outcome  # without the final body message the server closes the connection
        await send({"type": "http.response.body", "body": b""})
        return Outcome.OK


class _UpstreamCall:
    """One request's exchange with a backend: prepared while the request waits, started the moment
    it has a slot, and ended exactly once. It holds the slot: the slot goes back inside the
    callback in which the backend is done with the request, so the next waiter's request follows
    at once, and never while the backend may still be computing it."""

    __slots__ = (
        "_budget_at",
        "_exchange",
        "_headers",
        "_pool",
        "_prepared",
        "_rt",
        "_slot",
        "elapsed_s",
        "reply",
        "started_at",
    )

    def __init__(self, rt: Runtime, exchange: Exchange, pool: ModelPool, budget_s: float | None) -> None:
        self._rt = rt
        self._exchange = exchange
        self._pool = pool
        self._budget_at = None if budget_s is None else rt.clock() + budget_s
        self._headers = upstream_request_headers(exchange.scope["headers"])
        self._slot: Slot | None = None
        self.reply: Reply | None = None
        self.started_at = 0.0
        self.elapsed_s: float | None = None
        self._prepared: tuple[BackendState, bytes] | None = None
        if len(pool.backends) == 1:  # the usual case: serialize now, off the hand-over's path
            self._request(pool.backends[0])

    def hold(self, slot: Slot) -> None:
        """The slot this call's exchange runs in; the call gives it back."""
        self._slot = slot

    def start_at_grant(self, slot: Slot) -> None:
        """The grant hook: send at once when a pooled connection to the backend is idle."""
        assert self._rt.upstream is not None, "the upstream client is created in the lifespan"
        self._slot = slot
        backend = slot.backend
        self.reply = self._rt.upstream.try_send(
            origin_of(backend.url, backend.connection), self._request(backend), self._new_reply
        )

    async def start(self, backend: BackendState) -> Reply:
        """Send on a pooled or new connection; the held slot is released when the backend is done."""
        assert self._rt.upstream is not None, "the upstream client is created in the lifespan"
        reply = self.reply = self._new_reply()
        origin = origin_of(backend.url, backend.connection)
        await self._rt.upstream.send(origin, self._request(backend), reply)
        return reply

    def close(self) -> None:
        """The proxy is done with this call: an exchange still running ends as its backend's
        `on_abandon` says (and then frees the slot); a slot never used goes back now."""
        if self.reply is not None:
            self.reply.give_up(UpstreamBroken("abandoned"))
        elif self._slot is not None:
            self._rt.controller.release_soon(self._slot)

    def _new_reply(self) -> Reply:
        rt = self._rt
        self.started_at = now = rt.clock()
        give_up_after_s = None if self._budget_at is None else self._budget_at - now
        backend = self._slot.backend if self._slot is not None else None
        reply = Reply(
            asyncio.get_running_loop(),
            self._pool.upstream_timeout_s,
            head_only=self._exchange.scope["method"] == "HEAD",
            whole_up_to_bytes=_BUFFER_LIMIT_BYTES,
            on_abandon=backend.on_abandon if backend is not None else OnAbandon.ABORT,
            give_up_after_s=give_up_after_s,
        )
        reply.on_complete = self._finished
        return reply

    def _finished(self) -> None:
        """The backend is done with the request: record its time and give the slot back."""
        rt = self._rt
        reply = self.reply
        self.elapsed_s = rt.clock() - self.started_at
        if self._slot is None or reply is None:
            return
        if isinstance(reply.error, ConnectFailed | BackendGone) and rt.health is not None:
            # Before the slot goes back, or its release would hand it to a waiter for this backend.
            rt.health.mark_unreachable(self._pool, self._slot.backend)
        service_s: float | None = None
        if reply.complete:
            rt.metrics.observe_upstream(self._pool.name, self.elapsed_s)
            if reply.status < 400:
                service_s = self.elapsed_s
        elif isinstance(reply.given_up, TimeoutError):
            service_s = self.elapsed_s  # cut short: the service took at least this long
        rt.controller.release_soon(self._slot, service_s)

    def _request(self, backend: BackendState) -> bytes:
        """The request as `backend` gets it (kept for the backend it was last made for)."""
        if self._prepared is not None and self._prepared[0] is backend:
            return self._prepared[1]
        scope = self._exchange.scope
        target = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        body = self._exchange.body
        if backend.served_model != backend.model:
            target, body = served_names(
                target, body, backend.model, backend.served_model, self._exchange.style
            )
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        request = serialize_request(scope["method"], target, origin_of(backend.url), self._headers, body)
        self._prepared = (backend, request)
        return request


def served_names(target: str, body: bytes, model: str, served: str, style: ErrorStyle) -> tuple[str, bytes]:
    """The path and body with the gateway's model name replaced by the backend's own.

    KServe names the model in the path; OpenAI in the body's `model`, which is then written anew
    (only for backends configured with a different `served_model`).
    """
    prefix = f"/v2/models/{model}"
    if target == prefix or target.startswith(prefix + "/"):
        return f"/v2/models/{served}" + target[len(prefix) :], body
    if style is ErrorStyle.OPENAI and body:
        payload = json.loads(body)
        payload["model"] = served
        return target, json.dumps(payload).encode()
    return target, body


def _watch_disconnect(exchange: Exchange, reply: Reply) -> asyncio.Future[None]:
    """Give up on `reply` the moment the client goes away (cancel the watch once answered)."""
    watch = asyncio.ensure_future(until_disconnect(exchange.receive))
    watch.add_done_callback(lambda done: done.cancelled() or reply.give_up(ClientLeft()))
    return watch


def _is_event_stream(headers: RawHeaders) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def _server_timing(queue_s: float, upstream_s: float) -> tuple[bytes, bytes]:
    value = f"queue;dur={queue_s * 1000:.3f}, upstream;dur={upstream_s * 1000:.3f}"
    return b"server-timing", value.encode()
