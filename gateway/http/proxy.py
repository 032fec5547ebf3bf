"""The proxy path: admit, wait for a slot, forward to the backend, stream the answer back.

The slot is given back as soon as the backend's answer is complete, before it is written to the
client, so the next waiter reaches the backend while this answer is still on its way out.
Every request is counted exactly once, with the outcome it ended with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass

import aiohttp
from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorStyle, error_response
from gateway.flow.controller import Lease, Refusal
from gateway.http.exchange import RawHeaders, send_response, until_disconnect
from gateway.http.request_meta import RequestMeta
from gateway.runtime import Runtime
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.client import downstream_response_headers, upstream_request_headers
from policies.outcomes import Outcome

log = logging.getLogger("gateway.proxy")

# Event-loop turns a woken waiter needs to put its request on the wire: one to run, and on Python
# before 3.12 one more for the task in which aiohttp writes the body (3.12 starts it eagerly).
_DISPATCH_TURNS = 1 if sys.version_info >= (3, 12) else 2

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
        lease = await rt.controller.acquire(
            pool.name, meta.band, meta.budget_s, lambda: until_disconnect(exchange.receive)
        )
        if isinstance(lease, Refusal):
            retry_after_s = lease.retry_after_s
            if lease.outcome is Outcome.NO_BACKEND:
                retry_after_s = self._no_backend_retry_s
            await self.fail(
                exchange, lease.outcome, model=pool.name, priority=meta.priority, retry_after_s=retry_after_s
            )
            return
        timeout_s = pool.upstream_timeout_s
        if meta.budget_s is not None:
            timeout_s = max(0.001, meta.budget_s - lease.queue_wait_s)
        try:
            outcome = await self._forward(exchange, pool, lease, timeout_s)
        finally:
            await rt.controller.release(lease)
        rt.metrics.count(pool.name, meta.priority, outcome)

    async def unmetered(self, exchange: Exchange, pool: ModelPool) -> None:
        """Forward a control-plane request (metadata, config, readiness) without taking a slot."""
        backend = next((b for b in pool.backends if b.ready), None)
        if backend is None:
            await self._reply_error(exchange, Outcome.NO_BACKEND, retry_after_s=self._no_backend_retry_s)
            return
        try:
            async with self._request(exchange, backend, pool.upstream_timeout_s) as reply:
                body = await reply.read()
        except TimeoutError:
            await self._reply_error(exchange, Outcome.UPSTREAM_TIMEOUT)
            return
        except aiohttp.ClientError as error:
            await self._reply_error(exchange, Outcome.UPSTREAM_ERROR, detail=type(error).__name__)
            return
        headers = downstream_response_headers(reply.raw_headers)
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

    def _request(
        self, exchange: Exchange, backend: BackendState, timeout_s: float
    ) -> aiohttp.client._RequestContextManager:
        scope = exchange.scope
        target = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        body = exchange.body
        if backend.served_model != backend.model:
            target, body = served_names(target, body, backend.model, backend.served_model, exchange.style)
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        assert self._rt.session is not None, "the session is created in the lifespan"
        return self._rt.session.request(
            scope["method"],
            backend.url + target,
            headers=upstream_request_headers(scope["headers"]),
            data=body or None,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )

    async def _forward(self, exchange: Exchange, pool: ModelPool, lease: Lease, timeout_s: float) -> Outcome:
        rt = self._rt
        backend = lease.slot.backend
        started_at = rt.clock()
        try:
            async with self._request(exchange, backend, timeout_s) as reply:
                headers = downstream_response_headers(reply.raw_headers)
                length = reply.content_length
                if length is None or length > _BUFFER_LIMIT_BYTES or _is_event_stream(headers):
                    return await self._stream(exchange, pool, lease, reply, headers, started_at)
                upstream = _UpstreamTimer(rt, pool.name, lease, started_at, ok=reply.status < 400)
                # Give the slot back inside the protocol callback that completes the body: the next
                # waiter is woken one event-loop turn sooner than if this task had to run first.
                reply.content.on_eof(upstream.finished)
                body = await reply.read()
                upstream.finished()
            if upstream.handed_over:
                # The slot went straight to a waiter: let its request reach the backend before this
                # answer is written back, so the slot idles as little as possible.
                for _ in range(_DISPATCH_TURNS):
                    await asyncio.sleep(0)
        except aiohttp.ClientConnectorError:
            if rt.health is not None:
                rt.health.mark_unreachable(pool, backend)
            outcome, retry_after_s = Outcome.NO_BACKEND, self._no_backend_retry_s
        except TimeoutError:
            outcome, retry_after_s = Outcome.UPSTREAM_TIMEOUT, None
        except aiohttp.ClientError as error:
            log.warning("backend %s failed: %r", backend.url, error)
            outcome, retry_after_s = Outcome.UPSTREAM_ERROR, None
        else:
            headers += [
                (b"content-length", str(len(body)).encode()),
                _server_timing(lease.queue_wait_s, upstream.elapsed_s or 0.0),
            ]
            await send_response(exchange.send, reply.status, headers, body)
            return Outcome.OK
        await rt.controller.release(lease)
        await self._reply_error(exchange, outcome, retry_after_s=retry_after_s)
        return outcome

    async def _stream(
        self,
        exchange: Exchange,
        pool: ModelPool,
        lease: Lease,
        reply: aiohttp.ClientResponse,
        headers: RawHeaders,
        started_at: float,
    ) -> Outcome:
        """Pass the answer through chunk by chunk (SSE stays chunked, nothing is buffered).

        Once the status line is out an upstream failure can no longer become an error status:
        the answer is cut short, so the client sees a broken stream rather than a clean end.
        """
        rt = self._rt
        headers.append(_server_timing(lease.queue_wait_s, rt.clock() - started_at))
        send = exchange.send
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        client_gone = asyncio.ensure_future(until_disconnect(exchange.receive))
        try:
            async for chunk in reply.content.iter_any():
                if client_gone.done():
                    return Outcome.CLIENT_DISCONNECTED
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (TimeoutError, aiohttp.ClientError) as error:
            log.warning("backend %s failed mid-stream: %r", lease.slot.backend.url, error)
            outcome = Outcome.UPSTREAM_TIMEOUT if isinstance(error, TimeoutError) else Outcome.UPSTREAM_ERROR
            await rt.controller.release(lease)
            return outcome  # without the final body message the server closes the connection
        finally:
            client_gone.cancel()
        _UpstreamTimer(rt, pool.name, lease, started_at, ok=reply.status < 400).finished()
        await send({"type": "http.response.body", "body": b""})
        return Outcome.OK


class _UpstreamTimer:
    """Ends one upstream exchange exactly once: records its time and gives the slot back."""

    __slots__ = ("_lease", "_model", "_ok", "_rt", "_started_at", "elapsed_s", "handed_over")

    def __init__(self, rt: Runtime, model: str, lease: Lease, started_at: float, *, ok: bool) -> None:
        self._rt = rt
        self._model = model
        self._lease = lease
        self._started_at = started_at
        self._ok = ok
        self.elapsed_s: float | None = None
        self.handed_over = False

    def finished(self) -> None:
        if self.elapsed_s is not None:
            return
        rt = self._rt
        self.elapsed_s = rt.clock() - self._started_at
        rt.metrics.observe_upstream(self._model, self.elapsed_s)
        self.handed_over = rt.controller.release_soon(self._lease, self.elapsed_s if self._ok else None)


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


def _is_event_stream(headers: RawHeaders) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def _server_timing(queue_s: float, upstream_s: float) -> tuple[bytes, bytes]:
    value = f"queue;dur={queue_s * 1000:.3f}, upstream;dur={upstream_s * 1000:.3f}"
    return b"server-timing", value.encode()
