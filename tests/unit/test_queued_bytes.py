"""The queued-bytes bound: which bodies fit, and how long the queue needs to make room."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.flow.queued_bytes import QueuedBytes
from policies.queued_bytes import ByteLimits, bytes_excess_wait_s, excess_bytes, model_bound_binds


def test_a_body_fits_up_to_the_total_bound_exactly():
    limits = ByteLimits(total=100)
    assert excess_bytes(limits, {"a": 60}, "b", 40) == 0
    assert excess_bytes(limits, {"a": 60}, "b", 41) == 1


def test_a_model_bound_binds_before_the_total():
    limits = ByteLimits(total=1000, per_model={"a": 50})
    assert excess_bytes(limits, {"a": 40, "b": 500}, "a", 20) == 10
    assert excess_bytes(limits, {"a": 40, "b": 500}, "b", 20) <= 0  # b has no bound of its own


def test_the_wait_is_the_excess_over_the_rate_bodies_leave_at():
    # 10 units of work queued holding 1000 bytes, drained at 5 units/s: 500 bytes/s leave.
    assert bytes_excess_wait_s(250, held_bytes=1000, queued_work=10, drain_rate_per_s=5) == pytest.approx(0.5)
    assert bytes_excess_wait_s(250, held_bytes=0, queued_work=0, drain_rate_per_s=5) == 0.0


@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 400), st.booleans()), max_size=60))
def test_holds_never_pass_the_bounds_and_give_backs_restore_them(steps):
    queued = QueuedBytes(ByteLimits(total=1000, per_model={"a": 300}))
    held: list[tuple[str, int]] = []
    for model, size, leave in steps:
        if leave and held:
            queued.give_back(*held.pop(0))
        elif queued.hold(model, size) == 0:
            held.append((model, size))
        assert sum(queued.held.values()) <= 1000
        assert queued.held.get("a", 0) <= 300
    for model, size in held:
        queued.give_back(model, size)
    assert all(v == 0 for v in queued.held.values())


def test_the_refusal_names_the_bound_the_body_exceeds_most():
    limits = ByteLimits(total=100, per_model={"a": 50})
    assert model_bound_binds(limits, {"a": 40}, "a", 20)  # 10 over its own, 0 over the total
    assert not model_bound_binds(limits, {"a": 10, "b": 80}, "a", 20)  # 10 over the total, not its own
    assert not model_bound_binds(limits, {"b": 90}, "b", 20)  # b has no bound of its own
