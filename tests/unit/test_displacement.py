"""Which queued requests can no longer be served in time (policies.displacement)."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from policies.admission import AdmissionConfig, AdmissionRequest, max_work
from policies.displacement import (
    OVERDUE_SIGMAS,
    Queued,
    cap_victims,
    overdue,
    overdue_in_flow,
    owners_ahead,
    requests_per_handover,
)
from policies.wait import Throughput


def test_a_request_is_overdue_once_admission_would_refuse_it_where_it_stands():
    # 25 hand-overs a second for 1 s: 25 expected. With exponential service times (cv 1) the
    # count wavers by sqrt(n): n + 2 sqrt(n) <= 25 holds up to n = 16.
    assert not overdue(0.0, 1.0, 15.0, 25.0, 1.0)  # 15 ahead and its own: 16, admitted
    assert overdue(0.0, 1.0, 16.0, 25.0, 1.0)
    # Slots that hand over like clocks (cv 0): exactly the 25 expected.
    assert not overdue(0.0, 1.0, 24.0, 25.0, 0.0)
    assert overdue(0.0, 1.0, 25.0, 25.0, 0.0)
    assert overdue(2.0, 1.0, 0.0, 25.0, 1.0)  # its allowance has run out
    assert not overdue(0.0, math.inf, 1e9, 25.0, 1.0)  # no allowance: never
    assert not overdue(0.0, 1.0, 1e9, 0.0, 1.0)  # a drain not known yet: never


def test_the_issue_s_fixed_service_pool_displaces_the_lows_the_highs_push_out():
    # One slot of a fixed 200 ms (5 hand-overs a second). At 300 ms, 4 highs arrive ahead of
    # low 3 (leave-by 1.53 s, low 2 ahead of it) and low 4 (leave-by 1.54 s, lows 2 and 3 ahead).
    # The slot hands over at 0.4, 0.6, ... 1.4 s: low 3 starts at 1.4 s, in time; low 4 would
    # start at 1.6 s, too late.
    assert not overdue(0.3, 1.53, 4 + 1, 5.0, 0.0)
    assert overdue(0.3, 1.54, 4 + 2, 5.0, 0.0)


@given(
    left_s=st.floats(0.01, 60.0),
    rate=st.floats(0.1, 1000.0),
    ahead=st.floats(0.0, 1e5),
    cv=st.floats(0.0, 4.0),
)
def test_a_request_is_displaced_exactly_where_admission_would_refuse_its_work(left_s, rate, ahead, cv):
    # Admission of a request of the least urgent band with nothing more urgent arriving, in
    # hand-overs of one unit each: the limit is the work the drain carries in the time left.
    throughput = Throughput(
        service_time_s=1 / rate,
        drain_rate_per_s=rate,
        admitted_rate_by_band=(0.0,),
        offered_rate_by_band=(0.0,),
        service_cv=cv,
    )
    limit = max_work(AdmissionRequest(band=0, max_queue_wait_s=left_s), throughput, AdmissionConfig())
    assert overdue(0.0, left_s, ahead, rate, cv) is (ahead + 1 > limit)


@given(
    st.floats(0.0, 1e4),
    st.floats(0.0, 1e4),
    st.floats(0.1, 100.0),
    st.floats(0.1, 100.0),
    st.floats(0.0, 4.0),
)
def test_more_work_ahead_or_less_time_never_makes_a_request_less_overdue(ahead, more, left_s, rate, cv):
    if overdue(0.0, left_s, ahead, rate, cv):
        assert overdue(0.0, left_s, ahead + more, rate, cv)
        assert overdue(0.0, left_s / 2, ahead, rate, cv)


def test_in_a_fifo_flow_the_older_requests_count_ahead_of_each():
    # Four requests, newest first, each allowed 1 s at 25 hand-overs a second (16 at cv 1).
    newest_first = [(1.0, 1)] * 4
    # 12 urgent: the newest has 12 + 3 ahead and its own (16, admitted), none is overdue yet;
    # 13: the newest is, then the next with 13 + 2 ahead is not.
    assert overdue_in_flow(0.0, 12, 4, newest_first, 25.0, 1.0) == []
    assert overdue_in_flow(0.0, 13, 4, newest_first, 25.0, 1.0) == [0]
    assert overdue_in_flow(0.0, 15, 4, newest_first, 25.0, 1.0) == [0, 1, 2]
    assert overdue_in_flow(0.0, 16, 4, newest_first, 25.0, 1.0) == [0, 1, 2, 3]
    # Under EDF a flow's requests leave by deadline: only the urgent requests are surely ahead.
    assert overdue_in_flow(0.0, 13, 4, newest_first, 25.0, 1.0, in_arrival_order=False) == []


def test_requests_ahead_count_one_hand_over_each_whatever_they_cost():
    # Batch jobs of 16 items behind interactive requests of 1: in a pool of slots each job is one
    # hand-over. 20 jobs queued before the newest, 4 hand-overs a second, 9 s left: 20 + 1 needed
    # of 36 expected (26.3 at cv 1), so it stays; counted in work at a pool mean of 4 items a
    # hand-over it would have needed 81 and gone.
    assert overdue_in_flow(0.0, 0, 21, [(9.0, 1)], 4.0, 1.0) == []
    assert overdue_in_flow(0.0, 0, 60, [(9.0, 1)], 4.0, 1.0) == [0]


def test_a_batched_request_counts_what_is_ahead_in_the_batches_it_takes():
    # 60 ahead leave in batches of up to 4: 15 hand-overs and its own, within 26.3.
    assert overdue_in_flow(0.0, 0, 61, [(9.0, 4)], 4.0, 1.0) == []
    assert overdue_in_flow(0.0, 0, 61, [(9.0, 1)], 4.0, 1.0) == [0]


def test_a_patient_request_stays_while_an_impatient_one_behind_it_goes():
    newest_first = [(1.0, 1), (30.0, 1)]  # the older one may wait 30 s
    assert overdue_in_flow(0.0, 20, 2, newest_first, 25.0, 1.0) == [0]


def test_displacement_s_margin_is_admission_s_starting_one():
    assert OVERDUE_SIGMAS == AdmissionConfig().safety_sigmas


def test_owners_count_ahead_the_requests_that_run_within_their_quotas_most_urgent_first():
    # Room for 5 units: its 2 urgent units (2 requests), then 3 of its 4 units in band 1 (2
    # requests of 2: 1.5 of them at their mean cost); nothing of band 2 runs within it.
    assert owners_ahead([(5.0, [(2.0, 2), (4.0, 2), (3.0, 3)])], 3) == [3.5, 1.5, 0.0]
    two = [(5.0, [(2.0, 2), (4.0, 2), (3.0, 3)]), (1.0, [(0.0, 0), (0.0, 0), (9.0, 3)])]
    assert owners_ahead(two, 3) == [3.5 + 1 / 3, 1.5 + 1 / 3, 1 / 3]
    assert owners_ahead([(0.0, [(7.0, 1), (7.0, 1)])], 2) == [0.0, 0.0]  # at its quota: it waits like anyone


_queued = st.lists(st.tuples(st.floats(0.5, 50), st.integers(1, 20)), min_size=3, max_size=3)


@given(st.lists(st.tuples(st.floats(0, 100), _queued), max_size=4))
def test_owners_ahead_never_exceeds_their_queued_requests_and_falls_with_the_band(owners):
    ahead = owners_ahead(owners, 3)
    assert all(later <= earlier + 1e-9 for earlier, later in itertools.pairwise(ahead))
    for band in range(3):
        assert ahead[band] <= sum(n for _, queued in owners for _, n in queued[band:]) + 1e-9


def test_at_the_cap_the_least_urgent_borrowers_newest_work_goes_first():
    queued = [
        Queued(band=2, borrower=False, score=5.0, sequence=5, cost=1.0),  # an owner's, newest
        Queued(band=2, borrower=True, score=1.0, sequence=1, cost=1.0),  # a borrower's, oldest
        Queued(band=2, borrower=True, score=3.0, sequence=3, cost=1.0),
        Queued(band=1, borrower=True, score=9.0, sequence=9, cost=1.0),
        Queued(band=0, borrower=True, score=9.5, sequence=10, cost=1.0),
    ]
    assert cap_victims(queued, 0, 1.0) == [2]
    assert cap_victims(queued, 0, 3.0) == [2, 1, 0]
    assert cap_victims(queued, 0, 4.0) == [2, 1, 0, 3]
    assert cap_victims(queued, 1, 4.0) == []  # only band 2 is less urgent: not room enough
    assert cap_victims(queued, 0, 0.5) == [2]


_candidates = st.lists(
    st.builds(
        Queued,
        band=st.integers(0, 2),
        borrower=st.booleans(),
        score=st.floats(0, 100),
        sequence=st.integers(0, 1000),
        cost=st.floats(0.5, 8),
    ),
    max_size=12,
)


@given(_candidates, st.integers(0, 2), st.floats(0.1, 40))
def test_cap_victims_make_the_room_from_less_urgent_work_borrowed_before_owned(queued, band, excess):
    victims = cap_victims(queued, band, excess)
    assert all(queued[i].band > band for i in victims), "displaced work as urgent as the arrival"
    if victims:
        assert sum(queued[i].cost for i in victims) >= excess
    else:
        assert sum(q.cost for q in queued if q.band > band) < excess
    kept = [q for i, q in enumerate(queued) if i not in victims and q.band > band]
    for i in victims:
        taken = queued[i]
        for other in kept:
            # No victim was chosen while work of a less urgent band stays, nor owned work while
            # borrowed work of its band stays.
            assert other.band <= taken.band
            if other.band == taken.band:
                assert other.borrower <= taken.borrower


def test_a_hand_over_carries_one_request_or_at_most_a_batch_s_worth():
    assert requests_per_handover(None) == 1
    assert requests_per_handover(8.0) == 8
    assert requests_per_handover(0.5) == 1
