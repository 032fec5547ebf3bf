"""A response's head leaves with the first bytes of its body.

uvicorn writes a response's status line and headers when the app starts the response, and its
body when the app sends it: two writes, two system calls and, on a socket with Nagle off, two
segments the client wakes for, where one answer of a few hundred bytes would do. The gateway's
short answers (every refusal, every answer read whole) start and end in one turn of the event
loop, so the head is held until the body's first write joins it. A head whose body does not
follow in that turn (a stream waiting for its first chunk) leaves at the end of the turn, so
that a client sees a stream's head as soon as before, give or take the rest of that turn.
"""

from __future__ import annotations

import asyncio

_STATUS_LINE = b"HTTP/1.1 "


class HeadWithBody:
    """A response cycle's connection, as the cycle writes to it (see the module).

    It tells the head by its status line (uvicorn writes HTTP/1.1 ones), not by asking the cycle:
    holding the cycle, which holds it, would leave a reference cycle behind every request.
    """

    __slots__ = ("_head", "_loop", "_transport", "_wrote_head")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._wrote_head = False

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif not self._wrote_head and data.startswith(_STATUS_LINE) and data[9:10] != b"1":
            # The head: before it, only an interim answer (100 Continue) is written, at once.
            self._wrote_head = True
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def _flush(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head)
