from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.balancing import free_slots, pick_backend
from policies.estimators import (
    ObservedRate,
    blend_rate,
    coefficient_of_variation,
    ewma,
    rate_jump,
    unbiased_rate,
)
from policies.outcomes import Outcome, answered


@dataclass
class Slots:
    inflight: int
    max_concurrency: int
    ready: bool = True
    external_waiting: float = 0.0


@pytest.mark.parametrize(
    ("backends", "chosen"),
    [
        ([Slots(2, 4), Slots(1, 4)], 1),
        ([Slots(4, 4), Slots(3, 4)], 1),
        ([Slots(4, 4), Slots(8, 8)], None),
        ([Slots(0, 4, ready=False), Slots(3, 4)], 1),
        ([Slots(4, 8), Slots(1, 2)], 0),  # equal share: the first listed
        ([Slots(1, 8), Slots(0, 1)], 1),
        ([Slots(0, 4, external_waiting=3), Slots(2, 4)], 1),  # busy with others' work
        ([], None),
    ],
)
def test_pick_backend_takes_the_least_loaded_ready_one(backends, chosen):
    assert pick_backend(backends) == chosen


def test_free_slots_ignore_unready_backends():
    assert free_slots([Slots(1, 4), Slots(0, 8, ready=False), Slots(2, 2)]) == 3


def test_ewma_seeds_with_first_sample_then_moves_by_its_weight():
    assert ewma(None, 10.0, 0.1) == 10.0
    assert ewma(10.0, 20.0, 0.1) == pytest.approx(11.0)


def test_blended_rate_converges_to_a_steady_rate_and_decays_when_idle():
    rate = 0.0
    for _ in range(200):  # 5 events per 50 ms interval, for 10 s
        rate = blend_rate(rate, 5, 0.05, tau_s=1.0)
    assert rate == pytest.approx(100.0, rel=0.001)
    assert blend_rate(rate, 0, 5.0, tau_s=1.0) < 1.0


@given(
    st.floats(0.1, 1000.0),
    st.lists(st.floats(0.001, 0.5), min_size=1, max_size=40),
    st.sampled_from([0.5, 2.0, 30.0]),
)
def test_a_rate_estimate_corrected_for_its_start_reads_a_steady_rate_from_its_first_ticks(rate, ticks, tau_s):
    """blend_rate starts from 0, so a steady rate reads low until a few time constants have passed;
    divided by the share of its memory that saw events it reads the rate itself at once."""
    estimate, age_s = 0.0, 0.0
    for elapsed_s in ticks:
        estimate = blend_rate(estimate, rate * elapsed_s, elapsed_s, tau_s)
        age_s += elapsed_s
    assert unbiased_rate(estimate, age_s, tau_s) == pytest.approx(rate, rel=1e-6)
    assert estimate <= rate * (1 + 1e-9)  # what it corrects: the raw estimate reads low
    assert unbiased_rate(estimate, 0.0, tau_s) == 0.0


def test_blended_rate_weighs_intervals_by_their_length():
    # One 1 s interval or ten 0.1 s intervals at the same rate move the estimate alike.
    once = blend_rate(0.0, 100, 1.0, tau_s=2.0)
    tenfold = 0.0
    for _ in range(10):
        tenfold = blend_rate(tenfold, 10, 0.1, tau_s=2.0)
    assert once == pytest.approx(tenfold)


def test_observed_rate_is_events_over_observed_time():
    rate = ObservedRate(tau_s=2.0)
    assert rate.per_s is None
    for _ in range(2000):  # a hand-over every 5 ms
        rate = rate.observe(1.0, 0.005)
    assert rate.per_s == pytest.approx(200.0)


def test_observed_rate_forgets_over_observed_time_not_samples():
    rate = ObservedRate(tau_s=1.0)
    for _ in range(1000):
        rate = rate.observe(1.0, 0.01)  # 100/s for 10 s
    for _ in range(200):
        rate = rate.observe(1.0, 0.05)  # then 20/s for 10 s
    assert rate.per_s == pytest.approx(20.0, rel=0.01)


@pytest.mark.parametrize(
    ("rate_per_s", "events", "elapsed_s", "expected"),
    [
        (10.0, 6, 0.05, 120.0),  # 0.5 expected, 6 seen: the rate stepped up
        (120.0, 9, 0.05, None),  # 6 expected, 9 seen: noise
        (120.0, 20, 0.05, 400.0),  # 6 expected, 20 seen: beyond 4 deviations
        (0.0, 3, 0.05, None),  # too few events to say anything
        (10.0, 6, 0.0, None),  # no time has passed
    ],
)
def test_rate_jump_believes_only_counts_the_level_cannot_explain(rate_per_s, events, elapsed_s, expected):
    jump = rate_jump(rate_per_s, events, elapsed_s, z=4.0)
    assert jump == (None if expected is None else pytest.approx(expected))


@given(rate=st.floats(1, 1000), elapsed=st.floats(0.01, 1))
def test_rate_jump_is_rare_at_the_mean(rate, elapsed):
    assert rate_jump(rate, round(rate * elapsed), elapsed, z=4.0) is None


@pytest.mark.parametrize(
    ("mean", "spread", "samples", "cv"),
    [
        (0.04, 0.0, 0, 1.0),  # nothing measured: exponential
        (0.04, 0.0, 9, 1.0),  # 9 of the 10 samples a 0.1 average remembers
        (0.04, 0.0, 10, 0.0),
        (0.04, 0.02, 50, 0.5),
        (0.0, 0.02, 50, 1.0),  # no mean to divide by
    ],
)
def test_coefficient_of_variation_counts_as_exponential_until_measured(mean, spread, samples, cv):
    assert coefficient_of_variation(mean, spread, samples, weight=0.1) == pytest.approx(cv)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.OK),
        (204, Outcome.OK),
        (304, Outcome.OK),
        (400, Outcome.BACKEND_CLIENT_ERROR),
        (429, Outcome.BACKEND_CLIENT_ERROR),
        (500, Outcome.BACKEND_SERVER_ERROR),
        (503, Outcome.BACKEND_SERVER_ERROR),
    ],
)
def test_an_answered_request_is_counted_by_the_backends_status(status, outcome):
    assert answered(status) is outcome
