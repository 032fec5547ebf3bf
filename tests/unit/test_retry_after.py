import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.flow.retry_spreads import RetrySpreads
from policies.retry_after import (
    RetryAfterConfig,
    band_retry_load,
    header_values,
    next_spread,
    retry_after_s,
    spread_after,
)
from policies.wait import Throughput

NO_JITTER = RetryAfterConfig(min_s=0.01, max_s=60.0, jitter=0.0)


@pytest.mark.parametrize(
    ("excess", "drain", "load", "expected"),
    [
        (2.0, 100.0, 1.0, 2.0),  # the queue needs 2 s to drain enough
        (0.0, 100.0, 1.0, 0.01),  # fits already: one slot turnover
        (-1.0, 10.0, 1.0, 0.1),  # never below one turnover of the band
        (1.0, 100.0, 3.0, 3.0),  # a spread of 3 stretches the advice 3x
        (100.0, 100.0, 1.0, 60.0),  # clamped to max
    ],
)
def test_retry_after_from_drain_rate(excess, drain, load, expected):
    assert retry_after_s(excess, drain, load, 0.5, NO_JITTER) == pytest.approx(expected)


def test_jitter_spreads_symmetrically():
    config = RetryAfterConfig(jitter=0.2)
    assert retry_after_s(1.0, 100.0, 0.0, 0.0, config) == pytest.approx(0.8)
    assert retry_after_s(1.0, 100.0, 0.0, 0.5, config) == pytest.approx(1.0)
    assert retry_after_s(1.0, 100.0, 0.0, 0.999999, config) == pytest.approx(1.2, rel=1e-5)


@pytest.mark.parametrize(
    ("advice", "seconds", "millis"),
    [
        (0.0123, "1", "12"),
        (1.0, "1", "1000"),
        (1.2, "2", "1200"),
        (0.0001, "1", "1"),
        (59.9996, "60", "60000"),
    ],
)
def test_header_values_round_seconds_up_and_keep_millis_precise(advice, seconds, millis):
    assert header_values(advice) == (seconds, millis)


@given(
    st.floats(-100, 1000),
    st.floats(0.001, 1e5),
    st.floats(0, 1000),
    st.floats(0, 1, exclude_max=True),
)
def test_advice_stays_within_bounds(excess, drain, load, u):
    config = RetryAfterConfig(min_s=0.05, max_s=30.0, jitter=0.1)
    advice = retry_after_s(excess, drain, load, u, config)
    assert 0.05 <= advice <= 30.0
    seconds, millis = header_values(advice)
    assert int(seconds) >= 1
    assert int(seconds) * 1000 >= int(millis)


SPREAD = RetryAfterConfig(max_s=60.0, adapt_tau_s=5.0)


def test_spread_grows_by_the_overload_over_one_time_constant():
    assert next_spread(1.0, 2.0, 40.0, 5.0, SPREAD) == pytest.approx(2.0)
    assert next_spread(2.0, 2.0, 40.0, 2.5, SPREAD) == pytest.approx(2 * 2**0.5)


def test_spread_shrinks_when_returns_thin_out_and_never_below_one():
    assert next_spread(8.0, 0.5, 40.0, 5.0, SPREAD) == pytest.approx(4.0)
    assert next_spread(1.5, 0.1, 40.0, 5.0, SPREAD) == 1.0
    assert next_spread(50.0, 0.0, 40.0, 60.0, SPREAD) == 1.0  # an idle band forgets quickly


def test_spread_cannot_wind_up_past_useful_advice():
    # One turnover at 40/s is 25 ms; past 60 s of advice the factor stops growing.
    assert next_spread(1e9, 3.0, 40.0, 100.0, SPREAD) == pytest.approx(60.0 * 40.0)


@pytest.mark.parametrize(
    ("offered", "admitted", "drain", "load"),
    [
        (24.0, 6.0, 29.0, 4.0),  # refusing three in four: grow by arrivals per admission
        (10.0, 10.0, 40.0, 0.25),  # refusing none: shrink by arrivals per hand-over
        (20.0, 0.0, 40.0, 1000.0),  # refusing all: grow fast, but finitely
    ],
)
def test_the_load_the_spread_follows(offered, admitted, drain, load):
    assert band_retry_load(offered, admitted, drain) == pytest.approx(load)


def test_spread_settles_where_returning_clients_find_room():
    """N clients that each return after the advice offer N / advice; the band admits up to its
    drain: the spread settles where returns match what the band admits."""
    clients, drain, turnover = 200, 40.0, 1 / 40.0
    spread = 1.0
    for _ in range(3000):  # 300 s in 0.1 s steps
        offered = clients / (turnover * spread)
        load = band_retry_load(offered, min(offered, drain), drain)
        spread = next_spread(spread, load, drain, 0.1, SPREAD)
    assert turnover * spread == pytest.approx(clients / drain, rel=0.1)  # about 5 s


def test_a_lull_between_bursts_relaxes_the_spread_instead_of_compounding_it():
    """Bursts at twice the band's drain, 2 s each, 15 s apart, with advice every 10 ms while they
    refuse: the first advice of each burst comes after 15 s in which nobody was refused. Taking the
    burst's load to have held over that whole gap climbed the spread to its ceiling (Retry-After
    60 s with an idle backend); as a lull, every burst starts where the first did."""
    drain = 200.0
    bursting = Throughput(
        service_time_s=0.04,
        drain_rate_per_s=drain,
        admitted_rate_by_band=(drain,),
        offered_rate_by_band=(2 * drain,),
    )
    spreads = RetrySpreads(1, SPREAD, seen_s=2.0)
    first_of_burst: list[float] = []
    now = 0.0
    for burst in range(4):
        start = burst * 17.0
        for step in range(200):
            now = start + step * 0.01
            factor = spreads.follow(bursting, now).retry_spread(0)
            if step == 0:
                first_of_burst.append(factor)
    assert max(first_of_burst) < 1.5, first_of_burst
    assert spreads.follow(bursting, now).retry_spread(0) < 2 ** (4 / SPREAD.adapt_tau_s) * 1.01


@given(
    st.floats(1.0, 1e4),
    st.floats(0.0, 10.0),
    st.floats(1.0, 1e3),
    st.floats(0.0, 100.0),
    st.floats(0.01, 10.0),
)
def test_a_gap_longer_than_the_estimates_remember_only_relaxes_the_spread(
    previous, load, drain, elapsed, seen
):
    after = spread_after(previous, load, drain, elapsed, seen, SPREAD)
    if elapsed > seen:
        assert after <= max(1.0, previous)
    else:  # refusing all along: the plain integral step
        assert after == pytest.approx(next_spread(previous, load, drain, elapsed, SPREAD))
