"""Supervised loops: every long-lived background loop runs under a Supervisor that keeps it going.

- A body is an anyio-style task, `body(task_status=loop)`: it calls `task_status.started()` once
  it does its job, and again after each restart. `Loop.up` is True from then until it crashes or
  ends; `Supervisor.start` returns once the first run started (or ended): the handshake serving
  waits for.
- A crash (any Exception) is logged once with its traceback on `gateway.loop.<name>`, and the body
  runs again after a backoff that doubles per crash in a row, capped and jittered (replicas that
  crashed together do not retry in step); a run that lasted `healthy_after_s` resets it.
- A body that returns has done its job (its owner stopped it, a probe found Redis): it leaves.
- Cancellation is never caught: it ends a loop at once, wherever it waits.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import anyio
from anyio.abc import TaskStatus


class Body(Protocol):
    def __call__(self, *, task_status: TaskStatus[None]) -> Awaitable[None]: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    first_s: float = 0.1
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.2
    """Each wait is drawn within +-jitter (a fraction) of its capped base."""
    healthy_after_s: float = 60.0

    def delay_s(self, crashes: int, draw: float) -> float:
        """The wait after the `crashes`-th crash in a row (from 1); `draw` is uniform in [0, 1)."""
        # A bounded exponent: a loop that crashes for days must not overflow a float.
        base = min(self.max_s, self.first_s * self.factor ** min(crashes - 1, 64))
        return base * (1 + self.jitter * (2 * draw - 1))


class Loop(TaskStatus[None]):
    """One supervised loop: its state for owners, readiness and metrics; the status its body reports."""

    def __init__(self, name: str, body: Body, required: bool, supervisor: Supervisor) -> None:
        self.name = name
        self.required = required
        """Serving depends on it: while it is down the replica is not ready."""
        self.restarts = 0
        self.up = False
        self._body = body
        self._of = supervisor
        self._log = logging.getLogger(f"gateway.loop.{name}")
        self._first_run = asyncio.get_running_loop().create_future()
        self._restart_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._finished = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def restart_in_s(self) -> float:
        """Seconds until a crashed loop runs again (0 when it is not waiting to)."""
        return 0.0 if self._restart_at is None else max(0.0, self._restart_at - self._of.clock())

    def started(self, value: None = None) -> None:
        self.up = True
        self._release()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def wait(self) -> None:
        """Until the loop has ended (returned or cancelled)."""
        await self._finished.wait()

    def _ended(self) -> None:
        self.up, self._restart_at = False, None
        self._release()
        self._finished.set()

    async def _supervise(self) -> None:
        crashes = 0
        while True:
            began = self._of.clock()
            try:
                await self._body(task_status=self)
                return
            except Exception as error:
                self.up = False
                crash = error
            ran_s = self._of.clock() - began
            crashes = 1 if ran_s >= self._of.backoff.healthy_after_s else crashes + 1
            delay_s = self._of.backoff.delay_s(crashes, self._of.draw())
            self._log.error(
                "loop %s crashed after %.1f s (%d in a row); restarting in %.2f s",
                *(self.name, ran_s, crashes, delay_s),
                exc_info=crash,
            )
            del crash  # its traceback would keep the failed run's frames alive through the backoff
            self._release()  # whoever waits for the first run sees a loop that cannot start as down
            self._restart_at = self._of.clock() + delay_s
            await self._of.sleep(delay_s)
            self._restart_at = None
            self.restarts += 1

    def _release(self) -> None:
        if not self._first_run.done():
            self._first_run.set_result(None)


class Supervisor:
    """Runs loops in one asyncio.TaskGroup, from `open` (or the first `start`) until `stop`."""

    def __init__(
        self,
        *,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.backoff, self.clock, self.sleep, self.draw = backoff, clock, sleep, draw
        self._loops: list[Loop] = []
        self._left_restarts: dict[str, int] = {}  # counters never go down when a loop leaves
        self._group: asyncio.TaskGroup | None = None
        self._host: asyncio.Task[None] | None = None
        self._opened, self._closing = asyncio.Event(), asyncio.Event()

    async def open(self) -> None:
        if self._host is None:
            self._host = asyncio.create_task(self._hold_group(), name="supervisor")
        await self._opened.wait()

    async def start(self, name: str, body: Body, *, required: bool = False) -> Loop:
        """Start a loop; return once it has started its job (or ended its first run)."""
        await self.open()
        loop = self.start_soon(name, body, required=required)
        await asyncio.shield(loop._first_run)
        return loop

    def start_soon(self, name: str, body: Body, *, required: bool = False) -> Loop:
        """Start a loop from synchronous code (a callback too), in an open supervisor."""
        if self._group is None or self._closing.is_set():
            raise RuntimeError("the supervisor is not open")
        loop = Loop(name, body, required, self)
        self._loops.append(loop)
        self._left_restarts.setdefault(name, 0)
        loop._task = self._group.create_task(loop._supervise(), name=f"loop {name}")
        # A callback, not a `finally`: it runs even for a task cancelled before it ever ran.
        loop._task.add_done_callback(lambda _: self._leave(loop))
        return loop

    async def stop(self, grace_s: float = 0.0) -> None:
        """Wait up to `grace_s` for the loops to return (their owners told them to), then cancel them."""
        if self._host is None:
            return
        with anyio.move_on_after(grace_s):
            for loop in list(self._loops):
                await loop.wait()
        for loop in list(self._loops):
            loop.cancel()
        self._closing.set()
        await self._host
        self._host, self._group = None, None
        self._opened, self._closing = asyncio.Event(), asyncio.Event()

    def loops_up(self) -> Mapping[str, bool]:
        """Per name of the loops running now: whether every one of that name is up."""
        up: dict[str, bool] = {}
        for loop in self._loops:
            up[loop.name] = up.get(loop.name, True) and loop.up
        return up

    def restarts(self) -> Mapping[str, int]:
        """Per name of every loop started so far: its restarts, those of loops that left included."""
        counts = dict(self._left_restarts)
        for loop in self._loops:
            counts[loop.name] += loop.restarts
        return counts

    def required_down(self) -> list[str]:
        """The names of the loops serving depends on that are down now."""
        return sorted({loop.name for loop in self._loops if loop.required and not loop.up})

    def _leave(self, loop: Loop) -> None:
        self._loops.remove(loop)
        self._left_restarts[loop.name] += loop.restarts
        loop._ended()

    async def _hold_group(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._opened.set()
            await self._closing.wait()
