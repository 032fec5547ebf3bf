"""The supervisor: crashes are logged and restarted with backoff; cancellation and returns end a loop."""

from __future__ import annotations

import asyncio
import logging

import pytest
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry

from gateway.supervision import Backoff, Supervisor
from gateway.telemetry.metrics import GatewayMetrics
from tests.eventually import eventually

pytestmark = pytest.mark.anyio

# No jitter unless a test asks for it: draw 0.5 is the middle of the band.
NO_JITTER = 0.5


class Gate:
    """An injected sleep that records each backoff and waits until the test lets it pass."""

    def __init__(self, *, open_: bool = True) -> None:
        self.delays: list[float] = []
        self._open = asyncio.Event()
        if open_:
            self._open.set()

    async def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)
        await self._open.wait()

    def open(self) -> None:
        self._open.set()


class Crashes:
    """A body that crashes `times` times, then starts and runs until cancelled."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.runs = 0
        self.cancelled = False

    async def __call__(self, *, task_status: TaskStatus[None]) -> None:
        self.runs += 1
        if self.runs <= self.times:
            raise RuntimeError(f"crash {self.runs}")
        task_status.started()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def test_backoff_doubles_up_to_its_cap_with_jitter_around_the_base():
    backoff = Backoff(first_s=1.0, factor=2.0, max_s=5.0, jitter=0.2)
    assert [backoff.delay_s(n, NO_JITTER) for n in (1, 2, 3, 4, 10_000)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.delay_s(2, 0.0) == pytest.approx(1.6)
    assert backoff.delay_s(2, 0.999999) == pytest.approx(2.4)


async def test_a_crash_is_logged_once_with_its_traceback_on_the_loops_logger(caplog):
    gate = Gate()
    supervisor = Supervisor(sleep=gate.sleep, draw=lambda: NO_JITTER)
    body = Crashes(1)
    with caplog.at_level(logging.ERROR):
        loop = await supervisor.start("demo", body)
        await eventually(lambda: loop.up)
    records = [r for r in caplog.records if r.name == "gateway.loop.demo"]
    assert len(records) == 1
    assert records[0].exc_info is not None and str(records[0].exc_info[1]) == "crash 1"
    assert loop.restarts == 1 and body.runs == 2
    await supervisor.stop()


async def test_crashes_in_a_row_back_off_longer_each_time_up_to_the_cap():
    gate = Gate()
    backoff = Backoff(first_s=1.0, factor=2.0, max_s=5.0)
    supervisor = Supervisor(backoff=backoff, sleep=gate.sleep, draw=lambda: NO_JITTER)
    loop = await supervisor.start("demo", Crashes(5))
    await eventually(lambda: loop.up)
    assert gate.delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert loop.restarts == 5
    await supervisor.stop()


async def test_the_backoff_starts_over_after_a_run_that_lasted_long_enough():
    now = [0.0]
    run_lengths = {3: 100.0}  # the third run is a healthy one; the others crash at once

    gate = Gate()
    backoff = Backoff(first_s=1.0, factor=2.0, healthy_after_s=60.0)
    supervisor = Supervisor(backoff=backoff, clock=lambda: now[0], sleep=gate.sleep, draw=lambda: NO_JITTER)

    class Timed(Crashes):
        async def __call__(self, *, task_status: TaskStatus[None]) -> None:
            began = now[0]
            try:
                await super().__call__(task_status=task_status)
            finally:
                now[0] = began + run_lengths.get(self.runs, 0.0)

    loop = await supervisor.start("demo", Timed(4))
    await eventually(lambda: loop.up)
    assert gate.delays == [1.0, 2.0, 1.0, 2.0]
    await supervisor.stop()


async def test_a_loop_is_down_while_it_waits_to_be_restarted_and_up_again_after():
    runs: list[int] = []

    async def crashes_once_it_runs(*, task_status: TaskStatus[None]) -> None:
        runs.append(1)
        task_status.started()
        if len(runs) == 1:
            raise RuntimeError("crash")
        await asyncio.Event().wait()

    gate = Gate(open_=False)
    supervisor = Supervisor(backoff=Backoff(first_s=3.0), sleep=gate.sleep, draw=lambda: NO_JITTER)
    loop = await supervisor.start("demo", crashes_once_it_runs, required=True)
    await eventually(lambda: gate.delays != [])
    assert not loop.up
    assert supervisor.required_down() == ["demo"]
    assert supervisor.loops_up() == {"demo": False}
    assert 0 < loop.restart_in_s <= 3.0
    gate.open()
    await eventually(lambda: loop.up)
    assert supervisor.required_down() == []
    assert loop.restart_in_s == 0.0
    await supervisor.stop()


async def test_start_returns_only_once_the_loop_has_started():
    go = asyncio.Event()

    async def body(*, task_status: TaskStatus[None]) -> None:
        await go.wait()
        task_status.started()
        await asyncio.Event().wait()

    supervisor = Supervisor()
    starting = asyncio.create_task(supervisor.start("demo", body))
    for _ in range(20):  # turns of the loop in which start() must not return: nothing to wait for
        await asyncio.sleep(0)
    assert not starting.done()
    go.set()
    loop = await asyncio.wait_for(starting, 5)
    assert loop.up
    await supervisor.stop()


async def test_cancellation_ends_a_loop_without_a_restart_or_a_log(caplog):
    supervisor = Supervisor()
    body = Crashes(0)
    with caplog.at_level(logging.ERROR):
        loop = await supervisor.start("demo", body)
        loop.cancel()
        await asyncio.wait_for(loop.wait(), 5)
    assert body.cancelled and body.runs == 1
    assert not loop.up and loop.restarts == 0
    assert supervisor.loops_up() == {}
    assert not [r for r in caplog.records if r.name.startswith("gateway.loop")]
    await supervisor.stop()


async def test_stop_cancels_loops_that_wait_for_a_restart_too():
    gate = Gate(open_=False)
    supervisor = Supervisor(sleep=gate.sleep)
    waiting = await supervisor.start("crashed", Crashes(1))
    running = await supervisor.start("running", Crashes(0))
    await asyncio.wait_for(supervisor.stop(), 5)
    assert waiting.finished and running.finished


async def test_a_loop_that_returns_has_done_its_job_and_is_not_restarted():
    runs: list[int] = []

    async def once(*, task_status: TaskStatus[None]) -> None:
        runs.append(1)
        task_status.started()

    supervisor = Supervisor()
    loop = await supervisor.start("once", once)
    await asyncio.wait_for(loop.wait(), 5)
    assert runs == [1] and loop.restarts == 0
    assert supervisor.loops_up() == {}
    await supervisor.stop()


async def test_metrics_show_a_loop_down_while_it_waits_and_count_its_restarts():
    registry = CollectorRegistry()
    gate = Gate(open_=False)
    supervisor = Supervisor(sleep=gate.sleep)
    GatewayMetrics(registry).watch_loops([supervisor])
    loop = await supervisor.start("demo", Crashes(1))
    assert registry.get_sample_value("gateway_loop_up", {"loop": "demo"}) == 0.0
    assert registry.get_sample_value("gateway_loop_restarts_total", {"loop": "demo"}) == 0.0
    gate.open()
    await eventually(lambda: loop.up)
    assert registry.get_sample_value("gateway_loop_up", {"loop": "demo"}) == 1.0
    assert registry.get_sample_value("gateway_loop_restarts_total", {"loop": "demo"}) == 1.0
    loop.cancel()
    await loop.wait()
    # A loop that left keeps its restarts counted: a counter never goes down.
    assert registry.get_sample_value("gateway_loop_restarts_total", {"loop": "demo"}) == 1.0
    await supervisor.stop()
