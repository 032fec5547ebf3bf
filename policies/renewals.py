"""How many fresh services does one slot end within s seconds: the renewal function m(s) of a
service distribution, tabulated once per histogram for the pool readings (policies.handovers).

Why not s / mean: a slot counts about s / mean + (cv^2 - 1) / 2 in the long run, and where
services are a mix of short and long ones (a chat pool: most answers short, a few long) it counts
far more early on, while no long one has come: with 90% of 100 ms and 10% of 3.1 s, 5.9 within
the first second against s / mean's 2.5 (the mean is 0.4 s). Taking s / mean there predicted less
than half of the hand-overs that came, and admission refused work that would have fitted.

Rules this module keeps:
- m is solved from the renewal equation m(s) = F(s) + sum over x of m(s - x) dF(x) on a grid of
  STEPS steps of mean / STEPS_PER_MEAN, each step's mass of service times placed at the step's
  end. Every service is then taken as up to a step longer than measured, so the tabulated count is
  never above the histogram's own; a time between grid points reads the point below it.
- Past the grid, the count is the grid's last value: m never falls, so that is below it, and what
  comes after depends on services the grid does not reach (a long mode beyond it leaves m flat
  while s / mean climbs). The pool reading takes time over the mean where that is more.
- Solving costs O(STEPS^2) multiplications (about a millisecond and a half), so the table is kept
  with the histogram and solved again only after it has taken in a share of new samples
  (policies.service_times).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from operator import mul

STEPS_PER_MEAN = 16
STEPS = 256
"""The grid reaches STEPS / STEPS_PER_MEAN = 16 mean service times."""


class Renewals:
    """m(s): the expected count of fresh services that end within s seconds, one after another."""

    __slots__ = ("_counts", "_step_s")

    def __init__(self, cdf: Callable[[float], float], mean_s: float) -> None:
        if not (mean_s > 0 and math.isfinite(mean_s)):
            raise ValueError("the mean service time must be positive and finite")
        self._step_s = mean_s / STEPS_PER_MEAN
        self._counts = _solved(cdf, self._step_s)

    def count(self, within_s: float) -> float:
        """m(within_s): never above the histogram's renewal function, non-decreasing."""
        if within_s <= 0.0:
            return 0.0
        counts = self._counts
        return counts[min(int(within_s / self._step_s), len(counts) - 1)]

    def total_after(self, firsts_s: Sequence[float], within_s: float) -> float:
        """The sum of m(within_s - first) over `firsts_s`: the fresh services ended within
        `within_s` after first hand-overs at each of those times (count, inlined for the grid)."""
        counts, step_s, last, total = self._counts, self._step_s, len(self._counts) - 1, 0.0
        for first in firsts_s:
            span = within_s - first
            if span > 0.0:
                total += counts[min(int(span / step_s), last)]
        return total


def _solved(cdf: Callable[[float], float], step_s: float) -> list[float]:
    """m at 0, step, 2 step, ..., STEPS step, each service's mass at the end of its step."""
    tail = [cdf(i * step_s) for i in range(STEPS + 1)]
    masses = [later - earlier for earlier, later in pairwise(tail)]
    counts = [0.0]
    for i in range(1, STEPS + 1):
        # m_i = F_i + sum_{j=1..i} p_j m_{i-j}: masses[j - 1] is p_j, reversed(counts) m_{i-1} first.
        counts.append(tail[i] + sum(map(mul, masses, reversed(counts))))
    return counts
