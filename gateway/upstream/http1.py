"""The proxy's upstream client: HTTP/1.1 over pooled keep-alive connections, parsed by httptools.

Why not aiohttp on this path (it still does health checks and metric scrapes): a freed backend slot
idles until the next request reaches it, and with aiohttp that request can only be built and sent
by the waiting task once the event loop runs it, through 0.1-0.3 ms of Python per request
(loadtests/probes/client_cost.py). Here a request is serialized while it waits, and `try_send`
writes it on an idle connection from inside the callback that freed the slot.

The client's rules:
- one request at a time per connection; a connection returns to the pool only after a complete
  answer that allows keep-alive, and one idle for longer than `keepalive_s` is closed, not reused;
- an answer's body is framed by the parser (Content-Length, chunked, or the connection's end);
- an exchange that does not finish (timeout, cancellation, a broken answer) aborts its connection,
  since a half-read answer would corrupt the next one;
- failures are `ConnectFailed` (no connection: the backend is unreachable), `UpstreamBroken` (the
  exchange broke after the request was sent) or `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.upstream.client import RawHeaders

# An answer streamed faster than the client takes it is buffered up to this, then the backend's
# socket stops being read (TCP flow control pushes back).
_PAUSE_ABOVE_BYTES = 1 << 18
_RESUME_BELOW_BYTES = 1 << 16
# An answer's status line and headers may take this much; a backend that sends more is broken.
MAX_HEAD_BYTES = 1 << 16


class UpstreamError(Exception):
    """The upstream exchange failed."""


class ConnectFailed(UpstreamError):
    """No connection to the backend could be opened."""


class UpstreamBroken(UpstreamError):
    """The exchange broke after the request was sent: connection lost or answer malformed."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend listens: what a pooled connection is keyed by."""

    host: str
    port: int
    tls: bool

    @property
    def host_header(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}".encode("latin-1")


@lru_cache(maxsize=1024)  # bounded: endpoint discovery brings new pod addresses over time
def origin_of(url: str) -> Origin:
    """The origin of a backend's base URL (cached: looked up per request)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    return Origin(parts.hostname, parts.port or (443 if tls else 80), tls)


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


class Reply:
    """One upstream answer as it arrives: status and headers first, then the body.

    An answer whose Content-Length is at most `whole_up_to_bytes` is announced (`head` returns)
    only once it is complete: its reader then wakes once, not for the headers and again for the
    body, which often arrive in separate segments.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        *,
        head_only: bool = False,
        whole_up_to_bytes: int = 0,
    ) -> None:
        self.status = 0
        self.headers: RawHeaders = []
        self.content_length: int | None = None
        self.head_only = head_only
        self.headers_received = False
        self._whole_up_to_bytes = whole_up_to_bytes
        self.on_complete: Callable[[], None] | None = None
        """Called inside the protocol callback that completes the answer (or fails it)."""
        self._loop = loop
        self._head: asyncio.Future[None] = loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._connection: _Connection | None = None
        self.complete = False
        self.deadline = loop.time() + timeout_s
        self._timer = loop.call_at(self.deadline, self._expire)

    @property
    def finished(self) -> bool:
        """Complete, or failed: nothing more will arrive."""
        return self.complete or self._error is not None

    @property
    def buffered_bytes(self) -> int:
        """Body bytes received and not yet taken by the reader."""
        return self._buffered_bytes

    async def head(self) -> None:
        """Return once status and headers are in."""
        await self._head

    async def read(self) -> bytes:
        """The whole body."""
        if not self.complete:
            chunks = [chunk async for chunk in self.iter_chunks()]
        else:  # the usual case for a short answer: no need to iterate
            chunks, self._buffered_bytes = list(self._chunks), 0
            self._chunks.clear()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, without waiting for more than one chunk."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered_bytes -= len(chunk)
                if self._connection is not None and self._buffered_bytes < _RESUME_BELOW_BYTES:
                    self._connection.resume()
                yield chunk
            if self._error is not None:
                raise self._error
            if self.complete:
                return
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    # Fed by the connection.

    def _headers_done(self, status: int, headers: RawHeaders, content_length: int | None) -> None:
        self.status, self.headers, self.content_length = status, headers, content_length
        self.headers_received = True
        if content_length is None or content_length > self._whole_up_to_bytes:
            self._head.set_result(None)

    def _feed(self, chunk: bytes) -> bool:
        """Buffer a body chunk; True when the buffer is full enough to stop reading (only while it
        is read as a stream: an answer held whole is bounded by `whole_up_to_bytes`)."""
        self._chunks.append(chunk)
        self._buffered_bytes += len(chunk)
        self._wake()
        return self._buffered_bytes > _PAUSE_ABOVE_BYTES and self._head.done()

    def _finish(self) -> None:
        self.complete = True
        self._timer.cancel()
        if not self._head.done():
            self._head.set_result(None)
        self._wake()
        self._notify()

    def _fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self._error = error
        self._timer.cancel()
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a reply nobody awaits any more must not warn
        self._wake()
        self._notify()

    def _expire(self) -> None:
        error = TimeoutError("the backend did not answer in time")
        if self._connection is not None:
            self._connection._broken(error)
        else:
            self._fail(error)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _notify(self) -> None:
        callback, self.on_complete = self.on_complete, None
        if callback is not None:
            callback()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an origin, carrying one exchange at a time."""

    def __init__(self, pool: UpstreamClient, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.reply: Reply | None = None
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._headers: RawHeaders = []
        self._head_bytes = 0
        self._content_length: int | None = None
        self._framed = False
        self._paused = False

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, reply: Reply, request: bytes) -> None:
        assert self.transport is not None and self.reply is None
        self.reply = reply
        reply._connection = self
        self.transport.write(request)

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

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
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            refused = error.__context__  # what one of our callbacks raised, if it was that
            self._broken(
                refused
                if isinstance(refused, UpstreamBroken)
                else UpstreamBroken(f"malformed answer: {error}")
            )

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool._forget(self)
        reply, self.reply = self.reply, None
        if reply is None or reply.finished:
            return
        if reply.headers_received and not self._framed and not reply.head_only:
            reply._finish()  # a body without Content-Length or chunking ends with the connection
        else:
            reply._fail(UpstreamBroken("the backend closed the connection before the answer was complete"))

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._headers = []
        self._head_bytes = 0
        self._content_length = None
        self._framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise UpstreamBroken(f"answer headers over {MAX_HEAD_BYTES} bytes")
        self._headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length":
            self._content_length = int(value) if value.isdigit() else None
            self._framed = True
        elif lowered == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (we never ask for one); the real one follows
        reply = self.reply
        if reply is None:
            self.abort()  # an answer nobody asked for
            return
        reply._headers_done(status, self._headers, self._content_length)
        if reply.head_only:
            # The parser cannot be told this answer has no body, so the connection is not reused.
            self.reply = None
            reply._finish()
            self.abort()

    def on_body(self, body: bytes) -> None:
        reply = self.reply
        if reply is not None and reply._feed(body) and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        reply = self.reply
        if reply is None or not reply.headers_received:
            return  # the end of an interim answer
        self.reply = None
        reply._connection = None
        if self._parser.should_keep_alive() and self.usable:
            self.resume()
            self._pool._put_back(self)
        else:
            self.abort()
        reply._finish()

    def _broken(self, error: BaseException) -> None:
        reply, self.reply = self.reply, None
        self.abort()
        if reply is not None:
            reply._fail(error)


@dataclass(eq=False)
class UpstreamClient:
    """A pool of keep-alive connections per origin; build it in the lifespan, `close` at the end."""

    keepalive_s: float = 4.0
    """A connection idle for longer is closed instead of reused: this is shorter than the 5 s idle
    timeout of uvicorn (vLLM's server) and most others, so a request is not written onto a
    connection the backend is closing at that moment."""
    clock: Callable[[], float] = time.monotonic
    tls: ssl.SSLContext | None = None
    """For https backends; the system's trusted CAs by default."""
    _idle: dict[Origin, list[_Connection]] = field(default_factory=dict)
    _open: set[_Connection] = field(default_factory=set)

    def try_send(self, origin: Origin, request: bytes, make_reply: Callable[[], Reply]) -> Reply | None:
        """Send on an idle pooled connection at once, without awaiting; None when none is idle."""
        idle = self._idle.get(origin)
        expired_before = self.clock() - self.keepalive_s
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
        if self.try_send(origin, request, lambda: reply) is not None:
            return
        loop = asyncio.get_running_loop()
        if origin.tls and self.tls is None:
            self.tls = ssl.create_default_context()
        try:
            async with asyncio.timeout_at(reply.deadline):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=self.tls if origin.tls else None,
                )
        except TimeoutError:
            raise
        except OSError as error:  # refused, unreachable, unresolvable, an untrusted certificate
            raise ConnectFailed(f"{origin.host}:{origin.port}: {error.strerror or error}") from error
        connection = cast(_Connection, protocol)
        self._open.add(connection)
        connection.send(reply, request)

    @staticmethod
    def abandon(reply: Reply) -> None:
        """Give up on an unfinished exchange: its connection is closed, its reply failed."""
        if reply.finished:
            return
        if reply._connection is not None:
            reply._connection._broken(UpstreamBroken("abandoned"))
        else:
            reply._fail(UpstreamBroken("abandoned"))

    async def close(self) -> None:
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost

    def _put_back(self, connection: _Connection) -> None:
        connection.idle_since = self.clock()
        self._idle.setdefault(connection.origin, []).append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)
