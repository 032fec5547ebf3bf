"""Drain: the graceful stop. Once it starts, new requests are refused and the active ones finish,
until the drain's timeout; then the ones still active are cut.

Its rules:
- every ingress counts its requests from arrival to answer (`started` / `finished`, in a
  `finally`, inside the request's own task), and refuses new ones once `draining` is set;
- `cut` cancels the task of every request still active. The code that owns each stage of a
  request turns that cancellation into its answer (`absorb_cut` in an `except CancelledError`):
  503 `draining` while no response has started, a cut-short response otherwise. Cleanup runs as
  for any cancellation: a queue ticket is withdrawn, an exchange is closed as its backend's
  `on_abandon` says, and its slot goes back when the backend is done or the process exits.
"""

from __future__ import annotations

import asyncio
from typing import Any

DRAINING_RETRY_S = 1.0
"""Retry-After of a 503 `draining`: another replica takes the retry."""


class Drain:
    """Counts the requests that take backend slots, so that a stop can wait for them, then cut them."""

    def __init__(self) -> None:
        self.draining = False
        self.cut_short = False
        """The drain stopped waiting: the requests still active were cut."""
        self._active: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        """Cut, and the cancellation not taken back yet."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop_waiting = asyncio.Event()

    @property
    def active(self) -> int:
        return len(self._active)

    def started(self) -> None:
        """Count the current task's request (call it in the request's own task)."""
        task = asyncio.current_task()
        assert task is not None, "a request is counted from inside its task"
        self._active.add(task)
        self._idle.clear()
        if self.cut_short:
            self._cancel(task)  # it came after the cut, before the listener closed: cut it too

    def finished(self) -> None:
        task = asyncio.current_task()
        self._active.discard(task)
        self._cut.discard(task)
        if not self._active:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the active ones to end: True once none is left; False
        when `timeout_s` passed or `cut` came first."""
        self.draining = True
        idle = asyncio.ensure_future(self._idle.wait())
        stopped = asyncio.ensure_future(self._stop_waiting.wait())
        try:
            await asyncio.wait((idle, stopped), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            stopped.cancel()
        return not self._active and not self.cut_short

    def cut(self) -> int:
        """Stop waiting: cancel every request still active (each answers as its stage says), and
        those that arrive from now on; how many were active. Only the first call cuts."""
        if self.cut_short:
            return 0
        self.draining = self.cut_short = True
        self._stop_waiting.set()
        for task in self._active:
            self._cancel(task)
        return len(self._active)

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        self._cut.add(task)
        task.cancel("the drain timed out")

    def absorb_cut(self) -> bool:
        """In an `except CancelledError` of a request's task: True when the cancellation is this
        drain's cut (it is taken back, once, so that the request can still answer); False when it
        is any other, which must propagate."""
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    async def settle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every counted request to end (after a cut); False if some did not."""
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: it can drop a cancellation
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
