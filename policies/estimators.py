"""How fast do things happen? Exponentially weighted estimates of service times and event rates.

Every function takes the previous estimate and the new observation (with its time, where time
matters) and returns the next estimate; the caller owns the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def ewma(previous: float | None, sample: float, weight: float) -> float:
    """Exponentially weighted moving average; the first sample seeds it.

    `weight` in (0, 1] is the share of the new sample: 1 / weight is roughly the number of samples
    the average remembers.
    """
    if previous is None:
        return sample
    return previous + weight * (sample - previous)


@dataclass(frozen=True, slots=True)
class DecayingRate:
    """Events per second with exponential forgetting over `tau_s` seconds.

    The estimate is sum(exp(-(now - t_i) / tau_s)) / tau_s over past events t_i: for a steady rate
    r it converges to r after a few tau_s, and with no events it decays towards 0.
    """

    tau_s: float
    level_per_s: float = 0.0
    last_at: float | None = None

    def record(self, now: float, events: float = 1.0) -> DecayingRate:
        """The estimate after `events` more events at `now` (now never goes backwards)."""
        return DecayingRate(self.tau_s, self.at(now) + events / self.tau_s, now)

    def at(self, now: float) -> float:
        """The rate as seen at `now`, decayed since the last event."""
        if self.last_at is None:
            return 0.0
        elapsed_s = max(0.0, now - self.last_at)
        return self.level_per_s * math.exp(-elapsed_s / self.tau_s)
