"""When can a refused request's return be admitted? A per-band schedule of promised returns.

Retry-After is a promise: a refused client is told the time at which its return can be admitted,
counting the refused clients told to come back before it. The rules this module keeps:

- Each band books the work it has told to come back in slices of time that reach the ceiling
  (`max_s`). A slice takes returns up to the band's spare drain rate, so that returns land no
  faster than they can be admitted; a refusal takes the first room at or after its earliest time
  (the queue has drained enough for it to fit, and one turnover has passed). Under an urgent
  overload the queue drains slowly only while it lasts: what of it would drain past the
  overload's expected end (as long again as the band's refusals have seen it, as below) drains
  at the band's drain with the urgent bands back at their settled load.
- The spare rate is the band's drain less the fresh arrivals it will keep admitting: the arrival
  rate less the returns the schedule itself sends, counted as their slices fall due.
- While fresh arrivals alone fill the band (a burst, an overload) returns are still booked, at
  OVERLOAD_RETURN_SHARE of its drain: a bet that the overload ends.
- An overload that has lasted D seconds is expected to last about D more (the Lindy estimate of
  a duration known only by its age): slices beyond that take returns at the spare rate of settled
  times. That is the capacity of the slots the band may hold (`Throughput.capacity_by_band`: on
  a pool of long and short requests the drain of the last seconds of backlog is that of the
  seconds its long requests held the slots), less the fresh arrivals of the band and those above
  it while each refused nothing (the arrivals of `Throughput.settled_rate_by_band` less the
  returns each band's schedule had due between its refusals, but for the counting interval of
  each refusal). A burst's refusals thus land in the lull after it, as fast as the lull can take
  them, and the longer an overload goes on the later its refusals are told to return: a backoff
  that grows with the overload's age, up to the ceiling.
- Room is read with the spare rate of the moment: a lull raises every slice's room at once, so the
  advice shortens as soon as the load falls; with an idle band it is the earliest time (the
  queue's drain, one turnover), delayed by at most one slice of returns still owed.
- Spare rates are read on a grid (SPARE_STEP_BITS), rounded down: a return is never promised
  room that the rate of the moment does not have.
- Slices that pass are forgotten, whether their clients came back or not: no wind-up.
- Jitter spreads a return within its own slot (its cost over the spare rate), so that it cannot
  crowd the returns booked after it. Advice at the ceiling, where the schedule has no room left,
  is spread over the last `jitter` share of the ceiling.
- Replicas that share one queue share its spare rate: each counts the returns the others have
  promised (`Promised`, as they last published them) as taken room in its own slices, and their
  returns falling due as returns, not fresh arrivals. A promise whose slices have passed counts
  no longer, nor a returning rate older than the rates' memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from policies.estimators import COUNTING_INTERVAL_S, ObservedRate, ewma_in_time
from policies.retry_after import RetryAfterConfig
from policies.rounding import rounded_down
from policies.wait import Throughput, band_drain_rate_per_s, drain_left_to_band

SLICES = 240
"""Slices up to the ceiling: at the default 60 s, a quarter of a second each. Within a slice
returns are packed one after the other, those booked before taken to come first: a return may be
told to come up to one slice later than room for it opens, never sooner."""

SPARE_STEP_BITS = 4
"""Spare rates are read rounded down to a 1/16 step of their binary order (3-6%). The estimates
they come from drift with every refusal; read exactly, each drift opens a sliver of room in every
slice booked full before it, and under a long overload each refusal then booked a sliver of each:
a booking cost twice what it costs on the grid, where a full slice stays full until the rate
moves a step."""

OVERLOAD_RETURN_SHARE = 0.2
"""The share of its drain a band books returns at when fresh arrivals alone would fill it. Lower
promises later returns (idle slots once the burst is over), higher lands more of them inside the
burst, where they are refused again: a 2x burst lands about share / (share + 1) of its returns
before it ends."""


@dataclass(frozen=True, slots=True)
class ReturnSchedule:
    """The returns one band has promised, as work booked per slice of time."""

    origin_s: float
    """Where the first slice begins, on the caller's clock."""
    slice_s: float
    booked: tuple[float, ...]
    """Work told to come back in each slice; the last ends past `origin_s + max_s`."""
    returning_per_s: float
    """The rate at which booked returns have fallen due, averaged like the arrival rates."""
    updated_at: float
    """The last refusal booked (the schedule advances only then)."""
    refusing_since: float
    """The first refusal of the current overload: refusals no further apart than the rates'
    memory belong to one."""
    settled_returning: ObservedRate
    """The returns that fell due between the band's refusals, per second of those settled times."""
    urgent_since: float | None = None
    """The first refusal that saw more urgent bands take more than their settled load, of refusals
    that all saw it, none further apart than the settled memory; None when the last did not."""


@dataclass(frozen=True, slots=True)
class Promised:
    """The returns one replica has promised one band, as another replica counts them."""

    origin_s: float
    """Where its first slice begins, on the reader's clock."""
    slice_s: float
    booked: tuple[float, ...]
    """Work told to come back in each slice (trailing empty slices left out)."""
    returning_per_s: float
    settled_returning_per_s: float
    updated_at: float
    """Its last refusal, on the reader's clock: its returning rate is that old."""


def promised(schedule: ReturnSchedule) -> Promised:
    """What `schedule` has promised, to share with the replicas beside it (on its own clock)."""
    booked = schedule.booked
    end = len(booked)
    while end and booked[end - 1] <= 0:
        end -= 1
    settled = schedule.settled_returning.per_s or 0.0
    return Promised(
        schedule.origin_s,
        schedule.slice_s,
        booked[:end],
        schedule.returning_per_s,
        settled,
        schedule.updated_at,
    )


def booked_elsewhere(schedule: ReturnSchedule, others: Sequence[Promised]) -> Sequence[float]:
    """The work `others` have booked in each slice of `schedule`: each of their slices counts in
    the slice that holds its middle. What falls before the first slice has fallen due, and what
    falls past the last is beyond the ceiling: neither takes room."""
    return _booked_elsewhere(schedule.origin_s, schedule.slice_s, len(schedule.booked), tuple(others))


@lru_cache(maxsize=32)
def _booked_elsewhere(
    origin: float, width: float, slices: int, others: tuple[Promised, ...]
) -> tuple[float, ...]:
    # Every refusal of a band asks, at a cost of every slice of every other replica, and the
    # answer changes only when a slice passes or the others publish again (a few times a second).
    # An entry holds the promises it was read from (about 80 KB at 10 replicas): a few entries
    # serve every band refusing at once.
    taken = [0.0] * slices
    for other in others:
        for index, work in enumerate(other.booked):
            if work > 0:
                middle = other.origin_s + (index + 0.5) * other.slice_s
                mine = math.floor((middle - origin) / width)
                if 0 <= mine < slices:
                    taken[mine] += work
    return tuple(taken)


def returning_elsewhere_per_s(
    others: Sequence[Promised], now: float, rates_tau_s: float, settled_tau_s: float
) -> tuple[float, float]:
    """The rate at which the others' returns fall due now, and did in settled times; a rate not
    refreshed within the rates' memory counts no longer (that replica refuses nothing now), and a
    settled rate fades over the settled memory since its replica last refused (the settled times
    since then count at its next refusal)."""
    fresh = [o for o in others if now - o.updated_at <= rates_tau_s]
    settled = sum(
        o.settled_returning_per_s * math.exp(-max(0.0, now - o.updated_at) / settled_tau_s) for o in others
    )
    return sum(o.returning_per_s for o in fresh), settled


@dataclass(frozen=True, slots=True)
class Booking:
    """A refusal's promise: when to come back, and the schedule with its return booked."""

    advice_s: float
    schedule: ReturnSchedule


def empty_schedule(now: float, config: RetryAfterConfig, settled_tau_s: float = 30.0) -> ReturnSchedule:
    """A schedule with nothing booked, its first slice beginning `now`; `settled_tau_s` is the
    memory of the settled arrival rate it is compared with."""
    slices = (0.0,) * (SLICES + 1)
    return ReturnSchedule(now, config.max_s / SLICES, slices, 0.0, now, now, ObservedRate(settled_tau_s))


def advance(schedule: ReturnSchedule, now: float, rates_tau_s: float, refusers: int = 1) -> ReturnSchedule:
    """`schedule` at `now`: slices that ended fall due and feed the returning rate (averaged with
    time constant `rates_tau_s`, that of the arrival-rate estimates it is taken from), and the
    settled returning rate for the part of the time since the last refusal that was settled.

    Settled times are the counting intervals in which the pool refused none of the band's work
    (policies.estimators.settled_rate). A refusal takes about one interval out of them; `refusers`
    replicas refusing as often as this one take one each."""
    elapsed_s = now - schedule.updated_at
    if elapsed_s <= 0:
        return schedule
    passed = min(int((now - schedule.origin_s) // schedule.slice_s), len(schedule.booked))
    due = sum(schedule.booked[:passed])
    booked = schedule.booked[passed:] + (0.0,) * passed
    returning = ewma_in_time(schedule.returning_per_s, due / elapsed_s, elapsed_s, rates_tau_s)
    refusing_since, settled = schedule.refusing_since, schedule.settled_returning
    if elapsed_s > rates_tau_s:  # the overload before, if any, is over: this one starts now
        refusing_since = now
    settled_s = elapsed_s - refusers * COUNTING_INTERVAL_S
    if settled_s > 0:
        settled = settled.observe(due * settled_s / elapsed_s, settled_s)
    if passed == len(schedule.booked):  # idle longer than the whole schedule: start afresh at now
        origin = now
    else:
        origin = schedule.origin_s + passed * schedule.slice_s
    return ReturnSchedule(
        origin, schedule.slice_s, booked, returning, now, refusing_since, settled, schedule.urgent_since
    )


def spare_rate_per_s(throughput: Throughput, band: int, returning_per_s: float) -> float:
    """The work per second `band` can admit beyond its fresh arrivals: the rate returns may land at.

    Arrivals are read as the larger of the offered and the admitted rate: the offered estimate is
    slow, and the admitted one is the first to see an overload begin. They include the returns the
    schedule sends (`returning_per_s`), which are not fresh.
    """
    band_drain = band_drain_rate_per_s(throughput, band)
    arrivals = max(throughput.offered_rate_by_band[band], throughput.admitted_rate_by_band[band])
    fresh = max(0.0, arrivals - returning_per_s)
    return max(band_drain - fresh, OVERLOAD_RETURN_SHARE * band_drain)


def urgent_settled_per_s(
    throughput: Throughput, band: int, settled_returning_by_band: Sequence[float]
) -> float | None:
    """The fresh work per second the bands more urgent than `band` brought in settled times: their
    arrivals then less their returns that fell due then (`settled_returning_by_band`, from band 0;
    0 where not given). None without settled rates for every one of them."""
    settled = throughput.settled_rate_by_band
    urgent = [] if settled is None else settled[:band]
    if len(urgent) < band or any(rate is None for rate in urgent):
        return None
    return sum(max(0.0, (rate or 0.0) - _at(settled_returning_by_band, b)) for b, rate in enumerate(urgent))


def settled_band_drain_per_s(
    throughput: Throughput, band: int, settled_returning_by_band: Sequence[float]
) -> float | None:
    """The rate slots will reach `band` once the overload is over: the pool's capacity (its drain
    where not kept) less what the more urgent bands take in settled times (`urgent_settled_per_s`),
    and never more than the capacity of the slots the band may hold. None without settled rates for
    every band above it."""
    urgent = urgent_settled_per_s(throughput, band, settled_returning_by_band)
    if urgent is None:
        return None
    capacity = throughput.capacity_by_band
    if not capacity:
        return drain_left_to_band(throughput.drain_rate_per_s, urgent)
    return min(capacity[band], drain_left_to_band(capacity[0], urgent))


def settled_spare_rate_per_s(
    throughput: Throughput, band: int, spare_now_per_s: float, settled_returning_by_band: Sequence[float]
) -> float:
    """The spare rate expected once the overload is over: the band's drain then
    (`settled_band_drain_per_s`) less its own fresh arrivals of settled times (its arrivals then
    less its returns that fell due then), never below the spare of the moment. Without settled
    rates for the band and those above it, the spare of the moment."""
    settled = throughput.settled_rate_by_band
    band_drain = settled_band_drain_per_s(throughput, band, settled_returning_by_band)
    arrivals = settled[band] if settled is not None and len(settled) > band else None
    if band_drain is None or arrivals is None:
        return spare_now_per_s
    fresh = max(0.0, arrivals - _at(settled_returning_by_band, band))
    return max(spare_now_per_s, band_drain - fresh, OVERLOAD_RETURN_SHARE * band_drain)


def _at(rates: Sequence[float], band: int) -> float:
    return rates[band] if band < len(rates) else 0.0


@dataclass(frozen=True, slots=True)
class Spare:
    """The spare rate returns are booked at: `now_per_s` until `until`, `settled_per_s` after."""

    now_per_s: float
    settled_per_s: float
    until: float


def earliest_return_s(
    excess_wait_s: float, throughput: Throughput, band: int, config: RetryAfterConfig
) -> float:
    """The soonest a refused request may come back: when the queue has drained enough for it to fit
    (`excess_wait_s`, from admission), never before one turnover of its band nor `min_s`."""
    band_drain = band_drain_rate_per_s(throughput, band)
    turnover_s = throughput.handover_cost / band_drain if band_drain > 0 else config.max_s
    return min(config.max_s, max(config.min_s, excess_wait_s, turnover_s))


def excess_after_overload_s(
    excess_wait_s: float, band_drain_per_s: float, overload_left_s: float, drain_then_per_s: float | None
) -> float:
    """Admission's excess wait, read at the band's drain of the moment (`band_drain_per_s`), with
    what would drain of it after the overload's expected end (`overload_left_s` from now) drained at
    `drain_then_per_s` instead (the band's drain once more urgent bands are back to their settled
    load), where that is faster: an urgent burst that takes the slots now does not take them for
    ever. Never longer than the excess as read now."""
    if drain_then_per_s is None or excess_wait_s <= overload_left_s:
        return excess_wait_s
    if not drain_then_per_s > band_drain_per_s:
        return excess_wait_s
    speedup = drain_then_per_s / band_drain_per_s if band_drain_per_s > 0 else math.inf
    return overload_left_s + (excess_wait_s - overload_left_s) / speedup


def book_return(
    schedule: ReturnSchedule,
    cost: float,
    earliest_s: float,
    spare: Spare | float,
    now: float,
    jitter_u: float,
    config: RetryAfterConfig,
    elsewhere: Sequence[float] = (),
) -> Booking:
    """Book a return of `cost` work in the first room at or after `now + earliest_s`.

    Its slot (cost at the spare rate, a `Spare` or one rate throughout) may spill over several
    slices; it is told to come back at a point of that slot chosen by `jitter_u` (uniform in
    [0, 1)). No room before the ceiling: the ceiling. `schedule` must have been advanced to `now`;
    `elsewhere`: the work other replicas have booked in its slices (booked_elsewhere), or none.
    """
    if not isinstance(spare, Spare):
        spare = Spare(spare, spare, now)
    if not (spare.now_per_s > 0 and spare.settled_per_s > 0):  # none, or not a number: no room
        return _at_ceiling(schedule, cost, earliest_s, now, jitter_u, config)
    booked = list(schedule.booked)
    slot = _fill(booked, elsewhere, schedule, now + earliest_s, max(cost, 0.0), spare)
    if slot is None:
        return _at_ceiling(schedule, cost, earliest_s, now, jitter_u, config)
    opens_at, closes_at = slot
    told_at = opens_at + jitter_u * (closes_at - opens_at)
    if told_at - now > config.max_s:
        return _at_ceiling(schedule, cost, earliest_s, now, jitter_u, config)
    return Booking(max(earliest_s, told_at - now), _with_booked(schedule, tuple(booked)))


def advise_return(
    schedule: ReturnSchedule,
    cost: float,
    excess_wait_s: float,
    throughput: Throughput,
    band: int,
    now: float,
    jitter_u: float,
    config: RetryAfterConfig,
    rates_tau_s: float,
    others: Sequence[Promised] = (),
    urgent_settled_returning: Sequence[float] = (),
    *,
    excess_drains_with_band: bool = True,
) -> Booking:
    """Seconds until a refused request of `band` and `cost` should come back, its return booked;
    `others`: the band's returns other replicas of the queue have promised;
    `urgent_settled_returning`: per more urgent band, the rate its returns fell due in settled
    times (every replica's), which its settled arrivals hold and which will not come back fresh;
    `excess_drains_with_band`: whether `excess_wait_s` is the band's queue draining (admission's
    excess), which goes faster once an urgent overload is over, or a wait of another kind.

    Never below `earliest_return_s` of the excess left after the overload (`excess_after_overload_s`),
    never above `max_s`.
    """
    refusers = 1 + sum(now - o.updated_at <= rates_tau_s for o in others)
    last_refusal = schedule.updated_at
    schedule = advance(schedule, now, rates_tau_s, refusers)
    settled_tau_s = schedule.settled_returning.tau_s
    returning_now, returning_settled = returning_elsewhere_per_s(others, now, rates_tau_s, settled_tau_s)
    spare_now = spare_rate_per_s(throughput, band, schedule.returning_per_s + returning_now)
    returning = [_at(urgent_settled_returning, b) for b in range(band)]
    returning.append((schedule.settled_returning.per_s or 0.0) + returning_settled)
    settled = rounded_down(settled_spare_rate_per_s(throughput, band, spare_now, returning), SPARE_STEP_BITS)
    spare_now = rounded_down(spare_now, SPARE_STEP_BITS)
    # An overload younger than the rates' memory is given that long: its age says nothing yet,
    # and the first refusals of a burst would otherwise be sent back into it.
    overload_left_s = max(now - schedule.refusing_since, rates_tau_s)
    spare = Spare(spare_now, settled, until=now + overload_left_s)
    # Past the urgent overload's expected end (as long again as it has lasted) the urgent bands
    # give back what they take beyond their settled load; the pool's own drain, as its slots read
    # now, stays what admission read.
    urgent_then = urgent_settled_per_s(throughput, band, returning)
    drain_then = None if urgent_then is None else drain_left_to_band(throughput.drain_rate_per_s, urgent_then)
    drain_now = band_drain_rate_per_s(throughput, band)
    urgent_since = _urgent_since(
        schedule.urgent_since, last_refusal, settled_tau_s, now, drain_now, drain_then
    )
    schedule = replace(schedule, urgent_since=urgent_since)
    excess_s = excess_wait_s
    if excess_drains_with_band and urgent_since is not None:
        urgent_left_s = max(now - urgent_since, rates_tau_s)
        excess_s = excess_after_overload_s(excess_wait_s, drain_now, urgent_left_s, drain_then)
    earliest_s = earliest_return_s(excess_s, throughput, band, config)
    elsewhere = booked_elsewhere(schedule, others) if others else ()
    return book_return(schedule, cost, earliest_s, spare, now, jitter_u, config, elsewhere)


def _urgent_since(
    began: float | None,
    last_refusal: float,
    memory_s: float,
    now: float,
    drain_now: float,
    drain_then: float | None,
) -> float | None:
    """When the urgent overload a refusal at `now` sees began (`ReturnSchedule.urgent_since`, as
    `began` after the `last_refusal`); None if the band would drain no faster without it."""
    if drain_then is None or not drain_then > drain_now:
        return None
    if began is None or now - last_refusal > memory_s:
        return now
    return began


def _fill(
    booked: list[float],
    elsewhere: Sequence[float],
    schedule: ReturnSchedule,
    start: float,
    cost: float,
    spare: Spare,
) -> tuple[float, float] | None:
    """Book `cost` work of returns into `booked` from `start` on, slice by slice, each at its
    spare rate less what `elsewhere` (if given) has taken of it; when the first of them opens and
    when the last closes (None: no room before the last slice ends)."""
    origin, width = schedule.origin_s, schedule.slice_s
    first = max(0, int((start - origin) // width))
    # Slices before `switch` start before the overload is expected to end, at the spare of now.
    switch = max(first, min(len(booked), math.ceil((spare.until - origin) / width)))
    full_near, full_far = width * spare.now_per_s, width * spare.settled_per_s
    opens_at: float | None = None
    remaining = cost
    for index in range(first, len(booked)):
        near = index < switch
        filled = booked[index] + elsewhere[index] if elsewhere else booked[index]
        # Under a long overload most slices are full: skip them before any arithmetic.
        if index > first and filled >= (full_near if near else full_far):
            continue
        rate = spare.now_per_s if near else spare.settled_per_s
        slice_start = origin + index * width
        # Returns already booked are taken to fill the slice from its first usable moment on.
        free_from = max(slice_start, start) + filled / rate
        room = (slice_start + width - free_from) * rate
        if room <= 0:
            continue
        if opens_at is None:
            opens_at = free_from
        taken = min(remaining, room)
        booked[index] += taken
        remaining -= taken
        if remaining <= 0:
            return opens_at, free_from + taken / rate
    if opens_at is not None:
        booked[-1] += remaining
        return opens_at, origin + len(booked) * width
    return None


def _at_ceiling(
    schedule: ReturnSchedule,
    cost: float,
    earliest_s: float,
    now: float,
    jitter_u: float,
    config: RetryAfterConfig,
) -> Booking:
    """The ceiling, spread over its last `jitter` share, booked past the slices' room so that the
    return still counts when it falls due."""
    advice_s = min(config.max_s, max(earliest_s, config.max_s * (1.0 - config.jitter * jitter_u)))
    index = int((now + advice_s - schedule.origin_s) // schedule.slice_s)
    index = min(max(index, 0), len(schedule.booked) - 1)
    booked = list(schedule.booked)
    booked[index] += max(cost, 0.0)
    return Booking(advice_s, _with_booked(schedule, tuple(booked)))


def _with_booked(schedule: ReturnSchedule, booked: tuple[float, ...]) -> ReturnSchedule:
    return ReturnSchedule(
        schedule.origin_s,
        schedule.slice_s,
        booked,
        schedule.returning_per_s,
        schedule.updated_at,
        schedule.refusing_since,
        schedule.settled_returning,
        schedule.urgent_since,
    )
