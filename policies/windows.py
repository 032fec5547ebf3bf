"""Is a time window open? Weekly windows of local wall-clock time.

A window is a set of weekdays and a span of local time, `from` to `to` (the seed's compliance job
that may run only from 02:00 to 04:00). The rules this module keeps:

- Times are the local wall-clock time of the window's own time zone: the caller converts an instant
  to (weekday, minute of the day) in that zone, so daylight saving time is the zone's business, and
  a window from 02:00 to 04:00 is open two wall-clock hours even on the night the clocks move (one
  or three real hours then).
- `from` is in the window, `to` is not. A span whose `to` is not after its `from` crosses midnight:
  22:00 to 02:00 opens on each listed day at 22:00 and closes at 02:00 the next day (which need not
  be listed). `from` equal to `to` is the whole day.
- How long until a closed window opens is counted in wall-clock minutes, for Retry-After: across a
  change of the clocks it is off by the hour the clocks moved, never by a day.
"""

from __future__ import annotations

from dataclasses import dataclass

MINUTES_PER_DAY = 24 * 60
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


@dataclass(frozen=True, slots=True)
class Window:
    """Open on `days` (0 = Monday) from `start_minute` to `end_minute` of local time."""

    days: frozenset[int]
    start_minute: int
    end_minute: int

    def __post_init__(self) -> None:
        if not self.days or not self.days <= frozenset(range(7)):
            raise ValueError(f"a window needs days among 0 (Monday) to 6, got {sorted(self.days)}")
        for minute in (self.start_minute, self.end_minute):
            if not 0 <= minute < MINUTES_PER_DAY:
                raise ValueError(f"a window's times are minutes 0 to {MINUTES_PER_DAY - 1}, got {minute}")

    @property
    def length_minutes(self) -> int:
        span = (self.end_minute - self.start_minute) % MINUTES_PER_DAY
        return span or MINUTES_PER_DAY


def is_open(window: Window, weekday: int, minute: int) -> bool:
    """True when local time `minute` of `weekday` (0 = Monday) is in the window."""
    return minutes_until_open(window, weekday, minute) == 0


def minutes_until_open(window: Window, weekday: int, minute: int) -> int:
    """Wall-clock minutes from local time `minute` of `weekday` until the window is open (0: open)."""
    now = weekday * MINUTES_PER_DAY + minute
    week = 7 * MINUTES_PER_DAY
    soonest = week
    for day in window.days:
        opens = day * MINUTES_PER_DAY + window.start_minute
        # The opening of this day's span last week, this week or next: whichever holds `now`, or
        # is the next to come.
        for start in (opens - week, opens, opens + week):
            if start <= now < start + window.length_minutes:
                return 0
            if start > now:
                soonest = min(soonest, start - now)
    return soonest
