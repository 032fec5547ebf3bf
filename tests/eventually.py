"""eventually(): wait for observable state instead of sleeping and hoping it came.

A check is a predicate (returns True once the state is there) or an assertion (raises
AssertionError until it is; returning None counts as passing). It is retried every `interval_s`
until `timeout_s` has passed; then an AssertionError says what was awaited, with the last value
the predicate returned or the last assertion error (chained, so its message shows in full).
Any other exception from the check is a bug, not a "not yet", and propagates at once.

`await eventually(...)` in async tests (it yields to the event loop between tries, so servers
and stores running in the test's own loop keep working); `eventually_blocking(...)` in sync
tests and fixtures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

Check = Callable[[], bool | None]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_INTERVAL_S = 0.02


class _Tries:
    """One wait: runs the check, remembers how it last failed, and says when to give up."""

    def __init__(self, check: Check, timeout_s: float, interval_s: float, what: str | None) -> None:
        self.check = check
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.what = what or getattr(check, "__qualname__", repr(check))
        self.deadline = time.monotonic() + timeout_s
        self.last_value: object = None
        self.last_error: AssertionError | None = None

    def passed(self) -> bool:
        try:
            value = self.check()
        except AssertionError as error:
            self.last_error, self.last_value = error, None
            return False
        if value is None or value:
            return True
        self.last_error, self.last_value = None, value
        return False

    def pause_s(self) -> float | None:
        """Seconds to sleep before the next try, or None once the time is up."""
        left = self.deadline - time.monotonic()
        return None if left <= 0 else min(self.interval_s, left)

    def timed_out(self) -> AssertionError:
        if self.last_error is not None:
            last = f"last assertion error: {self.last_error}"
        else:
            last = f"last value: {self.last_value!r}"
        return AssertionError(f"timed out after {self.timeout_s} s waiting for {self.what}; {last}")


async def eventually(
    check: Check,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    what: str | None = None,
) -> None:
    """Return as soon as `check` passes; raise AssertionError if it has not within `timeout_s`."""
    tries = _Tries(check, timeout_s, interval_s, what)
    while not tries.passed():
        if (pause_s := tries.pause_s()) is None:
            raise tries.timed_out() from tries.last_error
        await asyncio.sleep(pause_s)


def eventually_blocking(
    check: Check,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    what: str | None = None,
) -> None:
    """`eventually` for synchronous code: blocks the calling thread between tries."""
    tries = _Tries(check, timeout_s, interval_s, what)
    while not tries.passed():
        if (pause_s := tries.pause_s()) is None:
            raise tries.timed_out() from tries.last_error
        time.sleep(pause_s)
