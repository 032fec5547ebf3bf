import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.http.usage_stream import UsageChunkDropper, asking_usage


def asked(payload: dict) -> dict | None:
    body = asking_usage(json.dumps(payload).encode(), payload)
    return None if body is None else json.loads(body)


def test_a_stream_that_does_not_ask_for_usage_is_made_to():
    payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "{hi}"}]}
    assert asked(payload) == {**payload, "stream_options": {"include_usage": True}}
    with_options = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": False}}
    assert asked(with_options)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    declined = {"model": "m", "stream": True, "stream_options": {"include_usage": False}}
    assert asked(declined)["stream_options"] == {"include_usage": True}


def test_requests_that_ask_already_or_do_not_stream_are_left_alone():
    assert asked({"model": "m", "stream": True, "stream_options": {"include_usage": True}}) is None
    assert asked({"model": "m"}) is None
    assert asked({"model": "m", "stream": False}) is None
    assert asked({"model": "m", "stream": True, "stream_options": "odd"}) is None  # the engine says what


def chunk(content: str) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": None}
    return b"data: " + json.dumps({"id": "c", "choices": [choice], "usage": None}).encode() + b"\n\n"


USAGE = b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = chunk("a") + chunk("b") + chunk("usage") + USAGE + DONE


@given(st.lists(st.integers(0, len(STREAM)), max_size=8))
def test_the_usage_chunk_leaves_the_stream_wherever_its_reads_split_it(cuts):
    dropper = UsageChunkDropper()
    bounds = [0, *sorted(cuts), len(STREAM)]
    out = b"".join(dropper.feed(STREAM[a:b]) for a, b in itertools.pairwise(bounds))
    assert out + dropper.close() == chunk("a") + chunk("b") + chunk("usage") + DONE


def test_other_events_pass_as_they_are():
    dropper = UsageChunkDropper()
    crlf = USAGE.replace(b"\n\n", b"\r\n\r\n")
    assert dropper.feed(crlf + b": a comment\n\n") == b": a comment\n\n"
    with_choices = b'data: {"choices": [{"index": 0}], "usage": {"prompt_tokens": 1}}\n\n'
    assert dropper.feed(with_choices) == with_choices  # vLLM's continuous usage stats
    assert dropper.feed(b"data: {not json\n\n") == b"data: {not json\n\n"
    assert dropper.feed(b"data: partial") == b""
    assert dropper.close() == b"data: partial"  # what is left at the end goes on as it is
