"""Reply: one upstream answer as it arrives, and what becomes of it when its reader leaves early.

Its rules:
- `on_complete` runs exactly once, inside the protocol callback in which the backend is done with
  the request: the answer ended, the connection closed, or the exchange failed or timed out. That
  is the moment its slot may go to the next request.
- A reader that leaves before the end (`give_up`: the client went away, or its budget ran out)
  gets its error at once, but the exchange goes on as `on_abandon` says: DRAIN reads and discards
  the rest of the answer, ABORT closes the connection and waits for the backend to close its side.
  Only the hard deadline (the upstream timeout) cuts an exchange short.
- `abort` ends the exchange at once (control-plane requests, which hold no slot).
- A reply on a slot counts its answer's events (head, body chunks, end) in its backend's
  `InFlight`, where passive health watches for a backend that stalls (gateway.upstream.health):
  an increment per chunk, no clock read.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from gateway.upstream.client import RawHeaders
from gateway.upstream.origin import OnAbandon

# An answer streamed faster than the client takes it is buffered up to this, then the backend's
# socket stops being read (TCP flow control pushes back).
PAUSE_ABOVE_BYTES = 1 << 18
RESUME_BELOW_BYTES = 1 << 16


class UpstreamError(Exception):
    """The upstream exchange failed."""


class ConnectFailed(UpstreamError):
    """No connection to the backend could be opened."""


class UpstreamBroken(UpstreamError):
    """The exchange broke after the request was sent: connection lost or answer malformed."""


class BackendGone(UpstreamBroken):
    """The backend closed the connection without a byte of answer (after the one retry a reused
    connection gets): it died or is dying, so requests should not be sent to it until it answers
    its health checks again."""


class UpstreamTimeout(TimeoutError):
    """The hard deadline of the exchange (the model's upstream timeout) passed."""


class BackendStalled(TimeoutError):
    """The backend sent no byte of any answer for the stall timeout: its requests are given up."""


class Carrier(Protocol):
    """The connection an exchange is on, as its Reply drives it."""

    def resume(self) -> None: ...
    def give_up(self, how: OnAbandon) -> None: ...
    def broken(self, error: BaseException) -> None: ...


class Reply:
    """One upstream answer: status and headers first, then the body.

    An answer whose Content-Length is at most `whole_up_to_bytes` is announced (`head` returns)
    only once it is complete: its reader then wakes once, not for the headers and again for the
    body, which often arrive in separate segments. `timeout_s` is the hard deadline of the whole
    exchange; `give_up_after_s`, when shorter, is how long the reader waits (the client's budget).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        *,
        head_only: bool = False,
        whole_up_to_bytes: int = 0,
        on_abandon: OnAbandon = OnAbandon.ABORT,
        give_up_after_s: float | None = None,
        in_flight: InFlight | None = None,
    ) -> None:
        self.status = 0
        self.headers: RawHeaders = []
        self.trailers: RawHeaders = []
        """Fields after a chunked body: kept apart, never merged into the headers."""
        self.content_length: int | None = None
        self.head_only = head_only
        self.on_abandon = on_abandon
        self.headers_received = False
        self.complete = False
        self.error: BaseException | None = None
        """Why the exchange failed, if it did."""
        self.given_up: BaseException | None = None
        """Why the reader left before the end, if it did."""
        self.retried = False
        self.on_complete: Callable[[], None] | None = None
        self._in_flight = in_flight
        self._whole_up_to_bytes = whole_up_to_bytes
        self._loop = loop
        self._head: asyncio.Future[None] = loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self.carrier: Carrier | None = None
        self.connecting = False
        """A connection is being opened for it: the opener sends, or ends it if it was given up."""
        self.deadline = loop.time() + timeout_s
        self._timer = loop.call_at(self.deadline, self._expire)
        self._budget_timer: asyncio.TimerHandle | None = None
        if give_up_after_s is not None and give_up_after_s < timeout_s:
            self._budget_timer = loop.call_later(max(0.0, give_up_after_s), self._budget_ran_out)

    @property
    def finished(self) -> bool:
        """Complete, or failed: the backend is done with it, nothing more will arrive."""
        return self.complete or self.error is not None

    @property
    def waits_on_reader(self) -> bool:
        """Its reader is behind a streamed answer: reading from the backend is paused (or pauses
        soon) until the reader takes what is buffered, so no byte is due from the backend."""
        return self._buffered_bytes >= RESUME_BELOW_BYTES and self._head.done()

    @property
    def buffered_bytes(self) -> int:
        """Body bytes received and not yet taken by the reader."""
        return self._buffered_bytes

    async def head(self) -> None:
        """Return once status and headers are in."""
        await self._head

    async def read(self) -> bytes:
        """The whole body."""
        if self.complete and self.given_up is None:  # the usual case for a short answer
            chunks, self._buffered_bytes = list(self._chunks), 0
            self._chunks.clear()
        else:
            chunks = [chunk async for chunk in self.iter_chunks()]
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, without waiting for more than one chunk."""
        while True:
            if self.given_up is not None:
                raise self.given_up
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered_bytes -= len(chunk)
                if self.carrier is not None and self._buffered_bytes < RESUME_BELOW_BYTES:
                    self.carrier.resume()
                yield chunk
                if self.given_up is not None:
                    raise self.given_up
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def give_up(self, error: BaseException) -> None:
        """The reader leaves: it gets `error`; the exchange ends as `on_abandon` says."""
        if self.given_up is not None or self.finished:
            return
        self.given_up = error
        self._cancel_budget()
        self._chunks.clear()
        self._buffered_bytes = 0
        self._reject_head(error)
        self._wake()
        if self.carrier is not None:
            self.carrier.give_up(self.on_abandon)
        elif not self.connecting:
            self._fail(error)  # it never reached a backend: nothing to wait for

    def abort(self, error: BaseException) -> None:
        """End the exchange now, closing its connection."""
        if self.finished:
            return
        if self.carrier is not None:
            self.carrier.broken(error)
        else:
            self._fail(error)

    # Fed by the connection.

    def _headers_done(self, status: int, headers: RawHeaders, content_length: int | None) -> None:
        self.status, self.headers, self.content_length = status, headers, content_length
        self.headers_received = True
        if self._in_flight is not None:
            self._in_flight.answer_events += 1
        if not self._head.done() and (content_length is None or content_length > self._whole_up_to_bytes):
            self._head.set_result(None)

    def _feed(self, chunk: bytes) -> bool:
        """Buffer a body chunk; True when the buffer is full enough to stop reading (only while it
        is read as a stream: an answer held whole is bounded by `whole_up_to_bytes`)."""
        if self._in_flight is not None:
            self._in_flight.answer_events += 1
        if self.given_up is not None:
            return False  # nobody reads it any more: let it flow past
        self._chunks.append(chunk)
        self._buffered_bytes += len(chunk)
        self._wake()
        return self._buffered_bytes > PAUSE_ABOVE_BYTES and self._head.done()

    def _finish(self) -> None:
        if self.finished:
            return
        if self._in_flight is not None:
            self._in_flight.answer_events += 1
        self.complete = True
        self.carrier = None
        self._cancel_timers()
        if not self._head.done():
            self._head.set_result(None)
        self._wake()
        self._notify()

    def _fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self.error = error
        self.carrier = None
        self._cancel_timers()
        self._reject_head(error)
        self._wake()
        self._notify()

    def _expire(self) -> None:
        self.abort(UpstreamTimeout("the backend did not answer in time"))

    def _budget_ran_out(self) -> None:
        self.give_up(TimeoutError("the backend did not answer within the request's budget"))

    def _reject_head(self, error: BaseException) -> None:
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a reply nobody awaits any more must not warn

    def _cancel_budget(self) -> None:
        if self._budget_timer is not None:
            self._budget_timer.cancel()
            self._budget_timer = None

    def _cancel_timers(self) -> None:
        self._timer.cancel()
        self._cancel_budget()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _notify(self) -> None:
        callback, self.on_complete = self.on_complete, None
        if callback is not None:
            callback()


class InFlight:
    """One backend's replies in flight (sent, not yet ended), and how many answer events (heads,
    body chunks, ends) they have brought: what the stall watch reads. Counted, not timed, so the
    data path pays an increment per chunk and a set insert and removal per request."""

    __slots__ = ("answer_events", "busy_since", "replies")

    def __init__(self) -> None:
        self.replies: set[Reply] = set()
        self.answer_events = 0
        self.busy_since: float | None = None
        """Since when requests have been in flight without a break; None when none is."""

    def add(self, reply: Reply, now: float) -> None:
        if not self.replies:
            self.busy_since = now
        self.replies.add(reply)

    def discard(self, reply: Reply) -> None:
        self.replies.discard(reply)
        if not self.replies:
            self.busy_since = None
