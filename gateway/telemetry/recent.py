"""Recent refusals: per model, class and reason, how many in the last minute, and the last advice.

What the status page shows beside the counters of /metrics, which only a Prometheus can turn into
rates. Counted in one-second buckets, a minute of them per key, so a storm of thousands of refusals
a second costs one increment each and a fixed amount of memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.outcomes import SHED_OUTCOMES, Outcome

WINDOW_S = 60

REFUSALS = SHED_OUTCOMES | {
    Outcome.NO_BACKEND,
    Outcome.DRAINING,
    Outcome.STORE_UNAVAILABLE,
    Outcome.BUDGET_TOO_SMALL,
    Outcome.COST_ABOVE_QUOTA,
}
"""What counts as a refusal here: the gateway said no, and no backend saw the request."""


@dataclass(slots=True)
class _PerSecond:
    counts: list[int] = field(default_factory=lambda: [0] * WINDOW_S)
    second: int = 0
    """The last second counted in."""

    def add(self, second: int) -> None:
        self._roll(second)
        self.counts[second % WINDOW_S] += 1

    def total(self, second: int) -> int:
        self._roll(second)
        return sum(self.counts)

    def _roll(self, second: int) -> None:
        """Forget the seconds that passed since the last count."""
        gone = min(second - self.second, WINDOW_S)
        for past in range(self.second + 1, self.second + 1 + max(0, gone)):
            self.counts[past % WINDOW_S] = 0
        self.second = max(self.second, second)


class RecentRefusals:
    """Refusals of the last minute by (model, class, reason), and each class's last Retry-After."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._counts: dict[tuple[str, str, str], _PerSecond] = {}
        self.last_retry_after_s: dict[tuple[str, str], float] = {}
        """(model, class) -> the last Retry-After told, in seconds."""

    def count(self, model: str, priority: str, reason: str) -> None:
        key = (model, priority, reason)
        counter = self._counts.get(key)
        if counter is None:
            counter = self._counts[key] = _PerSecond(second=int(self._clock()))
        counter.add(int(self._clock()))

    def advised(self, model: str, priority: str, seconds: float) -> None:
        self.last_retry_after_s[(model, priority)] = seconds

    def per_minute(self, model: str, priority: str) -> dict[str, int]:
        """Reason -> refusals of the class in the last minute (reasons with none left out)."""
        second = int(self._clock())
        found = {}
        for (m, p, reason), counter in self._counts.items():
            if m == model and p == priority and (total := counter.total(second)):
                found[reason] = total
        return found
