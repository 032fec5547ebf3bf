"""Capacity math against references computed here, independently, with exact rational arithmetic."""

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.capacity import Targets, erlang_b, erlang_c, mg1, mgc, mmc, replicas_for


def exact_erlang_c(servers: int, load: Fraction) -> Fraction:
    """The textbook series: C = (a^c/c! * c/(c-a)) / (sum_{k<c} a^k/k! + a^c/c! * c/(c-a))."""
    below = sum(load**k / math.factorial(k) for k in range(servers))
    top = load**servers / math.factorial(servers) * servers / (servers - load)
    return top / (below + top)


def exact_mmc_mean_wait(arrival: Fraction, service: Fraction, servers: int) -> Fraction:
    return exact_erlang_c(servers, arrival / service) / (servers * service - arrival)


@pytest.mark.parametrize(
    ("servers", "arrival", "service"),
    [
        (1, Fraction(1, 2), Fraction(1)),
        (2, Fraction(1), Fraction(1)),
        (2, Fraction(3), Fraction(2)),
        (3, Fraction(5, 2), Fraction(1)),
        (5, Fraction(4), Fraction(1)),
        (8, Fraction(190), Fraction(25)),  # 8 slots of 40 ms at 190 requests/s
        (10, Fraction(95, 10), Fraction(1)),
        (20, Fraction(15), Fraction(1)),
        (50, Fraction(45), Fraction(1)),
    ],
)
def test_mmc_matches_the_exact_erlang_c_series(servers, arrival, service):
    estimate = mmc(float(arrival), float(service), servers)
    assert estimate.p_wait == pytest.approx(float(exact_erlang_c(servers, arrival / service)), rel=1e-12)
    assert estimate.mean_wait == pytest.approx(
        float(exact_mmc_mean_wait(arrival, service, servers)), rel=1e-12
    )
    assert estimate.utilization == pytest.approx(float(arrival / (servers * service)))


def test_erlang_b_matches_its_exact_formula():
    load = Fraction(7, 2)
    exact = (load**6 / math.factorial(6)) / sum(load**k / math.factorial(k) for k in range(7))
    assert erlang_b(6, float(load)) == pytest.approx(float(exact), rel=1e-12)


def test_two_servers_at_unit_load_wait_with_probability_one_third():
    estimate = mmc(1.0, 1.0, 2)
    assert estimate.p_wait == pytest.approx(1 / 3)
    assert estimate.mean_wait == pytest.approx(1 / 3)


def test_mean_wait_is_erlang_c_over_spare_capacity_not_times_the_service_rate():
    # The seed multiplied C / (c*mu - lambda) by mu: 9/7 h here instead of 9/14 h.
    estimate = mmc(3.0, 2.0, 2)  # lambda 3/h, mu 2/h, 2 servers: C = 9/14, c*mu - lambda = 1/h
    assert estimate.p_wait == pytest.approx(9 / 14)
    assert estimate.mean_wait == pytest.approx(9 / 14)
    assert estimate.mean_wait != pytest.approx(9 / 14 * 2.0)


def test_erlang_c_stays_finite_and_exact_at_a_thousand_servers():
    # Exact reference in integers: multiply numerator and denominator of the series by c!.
    servers, load = 1000, 950
    below = sum(load**k * (math.factorial(servers) // math.factorial(k)) for k in range(servers))
    top = Fraction(load**servers * servers, servers - load)
    exact = top / (below + top)
    assert erlang_c(servers, float(load)) == pytest.approx(float(exact), rel=1e-9)
    estimate = mmc(950.0, 1.0, servers)
    assert 0.0 < estimate.p_wait < 1.0 and math.isfinite(estimate.mean_wait)


@pytest.mark.parametrize("servers", [1, 10, 1000, 5000])
def test_a_nearly_saturated_large_pool_still_gives_a_finite_wait(servers):
    estimate = mmc(servers * 0.9999, 1.0, servers)
    assert 0.0 < estimate.p_wait <= 1.0
    assert math.isfinite(estimate.mean_wait) and estimate.mean_wait > 0


@pytest.mark.parametrize(("arrival", "servers"), [(2.0, 2), (3.0, 2), (1000.0, 1000), (5.0, 1)])
def test_unstable_pools_report_an_infinite_wait_without_raising(arrival, servers):
    for estimate in (mmc(arrival, 1.0, servers), mgc(arrival, 1.0, servers, 0.5)):
        assert not estimate.stable
        assert estimate.p_wait == 1.0
        assert estimate.mean_wait == math.inf
        assert estimate.wait_percentile(0.95) == math.inf
        assert estimate.wait_exceeded(100.0) == 1.0
    assert mg1(arrival, 1.0, 0.5).mean_wait == math.inf


@pytest.mark.parametrize(
    ("variance_h2", "mean_wait_h"),
    [(0.25, 11.875), (0.01, 2.755)],  # the seed printed ~2.4 h and ~0.01 h
)
def test_pollaczek_khinchine_gives_the_seed_examples_right(variance_h2, mean_wait_h):
    # arrivals 3.8/h, service 4/h: rho = 0.95, E[S^2] = Var + 1/16 h^2
    estimate = mg1(3.8, 4.0, variance_h2)
    assert estimate.mean_wait == pytest.approx(mean_wait_h)
    assert estimate.p_wait == pytest.approx(0.95)


@pytest.mark.parametrize("variance_h2", [0.25, 0.01])
def test_allen_cunneen_on_one_server_is_pollaczek_khinchine(variance_h2):
    cv = math.sqrt(variance_h2) * 4.0  # sd / mean, the mean being 1/4 h
    assert mgc(3.8, 4.0, 1, cv).mean_wait == pytest.approx(mg1(3.8, 4.0, variance_h2).mean_wait)


@pytest.mark.parametrize(("servers", "cv"), [(2, 0.0), (4, 0.5), (8, 2.0), (16, 3.0)])
def test_allen_cunneen_scales_the_exact_mmc_wait_by_half_of_one_plus_cv_squared(servers, cv):
    arrival, service = Fraction(servers * 3, 4), Fraction(1)
    exact = float(exact_mmc_mean_wait(arrival, service, servers)) * (1 + cv**2) / 2
    assert mgc(float(arrival), 1.0, servers, cv).mean_wait == pytest.approx(exact, rel=1e-12)
    assert mgc(float(arrival), 1.0, servers, cv).p_wait == pytest.approx(
        mmc(float(arrival), 1.0, servers).p_wait
    )


def test_mmc_p95_follows_the_exponential_tail():
    # M/M/1, lambda 0.5, mu 1: P(W > t) = 0.5 exp(-0.5 t) = 0.05 at t = 2 ln 10.
    estimate = mmc(0.5, 1.0, 1)
    assert estimate.wait_percentile(0.95) == pytest.approx(2 * math.log(10))
    assert estimate.wait_exceeded(2 * math.log(10)) == pytest.approx(0.05)


def test_percentile_is_zero_when_that_share_never_waits():
    assert mmc(0.5, 1.0, 4).wait_percentile(0.95) == 0.0  # P(wait) ~ 0.0018 < 5%


def test_mgc_percentile_tail_is_stretched_to_the_allen_cunneen_mean():
    plain, variable = mmc(6.0, 1.0, 8), mgc(6.0, 1.0, 8, 2.0)
    stretch = (1 + 2.0**2) / 2
    assert variable.mean_wait == pytest.approx(plain.mean_wait * stretch)
    assert variable.wait_percentile(0.99) == pytest.approx(plain.wait_percentile(0.99) * stretch)


@pytest.mark.parametrize(
    ("arrival", "targets", "cv", "replicas", "bound_by"),
    [
        (100.0, Targets(mean_wait=0.01), 1.0, 125, "utilization"),  # 124 is 80.6% busy
        (3.8, Targets(mean_wait=1.0), 1.0, 5, "utilization"),  # 4 is 95% busy
        (3.8, Targets(mean_wait=0.1), 1.0, 7, "mean_wait"),  # 6 wait 0.108
        (0.0, Targets(mean_wait=0.1), 1.0, 1, "minimum"),
        (0.5, Targets(), 1.0, 1, "minimum"),
        (7.0, Targets(p_wait=0.05, max_utilization=1.0), 1.0, 13, "p_wait"),  # 12 waits 6.3%
        (7.0, Targets(mean_wait=0.01, max_utilization=1.0), 1.0, 13, "mean_wait"),  # 12 wait 0.0125
        (7.0, Targets(mean_wait=0.01, max_utilization=1.0), 3.0, 15, "mean_wait"),  # 14: 0.0101
    ],
)
def test_replicas_for_picks_the_smallest_count_meeting_every_target(arrival, targets, cv, replicas, bound_by):
    recommendation = replicas_for(arrival, 1.0, targets, service_cv=cv)
    assert (recommendation.replicas, recommendation.bound_by, recommendation.met) == (
        replicas,
        bound_by,
        True,
    )
    assert targets.met_by(mgc(arrival, 1.0, replicas, cv))
    if replicas > 1:
        assert not targets.met_by(mgc(arrival, 1.0, replicas - 1, cv))


def test_replicas_for_counts_every_slot_of_a_replica():
    # 190 requests/s of 40 ms on replicas of 8 slots: 7.6 slots busy, 80% needs 9.5 -> 10 slots, 2 replicas.
    recommendation = replicas_for(190.0, 25.0, Targets(mean_wait=0.005), servers_per_replica=8)
    assert recommendation.replicas == 2
    assert recommendation.estimate.servers == 16


@pytest.mark.parametrize(("arrival", "service"), [(1e7, 1.0), (1e300, 1e-300)])  # the second load is inf
def test_replicas_for_stops_at_its_limit_and_says_the_targets_are_unmet(arrival, service):
    recommendation = replicas_for(arrival, service, Targets(mean_wait=1.0), max_replicas=1000)
    assert recommendation.replicas == 1000
    assert not recommendation.met
    assert recommendation.estimate.mean_wait == math.inf


@pytest.mark.parametrize(
    "call",
    [
        lambda: mmc(-1.0, 1.0, 2),
        lambda: mmc(1.0, 0.0, 2),
        lambda: mmc(1.0, 1.0, 0),
        lambda: mgc(1.0, 1.0, 2, -0.5),
        lambda: mg1(1.0, 2.0, -0.1),
        lambda: replicas_for(1.0, 1.0, Targets(max_utilization=0.0)),
        lambda: replicas_for(1.0, 1.0, Targets(mean_wait=0.0)),
        lambda: replicas_for(1.0, 1.0, Targets(p_wait=1.5)),
        lambda: mmc(1.0, 2.0, 1).wait_percentile(1.0),
    ],
)
def test_invalid_arguments_are_refused_with_value_error(call):
    with pytest.raises(ValueError):
        call()


loads = st.floats(0.0, 200.0, allow_nan=False)
servers = st.integers(1, 300)
cvs = st.floats(0.0, 4.0, allow_nan=False)


@given(loads, servers, cvs)
def test_more_replicas_never_increase_the_wait(load, count, cv):
    fewer, more = mgc(load, 1.0, count, cv), mgc(load, 1.0, count + 1, cv)
    assert more.p_wait <= fewer.p_wait
    assert more.mean_wait <= fewer.mean_wait
    assert more.wait_percentile(0.95) <= fewer.wait_percentile(0.95)


@given(loads, servers, cvs)
def test_probability_of_waiting_is_a_probability(load, count, cv):
    estimate = mgc(load, 1.0, count, cv)
    assert 0.0 <= estimate.p_wait <= 1.0
    assert estimate.mean_wait >= 0.0
    assert 0.0 <= estimate.wait_exceeded(1.0) <= estimate.p_wait


@given(st.floats(0.01, 5.0), st.floats(0.0, 0.999), st.floats(0.0, 2.0))
def test_allen_cunneen_on_one_server_equals_pollaczek_khinchine(service_rate, rho, cv):
    arrival = rho * service_rate
    variance = (cv / service_rate) ** 2
    assert mgc(arrival, service_rate, 1, cv).mean_wait == pytest.approx(
        mg1(arrival, service_rate, variance).mean_wait, rel=1e-9, abs=1e-12
    )


@given(
    st.floats(0.0, 500.0),
    st.one_of(st.none(), st.floats(0.001, 10.0)),
    st.one_of(st.none(), st.floats(0.001, 1.0)),
    st.floats(0.3, 1.0),
    cvs,
    st.integers(1, 8),
)
def test_recommended_count_meets_its_targets_and_one_fewer_does_not(
    arrival, mean_wait, p_wait, ceiling, cv, slots
):
    targets = Targets(mean_wait=mean_wait, p_wait=p_wait, max_utilization=ceiling)
    recommendation = replicas_for(arrival, 1.0, targets, service_cv=cv, servers_per_replica=slots)
    assert recommendation.met
    assert targets.met_by(recommendation.estimate)
    count = recommendation.replicas
    direct = mgc(arrival, 1.0, count * slots, cv)  # not carried along the search's Erlang B walk
    assert direct.p_wait == pytest.approx(recommendation.estimate.p_wait, rel=1e-9)
    if count > 1:
        assert not targets.met_by(mgc(arrival, 1.0, (count - 1) * slots, cv))
    else:
        assert recommendation.bound_by == "minimum"
