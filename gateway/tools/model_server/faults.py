"""Faults the simulator can be told to have while it runs (`POST /sim/fault`), for tests of the
gateway's passive health. Health checks and metadata always pass: only inference misbehaves.

- `{"hang": true}`: inference requests are taken and never answered, until the fault is cleared;
  then the hung ones go on as if nothing had happened (a device that was stuck). In
  stop-on-disconnect mode a hung request ends when its client leaves; otherwise it stays. With
  `"path_prefix": "/v2/"` only the matching routes hang. `{"hang": true, "release": 2}` lets the
  two requests that have hung longest go on and keeps the rest (and new ones) hanging: a test
  frees slots one at a time, in the order they were taken.
- `{"status": 503}`: inference requests are answered at once with that status.
- `{}`: no fault.

`GET /sim/fault` shows the fault and the counts: inference requests received, hanging now, and
the most hanging at once since the last `/sim/reset`.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from starlette.types import Message, Receive


@dataclass(frozen=True, slots=True)
class Fault:
    hang: bool = False
    status: int | None = None
    path_prefix: str = "/"
    release: int = 0
    """How many of the requests hanging now go on, longest-hanging first (an act, not a state)."""

    @classmethod
    def parse(cls, body: bytes) -> Fault:
        """The fault a /sim/fault body asks for; ValueError when it is not one."""
        raw = json.loads(body or b"{}")
        if not isinstance(raw, dict) or set(raw) - {"hang", "status", "path_prefix", "release"}:
            raise ValueError("expected an object with hang, status, path_prefix or release")
        release = raw.get("release", 0)
        fault = cls(
            bool(raw.get("hang", False)), raw.get("status"), str(raw.get("path_prefix", "/")), release
        )
        if fault.status is not None and not (isinstance(fault.status, int) and 200 <= fault.status <= 599):
            raise ValueError("status must be an HTTP status")
        if not (isinstance(release, int) and release >= 0) or (release and not fault.hang):
            raise ValueError("release must be a count of hung requests, with hang: true")
        return fault


class Faults:
    """The fault in force and what it has done."""

    def __init__(self) -> None:
        self.fault = Fault()
        self.received = 0
        self.hanging = 0
        self.peak_hanging = 0
        self._held: deque[asyncio.Event] = deque()  # one per hung request, longest-hanging first

    def set(self, fault: Fault) -> None:
        self.fault = fault
        released = len(self._held) if not fault.hang else min(fault.release, len(self._held))
        for _ in range(released):
            self._held.popleft().set()  # it goes on

    def reset_peak(self) -> None:
        self.peak_hanging = self.hanging

    def stats(self) -> dict[str, Any]:
        return {
            **asdict(self.fault),
            "received": self.received,
            "hanging": self.hanging,
            "peak_hanging": self.peak_hanging,
        }

    def applies_to(self, path: str) -> bool:
        fault = self.fault
        return (fault.hang or fault.status is not None) and path.startswith(fault.path_prefix)

    async def hang(self, receive: Receive, *, until_disconnect: bool) -> tuple[bool, Receive]:
        """Hold an inference request until the fault is cleared: (True, a `receive` that gives
        its body again), or (False, ...) when it ended because its client left."""
        body = await _body(receive)
        self.hanging += 1
        self.peak_hanging = max(self.peak_hanging, self.hanging)
        held = asyncio.Event()
        self._held.append(held)
        cleared = asyncio.ensure_future(held.wait())
        waits: set[asyncio.Future[Any]] = {cleared}
        if until_disconnect:
            waits.add(asyncio.ensure_future(_disconnect(receive)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.hanging -= 1
            if not held.is_set():  # its client left, or the server stops
                self._held.remove(held)
            for waiting in waits:
                waiting.cancel()
        return cleared.done() and not cleared.cancelled(), _replay(body, receive)


async def _body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
