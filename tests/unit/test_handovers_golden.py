"""Hand-over counts and waits pinned to recorded values, so that a change meant to make the pool's
readings cheaper (or stepwise) cannot change what admission reads without saying so.

The cases are built from a seeded generator: service times of little spread (counted slot by
slot), exponential, spread beyond exponential, uniform, and the prior alone; pools of 1 to 16 slots
with free slots and urgent work or without; windows from 20 ms to 30 s (past the count where the
normal takes over); confidences from 0.5 to 0.999. The recorded values are in
tests/unit/golden/handovers.json. A change that means to change them records them again:

    python -m tests.unit.test_handovers_golden
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from policies.handovers import PoolState, handovers_within, wait_for
from policies.service_times import ServiceTimes

RECORDED = Path(__file__).parent / "golden" / "handovers.json"
CASES = 96
MEAN_S = 0.04


def _services(rng: random.Random) -> dict[str, ServiceTimes]:
    draws: dict[str, Callable[[], float]] = {
        "clock-like": lambda: rng.gauss(MEAN_S, MEAN_S / 80),
        "exponential": lambda: rng.expovariate(1 / MEAN_S),
        "spread": lambda: rng.lognormvariate(math.log(MEAN_S) - 0.8, 1.3),
        "uniform": lambda: rng.uniform(MEAN_S / 2, 1.5 * MEAN_S),
    }
    services = {"prior": ServiceTimes(prior_mean_s=MEAN_S)}
    for name, draw in draws.items():
        service = ServiceTimes(prior_mean_s=MEAN_S)
        for _ in range(600):
            service.record(draw())
        services[name] = service
    return services


def _cases() -> Iterator[tuple[str, PoolState, ServiceTimes, float, int, float]]:
    """(name, pool, service times, window, hand-overs wanted, confidence), the same every run."""
    rng = random.Random(20261203)
    services = _services(rng)
    for n in range(CASES):
        kind = list(services)[n % len(services)]
        busy = rng.randint(1, 16)
        ages = tuple(rng.uniform(0, 2.5 * MEAN_S) for _ in range(busy))
        free = rng.choice((0, 0, 0, 1, 3))
        urgent = rng.choice((0.0, 0.0, rng.uniform(0, 0.5) * busy / MEAN_S))
        window = rng.choice((0.02, 0.1, 0.25, 1.0, 30.0))
        wanted = rng.randint(1, max(1, int(1.5 * (busy + free) * window / MEAN_S)))
        confidence = rng.choice((0.5, 0.9, 0.99, 0.999))
        yield f"{n}-{kind}", PoolState(ages, free, urgent), services[kind], window, wanted, confidence


def _readings() -> dict[str, list[float]]:
    readings: dict[str, list[float]] = {}
    for name, state, service, window, wanted, confidence in _cases():
        count = handovers_within(state, service, window, confidence)
        readings[name] = [count, wait_for(state, service, wanted, confidence)]
    return readings


def test_the_pool_is_read_as_recorded():
    recorded = json.loads(RECORDED.read_text())
    readings = _readings()
    assert readings.keys() == recorded.keys()
    for name, (count, wait_s) in readings.items():
        recorded_count, recorded_wait_s = recorded[name]
        assert count == recorded_count, name
        # The waits are bisected; a last-bit difference of another libm may move one by a step.
        assert wait_s == pytest.approx(recorded_wait_s, rel=1e-6), name


def test_the_recorded_cases_cover_both_ways_of_counting_and_both_answers():
    readings = json.loads(RECORDED.read_text())
    counts = [count for count, _ in readings.values()]
    assert 0 in counts and max(counts) > 1024  # none at all, and past the normal's switch
    assert len(set(counts)) > CASES // 2
    assert any(name.endswith("clock-like") for name in readings)


if __name__ == "__main__":
    RECORDED.parent.mkdir(exist_ok=True)
    RECORDED.write_text(json.dumps(_readings(), indent=1) + "\n")
    print(f"recorded {CASES} readings in {RECORDED}")
