"""The HTTP relay: a backend's answer to the client, or the error the request ended with.

Short answers with a Content-Length are read whole (their slot frees before the client write) and
sent in one piece; long or open-ended ones (SSE) pass chunk by chunk, nothing buffered. Success
carries `Server-Timing: queue;dur=<ms>, upstream;dur=<ms>`. Errors are rendered by gateway.errors
in the route's style; while the gateway drains they close the connection. The drain's cut
(gateway.flow.drain) is answered 503 `draining` until the answer's status line is out, and cuts the
answer short after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from starlette.types import Receive, Send

from gateway.errors import ErrorStyle, error_response
from gateway.flow.drain import DRAINING_RETRY_S, Drain
from gateway.flow.verdicts import Lease, Refusal
from gateway.http.asgi_io import RawHeaders, send_response, until_disconnect
from gateway.telemetry.server_timing import server_timing_value
from gateway.upstream.client import downstream_response_headers
from gateway.upstream.exchange import BUFFER_LIMIT_BYTES, UpstreamExchange
from gateway.upstream.reply import ConnectFailed, Reply, UpstreamError
from policies.outcomes import Outcome, answered

log = logging.getLogger("gateway.proxy")


class StreamRewrite(Protocol):
    """What passes an event stream on, bytes in and bytes out (what it holds back, at `close`)."""

    def feed(self, chunk: bytes) -> bytes: ...
    def close(self) -> bytes: ...


# Statuses whose answers have no body, and must not say how long it is (RFC 9110 8.6).
_BODILESS = frozenset({204, 304})

# What of a stream its observer sees: enough for the last event or two (an OpenAI usage chunk).
_TAIL_BYTES = 4096


class ClientLeft(Exception):
    """The client went away while its request was with a backend."""


async def send_error(
    send: Send,
    style: ErrorStyle,
    outcome: Outcome,
    drain: Drain,
    *,
    detail: str | None = None,
    retry_after_s: float | None = None,
    rule: str | None = None,
) -> None:
    """Answer with `outcome`'s error (nothing, when the client is gone)."""
    if outcome is Outcome.CLIENT_DISCONNECTED:
        return  # nobody to answer
    status, headers, body = error_response(
        outcome, style, detail=detail, retry_after_s=retry_after_s, rule=rule
    )
    if drain.draining:
        headers.append((b"connection", b"close"))
    await send_response(send, status, headers, body)


class Relay:
    """The client's side of one admitted HTTP request (a gateway.flow.admitted.Ingress)."""

    __slots__ = (
        "_drain", "_no_backend_retry_s", "_observe", "_receive", "_rewrite_stream", "_send", "_style", "_work"
    )  # fmt: skip

    def __init__(
        self,
        receive: Receive,
        send: Send,
        style: ErrorStyle,
        work: UpstreamExchange,
        drain: Drain,
        no_backend_retry_s: float,
        observe: Callable[[bytes], None] | None = None,
        rewrite_stream: StreamRewrite | None = None,
    ) -> None:
        self._receive = receive
        self._send = send
        self._style = style
        self._work = work
        self._drain = drain
        self._no_backend_retry_s = no_backend_retry_s
        self._observe = observe
        """Shown a successful answer once it is out: its body, or a stream's last bytes."""
        self._rewrite_stream = rewrite_stream
        """Passes a successful event stream on (gateway.http.usage_stream), where one is given."""

    def until_disconnect(self) -> Awaitable[None]:
        return until_disconnect(self._receive)

    async def refuse(self, refusal: Refusal) -> None:
        await send_error(
            self._send,
            self._style,
            refusal.outcome,
            self._drain,
            detail=refusal.detail,
            retry_after_s=refusal.retry_after_s,
            rule=refusal.rule,
        )

    async def answer(self, lease: Lease) -> Outcome:
        work = self._work
        client_gone: asyncio.Future[None] | None = None
        try:
            reply = work.reply or await work.start()
            client_gone = self._watch_disconnect(reply)
            await reply.head()
            headers = downstream_response_headers(reply.headers)
            length = reply.content_length
            if length is None or length > BUFFER_LIMIT_BYTES or _is_event_stream(headers):
                return await self._stream(lease, reply, headers)
            body = await reply.read()
        except ClientLeft:
            return Outcome.CLIENT_DISCONNECTED
        except asyncio.CancelledError:
            if not self._drain.absorb_cut():
                raise
            outcome, retry_after_s = Outcome.DRAINING, DRAINING_RETRY_S  # cut before its answer started
        except ConnectFailed:  # the backend was marked unreachable before its slot went back
            outcome, retry_after_s = Outcome.NO_BACKEND, self._no_backend_retry_s
        except TimeoutError:
            outcome, retry_after_s = Outcome.UPSTREAM_TIMEOUT, None
        except UpstreamError as error:
            log.warning("backend %s failed: %s", lease.slot.backend.url, error)
            outcome, retry_after_s = Outcome.UPSTREAM_ERROR, None
        else:
            if reply.status not in _BODILESS:
                headers.append((b"content-length", str(len(body)).encode()))
            headers.append(server_timing(lease.queue_wait_s, work.elapsed_s or 0.0, lease.batch_wait_s))
            await send_response(self._send, reply.status, headers, body)
            if self._observe is not None and 200 <= reply.status < 300:
                self._observe(body)
            return answered(reply.status)
        finally:
            if client_gone is not None:
                client_gone.cancel()
        await send_error(self._send, self._style, outcome, self._drain, retry_after_s=retry_after_s)
        return outcome

    async def _stream(self, lease: Lease, reply: Reply, headers: RawHeaders) -> Outcome:
        """Pass the answer through chunk by chunk (SSE stays chunked, nothing is buffered).

        Once the status line is out an upstream failure, or the drain's cut, can no longer become
        an error status: the answer is cut short, so the client sees a broken stream rather than
        a clean end.
        """
        headers.append(server_timing(lease.queue_wait_s, self._work.running_for_s(), lease.batch_wait_s))
        send, observe = self._send, self._observe
        rewrite = self._rewrite_stream
        if rewrite is not None and not (200 <= reply.status < 300 and _is_event_stream(headers)):
            rewrite = None
        tail = b""
        try:
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            async for chunk in reply.iter_chunks():
                if observe is not None:
                    tail = (tail + chunk)[-_TAIL_BYTES:]
                if rewrite is not None and not (chunk := rewrite.feed(chunk)):
                    continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            rest = rewrite.close() if rewrite is not None else b""
            await send({"type": "http.response.body", "body": rest})
            if observe is not None and 200 <= reply.status < 300:
                observe(tail)
        except ClientLeft:
            return Outcome.CLIENT_DISCONNECTED
        except (TimeoutError, UpstreamError) as error:
            log.warning("backend %s failed mid-stream: %s", lease.slot.backend.url, error)
            outcome = Outcome.UPSTREAM_TIMEOUT if isinstance(error, TimeoutError) else Outcome.UPSTREAM_ERROR
            return outcome  # without the final body message the server closes the connection
        except asyncio.CancelledError:
            if not self._drain.absorb_cut():
                raise
            return Outcome.DRAINING  # cut mid-answer (the start is out): the connection closes
        return answered(reply.status)

    def _watch_disconnect(self, reply: Reply) -> asyncio.Future[None]:
        """Give up on `reply` the moment the client goes away (cancel the watch once answered)."""
        watch = asyncio.ensure_future(until_disconnect(self._receive))

        def left(done: asyncio.Future[None]) -> None:
            if not done.cancelled():
                reply.give_up(ClientLeft())

        watch.add_done_callback(left)
        return watch


def _is_event_stream(headers: RawHeaders) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def server_timing(queue_s: float, upstream_s: float, batch_s: float | None = None) -> tuple[bytes, bytes]:
    """The `Server-Timing` header (gateway.telemetry.server_timing)."""
    return b"server-timing", server_timing_value(queue_s, upstream_s, batch_s).encode()
