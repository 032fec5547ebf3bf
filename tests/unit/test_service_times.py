"""The service-time histogram: its prior, what it learns, what it forgets, and the residuals it gives."""

import math
import random
from bisect import bisect_right

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.handovers import PoolState, handovers_within
from policies.service_times import BINS_PER_OCTAVE, EDGES, LONGEST_S, ServiceTimes

BIN_RATIO = 2 ** (1 / BINS_PER_OCTAVE)


def exponential_cdf(t: float, mean: float) -> float:
    return -math.expm1(-t / mean)


def learned(value_s: float, samples: int = 2000, memory: float = 200.0) -> ServiceTimes:
    service = ServiceTimes(prior_mean_s=1.0, memory=memory)
    for _ in range(samples):
        service.record(value_s)
    return service


@pytest.mark.parametrize("mean", [0.001, 0.04, 0.8, 30.0])
@pytest.mark.parametrize("share", [0.01, 0.3, 1.0, 2.0, 6.0])
def test_service_times_without_samples_follow_the_exponential_prior_within_a_bin(mean, share):
    service = ServiceTimes(prior_mean_s=mean)
    t = share * mean
    # Mass is spread evenly within a bin: the cdf meets the exponential's at the bin's edges, between them
    # it lies between its values there.
    j = bisect_right(EDGES, t) - 1
    low, high = EDGES[j], EDGES[j + 1]
    assert service.cdf(low) == pytest.approx(exponential_cdf(low, mean), abs=1e-12)
    assert exponential_cdf(low, mean) - 1e-12 <= service.cdf(t) <= exponential_cdf(high, mean) + 1e-12
    assert service.samples == 0
    assert service.mean_s == pytest.approx(mean)
    assert service.cv == pytest.approx(1.0)


@pytest.mark.parametrize("value", [0.0005, 0.15, 0.8, 12.0])
@pytest.mark.parametrize("q", [0.001, 0.05, 0.5, 0.95, 0.999])
def test_quantiles_of_a_fixed_service_time_fall_within_one_bin_of_it(value, q):
    service = learned(value)
    assert value / BIN_RATIO <= service.quantile(q) <= value * BIN_RATIO


def test_a_fixed_service_time_is_learned_with_its_mean_and_no_spread():
    service = learned(0.8)
    assert service.samples == 2000
    assert service.mean_s == pytest.approx(0.8, rel=1e-4)
    assert service.cv < 0.01


def test_exponential_service_times_are_learned_with_a_cv_near_one():
    rng = random.Random(7)
    service = ServiceTimes(prior_mean_s=5.0, memory=5000)
    for _ in range(20000):
        service.record(rng.expovariate(1 / 0.2))
    assert service.mean_s == pytest.approx(0.2, rel=0.05)
    assert service.cv == pytest.approx(1.0, abs=0.05)
    assert service.cdf(0.2) == pytest.approx(exponential_cdf(0.2, 0.2), abs=0.02)


@pytest.mark.parametrize("age_share", [0.0, 0.2, 0.5, 0.9])
def test_the_residual_of_a_fixed_service_time_is_what_is_left_of_it(age_share):
    value = 0.8
    service = learned(value)
    age = age_share * value
    left = value - age
    assert service.residual_cdf(age, left + value * (BIN_RATIO - 1)) > 0.999
    assert service.residual_cdf(age, left / 2) < 0.001


def test_an_old_regime_is_forgotten_at_the_stated_rate():
    memory = 200.0
    service = learned(0.1, samples=5000, memory=memory)
    recorded = 0
    for new_regime in (0, 50, 200, 600):
        for _ in range(new_regime - recorded):
            service.record(2.0)
        recorded = new_regime
        assert service.cdf(0.5) == pytest.approx((1 - 1 / memory) ** recorded, rel=1e-3)


def test_the_prior_fades_like_one_sample():
    service = ServiceTimes(prior_mean_s=1.0, memory=100.0, prior_weight=10.0)
    for _ in range(100):
        service.record(0.01)
    prior_left = 10.0 * (1 - 1 / 100) ** 100
    recorded = sum((1 - 1 / 100) ** k for k in range(100))
    assert service.survival(0.1) == pytest.approx(
        prior_left * math.exp(-0.1) / (prior_left + recorded), rel=1e-3
    )


def test_a_request_older_than_any_mass_has_an_exponential_residual_of_the_mean():
    service = learned(0.15)
    age = 100.0  # no recorded request has run this long: nothing is known about this one
    assert service.survival(age) == 0.0
    assert service.residual_cdf(age, 0.0) == 0.0
    assert service.residual_cdf(age, 0.15) == pytest.approx(exponential_cdf(0.15, service.mean_s))


def test_service_times_of_zero_never_divide_by_zero():
    service = ServiceTimes(prior_mean_s=1e-6, memory=2.0)
    for _ in range(2000):
        service.record(0.0)
    assert service.cv == 0.0
    assert 0.0 < service.residual_cdf(1.0, 1.0) <= 1.0


def test_times_beyond_the_last_bin_count_as_the_longest():
    service = learned(1e12)
    assert service.mean_s == pytest.approx(LONGEST_S, rel=1e-3)
    assert service.cdf(LONGEST_S) == 1.0


def test_recording_nan_is_refused():
    with pytest.raises(ValueError):
        ServiceTimes(prior_mean_s=1.0).record(math.nan)


samples = st.lists(st.one_of(st.floats(0.0, 10.0), st.sampled_from([0.0, 1e-9, 0.05, 3e3, 1e9])), max_size=60)


def service_from(prior_mean: float, memory: float, recorded: list[float]) -> ServiceTimes:
    service = ServiceTimes(prior_mean_s=prior_mean, memory=memory)
    for value in recorded:
        service.record(value)
    return service


@settings(max_examples=200, deadline=None)
@given(
    st.floats(1e-4, 100.0),
    st.floats(1.5, 1e4),
    samples,
    st.lists(st.floats(0.0, 5e3), min_size=2, max_size=8),
)
def test_the_cdf_never_falls_and_quantiles_invert_it(prior_mean, memory, recorded, times):
    service = service_from(prior_mean, memory, recorded)
    values = [service.cdf(t) for t in sorted(times)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values)
    for q in (0.01, 0.5, 0.99):
        assert service.cdf(service.quantile(q)) == pytest.approx(q, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(1e-4, 100.0),
    st.floats(1.5, 1e4),
    samples,
    st.floats(0.0, 5e3),
    st.lists(st.floats(0.0, 5e3), min_size=2, max_size=8),
)
def test_a_residual_cdf_never_falls_and_stays_a_probability(prior_mean, memory, recorded, age, withins):
    service = service_from(prior_mean, memory, recorded)
    values = [service.residual_cdf(age, within) for within in sorted(withins)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values)


def test_service_times_of_about_zero_do_not_read_as_rare_clumps_of_hand_overs():
    times = ServiceTimes(prior_mean_s=0.05)
    for _ in range(3000):
        times.record(0.0)  # a backend that answers at once (from a cache, or with an error)
    assert times.cv < 1.0  # not thousands: the pool readings would expect one hand-over in ages
    pool = PoolState(ages_s=(0.0, 0.0), free_slots=0)
    assert handovers_within(pool, times, 0.01, 0.977) > 50  # thousands a second, two slots
