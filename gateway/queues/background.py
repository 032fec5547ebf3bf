"""Store operations run to their end in the background, whatever happens to whoever started them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

log = logging.getLogger("gateway.redis")


class Background:
    """The Redis store's detached operations: kept referenced until done, their failures reported
    (a RedisError to `on_failure`, anything else logged)."""

    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    async def settle(self) -> None:
        """Wait until every operation started so far, and those they start, has finished."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            if isinstance(error, RedisError):
                self._on_failure(error)
            else:
                log.warning("redis store operation failed: %r", error)
