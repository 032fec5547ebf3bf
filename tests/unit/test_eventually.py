"""The tests' wait helper: it returns once the state is there, and fails saying what it last saw."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.eventually import eventually, eventually_blocking


def test_a_predicate_is_retried_until_it_holds():
    tries = itertools.count(1)
    eventually_blocking(lambda: next(tries) >= 3, interval_s=0.001)
    assert next(tries) == 4


def test_an_assertion_is_retried_until_it_passes():
    values = iter([1, 2, 3])

    def check() -> None:
        assert next(values) == 3

    eventually_blocking(check, interval_s=0.001)


def test_timing_out_shows_the_last_value():
    values = itertools.count()
    with pytest.raises(AssertionError, match=r"waiting for the count; last value: False") as failure:
        eventually_blocking(lambda: next(values) < 0, timeout_s=0.05, interval_s=0.01, what="the count")
    assert "timed out after 0.05 s" in str(failure.value)


def test_timing_out_shows_the_last_assertion_error():
    seen = itertools.count()

    def check() -> None:
        raise AssertionError(f"depth is {next(seen)}")

    with pytest.raises(AssertionError, match=r"last assertion error: depth is \d+") as failure:
        eventually_blocking(check, timeout_s=0.05, interval_s=0.01)
    assert isinstance(failure.value.__cause__, AssertionError)


def test_other_errors_are_not_retried():
    tries = itertools.count(1)

    def check() -> bool:
        next(tries)
        raise KeyError("inflight")

    with pytest.raises(KeyError):
        eventually_blocking(check, timeout_s=5.0)
    assert next(tries) == 2


def test_the_check_runs_at_least_once_however_short_the_timeout():
    eventually_blocking(lambda: True, timeout_s=0.0)


@pytest.mark.anyio
async def test_the_async_form_waits_without_blocking_the_loop():
    ready = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, ready.set)
    await eventually(ready.is_set, interval_s=0.005)
    with pytest.raises(AssertionError, match="never"):
        await eventually(lambda: False, timeout_s=0.03, what="never")
