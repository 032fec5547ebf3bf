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


def test_a_body_in_utf_16_or_32_is_written_anew_in_utf_8():
    payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "h\u00e9"}]}
    for encoding in ("utf-16", "utf-16-le", "utf-32"):
        body = asking_usage(json.dumps(payload).encode(encoding), payload)
        assert json.loads(body.decode("utf-8")) == {**payload, "stream_options": {"include_usage": True}}


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


ENDINGS = [b"\n", b"\r", b"\r\n"]


@st.composite
def streams(draw):
    """A stream in any of the line endings the event-stream grammar allows, mixed, its usage event
    with an id or a comment line or neither; and the stream without it."""

    def event(*lines: bytes) -> bytes:
        written, ending = b"", b""
        for line in (*lines, b""):
            # A CR then an LF would be one CRLF, not two line ends.
            ending = draw(st.sampled_from(ENDINGS[1:] if ending == b"\r" and not line else ENDINGS))
            written += line + ending
        return written

    usage_lines = [USAGE.strip()]
    extra = draw(st.sampled_from([None, b"id: 7", b": keep-alive"]))
    if extra is not None:
        usage_lines.insert(draw(st.integers(0, 1)), extra)
    before = [event(chunk(c).strip()) for c in "ab"]
    done = event(DONE.strip())
    return b"".join([*before, event(*usage_lines), done]), b"".join([*before, done])


@given(streams(), st.lists(st.integers(0, 400), max_size=6))
def test_the_usage_chunk_leaves_streams_of_any_line_endings_wherever_reads_split_them(stream, cuts):
    sent, expected = stream
    dropper = UsageChunkDropper()
    bounds = [0, *sorted(min(c, len(sent)) for c in cuts), len(sent)]
    out = b"".join(dropper.feed(sent[a:b]) for a, b in itertools.pairwise(bounds))
    assert out + dropper.close() == expected


def test_an_event_is_passed_on_as_soon_as_its_blank_line_is_read_whatever_its_line_endings():
    for ending in ENDINGS:
        event = chunk("a").strip() + ending + ending
        assert UsageChunkDropper().feed(event) == event


def test_a_named_event_with_usage_is_not_an_openai_usage_chunk():
    named = b"event: usage\n" + USAGE
    assert UsageChunkDropper().feed(named) == named


def test_a_usage_event_whose_last_crlf_is_split_between_reads_leaves_with_its_lf():
    # Found by the property above: the blank line's CR ended one read, its LF began the next; the
    # event was taken out at the CR and its LF passed on as an empty line of its own.
    dropper = UsageChunkDropper()
    usage = USAGE.strip() + b"\r\n\r"
    assert dropper.feed(usage) == b""
    assert dropper.feed(b"\n" + DONE) == DONE
