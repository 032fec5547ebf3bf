"""The load generator's summary: what the benchmark tables are computed from."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from loadtests.bench import CAPACITY_RPS, low_share_beyond_capacity, ratios
from loadtests.openloop import (
    MIX,
    Arrival,
    ClassSummary,
    Outcome,
    expired_in_queue,
    poisson_schedule,
    summarize,
)


def _outcome(at_s: float, status: int | None, latency_ms: float, **extra: object) -> Outcome:
    return Outcome(Arrival(at_s, "low", 1000), status, latency_ms / 1000, **extra)  # type: ignore[arg-type]


def test_goodput_counts_answers_within_deadline_and_the_steady_window() -> None:
    outcomes = [
        _outcome(0.5, 200, 100),  # good, but in the warm-up
        _outcome(2.0, 200, 900),  # good, steady
        _outcome(3.0, 200, 1200),  # answered after its deadline: not goodput
        _outcome(9.5, 200, 10),  # good, in the cool-down
    ]
    low = summarize(outcomes, duration_s=10, warmup_s=1, cooldown_s=1)["low"]
    assert (low.sent, low.good) == (4, 3)
    assert low.steady_goodput_rps == pytest.approx(1 / 8)
    assert low.goodput_rps == pytest.approx(3 / 10)


def test_refusals_after_a_wait_are_told_apart_from_refusals_at_arrival() -> None:
    at_arrival = [_outcome(1 + i / 100, 429, 1.0, retry_after=True) for i in range(99)]
    expired = [_outcome(2.0, 429, 958.0, retry_after=True, expired_in_queue=True)]
    timed_out = [_outcome(3.0, None, 3000.0, error="TimeoutError")]
    low = summarize(at_arrival + expired + timed_out, duration_s=10, warmup_s=1, cooldown_s=1)["low"]
    assert low.rejections == {"429": 100, "TimeoutError": 1}
    assert low.expired_in_queue == 1
    assert low.rejection_p99_ms == pytest.approx(958.0)
    assert low.arrival_rejection_p99_ms == pytest.approx(1.0)
    assert low.retry_after_share == 1.0


def test_the_schedule_is_reproducible_and_poisson_like() -> None:
    first = poisson_schedule(200, 10, seed=3)
    assert first == poisson_schedule(200, 10, seed=3)
    assert 1800 < len(first) < 2200
    high_share = sum(a.priority == "high" for a in first) / len(first)
    assert 0.15 < high_share < 0.25


def test_instant_shed_refuses_the_low_requests_that_capacity_cannot_serve_beside_the_high_ones() -> None:
    assert low_share_beyond_capacity(0.3) == low_share_beyond_capacity(1.0) == 0.0
    for load in (1.5, 3.0, 6.0):
        offered = CAPACITY_RPS * load
        high, low = (offered * c.share for c in MIX)
        served_low = low * (1 - low_share_beyond_capacity(load))
        assert served_low == pytest.approx(max(0.0, CAPACITY_RPS - high))  # none once high fills it


def test_a_refusal_after_a_wait_in_the_queue_is_told_by_its_answer() -> None:
    assert expired_in_queue(429, b'{"error": "...", "reason": "deadline_expired_in_queue"}')
    assert not expired_in_queue(429, b'{"error": "...", "reason": "deadline_unmeetable"}')
    haproxy = (
        b"<html><body><h1>503 Service Unavailable</h1>\nNo server is available to handle this request.\n"
    )
    assert expired_in_queue(503, haproxy)
    assert not expired_in_queue(503, b'{"error": "...", "reason": "no_backend"}')


def _result(target: str, low_refusal_p99_ms: float | None, steady_goodput_rps: float) -> dict[str, object]:
    low = ClassSummary(0, 0, 0.0, steady_goodput_rps, None, None, arrival_rejection_p99_ms=low_refusal_p99_ms)
    return {"target": target, "classes": {"low": asdict(low)}}


def test_repeated_runs_give_each_runs_ratios_and_their_median() -> None:
    runs = [
        [_result("haproxy", None, 100.0), _result("gateway", 4.0, 110.0), _result("floor", 2.0, 0.0)],
        [_result("haproxy", None, 100.0), _result("gateway", 3.0, 100.0), _result("floor", 2.0, 0.0)],
        [_result("haproxy", None, 100.0), _result("gateway", 2.0, 120.0), _result("floor", 2.0, 0.0)],
    ]
    shown = ratios(runs)
    assert "- gateway refusal p99 / floor: 2.00x, 1.50x, 1.00x; median 1.50x" in shown
    assert "- gateway steady goodput / haproxy: 1.10x, 1.00x, 1.20x; median 1.10x" in shown
    assert "haproxy refusal p99" not in shown  # HAProxy refused nothing at arrival
    assert "floor steady goodput" not in shown  # and the floor serves nothing
