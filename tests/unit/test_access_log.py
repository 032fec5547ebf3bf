"""The access log's lines (gateway.telemetry.access_log): what a line says, in text and JSON, and
the rate limit that keeps a refusal storm off the disk."""

from __future__ import annotations

import json
import logging

import pytest

from gateway.telemetry.access_log import AccessLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scope(*headers: tuple[bytes, bytes]) -> dict:
    return {"method": "POST", "headers": list(headers)}


async def answered(access: AccessLog, record, status: int, *headers: tuple[bytes, bytes]) -> None:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    watched = access.watch(record, send)
    await watched({"type": "http.response.start", "status": status, "headers": list(headers)})
    await watched({"type": "http.response.body", "body": b"{}"})
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # passed on


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="gateway.access")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "gateway.access"]


@pytest.mark.anyio
async def test_a_line_says_who_asked_what_and_how_it_ended_never_a_key(lines):
    clock = Clock()
    access = AccessLog("json", 100.0, clock)
    record = access.start(
        scope((b"authorization", b"Bearer secret-key-1234"), (b"x-request-id", b"abc-1")), "infer"
    )
    record.asks("sim", "low", "team-a", 8.0)
    clock.now += 0.25
    timing = (b"server-timing", b"queue;dur=12.500, upstream;dur=40.000")
    await answered(access, record, 429, timing, (b"retry-after", b"2"), (b"retry-after-ms", b"1500"))
    record.outcome, record.rule = "queue_full", "priorities[low].max_wait_ms"
    access.write(record)
    [line] = lines()
    assert json.loads(line) == {
        "id": "abc-1",
        "method": "POST",
        "route": "infer",
        "model": "sim",
        "class": "low",
        "tenant": "team-a",
        "cost": 8.0,
        "status": 429,
        "outcome": "queue_full",
        "rule": "priorities[low].max_wait_ms",
        "queue_ms": 12.5,
        "upstream_ms": 40.0,
        "retry_after_s": 1.5,
        "ms": 250.0,
    }
    assert "secret" not in line


@pytest.mark.anyio
async def test_the_text_line_is_key_value_pairs_with_a_dash_for_what_is_not_known(lines):
    access = AccessLog("text", 100.0, Clock())
    record = access.start(scope((b"x-request-id", b"two words")), "chat")  # not an id a log can keep
    await answered(access, record, 404)
    record.asks("", "low")
    record.outcome = "unknown_model"
    access.write(record)
    made = record.request_id  # one made here instead
    assert len(made) == 16 and int(made, 16) >= 0
    assert lines() == [
        f"id={made} method=POST route=chat model=- class=low tenant=- cost=- status=404 outcome=unknown_model"
        " rule=- queue_ms=- upstream_ms=- retry_after_s=- ms=0"
    ]


@pytest.mark.anyio
async def test_the_answer_carries_the_id_back_and_the_backend_gets_one_made_here():
    access = AccessLog("json", 100.0, Clock())
    sent_none = scope()
    record = access.start(sent_none, "infer")
    assert sent_none["headers"] == [(b"x-request-id", record.request_id.encode())]  # for the backend
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await access.watch(record, send)(
        {"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"the-backends")]}
    )
    assert sent[0]["headers"] == [(b"x-request-id", record.request_id.encode())]  # one, the gateway's


def test_a_storm_is_cut_to_the_rate_and_the_next_line_tells_what_was_dropped(lines):
    clock = Clock()
    access = AccessLog("text", 10.0, clock)
    for _ in range(1000):  # a thousand refusals in the same instant
        access.write(access.start(scope(), "infer"))
    assert len(lines()) == 10  # a second's worth at once
    assert access.suppressed == 990
    clock.now += 0.15  # a line and a half's worth of time
    access.write(access.start(scope(), "infer"))
    assert lines()[-1].endswith("suppressed=990")
    access.write(access.start(scope(), "infer"))
    assert len(lines()) == 11  # half a line is left: this one is dropped
    assert access.suppressed == 991
