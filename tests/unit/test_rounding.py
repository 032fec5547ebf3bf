"""Values read on a grid: rounding down only lowers a value, by at most its step."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.rounding import rounded_down


@given(st.floats(1e-6, 1e6), st.integers(2, 8))
def test_rounding_only_lowers_and_by_at_most_a_step_of_the_binary_order(value, step_bits):
    assert value * (1 - 2.0**-step_bits) <= rounded_down(value, step_bits) <= value


@given(st.floats(0, 1e300), st.floats(0, 1e300))
def test_rounding_keeps_the_order_of_values(a, b):
    low, high = sorted((a, b))
    assert rounded_down(low, 4) <= rounded_down(high, 4)


@given(st.floats(1e-6, 1e6))
def test_a_value_on_the_grid_stays_where_it_is(value):
    assert rounded_down(rounded_down(value, 4), 4) == rounded_down(value, 4)


def test_a_value_just_below_a_power_of_two_rounds_to_the_step_below_it_not_further():
    # log2 of 1024 less an ulp rounds to exactly 10: the order of 1024, a step too coarse.
    just_below = math.nextafter(1024.0, 0.0)
    assert rounded_down(just_below, 4) == 1024 - 32
    assert rounded_down(1023.99, 4) <= rounded_down(just_below, 4)


@pytest.mark.parametrize("value", [0.0, -3.0, math.inf, -math.inf])
def test_values_at_or_below_zero_and_infinities_are_kept(value):
    assert rounded_down(value) == value


def test_nan_and_the_smallest_values_do_not_raise():
    assert math.isnan(rounded_down(math.nan))
    assert 0.0 <= rounded_down(5e-324) <= 5e-324
