"""How close does the pool reading come to what a pool of long and short requests hands over?

    python -m loadtests.pool_readings

The reading (policies.handovers.handovers_within: the most hand-overs reached within a time with a
confidence) against a seeded Monte Carlo of the pool, on the simulator's `long-tail` mix: 90% of
requests take 100 ms, 10% take 3.1 s. A request that has run past 100 ms is a long one. The reading
should come close to the truth and never exceed it: an optimistic reading admits work that then
expires in the queue. Runs in a few seconds; no servers.
"""

from __future__ import annotations

import random

from policies.handovers import PoolState, handovers_within
from policies.service_times import ServiceTimes

SHORT_S, LONG_S, LONG_SHARE = 0.1, 3.1, 0.1
POOLS = ((0.05, 0.05, 0.05, 0.05), (0.05, 0.05, 0.5, 1.0), (0.5, 1.0, 2.0, 0.05))
WITHIN_S = (0.5, 1.0, 2.0, 4.0, 7.6)
CONFIDENCES = (0.9, 0.977)


def short_or_long() -> ServiceTimes:
    """A histogram holding exactly one long service in ten (the pattern repeats within its memory)."""
    service = ServiceTimes(prior_mean_s=0.4, memory=200.0)
    for n in range(2000):
        service.record(LONG_S if n % 10 == 9 else SHORT_S)
    return service


def true_count_quantile(
    ages_s: tuple[float, ...],
    within_s: float,
    confidence: float,
    *,
    free: int = 0,
    mix: tuple[float, float, float] = (SHORT_S, LONG_S, LONG_SHARE),
    paths: int = 4000,
    seed: int = 11,
) -> int:
    """The count of hand-overs within `within_s` reached with `confidence`, by Monte Carlo of a
    two-point `mix` (short s, long s, long share): a request older than the short time is long."""
    short_s, long_s, long_share = mix
    rng = random.Random(seed)

    def draw() -> float:
        return long_s if rng.random() < long_share else short_s

    counts = []
    for _ in range(paths):
        count = free
        for age in (*ages_s, *[0.0] * free):
            short = age < short_s and rng.random() >= long_share
            ends = (short_s if short else long_s) - age
            while ends <= within_s:
                count += 1
                ends += draw()
        counts.append(count)
    counts.sort()
    return counts[int((1 - confidence) * paths)]


def main() -> None:
    service = short_or_long()
    print("| pool (ages, s) | within s | confidence | reading | true | reading / true |")
    print("|---|---|---|---|---|---|")
    for ages in POOLS:
        for within_s in WITHIN_S:
            for confidence in CONFIDENCES:
                read = handovers_within(PoolState(ages, 0), service, within_s, confidence)
                truth = true_count_quantile(ages, within_s, confidence)
                ratio = f"{read / truth:.2f}" if truth else "-"
                pool = ", ".join(f"{age:g}" for age in ages)
                print(f"| {pool} | {within_s:g} | {confidence:g} | {read} | {truth} | {ratio} |")


if __name__ == "__main__":
    main()
