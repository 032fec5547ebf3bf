"""Admission's pool reading is reused for a few milliseconds and sampled for export, never loosened."""

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.flow import predictions as predictions_module
from gateway.flow.predictions import Predictions, rounded_up_confidence
from policies.admission import AdmissionConfig, AdmissionRequest, confident_wait_s, work_limit
from policies.rounding import rounded_down
from policies.service_times import ServiceTimes
from policies.steps import Steps, finished
from policies.wait import QueueStats, Throughput
from tests.eventually import eventually

CONFIG = AdmissionConfig()
REQUEST = AdmissionRequest(band=0, max_queue_wait_s=0.3)


def learned(service_s: float) -> Throughput:
    times = ServiceTimes(service_s)
    for _ in range(500):
        times.record(service_s)
    return Throughput(service_s, 1 / service_s, (0.0,), (0.0,), service_times=times)


def busy(*started_at: float) -> QueueStats:
    return QueueStats((1,), 0, (1.0,), started_at=started_at)


class HeldReadings:
    """A step runner that holds each reading until the test lands it."""

    def __init__(self) -> None:
        self.pending: list[tuple[Steps[float], Callable[[float], None]]] = []

    def __call__(self, steps: Steps[float], on_value: Callable[[float], None]) -> None:
        self.pending.append((steps, on_value))

    def land(self) -> None:
        pending, self.pending = self.pending, []
        for steps, on_value in pending:
            on_value(finished(steps))


def on_the_edge(flow: Throughput) -> float:
    """When the one busy slot's request started, such that it is handed over just too late for a
    request arriving at 0 (allowed 0.3 s, as Predictions rounds it), and in time 8 ms later."""
    rounded = replace(REQUEST, max_queue_wait_s=rounded_down(REQUEST.max_queue_wait_s))
    for step in range(400):
        started = -step / 1000
        late = work_limit(rounded, busy(started), flow, 0.0, 0.977, CONFIG)
        if late == 0 and work_limit(rounded, busy(started), flow, 0.008, 0.977, CONFIG) == 1:
            return started
    raise AssertionError("no start puts the hand-over on the edge")


def limit(predictions: Predictions, flow: Throughput, now: float, *started_at: float) -> float:
    """The work limit `predictions` gives REQUEST at `now`, its slots busy since `started_at`."""
    return predictions.work_limit(REQUEST, busy(*started_at), flow, now, 0.977)


def test_a_reading_is_reused_while_fresh_and_read_again_once_stale_or_the_slots_change():
    flow = learned(0.4)
    started = on_the_edge(flow)
    readings = HeldReadings()
    predictions = Predictions(1, CONFIG, reuse_s=0.01, run_steps=readings)
    assert limit(predictions, flow, 0.0, started) == 0
    assert limit(predictions, flow, 0.008, started) == 0  # reused
    assert not readings.pending
    # Stale: read again a step at a time, the old limit serving until the new one lands.
    assert limit(predictions, flow, 0.011, started) == 0
    assert limit(predictions, flow, 0.012, started) == 0
    assert len(readings.pending) == 1  # one reading under way, not one per request
    readings.land()
    assert limit(predictions, flow, 0.013, started) == 1
    # Twice as stale (its reading never landed): read at once.
    predictions = Predictions(1, CONFIG, reuse_s=0.01, run_steps=readings)
    assert limit(predictions, flow, 0.0, started) == 0
    assert limit(predictions, flow, 0.015, started) == 0
    assert limit(predictions, flow, 0.021, started) == 1
    # Another slot busy: read again at once.
    predictions = Predictions(1, CONFIG, reuse_s=0.01, run_steps=readings)
    assert limit(predictions, flow, 0.0, started) == 0
    assert limit(predictions, flow, 0.001, started, -0.2) == 1


def reading_begun() -> tuple[Throughput, float, HeldReadings, Predictions]:
    """A limit read at 0 on the edge (0), stale at 0.011 and being read again (1 once landed)."""
    flow = learned(0.4)
    started = on_the_edge(flow)
    readings = HeldReadings()
    predictions = Predictions(1, CONFIG, reuse_s=0.01, run_steps=readings)
    assert limit(predictions, flow, 0.0, started) == 0
    assert limit(predictions, flow, 0.011, started) == 0
    assert len(readings.pending) == 1
    return flow, started, readings, predictions


def test_a_reading_that_lands_after_a_newer_one_is_dropped():
    flow, started, readings, predictions = reading_begun()
    # The slots changed meanwhile: read at once; then one busy slot again, just started, which
    # hands over too late: read at once again.
    assert limit(predictions, flow, 0.012, started, -0.2) == 2
    assert limit(predictions, flow, 0.013, 0.013) == 0
    readings.land()  # the reading begun at 0.011 (1) is older than the one made at 0.013
    assert limit(predictions, flow, 0.014, 0.013) == 0


@pytest.mark.anyio
async def test_a_stale_limit_is_read_again_a_busy_slot_per_turn_of_the_loop():
    flow = learned(0.4)
    started = on_the_edge(flow)
    predictions = Predictions(1, CONFIG, reuse_s=0.01)  # run_stepwise, on the running loop
    assert limit(predictions, flow, 0.0, started) == 0
    assert limit(predictions, flow, 0.011, started) == 0
    await asyncio.sleep(0)
    assert limit(predictions, flow, 0.012, started) == 0  # one turn later: still reading
    await eventually(lambda: limit(predictions, flow, 0.012, started) == 1)


def test_a_limit_being_read_again_outlives_the_pruning_of_old_ones():
    flow, started, readings, predictions = reading_begun()
    for octave in range(5):  # 320 budgets, each its own limit (one per step of the rounding)
        for step in range(64):
            budgeted = replace(REQUEST, budget_s=2**octave * (1 + (step + 0.5) / 64))
            predictions.work_limit(budgeted, busy(started), flow, 0.012, 0.977)
    assert limit(predictions, flow, 0.013, started) == 0  # still held, not read at once
    readings.land()
    assert limit(predictions, flow, 0.014, started) == 1


@pytest.mark.anyio
async def test_the_predicted_wait_is_sampled_per_band_a_reading_per_turn_of_the_loop():
    flow = learned(0.4)
    predictions = Predictions(1, CONFIG, sample_s=0.05)
    waits: list[float] = []
    predictions.sample_wait(0, busy(0.0), flow, 0.1, 0.977, waits.append)
    assert waits == []  # the search has not run yet: it runs as the loop turns
    await eventually(lambda: len(waits) == 1)
    # One request ahead: the slot hands over at 0.4 s and again at 0.8 s, 0.7 s from t=0.1.
    assert abs(waits[0] - 0.7) < 0.05  # within the histogram's resolution
    assert waits[0] == confident_wait_s(busy(0.0), flow, 0, 0.1, 0.977)  # the same as run whole
    predictions.sample_wait(0, busy(0.0), flow, 0.12, 0.977, waits.append)  # not this band's sample
    predictions.sample_wait(0, busy(0.0), flow, 0.16, 0.977, waits.append)
    await eventually(lambda: len(waits) == 2)


def test_the_predicted_wait_counts_free_slots_once():
    """One slot free (it goes to the request queued ahead at once) and one busy, just started: this
    request waits for the busy one, 0.4 s."""
    stats = QueueStats((1,), 1, (1.0,), started_at=(0.0,))
    assert abs(confident_wait_s(stats, learned(0.4), 0, 0.0, 0.977) - 0.4) < 0.05


@given(st.floats(0.5, 0.99999))
def test_the_confidence_is_read_on_a_grid_that_only_tightens(confidence):
    rounded = rounded_up_confidence(confidence)
    assert confidence <= rounded < 1
    assert (1 - rounded) >= (1 - confidence) * 2 ** (-1 / 8) * (1 - 1e-12)


def test_a_limit_is_reused_while_the_calibrated_confidence_moves_within_its_grid_step(monkeypatch):
    flow = learned(0.4)
    readings = HeldReadings()
    predictions = Predictions(1, CONFIG, reuse_s=0.05, run_steps=readings)
    stats = busy(-0.1)
    calls = []
    original = predictions_module.work_limit

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(predictions_module, "work_limit", counting)
    predictions.work_limit(REQUEST, stats, flow, 0.0, 0.9770)
    predictions.work_limit(REQUEST, stats, flow, 0.001, 0.9771)  # a settled request moved it
    assert len(calls) == 1
    assert not readings.pending
    # Another step of the grid (a flow calibrated tighter): another limit, read at once.
    predictions.work_limit(REQUEST, stats, flow, 0.002, 0.9900)
    assert len(calls) == 2
    assert not readings.pending
    # Back at the first step (a flow calibrated looser): its own limit, still fresh, serves.
    predictions.work_limit(REQUEST, stats, flow, 0.003, 0.9770)
    assert len(calls) == 2
    assert not readings.pending
