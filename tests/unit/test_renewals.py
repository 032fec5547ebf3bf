"""The renewal function of a service distribution, and what it changes in the pool's readings: a
mix of short and long services hands over far more often early on than time over the mean says."""

import math
import random
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.pool_readings import SHORT_S, short_or_long, true_count_quantile
from policies.handovers import PoolState, handovers_within
from policies.service_times import ServiceTimes


def exponential(mean_s: float) -> ServiceTimes:
    rng = random.Random(7)
    service = ServiceTimes(prior_mean_s=mean_s, memory=2000.0)
    for _ in range(20_000):
        service.record(rng.expovariate(1 / mean_s))
    return service


def test_short_services_between_long_ones_count_far_above_time_over_the_mean():
    service = short_or_long()
    # Exactly: the k-th service ends within 1 s only if the first k are short, so
    # m(1) = sum of 0.9^k for k = 1..10 = 5.86, where 1 s / mean (0.4 s) says 2.5.
    exact = sum(0.9**k for k in range(1, 11))
    count = service.renewals().count(1.0)
    assert 1.0 / service.mean_s < 2.6
    assert 4.5 <= count <= exact


@pytest.mark.parametrize("share", [0.25, 1.0, 4.0, 15.0])
def test_exponential_services_count_about_time_over_the_mean(share):
    service = exponential(0.05)
    within_s = share * service.mean_s
    count = service.renewals().count(within_s)
    # A Poisson stream counts t / mean; each service read up to a grid step longer loses a little
    # (20,000 draws are not quite exponential near 0: 3% above).
    assert 0.85 * within_s / service.mean_s <= count <= 1.03 * within_s / service.mean_s


def test_past_the_grid_the_count_holds_where_a_long_mode_lies_beyond_it():
    # 98% of 10 ms, 2% of 20 s (mean 0.46 s as learned): the grid ends at 16 means, 7.4 s, and m stays at
    # about 43 until a 20 s service can end. Adding time over the mean past the grid read 61 at 19 s.
    service = ServiceTimes(prior_mean_s=0.4, memory=200.0)
    for n in range(2000):
        service.record(20.0 if n % 50 == 49 else 0.01)
    renewals = service.renewals()
    assert renewals.count(19.0) == renewals.count(8.0) <= 43.4


def test_nothing_ends_within_no_time():
    assert short_or_long().renewals().count(0.0) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    samples=st.lists(st.floats(min_value=1e-4, max_value=5.0), min_size=1, max_size=60),
    times=st.lists(st.floats(min_value=0.0, max_value=200.0), min_size=2, max_size=12),
)
def test_the_count_never_falls_and_stays_within_lordens_bound(samples, times):
    service = ServiceTimes(prior_mean_s=0.3, memory=50.0)
    for sample in samples:
        service.record(sample)
    renewals = service.renewals()
    mean_s = max(service.mean_s, 1e-9)
    counts = [renewals.count(t) for t in sorted(times)]
    assert all(a <= b for a, b in pairwise(counts))
    for t, count in zip(sorted(times), counts, strict=True):
        # Lorden: m(t) <= t / mean + E[X^2] / mean^2 = t / mean + cv^2 + 1, beyond the grid too.
        assert 0.0 <= count <= t / mean_s + service.cv**2 + 1 + 1e-9


def test_the_table_is_solved_again_after_a_quarter_of_the_memory():
    service = ServiceTimes(prior_mean_s=0.4, memory=200.0)
    first = service.renewals()
    for _ in range(49):
        service.record(SHORT_S)
    assert service.renewals() is first
    service.record(SHORT_S)
    again = service.renewals()
    assert again is not first
    assert again.count(1.0) > first.count(1.0)


@pytest.mark.parametrize("age_s", [0.0, 0.05, 0.5])
@pytest.mark.parametrize("q", [0.1, 0.5, 0.85, 0.95])
def test_a_residual_quantile_inverts_its_cdf(age_s, q):
    residual = short_or_long().residual(age_s)
    remaining = residual.quantile(q)
    assert residual.cdf(remaining) == pytest.approx(q, abs=1e-9)


def test_a_residual_quantile_of_one_is_the_top_of_its_mass():
    service = ServiceTimes(prior_mean_s=1.0, memory=50.0)
    for sample in (0.5, 2.0, 0.1):
        service.record(sample)
    assert math.isfinite(service.residual(0.008).quantile(1.0))


def test_a_residual_beyond_every_sample_is_exponential_in_its_quantiles():
    service = short_or_long()
    residual = service.residual(1e6)
    assert residual.quantile(0.5) == pytest.approx(service.mean_s * math.log(2))


@pytest.mark.parametrize(
    ("ages_s", "within_s"), [((0.05,) * 4, 1.0), ((0.05,) * 4, 2.0), ((0.05, 0.05, 0.5, 1.0), 4.0)]
)
def test_a_short_or_long_pool_is_read_close_to_what_it_hands_over_and_never_above(ages_s, within_s):
    service = short_or_long()
    confidence = 0.9
    truth = true_count_quantile(ages_s, within_s, confidence)
    read = handovers_within(PoolState(ages_s, 0), service, within_s, confidence)
    # Time over the mean alone read 5 of 14, 9 of 15 and 15 of 25; the renewal function 9, 13, 21.
    assert 0.62 * truth <= read <= truth


@pytest.mark.parametrize("confidence", [0.5, 0.75, 0.9])
def test_a_large_count_of_rare_long_services_is_not_read_above_its_skewed_truth(confidence):
    # 37 in 38 requests take 100 ms, 1 in 38 takes 60 s. Past LARGE_COUNT the count is read as a
    # normal, whose median is its mean; this count's median lies well below its mean. With the
    # renewal function's mean the normal read 65 at 0.5 where 64 come.
    service = ServiceTimes(prior_mean_s=1.9, memory=2000.0)
    for n in range(20_000):
        service.record(60.0 if n % 38 == 37 else 0.1)
    ages_s, free, within_s = (0.19, 0.57, 2.85), 2, 15.2
    truth = true_count_quantile(ages_s, within_s, confidence, free=free, mix=(0.1, 60.0, 1 / 38))
    assert handovers_within(PoolState(ages_s, free), service, within_s, confidence) <= truth
