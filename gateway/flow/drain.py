"""Drain: the graceful stop. Once it starts, new requests are refused and the active ones finish."""

from __future__ import annotations

import asyncio


class Drain:
    """Counts the requests that take backend slots, so that a stop can wait for them to end.

    Every ingress counts its requests from arrival to answer (`started` / `finished`, in a
    `finally`), and refuses new ones once `draining` is set.
    """

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def started(self) -> None:
        self.active += 1
        self._idle.clear()

    def finished(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting and wait for in-flight and queued requests to finish; False on timeout."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
