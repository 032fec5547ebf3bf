"""The return schedule: Retry-After as the time a refused request's return can be admitted."""

from __future__ import annotations

import copy
import functools
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flow.return_schedules import ReturnSchedules
from policies.estimators import COUNTING_INTERVAL_S, ObservedRate, settled_rate
from policies.retry_after import RetryAfterConfig
from policies.return_schedule import (
    OVERLOAD_RETURN_SHARE,
    Spare,
    advance,
    advise_return,
    book_return,
    empty_schedule,
    excess_after_overload_s,
    settled_band_drain_per_s,
    settled_spare_rate_per_s,
    spare_rate_per_s,
)
from policies.wait import Throughput

CONFIG = RetryAfterConfig(min_s=0.01, max_s=60.0, jitter=0.1)
DRAIN = 200.0  # 8 slots x 40 ms
SLICE_S = empty_schedule(0.0, CONFIG).slice_s


def flow(offered: float, admitted: float | None = None, drain: float = DRAIN) -> Throughput:
    return Throughput(
        service_time_s=8 / drain,
        drain_rate_per_s=drain,
        admitted_rate_by_band=(min(offered, drain) if admitted is None else admitted,),
        offered_rate_by_band=(offered,),
    )


def advise_many(schedules: ReturnSchedules, count: int, throughput: Throughput, now: float) -> list[float]:
    rng = random.Random(count)
    return [schedules.advise(0, 1.0, 0.0, throughput, now, rng.random()) for _ in range(count)]


# -- bounds --------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    excess=st.floats(-10, 100),
    offered=st.floats(0, 1e4),
    drain=st.floats(0.01, 1e4),
    cost=st.floats(0.1, 64),
    refusals=st.integers(1, 40),
    gap_s=st.floats(0, 5),
    u=st.floats(0, 1, exclude_max=True),
)
def test_advice_never_below_the_excess_wait_or_one_turnover_nor_above_the_ceiling(
    excess, offered, drain, cost, refusals, gap_s, u
):
    config = RetryAfterConfig(min_s=0.01, max_s=30.0, jitter=0.1)
    schedules = ReturnSchedules(1, config)
    throughput = flow(offered, drain=drain)
    floor_s = min(config.max_s, max(config.min_s, excess, 1.0 / drain))
    for index in range(refusals):
        advice = schedules.advise(0, cost, excess, throughput, index * gap_s, u)
        assert floor_s <= advice <= config.max_s


def test_first_refusal_of_an_idle_band_comes_back_when_the_queue_fits_it():
    schedules = ReturnSchedules(1, CONFIG)
    assert schedules.advise(0, 1.0, 0.3, flow(0.0), 0.0, 0.0) == pytest.approx(0.3)
    slow = flow(0.0, drain=20.0)
    assert ReturnSchedules(1, CONFIG).advise(0, 1.0, 0.0, slow, 0.0, 0.0) == pytest.approx(1 / 20.0)
    assert ReturnSchedules(1, CONFIG).advise(0, 1.0, 0.0, flow(0.0), 0.0, 0.0) == CONFIG.min_s


@pytest.mark.parametrize("drain", [math.inf, math.nan, 5e-324])
def test_a_drain_rate_out_of_its_range_still_gets_advice_within_the_bounds(drain):
    schedules = ReturnSchedules(1, CONFIG)
    advice = advise_many(schedules, 3, flow(600.0, admitted=DRAIN, drain=drain), 0.0)
    assert all(CONFIG.min_s <= a <= CONFIG.max_s for a in advice)


# -- spreading returns over the spare rate --------------------------------------------------------------


@pytest.mark.parametrize(
    ("offered", "spare"), [(100.0, 100.0), (150.0, 50.0), (400.0, DRAIN * OVERLOAD_RETURN_SHARE)]
)
def test_refusals_at_one_instant_are_spread_over_their_work_over_the_spare_rate(offered, spare):
    count = 300
    advice = sorted(advise_many(ReturnSchedules(1, CONFIG), count, flow(offered), 0.0))
    assert advice[-1] == pytest.approx(count / spare, rel=0.05)
    for window_s in (0.05, 0.2, 1.0):
        most = max(sum(1 for a in advice[i:] if a < start + window_s) for i, start in enumerate(advice))
        assert most <= spare * window_s + 2, (window_s, most)


def test_costly_refusals_take_slots_in_proportion_to_their_cost():
    schedules = ReturnSchedules(1, CONFIG)
    first = schedules.advise(0, 32.0, 0.0, flow(100.0), 0.0, 0.0)
    second = schedules.advise(0, 1.0, 0.0, flow(100.0), 0.0, 0.0)
    assert second - first == pytest.approx(32 / 100.0)


def test_jitter_places_a_return_within_its_own_slot():
    # At 100/s to spare a return takes 10 ms; the second refusal's slot follows the first one's.
    advice = []
    for u in (0.0, 0.999):
        schedules = ReturnSchedules(1, CONFIG)
        schedules.advise(0, 1.0, 0.0, flow(100.0), 0.0, 0.5)
        advice.append(schedules.advise(0, 1.0, 0.0, flow(100.0), 0.0, u))
    opens_at = CONFIG.min_s + 1 / 100.0
    assert advice == pytest.approx([opens_at, opens_at + 0.999 / 100.0])


def test_returns_the_schedule_sends_are_not_counted_as_fresh_arrivals():
    # 150/s arrive, of which the schedule itself sends 100/s: 50/s are fresh, 150/s to spare.
    assert spare_rate_per_s(flow(150.0), 0, returning_per_s=100.0) == pytest.approx(150.0)
    assert spare_rate_per_s(flow(150.0), 0, returning_per_s=0.0) == pytest.approx(50.0)


def test_an_overload_seen_only_in_admissions_leaves_no_spare_but_the_overload_share():
    # The slow offered estimate still says 120/s; the band already admits all it can.
    assert spare_rate_per_s(flow(120.0, admitted=DRAIN), 0, 0.0) == pytest.approx(
        OVERLOAD_RETURN_SHARE * DRAIN
    )


def test_returns_that_fall_due_feed_the_returning_rate():
    schedule = empty_schedule(0.0, CONFIG)
    for _ in range(50):
        schedule = book_return(schedule, 1.0, 0.005, 100.0, 0.0, 0.5, CONFIG).schedule
    due = advance(schedule, 1.0, rates_tau_s=2.0)
    assert due.returning_per_s == pytest.approx(50 * (1 - math.exp(-0.5)), rel=0.01)
    assert sum(due.booked) == 0


def settled_flow(offered: float, settled: float) -> Throughput:
    return replace(flow(offered, admitted=DRAIN), settled_rate_by_band=(settled,))


def two_bands(
    admitted: tuple[float, float], offered: tuple[float, float], settled: tuple[float | None, float]
) -> Throughput:
    """A pool of DRAIN with two bands: what each admits and is offered now, and its settled rate."""
    return Throughput(
        0.04,
        DRAIN,
        admitted_rate_by_band=admitted,
        offered_rate_by_band=offered,
        settled_rate_by_band=settled,
    )


# Band 0 takes 190/s of the 200/s now, 20/s in settled times; band 1 gets 10/s now.
URGENT_BURST = two_bands((190.0, 10.0), (300.0, 100.0), (20.0, 60.0))


def test_an_overload_is_expected_to_last_as_long_again_and_then_the_settled_spare_returns():
    # Refusing for 5 s at 3x, after settled times at 100/s: returns fill the next 5 s at the
    # overload share, and from then on at the settled spare, 100/s.
    schedule = advance(empty_schedule(0.0, CONFIG), 5.0, rates_tau_s=2.0)
    schedule = replace(schedule, refusing_since=0.0)
    spare = Spare(OVERLOAD_RETURN_SHARE * DRAIN, DRAIN - 100.0, until=10.0)
    for _ in range(600):
        schedule = book_return(schedule, 1.0, 0.005, spare, 5.0, 0.5, CONFIG).schedule
    per_slice = [work / SLICE_S for work in schedule.booked[:-1]]
    near = per_slice[1 : int(5.0 / SLICE_S) - 1]
    far = per_slice[int(5.0 / SLICE_S) + 1 : int(6.0 / SLICE_S)]
    assert near == pytest.approx([OVERLOAD_RETURN_SHARE * DRAIN] * len(near))
    assert far == pytest.approx([DRAIN - 100.0] * len(far))


def test_the_settled_spare_counts_the_returns_of_settled_times_as_not_fresh():
    settled = settled_flow(400.0, settled=150.0)
    assert settled_spare_rate_per_s(settled, 0, 0.0, settled_returning_by_band=[50.0]) == pytest.approx(100.0)
    # Never below the spare of the moment, and without a settled rate it is that spare.
    assert settled_spare_rate_per_s(settled, 0, 150.0, []) == pytest.approx(150.0)
    assert settled_spare_rate_per_s(flow(400.0), 0, 40.0, []) == pytest.approx(40.0)


def test_the_settled_spare_of_a_band_gives_back_the_drain_an_urgent_overload_takes_now():
    # An urgent burst takes 170/s of the 200/s now; in settled times it takes 20/s, low 80/s.
    burst = two_bands((170.0, 30.0), (240.0, 400.0), (20.0, 80.0))
    assert settled_spare_rate_per_s(burst, 1, 6.0, []) == pytest.approx(100.0)
    # Without a settled rate for the band above, there is nothing to expect back.
    unknown = replace(burst, settled_rate_by_band=(None, 80.0))
    assert settled_spare_rate_per_s(unknown, 1, 6.0, []) == pytest.approx(6.0)


def test_the_settled_drain_is_the_pools_capacity_not_the_drain_of_its_last_backlog():
    # Long requests held the slots in the last seconds of backlog: 60/s measured, 200/s capacity.
    held = Throughput(
        0.04,
        60.0,
        admitted_rate_by_band=(60.0, 0.0),
        offered_rate_by_band=(60.0, 300.0),
        settled_rate_by_band=(20.0, 80.0),
        capacity_by_band=(DRAIN, DRAIN),
    )
    assert settled_band_drain_per_s(held, 1, []) == pytest.approx(DRAIN - 20.0)
    assert settled_spare_rate_per_s(held, 1, 6.0, []) == pytest.approx(DRAIN - 20.0 - 80.0)
    # Without a capacity kept, the drain of the moment.
    assert settled_band_drain_per_s(replace(held, capacity_by_band=()), 1, []) == pytest.approx(40.0)
    # Slots that band 0 reserves and leaves idle are not band 1's: 4 of 8 are left to it.
    reserved = replace(held, capacity_by_band=(DRAIN, DRAIN / 2))
    assert settled_spare_rate_per_s(reserved, 1, 6.0, []) == pytest.approx(DRAIN / 2 - 80.0)


def test_the_returns_of_urgent_bands_in_settled_times_leave_their_drain_to_the_band():
    # Of the urgent band's 50/s of settled arrivals, 30/s were its own returns: 20/s are fresh.
    burst = two_bands((170.0, 30.0), (240.0, 400.0), (50.0, 80.0))
    assert settled_band_drain_per_s(burst, 1, [30.0]) == pytest.approx(DRAIN - 20.0)
    assert settled_spare_rate_per_s(burst, 1, 6.0, [30.0, 0.0]) == pytest.approx(100.0)
    assert settled_spare_rate_per_s(burst, 1, 6.0, []) == pytest.approx(70.0)


def test_the_excess_beyond_the_overloads_end_drains_at_the_settled_drain():
    # 30 s of excess at 1/s now; the overload is expected to end in 4 s, then 9/s reach the band.
    assert excess_after_overload_s(30.0, 1.0, 4.0, 9.0) == pytest.approx(4.0 + 26.0 / 9.0)
    # Within the overload, with no settled drain, or with none faster than now: as it was.
    assert excess_after_overload_s(3.0, 1.0, 4.0, 9.0) == 3.0
    assert excess_after_overload_s(30.0, 1.0, 4.0, None) == 30.0
    assert excess_after_overload_s(30.0, 9.0, 4.0, 1.0) == 30.0
    # A pool that drains nothing now or then: nothing says it will drain sooner.
    assert excess_after_overload_s(60.0, 0.0, 2.0, 0.0) == 60.0


@settings(max_examples=200, deadline=None)
@given(
    excess=st.floats(-10, 1e4),
    now_drain=st.floats(0, 1e4),
    left=st.floats(0, 100),
    settled=st.one_of(st.none(), st.floats(0, 1e4)),
)
def test_the_excess_after_an_overload_is_never_longer_nor_shorter_than_the_overloads_end(
    excess, now_drain, left, settled
):
    after = excess_after_overload_s(excess, now_drain, left, settled)
    assert min(excess, left) <= after <= excess
    if settled is None or settled <= now_drain:
        assert after == excess


def test_an_urgent_burst_sends_the_refused_back_when_it_is_expected_to_end_not_at_its_drain():
    # Band 1 gets 10/s of the 200/s while band 0 bursts; its excess of 60 s at that rate is 600 of
    # work, which the 180/s it gets once the burst is over drain in a few seconds.
    # Its refusals have seen the burst for 3 s: it is expected to go on 3 s more.
    schedule = replace(advance(empty_schedule(0.0, CONFIG), 3.0, rates_tau_s=2.0), urgent_since=0.0)
    booking = advise_return(schedule, 1.0, 60.0, URGENT_BURST, 1, 3.0, 0.0, CONFIG, rates_tau_s=2.0)
    assert booking.advice_s == pytest.approx(3.0 + 57.0 * 10.0 / 180.0, rel=0.02)


def test_an_urgent_overload_seen_at_sparse_refusals_is_expected_to_last_as_long_again():
    # Band 1 is refused every 3 s (further apart than the rates' memory) while band 0 floods for
    # five minutes: the flood's age grows with each refusal, and with it the advice.
    schedule = empty_schedule(0.0, CONFIG)
    advice = []
    for at in range(0, 301, 3):
        booking = advise_return(schedule, 1.0, 50.0, URGENT_BURST, 1, float(at), 0.0, CONFIG, rates_tau_s=2.0)
        schedule = booking.schedule
        advice.append(booking.advice_s)
    assert advice[0] < 10.0
    assert advice[-1] >= 50.0
    assert schedule.urgent_since == 0.0


def test_an_urgent_overload_is_a_new_one_after_a_settled_memory_without_refusals():
    schedule = advise_return(
        empty_schedule(0.0, CONFIG), 1.0, 50.0, URGENT_BURST, 1, 0.0, 0.0, CONFIG, rates_tau_s=2.0
    ).schedule
    later = advise_return(schedule, 1.0, 50.0, URGENT_BURST, 1, 40.0, 0.0, CONFIG, rates_tau_s=2.0)
    assert later.schedule.urgent_since == 40.0
    assert later.advice_s < 10.0


def test_a_wait_that_does_not_drain_with_the_band_is_not_shortened_by_the_urgent_overloads_end():
    # A cluster's backlog, or bodies over their byte bound, wait as long whatever band 0 takes.
    assert ReturnSchedules(2, CONFIG).advise(1, 1.0, 40.0, URGENT_BURST, 0.0, 0.0, drains=False) >= 40.0
    assert ReturnSchedules(2, CONFIG).advise(1, 1.0, 40.0, URGENT_BURST, 0.0, 0.0) < 10.0


def test_refusals_of_other_replicas_take_their_counting_intervals_out_of_settled_time():
    schedule = empty_schedule(0.0, CONFIG)
    for _ in range(20):
        schedule = book_return(schedule, 1.0, 0.005, 50.0, 0.0, 0.5, CONFIG).schedule
    alone = advance(schedule, 0.1, rates_tau_s=2.0)
    assert alone.settled_returning.observed_s == pytest.approx(0.1 - COUNTING_INTERVAL_S)
    assert advance(schedule, 0.1, rates_tau_s=2.0, refusers=3).settled_returning.per_s is None


def test_returns_between_sporadic_refusals_count_as_returns_of_settled_times():
    # Returns fall due at 50/s in a lull whose refusals come every half second: all but the
    # interval that held each refusal is settled time, and the returns in it are not fresh.
    schedule = empty_schedule(0.0, CONFIG)
    for _ in range(120):
        schedule = book_return(schedule, 1.0, 0.005, 50.0, 0.0, 0.5, CONFIG).schedule
    for at in (0.5, 1.0, 1.5, 2.0):
        schedule = advance(schedule, at, rates_tau_s=2.0)
    assert schedule.settled_returning.per_s == pytest.approx(50.0, rel=0.05)


def test_a_band_counts_the_returns_urgent_bands_had_in_settled_times_as_not_fresh():
    lull = two_bands((150.0, 50.0), (150.0, 400.0), (100.0, 50.0))

    def last_advice_at(schedules: ReturnSchedules, now: float) -> float:
        rng = random.Random(1)
        return [schedules.advise(1, 1.0, 0.0, lull, now, rng.random()) for _ in range(300)][-1]

    def last_advice(schedules: ReturnSchedules) -> float:
        return last_advice_at(copy.deepcopy(schedules), 3.0)

    # Band 0's refusals come back at 50/s in a lull that refuses one of them every half second:
    # of its 100/s of settled arrivals half are returns, which leave their drain to band 1.
    schedules = ReturnSchedules(2, CONFIG)
    for _ in range(100):
        schedules.advise(0, 1.0, 0.0, replace(lull, offered_rate_by_band=(50.0, 50.0)), 0.0, 0.5)
    for at in (0.5, 1.0, 1.5, 2.0):
        schedules.advise(0, 1.0, 0.0, lull, at, 0.5)
    assert last_advice(schedules) < 0.8 * last_advice(ReturnSchedules(2, CONFIG))
    # Fifteen minutes on, with nothing of band 0's due since, those returns are long gone.
    assert last_advice_at(schedules, 900.0) == pytest.approx(
        last_advice_at(ReturnSchedules(2, CONFIG), 900.0), rel=0.02
    )


def test_an_overload_begins_at_the_first_refusal_after_a_quiet_spell():
    schedule = empty_schedule(0.0, CONFIG)
    for at in (0.5, 1.0, 2.5):  # no further apart than the rates' memory: one overload
        schedule = advance(schedule, at, rates_tau_s=2.0)
    assert schedule.refusing_since == 0.0
    assert advance(schedule, 5.0, rates_tau_s=2.0).refusing_since == 5.0


def test_a_small_drift_of_the_rates_leaves_the_slices_booked_full_as_they_are():
    schedules = ReturnSchedules(1, CONFIG)
    advise_many(schedules, 1000, flow(600.0, admitted=DRAIN), 0.0)
    before = schedules.schedule(0).booked
    drifted = DRAIN * 1.01
    schedules.advise(0, 1.0, 0.0, flow(600.0, admitted=drifted, drain=drifted), 0.0, 0.5)
    after = schedules.schedule(0).booked
    changed = [i for i, (was, now) in enumerate(zip(before, after, strict=True)) if was != now]
    # One return, one slot: not a sliver of each slice the drift would have opened.
    assert 1 <= len(changed) <= 2


# -- following the load down -------------------------------------------------------------------------------


def test_a_lull_shortens_the_advice_at_once():
    schedules = ReturnSchedules(1, CONFIG)
    in_burst = advise_many(schedules, 200, flow(400.0, admitted=DRAIN), 0.0)[-1]
    in_lull = schedules.advise(0, 1.0, 0.0, flow(100.0), 0.01, 0.5)
    assert in_burst > 4.0
    assert in_lull <= CONFIG.min_s + SLICE_S


def test_advice_shortens_strictly_as_the_spare_rate_rises():
    advice = []
    for offered in (190.0, 150.0, 100.0, 50.0):
        schedules = ReturnSchedules(1, CONFIG)
        advice.append(advise_many(schedules, 100, flow(offered), 0.0)[-1])
    assert advice == sorted(advice, reverse=True)
    assert len(set(advice)) == len(advice)


def test_an_idle_band_forgets_clients_that_never_came_back():
    schedules = ReturnSchedules(1, CONFIG)
    advise_many(schedules, 3000, flow(600.0, admitted=DRAIN), 0.0)  # far past the ceiling
    assert schedules.advise(0, 1.0, 0.0, flow(600.0, admitted=DRAIN), 0.0, 0.5) >= 0.9 * CONFIG.max_s
    assert schedules.advise(0, 1.0, 0.0, flow(600.0, admitted=DRAIN), CONFIG.max_s + 1, 0.0) == CONFIG.min_s


def test_advice_at_the_ceiling_is_spread_over_its_last_jitter_share():
    schedules = ReturnSchedules(1, CONFIG)
    overload = flow(600.0, admitted=DRAIN)
    advise_many(schedules, 3000, overload, 0.0)
    latest, soonest = (schedules.advise(0, 1.0, 0.0, overload, 0.0, u) for u in (0.0, 0.999))
    assert latest == CONFIG.max_s
    assert soonest == pytest.approx(CONFIG.max_s * (1 - 0.999 * CONFIG.jitter))


def test_an_idle_band_advises_the_time_to_drain_its_queue_even_right_after_the_ceiling():
    schedules = ReturnSchedules(1, CONFIG)
    advise_many(schedules, 3000, flow(600.0, admitted=DRAIN), 0.0)
    # Only the returns due in the slice it lands in come before it.
    assert 0.3 <= schedules.advise(0, 1.0, 0.3, flow(0.0), 0.0, 0.5) <= 0.3 + SLICE_S


@settings(max_examples=60, deadline=None)
@given(refusals=st.integers(1, 800), idle_s=st.floats(0, 200))
def test_idle_time_only_ever_shortens_the_advice(refusals, idle_s):
    schedules = ReturnSchedules(1, CONFIG)
    advise_many(schedules, refusals, flow(400.0, admitted=DRAIN), 0.0)
    burst = flow(400.0, admitted=DRAIN)
    now_advice = schedules.advise(0, 1.0, 0.0, burst, 0.0, 0.0)
    later = ReturnSchedules(1, CONFIG)
    advise_many(later, refusals, flow(400.0, admitted=DRAIN), 0.0)
    assert later.advise(0, 1.0, 0.0, burst, idle_s, 0.0) <= now_advice + 1e-9


# -- a burst, a lull, and clients that obey the advice ---------------------------------------------------

SLOTS, SERVICE_S = 8, 0.04
QUEUE_LIMIT = 20.0  # work ahead: 100 ms of queue at 200/s
RATE_TAU_S, FAST_TAU_S = 2.0, 0.5  # the gateway's rate estimates (gateway/queues/estimates.py)
SETTLED_TAU_S = 30.0
TICK_S = 0.05
MAX_ATTEMPTS = 6  # the first and 5 retries


@dataclass
class Client:
    arrived_at: float
    attempts: int = 0
    admitted_on: int | None = None


@dataclass
class Rate:
    """An event rate that forgets with time constant tau_s, as the gateway's estimates do."""

    tau_s: float
    per_s: float = 0.0
    at: float = 0.0

    def read(self, now: float) -> float:
        return self.per_s * math.exp(-(now - self.at) / self.tau_s)

    def count(self, now: float, work: float = 1.0) -> None:
        self.per_s, self.at = self.read(now) + work / self.tau_s, now


@dataclass
class Band:
    """One band of SLOTS slots of fixed SERVICE_S behind a queue that admits a request when the work
    queued ahead of it is below QUEUE_LIMIT; refusals are advised by the real ReturnSchedules."""

    config: RetryAfterConfig
    rng: random.Random
    schedules: ReturnSchedules = field(init=False)
    busy: int = 0
    queue: deque[Client] = field(default_factory=deque)
    offered: Rate = field(default_factory=lambda: Rate(RATE_TAU_S))
    settled: ObservedRate = field(default_factory=lambda: ObservedRate(SETTLED_TAU_S))
    tick: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    """The counting interval of the settled rate: its start, work offered and refused in it."""
    admitted_slow: Rate = field(default_factory=lambda: Rate(RATE_TAU_S))
    admitted_fast: Rate = field(default_factory=lambda: Rate(FAST_TAU_S))
    events: list[tuple[float, int, str, Client | None]] = field(default_factory=list)
    advice: list[tuple[float, float]] = field(default_factory=list)
    retries: int = 0
    busy_s: float = 0.0
    sequence: int = 0

    def __post_init__(self) -> None:
        self.schedules = ReturnSchedules(1, self.config, rates_seen_s=RATE_TAU_S)

    def at(self, when: float, kind: str, client: Client | None = None) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, kind, client))

    def throughput(self, now: float) -> Throughput:
        admitted = max(self.admitted_slow.read(now), self.admitted_fast.read(now))
        settled = (self.settled.per_s,)
        offered = (self.offered.read(now),)
        return Throughput(SERVICE_S, SLOTS / SERVICE_S, (admitted,), offered, settled_rate_by_band=settled)

    def count(self, now: float, refused: bool) -> None:
        """Counts an arrival as the gateway's estimates do, in intervals of TICK_S."""
        start, offered, refusals = self.tick
        if now - start >= TICK_S:
            self.settled = settled_rate(self.settled, offered, refusals, now - start)
            start, offered, refusals = now, 0.0, 0.0
        self.tick = [start, offered + 1, refusals + refused]

    def arrive(self, client: Client, now: float) -> None:
        client.attempts += 1
        self.retries += client.attempts > 1
        self.offered.count(now)
        self.count(now, refused=self.busy >= SLOTS and len(self.queue) >= QUEUE_LIMIT)
        if self.busy < SLOTS or len(self.queue) < QUEUE_LIMIT:
            client.admitted_on = client.attempts
            self.admitted_slow.count(now)
            self.admitted_fast.count(now)
            if self.busy < SLOTS:
                self.start(now)
            else:
                self.queue.append(client)
            return
        excess_s = (len(self.queue) + 1 - QUEUE_LIMIT) / (SLOTS / SERVICE_S)
        advice = self.schedules.advise(0, 1.0, excess_s, self.throughput(now), now, self.rng.random())
        self.advice.append((now, advice))
        if client.attempts < MAX_ATTEMPTS:
            self.at(now + advice, "arrive", client)

    def start(self, now: float) -> None:
        self.busy += 1
        self.busy_s += SERVICE_S
        self.at(now + SERVICE_S, "finish")

    def finish(self, now: float) -> None:
        self.busy -= 1
        if self.queue:
            self.queue.popleft()
            self.start(now)


@dataclass(frozen=True)
class Run:
    clients: list[Client]
    band: Band
    until: float

    def refused(self, since: float = 0.0, before: float = math.inf) -> list[Client]:
        return [c for c in self.clients if since <= c.arrived_at < before and c.admitted_on != 1]

    def first_retry_share(self) -> float:
        refused = self.refused()
        return sum(c.admitted_on == 2 for c in refused) / len(refused)

    def retries_per_refused(self) -> float:
        return self.band.retries / len(self.refused())

    def served_share(self, since: float, before: float) -> float:
        arrived = [c for c in self.clients if since <= c.arrived_at < before]
        return sum(c.admitted_on is not None for c in arrived) / len(arrived)


def run(
    phases: list[tuple[float, float]],
    config: RetryAfterConfig = CONFIG,
    seed: int = 7,
    until: float = math.inf,
) -> Run:
    """Poisson arrivals at each phase's load (x the band's capacity) for its seconds; the clients'
    retries are followed to the end, or up to `until`."""
    rng = random.Random(seed)
    band = Band(config, rng)
    clients: list[Client] = []
    start = 0.0
    for seconds, load in phases:
        now = start + rng.expovariate(load * DRAIN)
        while now < start + seconds:
            clients.append(Client(now))
            band.at(now, "arrive", clients[-1])
            now += rng.expovariate(load * DRAIN)
        start += seconds
    now = 0.0
    while band.events and band.events[0][0] < until:
        now, _, kind, client = heapq.heappop(band.events)
        if kind == "finish":
            band.finish(now)
        elif client is not None:
            band.arrive(client, now)
    return Run(clients, band, now)


# The burst of issue 13: 2x for 3 s after a second at 0.5x, then a lull at 0.5x. With the spread
# factor this run admitted about 13% of the refused clients on their first retry, made 3.8 retries
# per refused request and served 52% of the burst.
BURST = [(1.0, 0.5), (3.0, 2.0), (30.0, 0.5)]


@functools.cache
def burst_run(seed: int) -> Run:
    return run(BURST, seed=seed)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_after_a_burst_most_refused_clients_are_admitted_on_their_first_retry(seed):
    assert burst_run(seed).first_retry_share() >= 0.8


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_after_a_burst_nearly_all_of_it_is_served(seed):
    assert burst_run(seed).served_share(1.0, 4.0) >= 0.95


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_after_a_burst_refused_requests_retry_about_once(seed):
    assert burst_run(seed).retries_per_refused() <= 1.5


@functools.cache
def overload_run() -> Run:
    return run([(15.0, 3.0)], until=15.0)


def test_sustained_overload_pushes_the_advice_to_the_ceiling():
    late = [advice for at, advice in overload_run().band.advice if at > 10.0]
    assert min(late) >= CONFIG.max_s * (1 - CONFIG.jitter)


def test_sustained_overload_does_not_send_the_refused_back_into_the_full_queue():
    assert overload_run().retries_per_refused() <= 0.2


# The admission benchmark's burst train (loadtests/admission.py, `burst`): after 3 s at 0.5x, bursts
# of 2x and 3x for 2 and 4 s, each followed by a 0.5x lull that can serve its excess with a quarter
# to spare; returns due more than 10 s after the last arrival are not followed. Booked at the
# overload share alone, the last burst's returns ran tens of seconds past its lull (51% of it
# served, 60% admitted on the first retry).
TRAIN = [
    (3.0, 0.5),
    (2.0, 2.0),
    (5.0, 0.5),
    (2.0, 3.0),
    (10.0, 0.5),
    (4.0, 2.0),
    (10.0, 0.5),
    (4.0, 3.0),
    (20.0, 0.5),
]
TRAIN_BURSTS = [(3.0, 5.0), (10.0, 12.0), (22.0, 26.0), (36.0, 40.0)]


@functools.cache
def train_run(seed: int) -> Run:
    return run(TRAIN, seed=seed, until=sum(seconds for seconds, _ in TRAIN) + 10.0)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_train_of_bursts_is_served_in_the_lulls_between_them(seed):
    train = train_run(seed)
    assert min(train.served_share(start, end) for start, end in TRAIN_BURSTS) >= 0.95
    assert train.first_retry_share() >= 0.8
    assert train.retries_per_refused() <= 1.5
