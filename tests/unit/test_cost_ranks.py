import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.admission import AdmissionConfig, AdmissionRequest, Reject, refuse
from policies.cost_ranks import CostRanks, room_limit, room_share
from policies.wait import QueueStats, Throughput
from tests.unit.test_admission import decide


def test_a_cost_ranks_by_the_share_of_recent_requests_cheaper_than_it():
    ranks = CostRanks(window=4)
    assert ranks.rank(100.0) == 0.0  # nothing seen yet: no preference
    for cost in (10.0, 20.0, 30.0, 40.0):
        ranks.add(cost)
    assert [ranks.rank(c) for c in (5.0, 10.0, 25.0, 40.0, 99.0)] == [0.0, 0.0, 0.5, 0.75, 1.0]
    ranks.add(50.0)  # the oldest (10) leaves the window
    assert ranks.rank(15.0) == 0.0


def test_requests_of_one_cost_all_rank_first():
    ranks = CostRanks()
    for _ in range(300):
        ranks.add(1.0)
    assert ranks.rank(1.0) == 0.0
    assert room_share(ranks.rank(1.0), 0.5) == 1.0


@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=600), st.integers(1, 64))
def test_the_window_ranks_exactly_its_last_costs(costs, window):
    ranks = CostRanks(window)
    for cost in costs:
        ranks.add(cost)
    last = costs[-window:]
    probe = costs[len(costs) // 2]
    assert ranks.rank(probe) == sum(c < probe for c in last) / len(last)


def test_the_costliest_fill_only_their_share_of_the_room_beyond_one_handover():
    assert room_share(1.0, 0.5) == 0.5
    assert room_share(0.0, 0.5) == 1.0
    assert room_limit(21.0, 1.0, 0.5) == 11.0
    assert room_limit(21.0, 1.0, 1.0) == 21.0
    # A limit of one hand-over or less (nothing may queue ahead) is not cut: an empty queue
    # refuses no one for their cost.
    assert room_limit(0.8, 1.0, 0.5) == 0.8
    assert room_limit(-1.0, 1.0, 0.5) == -1.0


@given(st.floats(-10.0, 1e4), st.floats(0.1, 100.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_a_higher_rank_never_gets_more_room(limit, handover, rank, costliest):
    share = room_share(rank, costliest)
    assert room_limit(limit, handover, share) <= limit
    assert room_limit(limit, handover, share) >= min(limit, handover)
    assert room_share(min(1.0, rank + 0.1), costliest) <= share


FLOW = Throughput(
    service_time_s=1.0,
    drain_rate_per_s=20.0,
    admitted_rate_by_band=(0.0, 20.0),
    offered_rate_by_band=(0.0, 40.0),
)
CONFIG = AdmissionConfig(safety_sigmas=0.0)


def test_behind_a_contended_queue_the_costly_request_is_refused_and_the_cheap_one_admitted():
    # 20 work units a second reach the band; it may wait 1 s; 14 units are queued ahead.
    stats = QueueStats(queued_by_band=(0, 10), free_slots=0, queued_work_by_band=(0.0, 14.0))
    cheap = AdmissionRequest(band=1, max_queue_wait_s=1.0, cost=1.0, room_share=1.0)
    costly = AdmissionRequest(band=1, max_queue_wait_s=1.0, cost=1.0, room_share=0.5)
    assert decide(cheap, stats, FLOW, 0.5, CONFIG) is None
    refused = decide(costly, stats, FLOW, 0.5, CONFIG)
    assert isinstance(refused, Reject)
    # It fits when the queue has drained to its share of the room, 1 + 19 / 2 units: 4.5 units
    # (0.225 s) from now.
    assert refused.excess_wait_s == pytest.approx(4.5 / 20)
    empty = QueueStats(queued_by_band=(0, 0), free_slots=0)
    assert decide(costly, empty, FLOW, 0.5, CONFIG) is None


def test_the_room_share_changes_nothing_for_a_request_refused_anyway():
    full = QueueStats(queued_by_band=(0, 30), free_slots=0, queued_work_by_band=(0.0, 30.0))
    request = AdmissionRequest(band=1, max_queue_wait_s=1.0, cost=1.0)
    assert refuse(request, full, FLOW, 0.5, CONFIG).excess_wait_s == pytest.approx(31 / 20 - 1.0)
