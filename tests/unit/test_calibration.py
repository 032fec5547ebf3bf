"""The admission confidence follows outcomes until admitted work expires at the target rate."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.calibration import CalibrationConfig, confidence_after, starting_confidence

CONFIG = CalibrationConfig(target_expiry=0.01)


def test_it_starts_where_two_standard_deviations_put_it():
    assert starting_confidence(2.0, CONFIG) == pytest.approx(0.97725, abs=1e-4)
    assert starting_confidence(0.0, CONFIG) == pytest.approx(0.5)


@given(st.floats(0.0, 10.0))
def test_any_margin_the_settings_allow_starts_within_the_clamp(sigmas):
    # Past about 8.3 sigmas the normal's cdf is 1.0: a certainty every prediction refuses to take.
    assert CONFIG.min_confidence <= starting_confidence(sigmas, CONFIG) <= CONFIG.max_confidence


@given(st.floats(0.5, 0.9999), st.booleans())
def test_an_expiry_tightens_a_request_served_in_time_loosens_within_bounds(confidence, expired):
    after = confidence_after(confidence, expired, CONFIG)
    assert CONFIG.min_confidence <= after <= CONFIG.max_confidence
    if expired:
        assert after >= confidence or after == CONFIG.max_confidence
    else:
        assert after <= confidence or after == CONFIG.min_confidence


@pytest.mark.parametrize("pessimism", [0.1, 0.3, 1.0, 3.0])
def test_a_wrong_predictor_is_steered_to_the_target_share_of_expiries(pessimism):
    """A predictor whose miss probabilities are off by `pessimism` (below 1: it overstates the
    risk, and refuses work that fits): the realised share of expiries still settles at the target."""
    draw = random.Random(7).random
    confidence, expired, trials = starting_confidence(2.0, CONFIG), 0, 0
    for step in range(60_000):
        miss = min(1.0, pessimism * (1.0 - confidence))
        outcome = draw() < miss
        confidence = confidence_after(confidence, outcome, CONFIG)
        if step >= 20_000:  # after it settled
            expired, trials = expired + outcome, trials + 1
    assert expired / trials == pytest.approx(CONFIG.target_expiry, rel=0.25)


def test_a_pessimistic_predictor_loosens_within_a_few_thousand_requests():
    # Seconds under overload, where hundreds of requests a second queue and leave.
    confidence = starting_confidence(2.0, CONFIG)
    for _ in range(3000):
        confidence = confidence_after(confidence, False, CONFIG)
    assert confidence < 0.93
