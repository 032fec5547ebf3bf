"""gateway.http.pricing for OpenAI bodies: prompt characters, max_tokens, usage in answers and streams."""

from __future__ import annotations

import json

import pytest

from gateway.http.pricing import choices_of, max_tokens_of, prompt_chars, usage_in
from policies.token_costs import TokenCostModel


def test_prompt_characters_come_from_messages_parts_prompts_and_token_ids():
    chat = {"messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "hello"}]}
    assert prompt_chars(chat) == 8
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "four"}, {"type": "image"}]}]}
    assert prompt_chars(parts) == 4
    assert prompt_chars({"prompt": "twelve chars"}) == 12
    assert prompt_chars({"prompt": ["ab", "cd"]}) == 4
    assert prompt_chars({"prompt": [101, 102, 103]}) == 12
    assert prompt_chars({"messages": "not a list"}) == 0
    assert prompt_chars({}) == 0
    assert prompt_chars({"prompt": [[101, 102], [103]]}) == 12  # a batch of token-id prompts


def test_a_prompt_nested_deeper_than_content_parts_counts_nothing_and_never_exhausts_the_stack():
    content: object = "hi"
    for _ in range(5000):
        content = [content]
    assert prompt_chars({"messages": [{"role": "user", "content": content}]}) == 0
    assert prompt_chars({"prompt": content}) == 0


def test_max_tokens_is_the_newer_field_first_and_only_a_positive_integer():
    assert max_tokens_of({"max_completion_tokens": 7, "max_tokens": 9}) == 7
    assert max_tokens_of({"max_tokens": 9}) == 9
    assert max_tokens_of({"max_tokens": True}) is None
    assert max_tokens_of({"max_tokens": -1}) is None
    assert max_tokens_of({"max_tokens": "12"}) is None


def test_usage_is_read_from_a_whole_answer_and_from_the_last_event_of_a_stream():
    answer = {
        "choices": [{"message": {"content": 'a "usage" of words'}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    assert usage_in(json.dumps(answer).encode()) == (3, 4)
    stream = (
        b'data: {"choices": [{"delta": {"content": "x"}}], "usage": null}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert usage_in(stream) == (11, 2)
    assert usage_in(stream[-40:]) is None  # a tail that cut the usage event short
    assert usage_in(b'data: {"choices": []}\n\ndata: [DONE]\n\n') is None
    assert usage_in(b'{"usage": null}') is None
    assert usage_in(b"not json") is None


@pytest.mark.parametrize("text", ["a data: URI", "data:image/png;base64,AAAA", "line one\ndata: two"])
def test_an_answer_whose_text_says_data_is_still_read_whole(text):
    answer = {
        "choices": [{"message": {"content": text}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 700},
    }
    assert usage_in(json.dumps(answer).encode()) == (12, 700)
    assert usage_in(json.dumps(answer, indent=2).encode()) == (12, 700)


def test_a_stream_with_carriage_returns_alone_is_read_to_the_end_of_its_line():
    stream = (
        b'data: {"choices": []}\r\r'
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}\r\r'
    )
    assert usage_in(stream + b"data: [DONE]\r\r") == (3, 5)


def test_several_completions_cost_as_many_and_are_learned_each():
    model = TokenCostModel()
    one = model.estimate(2, 100)
    sixteen = model.estimate(2, 100, choices=choices_of({"n": 16, "max_tokens": 100}))
    assert sixteen.output_tokens == 16 * one.output_tokens
    assert choices_of({"best_of": 4, "n": 2}) == 4
    assert choices_of({"prompt": ["a", "b", "c"], "n": 2}) == 6
    assert choices_of({"prompt": [1, 2, 3]}) == 1  # token ids: one prompt
    assert choices_of({"n": True}) == choices_of({"n": -3}) == 1
    for _ in range(10):
        model.learn(2, sixteen, 3.0, 16 * 40.0, choices=16)
    assert model.expected_output_tokens(None) == 40.0  # each completion's length


def test_the_tools_a_chat_offers_are_prompt():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"description": "x" * 10_000}}}]
    assert prompt_chars({**chat, "tools": tools}) > prompt_chars(chat) + 10_000
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert prompt_chars({**chat, "tools": deep}) == prompt_chars(chat)  # too deep to count, not an error
