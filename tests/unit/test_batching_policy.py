"""When a forming batch leaves (policies.batching)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.batching import BatchLimits, FormingBatch, hold_s

LIMITS = BatchLimits(max_batch_size=16, max_delay_s=0.005, preferred_sizes=(8,))


def test_on_the_last_free_slot_a_batch_waits_out_the_delay_from_its_oldest_member():
    assert hold_s(LIMITS, FormingBatch(items=1, head_age_s=0.0, free_slots=1)) == pytest.approx(0.005)
    assert hold_s(LIMITS, FormingBatch(items=3, head_age_s=0.002, free_slots=1)) == pytest.approx(0.003)
    assert hold_s(LIMITS, FormingBatch(items=3, head_age_s=0.009, free_slots=1)) == 0.0


def test_a_spare_slot_or_none_free_means_no_wait():
    assert hold_s(LIMITS, FormingBatch(items=1, head_age_s=0.0, free_slots=2)) == 0.0
    assert hold_s(LIMITS, FormingBatch(items=1, head_age_s=0.0, free_slots=0)) == 0.0


def test_a_full_or_preferred_batch_leaves_at_once():
    assert hold_s(LIMITS, FormingBatch(items=16, head_age_s=0.0, free_slots=1)) == 0.0
    assert hold_s(LIMITS, FormingBatch(items=20, head_age_s=0.0, free_slots=1)) == 0.0
    assert hold_s(LIMITS, FormingBatch(items=8, head_age_s=0.0, free_slots=1)) == 0.0
    assert hold_s(LIMITS, FormingBatch(items=9, head_age_s=0.0, free_slots=1)) > 0.0


def test_the_most_urgent_members_budget_cuts_the_wait():
    urgent = FormingBatch(items=1, head_age_s=0.0, free_slots=1, slack_s=0.001)
    assert hold_s(LIMITS, urgent) == pytest.approx(0.001)
    late = FormingBatch(items=1, head_age_s=0.0, free_slots=1, slack_s=-0.5)
    assert hold_s(LIMITS, late) == 0.0


def test_limits_are_checked():
    with pytest.raises(ValueError):
        BatchLimits(max_batch_size=0, max_delay_s=0.001)
    with pytest.raises(ValueError):
        BatchLimits(max_batch_size=4, max_delay_s=-1)


@given(
    items=st.integers(1, 40),
    age=st.floats(0, 1),
    free=st.integers(0, 8),
    slack=st.none() | st.floats(-1, 1),
    delay=st.floats(0, 0.1),
)
def test_no_member_is_held_past_the_delay_or_its_budget(items, age, free, slack, delay):
    limits = BatchLimits(max_batch_size=16, max_delay_s=delay)
    wait = hold_s(limits, FormingBatch(items=items, head_age_s=age, free_slots=free, slack_s=slack))
    assert 0.0 <= wait <= max(0.0, delay - age)
    if slack is not None:
        assert wait <= max(0.0, slack)
    if free != 1 or items >= 16:
        assert wait == 0.0
