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


def ewma_in_time(previous: float | None, sample: float, elapsed_s: float, tau_s: float) -> float:
    """An average of a sampled value that forgets with time constant `tau_s` (not per sample).

    A sample taken `elapsed_s` after the previous one weighs 1 - exp(-elapsed_s / tau_s); the first
    sample seeds the average.
    """
    if previous is None:
        return sample
    return previous + -math.expm1(-max(0.0, elapsed_s) / tau_s) * (sample - previous)


def counter_increase(before: float | None, after: float) -> float:
    """How much a Prometheus counter grew between two readings.

    A counter that went down was reset (its server restarted): everything it counts now is new.
    """
    if before is None:
        return 0.0
    return after - before if after >= before else after


def blend_rate(previous_per_s: float, events: float, elapsed_s: float, tau_s: float) -> float:
    """The event rate after `events` more events in the last `elapsed_s` seconds.

    An average in time, forgetting the past with time constant `tau_s`: evaluated once per counting
    interval rather than per event, so that counting an event costs an integer increment, and
    equivalent to per-event exponential decay for intervals short against `tau_s`.
    """
    if elapsed_s <= 0:
        return previous_per_s
    weight = -math.expm1(-elapsed_s / tau_s)
    return previous_per_s + weight * (events / elapsed_s - previous_per_s)


def unbiased_rate(rate_per_s: float, age_s: float, tau_s: float) -> float:
    """A `blend_rate` estimate that started from 0 `age_s` ago, divided by the share of its memory
    that has seen events (1 - exp(-age / tau), as Adam's moments are corrected): the rate of what
    it has seen, not that rate averaged with the 0 it started from. Beyond a few `tau_s` it is the
    estimate itself."""
    seen = -math.expm1(-max(0.0, age_s) / tau_s)
    return rate_per_s / seen if seen > 0 else 0.0


def rate_upper_bound(rate_per_s: float, window_s: float, event_work: float, z: float) -> float:
    """A rate of Poisson events of `event_work` each, estimated from about `window_s` seconds of
    them, `z` standard deviations up (the count's sqrt): what a flow may still send, read where
    sending less than that would be the safe side to be wrong on."""
    if window_s <= 0:
        return rate_per_s
    return rate_per_s + z * math.sqrt(max(rate_per_s, 0.0) * event_work / window_s)


def coefficient_of_variation(mean: float, spread: float, samples: int, weight: float) -> float:
    """Spread over mean of a quantity averaged by an EWMA of `weight` from a spread of 0.

    1 (as for exponential times) until the averages have seen as many samples as they remember
    (1 / weight): a spread that started at 0 reads low until then.
    """
    if samples * weight < 1 or mean <= 0:
        return 1.0
    return spread / mean


JUMP_MIN_EVENTS = 4
"""Fewer events in an interval never count as a step, however low the level."""


def rate_jump(
    rate_per_s: float, events: int, elapsed_s: float, z: float, min_events: int = JUMP_MIN_EVENTS
) -> float | None:
    """The new level of an event rate, when `events` in `elapsed_s` are too many for it to explain.

    A Poisson count with mean m rarely exceeds m + z * sqrt(max(m, 1)): with z = 6, for any mean,
    in fewer than one interval in 100,000 (z = 4 would pass one in 1,000 to 10,000, every few
    minutes at 20 intervals a second). Such a count says the rate has stepped up, and its own rate
    is returned as the new level; None when the count fits the rate. An estimate that averages
    over seconds would otherwise take seconds to follow a step to overload, and admit less urgent
    work meanwhile as if the urgent surge were not there.
    """
    if elapsed_s <= 0 or events < min_events:
        return None
    expected = rate_per_s * elapsed_s
    if events <= expected + z * math.sqrt(max(expected, 1.0)):
        return None
    return events / elapsed_s


COUNTING_INTERVAL_S = 0.05
"""The shortest interval over which the pool's counts are blended into rates
(gateway/queues/estimates.py): a settled-times rate counts the intervals that refused nothing, so a
refusal takes about one of them out of settled time."""


@dataclass(frozen=True, slots=True)
class ObservedRate:
    """Events per second of observed time, with both exponentially forgotten over `tau_s`.

    Fed with (events, duration) pairs, it weighs the past by how much observed time has passed
    since, not by how many samples: a rate of 200 per second with tau_s = 2 averages about 400
    events, however bursty they are, so one lucky burst cannot swing it.
    """

    tau_s: float
    events: float = 0.0
    observed_s: float = 0.0

    def observe(self, events: float, duration_s: float) -> ObservedRate:
        """The estimate after `events` events in `duration_s` more seconds of observation."""
        decay = math.exp(-duration_s / self.tau_s)
        return ObservedRate(self.tau_s, self.events * decay + events, self.observed_s * decay + duration_s)

    @property
    def per_s(self) -> float | None:
        """The rate, or None before anything was observed."""
        return self.events / self.observed_s if self.observed_s > 0 else None


def settled_rate(previous: ObservedRate, offered: float, refused: float, elapsed_s: float) -> ObservedRate:
    """The arrival rate of settled times after an interval of `elapsed_s` in which `offered` work
    arrived and `refused` of it was refused: only intervals that refused nothing count, so that
    an overload neither raises it nor, by the time it takes, makes it forget the load before."""
    # Work totals are floats: a difference of rounding is not a refusal.
    if refused > 1e-9 * max(1.0, offered) or elapsed_s <= 0:
        return previous
    return previous.observe(offered, elapsed_s)
