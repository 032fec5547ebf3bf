"""Replicas of one queue share its spare rate: each counts the returns the others promised."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.retry_after import RetryAfterConfig
from policies.return_schedule import (
    Promised,
    ReturnSchedule,
    advance,
    advise_return,
    booked_elsewhere,
    empty_schedule,
    promised,
    returning_elsewhere_per_s,
)
from policies.wait import Throughput

CONFIG = RetryAfterConfig(min_s=0.01, max_s=60.0, jitter=0.1)
TAU_S = 2.0
# 8 slots x 40 ms, offered 3 times what it drains: returns are booked at the overload share.
OVERLOAD = Throughput(
    service_time_s=0.04,
    drain_rate_per_s=200.0,
    admitted_rate_by_band=(200.0,),
    offered_rate_by_band=(600.0,),
)


def refuse(
    schedule: ReturnSchedule, others: list[Promised], now: float, u: float
) -> tuple[float, ReturnSchedule]:
    booking = advise_return(schedule, 1.0, 0.0, OVERLOAD, 0, now, u, CONFIG, TAU_S, others)
    return booking.advice_s, booking.schedule


@settings(max_examples=60, deadline=None)
@given(replicas=st.integers(2, 4), refusals=st.integers(1, 600), seed=st.integers(0, 2**16))
def test_replicas_that_see_each_others_promises_book_no_more_than_one_queue_can_take(
    replicas, refusals, seed
):
    # Refusals reach the replicas in any order, at one moment; each counts what the others have
    # promised so far. Together they book each slice up to its room once, as a single replica would.
    rng = random.Random(seed)
    schedules = [empty_schedule(0.0, CONFIG) for _ in range(replicas)]
    single = empty_schedule(0.0, CONFIG)
    for _ in range(refusals):
        at = rng.randrange(replicas)
        others = [promised(s) for i, s in enumerate(schedules) if i != at]
        _, schedules[at] = refuse(schedules[at], others, 0.0, 0.5)
        _, single = refuse(single, [], 0.0, 0.5)
    together = [sum(s.booked[i] for s in schedules) for i in range(len(single.booked))]
    assert all(abs(a - b) < 1e-6 for a, b in zip(together, single.booked, strict=True))


def test_a_replica_blind_to_the_others_promises_as_much_again():
    # The defect it mends: three replicas refusing a burst each book the whole spare rate.
    blind = [empty_schedule(0.0, CONFIG) for _ in range(3)]
    seeing = [empty_schedule(0.0, CONFIG) for _ in range(3)]
    last_blind = last_seeing = 0.0
    for n in range(300):
        at = n % 3
        last_blind, blind[at] = refuse(blind[at], [], 0.0, 0.5)
        others = [promised(s) for i, s in enumerate(seeing) if i != at]
        last_seeing, seeing[at] = refuse(seeing[at], others, 0.0, 0.5)
    # The spare rate is the overload share of 200/s, 40/s: 300 returns need 7.5 s of it.
    assert 7.0 < last_seeing < 8.0
    assert last_blind < 0.4 * last_seeing


def test_others_slices_count_in_the_slice_that_holds_their_middle_and_passed_ones_not_at_all():
    mine = empty_schedule(10.0, CONFIG)  # slices of 0.25 s from 10.0
    other = Promised(9.6, 0.25, (1.0, 2.0, 3.0, 4.0), 0.0, 0.0, 10.0)  # middles 9.725 .. 10.475
    taken = booked_elsewhere(mine, [other])
    assert taken[:2] == (3.0, 4.0) and sum(taken) == 7.0


def test_the_others_bookings_are_worked_out_once_until_they_publish_again_or_a_slice_passes():
    # Every refusal of the band asks, and working it out takes every slice of every other replica.
    mine = empty_schedule(10.0, CONFIG)  # slices of 0.25 s from 10.0
    others = (Promised(9.6, 0.25, (1.0, 2.0, 3.0, 4.0), 0.0, 0.0, 10.0),)  # middles 9.725 .. 10.475
    taken = booked_elsewhere(mine, others)
    assert booked_elsewhere(mine, others) is taken
    one_slice_on = advance(mine, 10.25, TAU_S)  # the slice the 3.0 fell in has passed
    assert one_slice_on.origin_s == 10.25
    assert booked_elsewhere(one_slice_on, others)[:2] == (4.0, 0.0)
    republished = (Promised(9.6, 0.25, (1.0, 2.0, 3.0, 5.0), 0.0, 0.0, 10.2),)
    assert booked_elsewhere(mine, republished)[:2] == (3.0, 5.0)


def test_a_returning_rate_not_refreshed_within_the_rates_memory_counts_no_longer():
    fresh = Promised(0.0, 0.25, (), 30.0, 5.0, updated_at=9.0)
    stale = Promised(0.0, 0.25, (), 50.0, 7.0, updated_at=7.0)
    assert returning_elsewhere_per_s([fresh, stale], 10.0, TAU_S, math.inf) == (30.0, 12.0)


def test_a_settled_returning_rate_fades_over_the_settled_memory_since_its_replica_last_refused():
    # 900 s without a refusal: the settled times since then, with nothing of its returns due,
    # count at its next refusal; read now, its rate has faded with them.
    old = Promised(0.0, 0.25, (), 0.0, 50.0, updated_at=100.0)
    assert returning_elsewhere_per_s([old], 1000.0, TAU_S, 30.0)[1] == pytest.approx(50.0 * math.exp(-30.0))


def test_the_others_returns_are_not_fresh_arrivals():
    # 250/s arrive on a drain of 200/s: alone, a replica books returns at the overload share, 40/s.
    # When 100/s of them are the other replica's returns falling due, 150/s are fresh: 50/s spare.
    # A return of 20 from 10 ms on ends 0.5 s later for the first, 0.4 s for the second.
    busy = Throughput(0.04, 200.0, admitted_rate_by_band=(250.0,), offered_rate_by_band=(250.0,))
    returning = Promised(0.0, 0.25, (), 100.0, 0.0, updated_at=0.0)
    late = 1 - 1e-9
    schedule = empty_schedule(0.0, CONFIG)
    alone = advise_return(schedule, 20.0, 0.0, busy, 0, 0.0, late, CONFIG, TAU_S)
    shared = advise_return(schedule, 20.0, 0.0, busy, 0, 0.0, late, CONFIG, TAU_S, [returning])
    assert abs(alone.advice_s - 0.51) < 1e-6 and abs(shared.advice_s - 0.41) < 1e-6
