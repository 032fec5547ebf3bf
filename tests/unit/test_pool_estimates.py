import pytest

from gateway.queues.estimates import REACH_Z, TICK_S, PoolEstimates, StoreCounters
from gateway.settings import Estimation
from policies.estimators import rate_upper_bound

CONFIG = Estimation(service_time_weight=0.1)


def test_service_times_count_as_exponential_until_the_average_has_seen_enough():
    estimates = PoolEstimates(bands=2, expected_service_s=0.04, config=CONFIG)
    assert estimates.throughput(slots=8, now=0.0).service_cv == 1.0
    for _ in range(9):
        estimates.record_service(0.04)
    assert estimates.throughput(slots=8, now=0.0).service_cv == 1.0  # 9 of the 10 it remembers
    estimates.record_service(0.04)
    assert estimates.throughput(slots=8, now=0.0).service_cv == pytest.approx(0.0)


def test_the_measured_variation_of_service_times_is_their_spread_over_their_mean():
    estimates = PoolEstimates(bands=2, expected_service_s=0.04, config=CONFIG)
    for i in range(2000):  # 20 and 60 ms in turn: mean 40 ms, spread 20 ms
        estimates.record_service(0.02 if i % 2 else 0.06)
    flow = estimates.throughput(slots=8, now=0.0)
    assert flow.service_time_s == pytest.approx(0.04, rel=0.1)
    assert flow.service_cv == pytest.approx(0.5, rel=0.15)


def test_the_capacity_is_the_slots_over_the_mean_of_the_measured_service_times():
    estimates = PoolEstimates(bands=1, expected_service_s=0.4, config=CONFIG)
    for i in range(4000):  # 90% take 0.1 s, 10% take 3.1 s: a mean of 0.4 s
        estimates.record_service(3.1 if i % 10 == 0 else 0.1)
    assert estimates.throughput(slots=4, now=0.0).capacity_by_band == (pytest.approx(4 / 0.4, rel=0.02),)


def test_a_bands_capacity_counts_only_the_slots_more_urgent_reservations_leave_it():
    estimates = PoolEstimates(bands=3, expected_service_s=0.04, config=CONFIG)
    for _ in range(1000):
        estimates.record_service(0.04)
    capacity = estimates.throughput(slots=8, now=0.0, reserved_by_band=(2, 5, 0)).capacity_by_band
    assert capacity == (pytest.approx(200.0), pytest.approx(150.0), pytest.approx(75.0))
    assert estimates.throughput(slots=4, now=0.0, reserved_by_band=(2, 5, 0)).capacity_by_band[2] == 0.0


def _feed(
    estimates: PoolEstimates,
    counters: StoreCounters,
    seconds: float,
    offered: float,
    refused: float,
    at: float,
) -> float:
    """Feeds `seconds` of ticks of TICK_S each with `offered` work per second, `refused` of it refused."""
    for _ in range(round(seconds / TICK_S)):
        counters.offered_work[0] += offered * TICK_S
        counters.admitted_work[0] += (offered - refused) * TICK_S
        at += TICK_S
        estimates.observe(counters, at)
    return at


def test_the_settled_rate_counts_only_times_that_refused_nothing():
    estimates = PoolEstimates(bands=1, expected_service_s=0.04, config=CONFIG)
    counters = StoreCounters.empty(1)
    estimates.observe(counters, 0.0)
    assert estimates.throughput(slots=8, now=0.0).settled_rate_by_band == (None,)
    at = _feed(estimates, counters, 5.0, offered=100.0, refused=0.0, at=0.0)
    assert estimates.throughput(slots=8, now=at).settled_rate_by_band == (pytest.approx(100.0),)
    # A long overload neither raises it nor, by lasting, makes it forget the load before.
    at = _feed(estimates, counters, 60.0, offered=600.0, refused=400.0, at=at)
    flow = estimates.throughput(slots=8, now=at)
    assert flow.settled_rate_by_band == (pytest.approx(100.0),)
    assert flow.offered_rate_by_band[0] == pytest.approx(600.0)


@pytest.mark.parametrize("ticks", [3, round(20 / TICK_S)])
def test_tenant_rates_are_each_flows_admitted_work_per_second_from_the_first_ticks(ticks):
    """What each flow queues (its arrivals in turn ahead of others'), read at its rate after a few
    counting intervals as after ten time constants: not ramping up from 0 while a flood begins."""
    estimates = PoolEstimates(bands=2, expected_service_s=0.04, config=CONFIG)
    counters = StoreCounters.empty(2)
    estimates.observe(counters, 0.0)
    at = 0.0
    for _ in range(ticks):
        for flow, work in (((1, "a"), 3.0), ((1, "b"), 1.0), ((0, ""), 2.0)):
            counters.admitted_by_flow[flow] = counters.admitted_by_flow.get(flow, 0.0) + work
            counters.granted_by_flow[flow] = counters.granted_by_flow.get(flow, 0.0) + work / 2
        at += TICK_S
        estimates.observe(counters, at)
    throughput = estimates.throughput(slots=8, now=at)
    rates, granted = throughput.tenant_rate_by_band, throughput.tenant_granted_by_band
    per_tick = 1 / TICK_S
    # Admitted work is read a little up, by what the count has seen (REACH_Z): what each may send.
    window_s = min(at, 2 * CONFIG.rate_window_s / 4)
    assert rates[0] == {"": pytest.approx(rate_upper_bound(2.0 * per_tick, window_s, 1.0, REACH_Z), rel=0.01)}
    assert rates[1] == {
        "a": pytest.approx(rate_upper_bound(3.0 * per_tick, window_s, 1.0, REACH_Z), rel=0.01),
        "b": pytest.approx(rate_upper_bound(per_tick, window_s, 1.0, REACH_Z), rel=0.01),
    }
    # What each gets, for the shares reported, is what it was granted.
    assert granted[1] == {
        "a": pytest.approx(1.5 * per_tick, rel=0.01),
        "b": pytest.approx(per_tick / 2, rel=0.01),
    }


def test_a_flow_that_begins_long_after_the_pool_is_read_at_its_rate_from_its_first_ticks():
    """A replica's first view of a shared store comes at its start, not at the flood's: a flow's
    estimate starts from 0 when the flow shows, and is corrected from there, not from the pool's
    first totals."""
    estimates = PoolEstimates(bands=1, expected_service_s=0.04, config=CONFIG)
    counters = StoreCounters.empty(1)
    at = 0.0
    for _ in range(round(10 / TICK_S)):  # ten quiet seconds
        estimates.observe(counters, at)
        at += TICK_S
    for _ in range(3):
        counters.admitted_by_flow[0, "a"] = counters.admitted_by_flow.get((0, "a"), 0.0) + 5.0
        at += TICK_S
        estimates.observe(counters, at)
    (rates,) = estimates.throughput(slots=8, now=at).tenant_rate_by_band
    assert rates["a"] >= 5.0 / TICK_S  # read from the pool's ten seconds, it was a third of it
