"""policies.token_costs: estimates in tokens, learned from usage alone."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.token_costs import PRIOR_CHARS_PER_TOKEN, TokenCostModel, TokenPricing


def test_before_any_answer_the_prompt_is_priced_at_the_prior_ratio_and_the_output_at_max_tokens():
    model = TokenCostModel(TokenPricing(prompt_weight=0.5, default_output_tokens=100))
    estimate = model.estimate(400, 50)
    assert estimate.prompt_tokens == 400 / PRIOR_CHARS_PER_TOKEN
    assert estimate.output_tokens == 50
    assert estimate.cost == 0.5 * 100 + 50
    assert model.estimate(400, None).output_tokens == 100
    assert model.error is None


def test_the_estimate_converges_on_true_counts_seen_only_through_usage():
    rng = random.Random(7)
    model = TokenCostModel(TokenPricing(prompt_weight=0.5, output_quantile=0.5))
    true_chars_per_token = 2.7  # a language or a tokenizer far from the prior of 4
    errors = []
    for _ in range(600):
        prompt_tokens = rng.randint(50, 2000)
        chars = round(prompt_tokens * true_chars_per_token * rng.uniform(0.9, 1.1))
        completion = rng.randint(180, 220)
        estimate = model.estimate(chars, 1000)
        actual = 0.5 * prompt_tokens + completion
        errors.append(abs(estimate.cost - actual) / actual)
        model.learn(chars, estimate, prompt_tokens, completion)
    assert model.chars_per_token == pytest.approx(true_chars_per_token, rel=0.05)
    assert model.expected_output_tokens(1000) == pytest.approx(200, rel=0.05)
    assert sum(errors[:10]) / 10 > 0.5  # the prior's output of max_tokens is far off at first
    assert sum(errors[-100:]) / 100 < 0.1
    assert model.error is not None and model.error < 0.1


def test_outliers_move_the_learned_values_by_a_rank_not_by_their_size():
    model = TokenCostModel(TokenPricing(output_quantile=0.5, window=64))
    for _ in range(60):
        model.learn(400, model.estimate(400, None), 100, 20)
    for _ in range(3):
        model.learn(400, model.estimate(400, None), 1, 100_000)  # a garbage usage, a runaway answer
    assert model.chars_per_token == 4.0
    assert model.expected_output_tokens(None) == 20


def test_output_lengths_are_learned_per_tenant_and_capped_by_max_tokens():
    pricing = TokenPricing(output_quantile=0.9, min_samples=4)
    model = TokenCostModel(pricing)
    for length in range(1, 11):
        model.learn(40, model.estimate(40, None, "chatty"), 10, length * 100, "chatty")
        model.learn(40, model.estimate(40, None, "terse"), 10, length, "terse")
    assert model.expected_output_tokens(None, "chatty") == 900
    assert model.expected_output_tokens(None, "terse") == 9
    assert model.expected_output_tokens(50, "chatty") == 50
    # A tenant with too few answers of its own gets the model's.
    model.learn(40, model.estimate(40, None, "new"), 10, 5, "new")
    assert model.expected_output_tokens(None, "new") == model.expected_output_tokens(None, "nobody")


def test_usage_that_is_not_a_positive_count_is_not_learned():
    model = TokenCostModel(TokenPricing(min_samples=1))
    model.learn(400, model.estimate(400, 10), 0, float("nan"))
    model.learn(400, model.estimate(400, 10), float("inf"), -3)
    assert model.chars_per_token == PRIOR_CHARS_PER_TOKEN
    assert model.expected_output_tokens(10) == 10
    assert model.error is None


@given(
    chars=st.integers(0, 10_000_000),
    max_tokens=st.one_of(st.none(), st.integers(1, 1_000_000)),
    answers=st.lists(
        st.tuples(st.integers(1, 10_000), st.floats(0.5, 50), st.integers(1, 5000)), max_size=30
    ),
)
def test_an_estimate_is_at_least_one_token_out_and_never_above_max_tokens(chars, max_tokens, answers):
    model = TokenCostModel(TokenPricing(min_samples=2))
    for prompt_tokens, ratio, completion in answers:
        model.learn(round(prompt_tokens * ratio), model.estimate(1, None), prompt_tokens, completion)
    estimate = model.estimate(chars, max_tokens)
    assert estimate.output_tokens >= 1 and estimate.prompt_tokens >= 1
    if max_tokens is not None:
        assert estimate.output_tokens <= max_tokens
    assert estimate.cost == pytest.approx(0.5 * estimate.prompt_tokens + estimate.output_tokens)


def test_a_chat_templates_tokens_are_an_overhead_not_a_ratio():
    rng = random.Random(3)
    model = TokenCostModel(TokenPricing(min_samples=8))
    for _ in range(10):  # short chats: the template's 12 tokens outnumber their text's
        chars = rng.randint(8, 60)
        model.learn(chars, model.estimate(chars, 10), 12 + chars / 4, 10)
    assert model.prompt_overhead == pytest.approx(12, abs=1)
    assert model.chars_per_token == pytest.approx(4, rel=0.1)
    long_prompt = model.estimate(3200, 10).prompt_tokens
    assert long_prompt == pytest.approx(12 + 3200 / 4, rel=0.1)  # a ratio alone said about 3x that
