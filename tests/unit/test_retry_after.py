import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.retry_after import RetryAfterConfig, header_values, retry_after_s

NO_JITTER = RetryAfterConfig(min_s=0.01, max_s=60.0, jitter=0.0)


@pytest.mark.parametrize(
    ("excess", "drain", "expected"),
    [
        (2.0, 100.0, 2.0),  # the queue needs 2 s to drain enough
        (0.0, 100.0, 0.01),  # fits already: one slot turnover
        (-1.0, 10.0, 0.1),  # never below one turnover of the band
        (100.0, 100.0, 60.0),  # clamped to max
    ],
)
def test_retry_after_from_drain_rate(excess, drain, expected):
    assert retry_after_s(excess, drain, 0.5, NO_JITTER) == pytest.approx(expected)


def test_jitter_spreads_symmetrically():
    config = RetryAfterConfig(jitter=0.2)
    assert retry_after_s(1.0, 100.0, 0.0, config) == pytest.approx(0.8)
    assert retry_after_s(1.0, 100.0, 0.5, config) == pytest.approx(1.0)
    assert retry_after_s(1.0, 100.0, 0.999999, config) == pytest.approx(1.2, rel=1e-5)


@pytest.mark.parametrize(
    ("advice", "seconds", "millis"),
    [
        (0.0123, "1", "12"),
        (1.0, "1", "1000"),
        (1.2, "2", "1200"),
        (0.0001, "1", "1"),
        (59.9996, "60", "60000"),
        (2.0004, "2", "2000"),  # the seconds come from the millis: not "3" for 0.4 ms
        (2.0006, "3", "2001"),
    ],
)
def test_header_values_round_seconds_up_and_keep_millis_precise(advice, seconds, millis):
    assert header_values(advice) == (seconds, millis)


@given(st.floats(-100, 1000), st.floats(0.001, 1e5), st.floats(0, 1, exclude_max=True))
def test_advice_stays_within_bounds(excess, drain, u):
    config = RetryAfterConfig(min_s=0.05, max_s=30.0, jitter=0.1)
    advice = retry_after_s(excess, drain, u, config)
    assert 0.05 <= advice <= 30.0
    seconds, millis = header_values(advice)
    assert int(seconds) >= 1
    assert int(seconds) == -(-int(millis) // 1000)
