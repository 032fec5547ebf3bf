import pytest

from gateway.queues.estimates import PoolEstimates
from gateway.settings import Estimation

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
