"""How low could the overload refusal latency go if refusing cost nothing? An upper-bound experiment,
not a benchmark, and not a way to run the gateway.

Put this directory on PYTHONPATH with INSTANT_REFUSALS=<share> and run the core benchmark:

    INSTANT_REFUSALS=0.84 PYTHONPATH=loadtests/probes/instant_refusals \\
        python -m loadtests.bench --scenarios overload --targets gateway,floor

Python imports `sitecustomize` at start, so every gateway process started answers that share of
its `low` requests, drawn at random, with a fixed 429 written from the client protocol as soon as
the request is read: no ASGI task, no classification, no admission, no return booking. The rest
go through the gateway as usual. At the share the gateway refuses under the benchmark's 3x
overload (about 84% of `low`), the refusal latency it then measures is what a refusal path of no
cost would give beside the served requests: the bound on what any work on the refusal path alone
can reach. (The fixed answer's Retry-After is not computed, and the random refusals leave the low
class's queue emptier than admission would: read the refusal latency only.)
"""

from __future__ import annotations

import os
import random
import sys
import weakref

if os.environ.get("INSTANT_REFUSALS") and "serve" in sys.argv:
    from gateway.server.connections import LimitedHttpToolsProtocol

    _share = float(os.environ["INSTANT_REFUSALS"])
    _BODY = (
        b'{"error": "the request cannot be served within its deadline", "reason": "deadline_unmeetable", '
        b'"rule": "priorities[low].max_wait_ms"}'
    )
    _ANSWER = (
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 2\r\n"
        b"retry-after-ms: 1500\r\ncontent-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
    )
    # Connections whose request is being refused (weakly: one closed mid-body is not kept).
    _refusing: weakref.WeakSet[LimitedHttpToolsProtocol] = weakref.WeakSet()

    on_headers_complete = LimitedHttpToolsProtocol.on_headers_complete
    on_body = LimitedHttpToolsProtocol.on_body
    on_message_complete = LimitedHttpToolsProtocol.on_message_complete

    def refusing_headers_complete(self: LimitedHttpToolsProtocol) -> None:
        low = any(name == b"x-priority" and value == b"low" for name, value in self.headers)
        if not (low and random.random() < _share):
            on_headers_complete(self)
            return
        _refusing.add(self)  # no cycle, no task: the answer is written once the body is read
        self._disarm()
        self._reading_head, self._in_body, self._head_ended_in_read = False, True, True

    def refusing_body(self: LimitedHttpToolsProtocol, body: bytes) -> None:
        if self not in _refusing:
            on_body(self, body)
            return
        self._body_read = True  # as on_body says: these bytes are body, not trailers

    def refusing_message_complete(self: LimitedHttpToolsProtocol) -> None:
        if self not in _refusing:
            on_message_complete(self)
            return
        _refusing.discard(self)
        self._disarm()  # the body's clock, if a later read armed it
        self._in_body = self._head_begun = False
        self._reading_head = True
        self._head_bytes = 0
        self.transport.write(_ANSWER)

    LimitedHttpToolsProtocol.on_headers_complete = refusing_headers_complete  # type: ignore[method-assign]
    LimitedHttpToolsProtocol.on_body = refusing_body  # type: ignore[method-assign]
    LimitedHttpToolsProtocol.on_message_complete = refusing_message_complete  # type: ignore[method-assign]
