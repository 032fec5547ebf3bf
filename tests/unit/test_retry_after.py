import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.retry_after import RetryAfterConfig, header_values, retry_after_s, upstream_advice_s

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


NOW = 1_796_600_000.0  # 2026-12-06
A_MINUTE = 60.0


@pytest.mark.parametrize(
    ("headers", "advice"),
    [
        ([(b"retry-after", b"5")], 5.0),
        ([(b"retry-after", b"0")], 0.0),
        ([(b"retry-after-ms", b"1500"), (b"retry-after", b"2")], 1.5),  # the finer one first
        ([(b"retry-after-ms", b"nonsense"), (b"retry-after", b"2")], 2.0),
        ([(b"retry-after", b"Sun, 06 Dec 2026 23:33:50 GMT")], 30.0),  # an HTTP-date, 30 s ahead
        ([(b"retry-after", b"-5")], None),
        ([(b"retry-after", b"5.5")], None),  # delta-seconds are whole
        ([(b"retry-after-ms", b"-1")], None),
        ([(b"retry-after-ms", b"nan")], None),
        ([(b"retry-after", b"Tue, 01 Dec 2099 00:00:00 GMT")], None),  # far past the ceiling
        ([(b"retry-after", b"Sun, 06 Dec 2026 23:32:00 GMT")], None),  # a date past
        ([(b"retry-after", b"3601")], None),
        ([(b"retry-after", b"\xff")], None),
        ([(b"content-type", b"application/json")], None),
    ],
)
def test_a_backends_own_advice_passes_only_where_a_client_should_follow_it(headers, advice):
    found = upstream_advice_s(headers, NOW, A_MINUTE * 60)
    assert found == (None if advice is None else pytest.approx(advice))
