"""The proxy's upstream client: HTTP/1.1 over pooled keep-alive connections, parsed by httptools.

Why not aiohttp on this path (it still does health checks and metric scrapes): a freed backend slot
idles until the next request reaches it, and with aiohttp that request can only be built and sent
by the waiting task once the event loop runs it, through 0.1-0.3 ms of Python per request
(loadtests/probes/client_cost.py). Here a request is serialized while it waits, and `try_send`
writes it on an idle connection from inside the callback that freed the slot.

The client's rules, held to h11's standard:
- one request at a time per connection. A connection returns to the pool only after a complete
  answer that allows keep-alive, and only once the parser has finished the buffer that ended it:
  bytes past the end of an answer close that connection and never reach the next exchange;
- an answer's body is framed by the parser (Content-Length, chunked, or the connection's end);
  trailers are kept apart from the headers; a head (status line and fields) may take at most
  `max_head_bytes`, counted as bytes arrive, so a head that never ends is cut at once;
- a connection idle for longer than its origin's `keepalive_s` is closed, not reused; a request
  whose reused connection died before any answer byte came is sent once more on a fresh connection
  where the backend closed it as we wrote (within CLOSED_AS_WRITTEN_S of the write) or where its
  method is idempotent, and only then: an inference the backend held and died on is not sent twice;
- a body that ends with the connection (no Content-Length, no chunking) is whole only at a clean
  close; a reset is a broken answer. Trailers are held to the head's byte bound as they arrive;
- an exchange that fails (timeout, a broken or malformed answer) aborts its connection, since a
  half-read answer would corrupt the next one; one whose reader left ends as gateway.upstream.reply
  says;
- failures are `ConnectFailed` (no connection: the backend is unreachable), `UpstreamBroken` (the
  exchange broke after the request was sent) or `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import httptools

from gateway.fields import decimal
from gateway.upstream.client import RawHeaders
from gateway.upstream.origin import OnAbandon, Origin, tls_context
from gateway.upstream.reply import BackendGone, ConnectFailed, Reply, UpstreamBroken

CLOSED_AS_WRITTEN_S = 0.25
"""A reused connection closed this soon after a request was written on it, without an answer byte,
was closed by its backend as the request travelled (the keep-alive race): the request is sent again.
The race's close comes within a round trip; the margin is for a gateway whose loop is busy. A
backend that did read the request and died on it this soon gets it once more."""

_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})


def serialize_request(method: str, target: str, origin: Origin, headers: RawHeaders, body: bytes) -> bytes:
    """The request as it goes on the wire. `headers` must already be free of hop-by-hop fields,
    Host and Content-Length (gateway.upstream.client.upstream_request_headers)."""
    parts = [f"{method} {target} HTTP/1.1\r\nhost: ".encode("latin-1"), origin.host_header, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        parts.append(b"content-length: %d\r\n" % len(body))
    parts += (b"\r\n", body)
    return b"".join(parts)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an origin, carrying one exchange at a time."""

    def __init__(self, pool: UpstreamClient, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._max_head_bytes = origin.options.max_head_bytes
        self.transport: asyncio.Transport | None = None
        self.reply: Reply | None = None
        self.idle_since = 0.0
        self.exchanges = 0
        self._request = b""
        self._answer_bytes = 0
        self._parser = httptools.HttpResponseParser(self)
        # What h11 takes too: a bare LF ending a line, spaces after a chunk's size.
        self._parser.set_dangerous_leniencies(
            lenient_optional_cr_before_lf=True, lenient_spaces_after_chunk_size=True
        )
        self._headers: RawHeaders = []
        self._head_done = False
        self._head_bytes = 0
        """Bytes read while the current head was incomplete."""
        self._field_bytes = 0
        self._trailer_bytes = 0
        """Bytes read since the body's last byte, while the answer is not complete (its last
        chunk's framing and trailers, which the parser buffers)."""
        self._body_in_read = False
        self._sent_at = 0.0
        self._content_length: int | None = None
        self._framed = False
        self._paused = False
        self._hung_up = False
        self._ended: Reply | None = None
        """An answer the parser completed in the buffer being fed: settled once the feed is done."""
        self._keep_alive = False
        self._dirty = False
        """Bytes came past the end of an answer: the connection can no longer be trusted."""

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self._dirty

    def send(self, reply: Reply, request: bytes) -> None:
        assert self.transport is not None and self.reply is None
        self.reply = reply
        reply.carrier = self
        self.exchanges += 1
        self._request = request
        self._answer_bytes = self._head_bytes = self._trailer_bytes = 0
        self._head_done = False
        self._sent_at = self._pool.clock()
        self.transport.write(request)

    # Carrier, for the Reply

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def give_up(self, how: OnAbandon) -> None:
        self.resume()  # what arrives now is discarded: let it flow
        if how is OnAbandon.DRAIN or self.transport is None:
            return
        self._hung_up = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the backend sees its client leave; it closes when it stops
        else:
            self.transport.close()  # TLS cannot half-close: the backend's close cannot be awaited

    def broken(self, error: BaseException) -> None:
        reply, self.reply = self.reply, None
        self.abort()
        if reply is not None:
            reply._fail(error)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.reply is None:
            self.abort()  # bytes nobody asked for: the connection can no longer be trusted
            return
        self._answer_bytes += len(data)
        in_body = self._head_done
        if not in_body:
            self._head_bytes += len(data)
        self._body_in_read = False
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as error:  # 101: never asked
            if self._ended is None:
                refused = error.__context__  # what one of our callbacks raised, if it was that
                reason = refused if isinstance(refused, UpstreamBroken) else None
                self.broken(reason or UpstreamBroken(f"malformed answer: {error!r}"))
                return
            self._dirty = True  # garbage after a complete answer
        if self._ended is not None:
            self._settle()
        elif not self._head_done and self._head_bytes > self._max_head_bytes:
            self.broken(UpstreamBroken(f"answer head over {self._max_head_bytes} bytes"))
        elif in_body:
            self._trailer_bytes = 0 if self._body_in_read else self._trailer_bytes + len(data)
            if self._trailer_bytes > self._max_head_bytes:
                self.broken(UpstreamBroken(f"answer trailers over {self._max_head_bytes} bytes"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool._forget(self)
        reply, self.reply = self.reply, None
        if reply is None or reply.finished:
            return
        reply.carrier = None
        if self._hung_up:
            reply._fail(UpstreamBroken("closed after its reader left"))
        elif reply.headers_received and not self._framed and not reply.head_only:
            if exc is None:
                reply._finish()  # a body without Content-Length or chunking ends with the connection
            else:  # a reset is not the end of the body: the client must not take it whole
                reply._fail(UpstreamBroken(f"the connection broke before the answer's end: {exc!r}"))
        elif self._answer_bytes == 0 and self.exchanges > 1 and reply.given_up:
            # Reused and closed without a word while its reader left: the keep-alive race, not a
            # backend gone (which would be taken out of dispatch).
            reply._fail(UpstreamBroken("closed without answering after its reader left"))
        elif self._answer_bytes == 0 and self.exchanges > 1 and not reply.retried and self._may_resend():
            self._pool._retry(self.origin, self._request, reply)
        elif self._answer_bytes == 0:
            reply._fail(BackendGone("the backend closed the connection without answering"))
        else:
            reply._fail(UpstreamBroken("the backend closed the connection before the answer was complete"))

    def _may_resend(self) -> bool:
        """Whether a request its reused connection lost without a byte of answer was, by all signs,
        never read: the backend closed the idle connection as it was written (its close arrives
        within a moment of the write). A request the backend held longer it may have worked on,
        and only an idempotent method (RFC 9110 9.2.2) is sent again then."""
        if self._pool.clock() - self._sent_at <= CLOSED_AS_WRITTEN_S:
            return True
        return self._request.split(b" ", 1)[0] in _IDEMPOTENT

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._ended is not None:
            self._dirty = True  # a second answer in the buffer that ended the first
        self._headers = []
        self._field_bytes = 0
        self._content_length = None
        self._framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_bytes += len(name) + len(value) + 4
        if self._field_bytes > self._max_head_bytes:
            part = "trailers" if self._head_done else "headers"
            raise UpstreamBroken(f"answer {part} over {self._max_head_bytes} bytes")
        if self._head_done:
            if self.reply is not None:
                self.reply.trailers.append((name, value))
            return
        self._headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length":
            self._content_length = decimal(value)
            self._framed = True
        elif lowered == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        if 100 <= self._parser.get_status_code() < 200:
            self._head_bytes = 0  # an interim answer (we never ask for one); the real one follows
            return
        self._head_done = True
        self._field_bytes = 0
        reply = self.reply
        if reply is None:
            self.abort()  # an answer nobody asked for
            return
        reply._headers_done(self._parser.get_status_code(), self._headers, self._content_length)
        if reply.head_only:
            # The parser cannot be told this answer has no body, so the connection is not reused.
            self.reply, self._ended, self._keep_alive = None, reply, False

    def on_body(self, body: bytes) -> None:
        self._body_in_read = True
        reply = self.reply
        if reply is not None and reply._feed(body) and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        reply = self.reply
        if reply is None or not reply.headers_received:
            return  # the end of an interim answer
        self.reply, self._ended = None, reply
        self._keep_alive = self._parser.should_keep_alive()

    def _settle(self) -> None:
        """Pool or close the connection, then complete the answer: its completion may write the
        next request, which must find the connection in its final state."""
        reply, self._ended = self._ended, None
        assert reply is not None
        reply.carrier = None
        if self._keep_alive and not self._hung_up and self.usable:
            self.resume()
            self._pool._put_back(self)
        else:
            self.abort()
        reply._finish()


@dataclass(eq=False)
class UpstreamClient:
    """A pool of keep-alive connections per origin; build it in the lifespan, `close` at the end."""

    clock: Callable[[], float] = time.monotonic
    _idle: dict[Origin, list[_Connection]] = field(default_factory=dict)
    _open: set[_Connection] = field(default_factory=set)
    _retries: set[asyncio.Task[None]] = field(default_factory=set)

    def try_send(self, origin: Origin, request: bytes, make_reply: Callable[[], Reply]) -> Reply | None:
        """Send on an idle pooled connection at once, without awaiting; None when none is idle."""
        idle = self._idle.get(origin)
        expired_before = self.clock() - origin.options.keepalive_s
        while idle:
            connection = idle.pop()  # the most recently used: the others may age out
            if connection.usable and connection.idle_since > expired_before:
                reply = make_reply()
                connection.send(reply, request)
                return reply
            connection.abort()
        return None

    async def send(self, origin: Origin, request: bytes, reply: Reply) -> None:
        """Send on an idle connection, or on a new one."""
        if self.try_send(origin, request, lambda: reply) is None:
            await self._open_and_send(origin, request, reply)

    async def close(self) -> None:
        for task in self._retries:
            task.cancel()
        for connection in list(self._open):
            # Failed as the gateway's own stop, not as a backend gone: nothing is marked unready.
            connection.broken(UpstreamBroken("the gateway is stopping"))
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost

    async def _open_and_send(self, origin: Origin, request: bytes, reply: Reply) -> None:
        loop = asyncio.get_running_loop()
        reply.connecting = True
        try:
            async with asyncio.timeout_at(reply.deadline):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=tls_context(origin.options.tls) if origin.tls else None,
                )
        except TimeoutError:
            raise
        except OSError as error:  # refused, unreachable, unresolvable, an untrusted certificate
            raise ConnectFailed(f"{origin.host}:{origin.port}: {error.strerror or error}") from error
        finally:
            reply.connecting = False
        connection = protocol
        self._open.add(connection)
        if reply.finished or reply.given_up is not None:
            connection.abort()  # its reader left while the connection opened: nothing was sent
            reply._fail(reply.given_up or UpstreamBroken("abandoned"))
            return
        connection.send(reply, request)

    def _retry(self, origin: Origin, request: bytes, reply: Reply) -> None:
        reply.retried = reply.connecting = True

        async def again() -> None:
            try:
                await self._open_and_send(origin, request, reply)
            except (ConnectFailed, TimeoutError) as error:
                reply._fail(error)

        task = asyncio.ensure_future(again())
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    def _put_back(self, connection: _Connection) -> None:
        connection.idle_since = self.clock()
        self._idle.setdefault(connection.origin, []).append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)
