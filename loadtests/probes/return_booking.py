"""What does booking a refused request's return cost, by the number of replicas? A diagnostic.

    python -m loadtests.probes.return_booking

Each run refuses 6,000 requests of one band at 400 a second, on a pool that drains 200 a second
and is offered three times that (so the schedule fills up to its ceiling), through
`policies.return_schedule.advise_return`. With several replicas the refusals go to each in turn,
and each reads the others' promises as the Redis store exchanges them, every quarter of a second.
It prints the CPU per refusal (the best of three runs): what a refusal's Retry-After costs on
top of the rest of its path, and how that grows with the replicas sharing the queue; and a
digest of every advice and schedule booked, the same before and after a change that means only to
make booking cheaper. A last line books for one replica as the core benchmark's overload does,
for 30 s after a quieter spell (settled rates of a quarter of the load): the settled spare is large, the
overload's returns fall due while it lasts, and the rates the booking reads drift with them.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from policies.retry_after import RetryAfterConfig
from policies.return_schedule import Promised, ReturnSchedule, advise_return, empty_schedule, promised
from policies.wait import Throughput

REFUSALS, RATE_PER_S, EXCHANGE_S, TAU_S = 6000, 400.0, 0.25, 2.0
OVERLOAD = Throughput(
    service_time_s=0.04,
    drain_rate_per_s=200.0,
    admitted_rate_by_band=(40.0, 600.0),
    offered_rate_by_band=(40.0, 600.0),
    settled_rate_by_band=(40.0, 600.0),
)


AFTER_QUIET = Throughput(
    service_time_s=0.04,
    drain_rate_per_s=200.0,
    admitted_rate_by_band=(120.0, 80.0),
    offered_rate_by_band=(120.0, 480.0),
    settled_rate_by_band=(10.0, 40.0),
)


def cpu_per_refusal_s(
    replicas: int, seed: int, digest: Any, throughput: Throughput = OVERLOAD, refusals: int = REFUSALS
) -> float:
    rng = random.Random(seed)
    config = RetryAfterConfig()
    schedules: list[ReturnSchedule] = [empty_schedule(0.0, config) for _ in range(replicas)]
    seen: list[tuple[Promised, ...]] = [() for _ in range(replicas)]
    exchanged = [-EXCHANGE_S] * replicas
    now = spent = 0.0
    for n in range(refusals):
        now += rng.expovariate(RATE_PER_S)
        at = n % replicas
        if now - exchanged[at] >= EXCHANGE_S:
            seen[at] = tuple(promised(s) for i, s in enumerate(schedules) if i != at)
            exchanged[at] = now
        u, others = rng.random(), seen[at]
        started = time.process_time()
        booking = advise_return(schedules[at], 1.0, 0.1, throughput, 1, now, u, config, TAU_S, others)
        spent += time.process_time() - started
        schedules[at] = booking.schedule
        digest.update(repr((booking.advice_s, booking.schedule.booked)).encode())
    return spent / refusals


def main() -> None:
    for replicas in (1, 3, 10):
        digest = hashlib.sha256()
        best = min(cpu_per_refusal_s(replicas, seed, digest) for seed in range(3))
        shown = f"{best * 1e6:6.1f} us of CPU per refusal, bookings {digest.hexdigest()[:16]}"
        print(f"{replicas:2} replicas: {shown}", flush=True)
    digest = hashlib.sha256()
    best = min(cpu_per_refusal_s(1, seed, digest, AFTER_QUIET, 2 * REFUSALS) for seed in range(3))
    print(f" 1 replica, 30 s after a quieter spell: {best * 1e6:6.1f} us of CPU per refusal", flush=True)


if __name__ == "__main__":
    main()
