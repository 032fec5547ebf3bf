import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.wait import (
    MIN_DRAIN_SHARE,
    QueueStats,
    Throughput,
    band_count_variance_rate,
    band_drain_rate_per_s,
    drain_rate_from_slots,
    offered_load,
    pool_drain_rate_per_s,
    predicted_wait_s,
    work_before_grant,
    work_to_drain,
)


def throughput(drain: float = 100.0, admitted: tuple[float, ...] = (0.0, 0.0), offered=None) -> Throughput:
    return Throughput(
        service_time_s=0.04,
        drain_rate_per_s=drain,
        admitted_rate_by_band=admitted,
        offered_rate_by_band=offered if offered is not None else admitted,
    )


@pytest.mark.parametrize(
    ("queued", "free", "band", "work"),
    [
        ((0, 0), 3, 1, 0),  # a slot is free: no wait
        ((0, 0), 0, 0, 1),  # all busy, nobody ahead: one hand-over
        ((2, 5), 0, 0, 3),  # high only counts high ahead
        ((2, 5), 0, 1, 8),  # low counts high and low ahead
        ((2, 5), 1, 1, 8),  # a slot free while work waits (held by a quota): the store counts it all
    ],
)
def test_work_to_drain_counts_more_urgent_and_own_band_as_the_store_checks(queued, free, band, work):
    assert work_to_drain(QueueStats(queued, free), band) == work


@pytest.mark.parametrize(
    ("work", "free", "band", "handover_cost", "expected"),
    [
        ((0.0, 0.0), 1, 1, 8.0, 0.0),  # a slot is free
        ((0.0, 0.0), 0, 1, 8.0, 8.0),  # one hand-over of the usual size
        ((16.0, 40.0), 0, 0, 8.0, 24.0),  # high counts high's work, then one hand-over
        ((16.0, 40.0), 0, 1, 8.0, 64.0),
    ],
)
def test_work_to_drain_counts_work_not_requests(work, free, band, handover_cost, expected):
    stats = QueueStats((2, 5), free, queued_work_by_band=work)
    assert work_to_drain(stats, band, handover_cost) == expected


def test_wait_is_zero_when_a_slot_is_free():
    assert predicted_wait_s(QueueStats((0, 0), 1), throughput(), 1) == 0.0


def test_wait_is_positions_over_drain_rate():
    assert predicted_wait_s(QueueStats((0, 9), 0), throughput(drain=50.0), 1) == pytest.approx(10 / 50)


def test_urgent_arrivals_slow_the_drain_seen_by_lower_bands():
    flow = throughput(drain=200.0, admitted=(120.0, 60.0))
    assert band_drain_rate_per_s(flow, 0) == 200.0
    assert band_drain_rate_per_s(flow, 1) == pytest.approx(80.0)


def test_band_drain_rate_never_falls_below_its_floor():
    flow = throughput(drain=100.0, admitted=(500.0, 0.0))
    assert band_drain_rate_per_s(flow, 1) == pytest.approx(100.0 * MIN_DRAIN_SHARE)


def test_offered_load_is_the_bands_arrivals_per_hand_over_it_gets():
    flow = throughput(drain=100.0, admitted=(40.0, 0.0), offered=(50.0, 120.0))
    assert offered_load(flow, 0) == pytest.approx(0.5)
    assert offered_load(flow, 1) == pytest.approx(2.0)  # 120 arrivals for the 60 hand-overs left


def test_drain_rate_from_slots_is_slots_over_service_time():
    assert drain_rate_from_slots(8, 0.04) == pytest.approx(200.0)


stats_strategy = st.builds(
    QueueStats,
    queued_by_band=st.tuples(*[st.integers(0, 1000)] * 3),
    free_slots=st.integers(0, 16),
)
flow_strategy = st.builds(
    Throughput,
    service_time_s=st.floats(0.001, 10),
    drain_rate_per_s=st.floats(0.1, 10_000),
    admitted_rate_by_band=st.tuples(*[st.floats(0, 10_000)] * 3),
    offered_rate_by_band=st.tuples(*[st.floats(0, 10_000)] * 3),
)


@given(stats_strategy, flow_strategy, st.integers(0, 2), st.integers(1, 50))
def test_wait_is_monotone_in_queue_position(stats, flow, band, extra):
    deeper = list(stats.queued_by_band)
    deeper[band] += extra
    longer = QueueStats(tuple(deeper), stats.free_slots)
    assert predicted_wait_s(longer, flow, band) >= predicted_wait_s(stats, flow, band)


@given(stats_strategy, flow_strategy)
def test_more_urgent_band_never_predicts_a_longer_wait(stats, flow):
    waits = [predicted_wait_s(stats, flow, band) for band in range(3)]
    assert waits == sorted(waits)


@pytest.mark.parametrize(
    ("handovers", "backlog_s", "expected"),
    [
        (0, 0, 200.0),  # nothing seen: slots / service time
        (300, 2.0, (300 + 20) / 2.1),  # seconds of backlog: the measurement dominates
        (1, 0.5, 21 / 0.6),  # one slow gap after a restart: not a rate that refuses everything
        (8, 0.013, 200.0),  # the burst after an idle spell: bounded by Little's law
    ],
)
def test_pool_drain_rate_is_measured_but_bounded_by_the_slots(handovers, backlog_s, expected):
    assert pool_drain_rate_per_s(handovers, backlog_s, 8, 0.04) == pytest.approx(expected)


@given(
    handovers=st.floats(0, 1e6),
    backlog_s=st.floats(0, 1e4),
    slots=st.integers(1, 1000),
    service=st.floats(1e-3, 100),
)
def test_pool_drain_rate_is_positive_and_within_what_the_slots_sustain(handovers, backlog_s, slots, service):
    assert 0 < pool_drain_rate_per_s(handovers, backlog_s, slots, service) <= slots / service * (1 + 1e-12)


@pytest.mark.parametrize(
    ("cv", "admitted", "band", "variance_rate"),
    [
        (1.0, (0.0, 0.0), 0, 100.0),  # exponential service: a Poisson count of 100/s
        (0.0, (0.0, 0.0), 0, 0.0),  # every call 40 ms: a clock
        (0.5, (0.0, 0.0), 0, 25.0),
        (0.0, (30.0, 0.0), 1, 30.0),  # high's Poisson arrivals take hand-overs from low at random
        (0.0, (30.0, 0.0), 0, 0.0),  # ... but not from high itself
        (1.0, (30.0, 0.0), 1, 130.0),
    ],
)
def test_count_variance_adds_service_variation_and_urgent_arrivals(cv, admitted, band, variance_rate):
    flow = Throughput(0.04, 100.0, admitted, admitted, service_cv=cv)
    assert band_count_variance_rate(flow, band) == pytest.approx(variance_rate)


@pytest.mark.parametrize(
    ("ahead", "free", "cost", "expected"),
    [
        (0.0, 1, 9.0, 0.0),  # a free slot and nobody ahead: granted now, whatever it costs
        (0.0, 0, 9.0, 3.0),  # every slot busy, nobody queued: its own hand-over
        (4.0, 0, 1.0, 7.0),  # the work ahead, then its own hand-over, which a cheap request needs too
        (4.0, 0, 9.0, 13.0),  # behind queued work, the room its whole cost takes
        (4.0, 2, 1.0, 7.0),  # work ahead of it waits for those slots first
    ],
)
def test_the_work_a_store_checks_before_a_grant(ahead, free, cost, expected):
    assert work_before_grant(ahead, free, 3.0, cost) == expected


def test_behind_queued_work_a_long_request_is_refused_where_a_short_one_still_fits():
    stats = QueueStats(queued_by_band=(0, 2), free_slots=0, queued_work_by_band=(0.0, 6.0))
    limit = 10.0
    short, long = (work_to_drain(stats, 1, 3.0, cost=c) for c in (1.0, 6.0))
    assert short == 9.0 <= limit < long == 12.0
    idle_queue = QueueStats(queued_by_band=(0, 0), free_slots=0)
    assert work_to_drain(idle_queue, 1, 3.0, cost=60.0) == 3.0  # nothing queued for it to crowd
