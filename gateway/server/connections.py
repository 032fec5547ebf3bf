"""Limits on clients, kept by the HTTP protocol under uvicorn (httptools): how long a request's head
and body may take, how large a head may be, and how many connections the process holds.

The rules this module keeps:
- a request's head (request line and header fields) must arrive within `header_timeout_ms` of its
  first byte or, on a new connection, of the connection's start; its body within `body_timeout_ms`
  of the head. A client that is too slow, or silent, is cut (its connection reset) and counted;
- the clocks run only while the gateway waits on the client: a pipelined request's start when the
  requests before it on the connection are answered. A request whose head and body have arrived is
  never cut by them, however long it queues or is served;
- a head over `max_header_bytes` (request line, fields and their separators, as sent by a client
  that writes `Name: value`) or with more than `max_headers` fields is answered 431 with a JSON
  error, and the connection closes; so is, with a 400, an HTTP/1.1 request without a Host field or
  any request with two (RFC 9112, 3.2: the target's authority would be ambiguous). Bytes are
  counted as they are read, so a head that never ends is cut at the limit (give or take the one
  read it began in), never buffered whole. Trailers of a chunked body are held to the same byte
  bound; they cut the connection, as the app owns the answer;
- an answer's bytes must be taken by the client: once the connection's write buffer is full (the
  client stopped reading), it must drain within `send_timeout_ms` or the connection is cut. The app
  then sees its client leave, so a slot held for a client that stopped reading goes back as for one
  that left (the backend's `on_abandon`), instead of waiting on it up to the upstream timeout;
- after a refused head the connection reads and drops what the client still sends, for up to
  LINGER_S, so that the client reads the answer instead of a reset;
- an Upgrade (WebSocket, h2c) is ignored and its request served as plain HTTP/1.1: the parser ends
  such a request at its head, so a Content-Length body is read past it, and the connection closes
  after the answer (a chunked one is a 400);
- the process holds at most `max_connections` client connections, every client listener together
  (one process, one open-file limit). At the limit a new connection closes the one that has waited
  longest without a request in progress (idle between requests, still sending its head, or its
  body stalled: nothing of it for `body_idle_ms`); when every other one has a request in
  progress, the new one is closed at once. The admin listener keeps ADMIN_CONNECTIONS of its own,
  so that a flood of clients never keeps a kubelet's probe or Prometheus out.

The limits need httptools (a hard dependency); uvicorn's h11 protocol does not keep them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.fields import decimal
from gateway.server.client_limits import REFUSAL_STATUS, Cut, refusal_body
from gateway.server.head_with_body import HeadWithBody

if TYPE_CHECKING:
    from gateway.server.client_connections import ClientConnections

LINGER_S = 2.0
"""After a refused head, how long what the client still sends is read and dropped before the
connection closes."""

# A request line is `METHOD SP target SP HTTP/1.1 CRLF`; the head ends with an empty line.
_REQUEST_LINE_AND_END = len(b"  HTTP/1.1\r\n") + len(b"\r\n")
_FIELD_SEPARATORS = len(b": \r\n")


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int:
    """A request's body length as its head declares it: -1 when chunked (the parser has checked
    that Content-Length is a number, and that both are not sent)."""
    for name, value in headers:
        if name == b"content-length":
            return decimal(value) or 0
        if name == b"transfer-encoding":
            return -1
    return 0


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a head over a limit."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, holding its client to `clients.limits` (see the module's rules).
    gateway.server.client_connections.ClientConnections makes the subclass that sets `clients`."""

    clients: ClassVar[ClientConnections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = self.clients.limits
        self._clock: tuple[Cut | None, float] | None = None
        """What is cut when the time is up (None: the linger after a refused head ends), and how
        long it is."""
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        """Runs while the write buffer is full: the client has that long to take its answer."""
        self._reading_head = True  # the bytes that come next belong to a request's head
        self._head_begun = self._in_body = self._body_read = self._head_ended_in_read = False
        # Bytes read while this head was incomplete, from the first read that began inside it; the
        # head as parsed (target, fields, separators); bytes of this body in reads that carried no
        # body byte (trailers, which the parser buffers too).
        self._head_bytes = self._field_bytes = self._fields = self._trailer_bytes = 0
        self._refusal: Cut | None = None
        self._refusal_due: Cut | None = None
        self._lingering = False  # a head was refused: what the client sends now is dropped
        self._upgrade_body_left: int | None = None
        """Of a request with Upgrade: bytes of its body still to come (-1 when chunked)."""
        self._table = self.clients.table
        """The connections this one counts among: the clients', or the admin listener's."""
        self._idle_timer: asyncio.TimerHandle | None = None
        """Runs while a body is read: nothing of it for `body_idle_s` makes it evictable."""
        self._stalled = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sockname = transport.get_extra_info("sockname")
        if isinstance(sockname, tuple) and sockname[1] == self.clients.admin_port:
            self._table = self.clients.admin_table
        victim = self._table.opened(self)
        if victim is self:
            self.clients.count(Cut.REFUSED)
            transport.abort()
            return
        if victim is not None:
            victim._cut(Cut.EVICTED)
        self._arm(Cut.HEADER_TIMEOUT, self._limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_send_clock()
        self._stop_idle_clock()
        self._table.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self._reading_head:
            self._head_bytes += len(data)
        self._body_read = self._head_ended_in_read = False
        self._unset_keepalive_if_required()
        try:
            if self._upgrade_body_left is None:
                self.parser.feed_data(data)
            else:
                self._read_upgrade_body(data)
        except httptools.HttpParserUpgrade as upgrade:  # uvicorn_config sets ws="none"
            self._read_upgrade_body(data[upgrade.args[0] :])
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(self._refusal)
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        limits = self._limits
        if self._reading_head:
            if self._head_bytes > limits.max_header_bytes:
                self._refuse(Cut.HEADERS_TOO_LARGE)
            elif self._head_begun and self._clock is None:
                self._arm(Cut.HEADER_TIMEOUT, limits.header_timeout_s)
        elif self._in_body:  # the request's body is still to come (a whole request never gets here)
            if self._body_read:
                self._trailer_bytes = 0
            elif not self._head_ended_in_read:
                self._trailer_bytes += len(data)
                if self._trailer_bytes > limits.max_header_bytes:
                    self._cut(Cut.HEADERS_TOO_LARGE)
                    return
            if self._body_read or self._head_ended_in_read:
                self._body_came()
            if self._clock is None:
                self._arm(Cut.BODY_TIMEOUT, limits.body_timeout_s)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self._limits.send_timeout_s, self._send_time_up)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_clock()

    # httptools callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        self._field_bytes = self._fields = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)  # first: a 431 for a target too long takes its route's style from it
        self._field_bytes += len(url)
        self._check_head_bytes(0)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._reading_head:
            self._fields += 1
            if self._fields > self._limits.max_headers:
                self._refusal = Cut.TOO_MANY_HEADERS
                raise _Refused
            self._field_bytes += len(name) + len(value) + _FIELD_SEPARATORS
            self._check_head_bytes(0)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._check_head_bytes(len(self.parser.get_method()) + _REQUEST_LINE_AND_END)
        hosts = sum(name == b"host" for name, _ in self.headers)
        if hosts > 1 or (hosts == 0 and self.parser.get_http_version() == "1.1"):
            self._refusal = Cut.BAD_HOST
            raise _Refused
        self._disarm()
        self._reading_head, self._in_body, self._head_ended_in_read = False, True, True
        self._trailer_bytes = 0
        before = self.cycle
        super().on_headers_complete()
        if (cycle := self.cycle) is not None and cycle is not before:  # its task has not run yet
            cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
        self._table.busy(self)

    def on_body(self, body: bytes) -> None:
        self._body_read = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._upgrade_body_left is None and self.parser.should_upgrade():
            # The parser ends an upgrade's request at its head; the upgrade is ignored (RFC 9110
            # 7.8), so its body is read past the parser, which is spent for this connection.
            self._upgrade_body_left = _declared_length(self.headers)
            if self._upgrade_body_left != 0:
                return
        super().on_message_complete()
        self._disarm()
        self._stop_idle_clock()
        if self._stalled:  # its last bytes came: the request is in progress
            self._stalled = False
            self._table.busy(self)
        self._in_body = self._head_begun = False
        self._reading_head = True
        self._head_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._serving():
            self._table.waiting(self)
            if self._refusal_due is not None:
                self._answer_refusal(self._refusal_due)
        self._reschedule()

    def _read_upgrade_body(self, data: bytes) -> None:
        """An ignored upgrade's body, past the parser; then the answer closes the connection."""
        left = self._upgrade_body_left
        if left is None or left < 0:  # chunked: only the parser could read it
            self._lingering = True
            self.send_400_response("a request with Upgrade must have a Content-Length body, or none")
            return
        if left and data:
            self.on_body(data[:left])
            self._upgrade_body_left = left = max(0, left - len(data))
            if left == 0:
                self.on_message_complete()
        if left == 0 and self.cycle is not None:
            self.cycle.keep_alive = False  # what follows cannot be parsed: it is dropped

    # Limits

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _check_head_bytes(self, more: int) -> None:
        if self._field_bytes + more > self._limits.max_header_bytes:
            self._refusal = Cut.HEADERS_TOO_LARGE
            raise _Refused

    def _refuse(self, cut: Cut) -> None:
        """Answer 431 (or 400: REFUSAL_STATUS) once the requests before this one are answered,
        dropping what else comes."""
        self.clients.count(cut)
        self._lingering = True
        self._disarm()
        if self._serving():
            self._refusal_due = cut  # written after the answers it must not cut into
        else:
            self._answer_refusal(cut)

    def _answer_refusal(self, cut: Cut) -> None:
        """Write the refusal, then linger: read and drop what comes until the client closes, or LINGER_S."""
        self._refusal_due = None
        body = refusal_body(cut, self._limits, openai=getattr(self, "url", b"").startswith(b"/v1/"))
        head = [STATUS_LINE[REFUSAL_STATUS.get(cut, 431)]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        self.transport.write(b"".join(head) + b"connection: close\r\n\r\n" + body)
        self._arm(None, LINGER_S)
        self.flow.resume_reading()  # a pipelined request may have paused it
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()

    def _cut(self, cut: Cut) -> None:
        self.clients.count(cut)
        self._disarm()
        self.transport.abort()

    def _arm(self, cut: Cut | None, seconds: float) -> None:
        self._disarm()
        self._clock = (cut, seconds)
        self._reschedule()

    def _disarm(self) -> None:
        self._clock = None
        self._hold()

    def _hold(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _reschedule(self) -> None:
        """Start the clock once the gateway waits on the client: a head not while a request before
        it is served, a body not while its request waits in the pipeline for the ones before it."""
        if self._clock is None:
            return
        cut, seconds = self._clock
        if (cut is Cut.HEADER_TIMEOUT and self._serving()) or (cut is Cut.BODY_TIMEOUT and self.pipeline):
            self._hold()
        elif self._timer is None:
            self._timer = self.loop.call_later(seconds, self._time_up)

    def _body_came(self) -> None:
        """Bytes of the body came (or its head ended): it is not stalled, for `body_idle_s` more."""
        if self._stalled:
            self._stalled = False
            self._table.busy(self)
        self._stop_idle_clock()
        self._idle_timer = self.loop.call_later(self._limits.body_idle_s, self._body_idle)

    def _body_idle(self) -> None:
        """Nothing of the body for `body_idle_s`: evictable, unless the gateway is the one not
        reading (its buffer full, or the request waits behind one still served on this connection)."""
        self._idle_timer = None
        if not self._in_body:
            return
        if self.flow.read_paused or self.pipeline:
            self._idle_timer = self.loop.call_later(self._limits.body_idle_s, self._body_idle)
            return
        self._stalled = True
        self._table.waiting(self)

    def _stop_idle_clock(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _stop_send_clock(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_time_up(self) -> None:
        self._send_timer = None
        self._cut(Cut.SEND_TIMEOUT)

    def _time_up(self) -> None:
        self._timer = None
        cut = self._clock[0] if self._clock is not None else None
        if cut is None:  # the linger after a refused head is over
            self._disarm()
            self.transport.abort()
        else:
            self._cut(cut)
