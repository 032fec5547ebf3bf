"""Weekly windows of local time (policies.windows)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.windows import MINUTES_PER_DAY, Window, is_open, minutes_until_open

NIGHTLY = Window(frozenset(range(7)), 2 * 60, 4 * 60)  # 02:00-04:00 every day
LATE_WEEKDAYS = Window(frozenset(range(5)), 22 * 60, 2 * 60)  # 22:00-02:00, opening Mon-Fri


def test_a_window_holds_its_from_and_not_its_to():
    assert not is_open(NIGHTLY, 0, 2 * 60 - 1)
    assert is_open(NIGHTLY, 0, 2 * 60)
    assert is_open(NIGHTLY, 0, 4 * 60 - 1)
    assert not is_open(NIGHTLY, 0, 4 * 60)


def test_a_span_that_crosses_midnight_closes_the_next_day_even_if_that_day_is_not_listed():
    assert is_open(LATE_WEEKDAYS, 4, 23 * 60)  # Friday 23:00
    assert is_open(LATE_WEEKDAYS, 5, 60)  # Saturday 01:00: Friday's span
    assert not is_open(LATE_WEEKDAYS, 5, 23 * 60)  # Saturday 23:00: no span opens on Saturday
    assert not is_open(LATE_WEEKDAYS, 0, 30)  # Monday 00:30: no span opened on Sunday


def test_minutes_until_open_counts_to_the_next_opening_across_the_week():
    assert minutes_until_open(NIGHTLY, 0, 4 * 60) == 22 * 60
    assert (
        minutes_until_open(LATE_WEEKDAYS, 5, 3 * 60) == 2 * MINUTES_PER_DAY + 19 * 60
    )  # Sat 03:00 -> Mon 22:00


def test_equal_from_and_to_is_the_whole_day():
    whole = Window(frozenset({2}), 9 * 60, 9 * 60)
    assert is_open(whole, 2, 0) is False  # Wednesday's day starts at 09:00
    assert is_open(whole, 2, 9 * 60) and is_open(whole, 3, 8 * 60 + 59)
    assert not is_open(whole, 3, 9 * 60)


def test_a_window_needs_days_and_times_of_a_day():
    with pytest.raises(ValueError, match="days"):
        Window(frozenset(), 0, 60)
    with pytest.raises(ValueError, match="minutes"):
        Window(frozenset({0}), 0, MINUTES_PER_DAY)


@given(
    st.frozensets(st.integers(0, 6), min_size=1),
    st.integers(0, MINUTES_PER_DAY - 1),
    st.integers(0, MINUTES_PER_DAY - 1),
    st.integers(0, 6),
    st.integers(0, MINUTES_PER_DAY - 1),
)
def test_waiting_the_minutes_until_open_lands_in_the_window(days, start, end, weekday, minute):
    window = Window(days, start, end)
    wait = minutes_until_open(window, weekday, minute)
    assert 0 <= wait < 7 * MINUTES_PER_DAY
    later = weekday * MINUTES_PER_DAY + minute + wait
    assert is_open(window, (later // MINUTES_PER_DAY) % 7, later % MINUTES_PER_DAY)
    if wait > 0:
        before = later - 1
        assert not is_open(window, (before // MINUTES_PER_DAY) % 7, before % MINUTES_PER_DAY)
