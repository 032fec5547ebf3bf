"""Values read on a grid: rounding down only lowers a value, by at most its step."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.rounding import rounded_down


@given(st.floats(1e-6, 1e6), st.integers(2, 8))
def test_rounding_only_lowers_and_by_at_most_a_step_of_the_binary_order(value, step_bits):
    assert value * (1 - 2.0**-step_bits) <= rounded_down(value, step_bits) <= value


@given(st.floats(1e-6, 1e6), st.floats(1e-6, 1e6))
def test_rounding_keeps_the_order_of_values(a, b):
    low, high = sorted((a, b))
    assert rounded_down(low, 4) <= rounded_down(high, 4)


@given(st.floats(1e-6, 1e6))
def test_a_value_on_the_grid_stays_where_it_is(value):
    assert rounded_down(rounded_down(value, 4), 4) == rounded_down(value, 4)


def test_values_at_or_below_zero_are_kept():
    assert rounded_down(0.0) == 0.0
    assert rounded_down(-3.0) == -3.0
