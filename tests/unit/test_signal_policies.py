import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.estimators import counter_increase
from policies.histograms import bucket_deltas, quantile
from policies.saturation import saturation
from policies.shedding import BacklogLimits, ClusterBacklog, first_shed_band, shed_excess_wait_s

INF = math.inf


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, [(1.0, 10), (2.0, 20), (INF, 20)], 1.0),
        (0.75, [(1.0, 10), (2.0, 20), (INF, 20)], 1.5),  # interpolated inside (1, 2]
        (0.95, [(1.0, 0), (2.5, 0), (5.0, 100), (INF, 100)], 4.875),
        (0.99, [(1.0, 50), (INF, 100)], 1.0),  # in +Inf: the largest finite bound
        (0.5, [(1.0, 0), (INF, 0)], None),
        (0.5, [], None),
    ],
)
def test_quantile_interpolates_like_promql(q, buckets, expected):
    assert quantile(q, buckets) == (pytest.approx(expected) if expected is not None else None)


def test_bucket_deltas_are_the_observations_between_readings():
    assert bucket_deltas({1.0: 4, INF: 9}, {1.0: 6, INF: 14}) == {1.0: 2, INF: 5}
    assert bucket_deltas({}, {1.0: 3}) == {1.0: 3}


def test_bucket_deltas_see_a_reset():
    assert bucket_deltas({1.0: 40, INF: 90}, {1.0: 1, INF: 2}) is None


@pytest.mark.parametrize(("before", "after", "increase"), [(None, 5, 0), (10, 15, 5), (10, 3, 3), (7, 7, 0)])
def test_counter_increase_reads_a_decrease_as_a_restart(before, after, increase):
    assert counter_increase(before, after) == increase


LIMITS = BacklogLimits(pending_workloads=10, admission_wait_p95_s=60)


@pytest.mark.parametrize(
    ("pending", "p95", "bands", "first"),
    [
        (5, None, 3, None),  # below the limit
        (10, 30, 3, None),  # at the limit is not past it
        (11, None, 3, 2),  # just past: the least urgent band
        (25, None, 3, 1),  # past twice the limit: two bands
        (500, None, 3, 1),  # the most urgent band is never shed
        (0, 90, 3, 2),  # the admission wait alone can backlog the queue
        (11, None, 1, None),  # a single class is never shed
    ],
)
def test_least_urgent_bands_are_shed_first_and_more_as_the_backlog_grows(pending, p95, bands, first):
    assert first_shed_band(ClusterBacklog(pending, p95), LIMITS, bands) == first


def test_no_report_sheds_nothing():
    assert first_shed_band(None, LIMITS, 3) is None


def test_a_shed_request_waits_out_the_queue_then_the_cluster():
    assert shed_excess_wait_s(1.5, ClusterBacklog(20, 42.0)) == pytest.approx(43.5)
    assert shed_excess_wait_s(-0.9, ClusterBacklog(20, 42.0)) == 42.0  # it would fit the queue
    assert shed_excess_wait_s(1.5, ClusterBacklog(20, None)) == 1.5


@pytest.mark.parametrize(
    ("inflight", "slots", "waiting", "running", "fresh", "expected"),
    [
        (4, 8, 0, None, True, 0.5),
        (4, 8, 6, None, True, 1.25),  # the backend queues others' work
        (4, 8, 6, 8, True, 1.75),  # it runs more than our 4
        (4, 8, 6, 8, False, 0.5),  # stale: our own count only
        (0, 0, 0, None, True, 1.0),  # capacity unknown
    ],
)
def test_saturation(inflight, slots, waiting, running, fresh, expected):
    assert saturation(inflight, slots, waiting, running, fresh) == pytest.approx(expected)


@given(st.lists(st.floats(0, 1000), min_size=1, max_size=8), st.floats(0.01, 0.99))
def test_quantile_stays_within_the_bounds(counts, q):
    bounds = [float(2**i) for i in range(len(counts))]
    cumulative = []
    total = 0.0
    for bound, count in zip(bounds, counts, strict=True):
        total += count
        cumulative.append((bound, total))
    value = quantile(q, cumulative)
    if total == 0:
        assert value is None
    else:
        assert 0.0 <= value <= bounds[-1]


def test_a_level_that_is_not_a_number_sheds_nothing_and_an_infinite_one_all_but_band_0():
    assert first_shed_band(ClusterBacklog(math.nan, None), LIMITS, 3) is None
    assert first_shed_band(ClusterBacklog(math.inf, None), LIMITS, 3) == 1
