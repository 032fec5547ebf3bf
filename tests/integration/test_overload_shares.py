"""Weighted shares under sustained open-loop overload at a default-sized budget, through a real
gateway on both stores: two tenants weighted 3:1 flood one class at 2.5x the backend's capacity
with a 3 s queue wait. Admission refuses most of both; what it admits is served in time, and the
work is split by weight. At 30 s budgets admission never refused and the shares held; at 3 s the
lighter tenant was served 0.4 requests a second of its 40, and its admitted requests expired.
The simulator, the twin of the gateway on its memory store, run on the same arrivals, must agree:
the same shares handed over, the same shares of each tenant's requests refused at arrival
(measured, when slots took 50 ms: 37.9% and 80.0% against the gateway's 37.7% and 80.2%).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time

import aiohttp
import pytest

from gateway.tools.simulate.admitting import Admission
from gateway.tools.simulate.engine import Band, Handover, Setup, simulate
from gateway.tools.simulate.workload import Arrival
from policies.calibration import CalibrationConfig
from tests.integration.servers import gateway_config

pytestmark = [pytest.mark.anyio, pytest.mark.flood]
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"
# 40 requests a second: slots of 100 ms, not 50, so that the gateway's own CPU never sets the pace. At
# 80 a second (2.5x: 200 requests a second through one gateway, the load generator beside it), the
# machine running twice slower now and then than its usual pace left slots idle and admitted
# requests late, floods running alone included.
SLOTS, SERVICE_MS = 4, 100
PER_TENANT_RATE = 50.0  # 2.5x the backend's capacity between them
SEND_S = 9.0
ALLOWED_MS = 3000  # the class's max_wait_ms
# A grant's way from Redis to its replica and the slot's to the request, at most: 50 ms alone; with
# the suite's other load tests beside the flood on this 2-core machine, 205 ms was seen. Either is
# well short of the grace a withdrawn ticket's grant is waited for (GRANT_ON_ITS_WAY_S, 0.5 s).
GRANT_WAY_MS = 250
HTTP_OVERHEAD_S = 0.001  # a hand-over to the simulated backend and its answer back, about
COUNTED_FROM_S = 4.0  # the queue has filled and the gateway has measured the flows' rates


def schedule(seed: int, rate: float = PER_TENANT_RATE, send_s: float = SEND_S) -> list[float]:
    """When a tenant sends: Poisson arrivals at `rate` for `send_s`."""
    rng, due, times = random.Random(seed), 0.0, []
    while (due := due + rng.expovariate(rate)) < send_s:
        times.append(due)
    return times


async def open_loop(
    url: str,
    tenant: str,
    seed: int,
    started: float,
    served: list,
    refused: list,
    body: dict = INFER,
    rate: float = PER_TENANT_RATE,
    send_s: float = SEND_S,
):
    """`tenant` sends `body` on its `schedule` whatever the answers; each answer is recorded with
    the time it came, from `started`, and a served one with its wait in the queue (Server-Timing,
    ms)."""

    async def send(http):
        async with http.post(url + PATH, json=body, headers={"X-Tenant": tenant}) as reply:
            answer = await reply.read()
        at = time.monotonic() - started
        if reply.status == 200:
            queue_ms = float(re.search(r"queue;dur=([0-9.]+)", reply.headers["Server-Timing"]).group(1))
            served.append((at, tenant, queue_ms))
        else:
            assert reply.status == 429, answer
            refused.append((at, tenant, answer))

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        sends = []
        for due in schedule(seed, rate, send_s):
            await asyncio.sleep(max(0.0, started + due - time.monotonic()))
            sends.append(asyncio.ensure_future(send(http)))
        await asyncio.gather(*sends)


async def flood(
    start_sim,
    start_gateway,
    store_section,
    weights=None,
    sends=None,
    service_ms=SERVICE_MS,
    per_item_ms=0.0,
    send_s=SEND_S,
):
    """Each tenant (tenant -> weight; team-a 3, team-b 1 unless told) floods for `send_s`, at
    PER_TENANT_RATE with INFER unless `sends` tells it (tenant -> (rate, body); then the model is
    priced in batch items, each item `per_item_ms` more at the backend than `service_ms`); the
    answers: (served, refused), each stamped with its time."""
    weights = weights or {"team-a": 3, "team-b": 1}
    sends = sends or {}
    sim = start_sim(slots=SLOTS, base_ms=service_ms, per_item_ms=per_item_ms)
    overrides = {} if store_section is None else {"store": store_section}
    config = gateway_config(
        [(sim.url, SLOTS)],
        priorities=[{"name": "low", "max_wait_ms": ALLOWED_MS}],
        expected_service_ms=service_ms,
        tenants=[{"name": name, "weight": weight} for name, weight in weights.items()],
        **overrides,
    )
    if sends:
        config["models"][0]["cost"] = "batch_items"
    gateway = start_gateway(config)
    served: list[tuple[float, str, float]] = []
    refused: list[tuple[float, str, bytes]] = []
    started = time.monotonic()
    await asyncio.gather(
        *(
            open_loop(gateway.url, name, seed, started, served, refused, body, rate, send_s)
            for seed, name in enumerate(weights, start=1)
            for rate, body in [sends.get(name, (PER_TENANT_RATE, INFER))]
        )
    )
    assert sim.stats()["peak_inflight"] <= SLOTS
    return served, refused


def busy_share(store_section) -> float:
    """The share of the backend's capacity a flood must be served at, at least: no slot idles but
    for the hand-overs. In memory a hand-over is instant. Through Redis it takes a round trip and a
    wake (docs/design/architecture.md), which on this 2-core machine, with the suite's other load tests
    beside it, cut a flood to 0.64 of the capacity once (above 0.85 alone): there the bar catches
    only a dispatch that leaves slots idle for good (grants lost, a flow never handed over)."""
    return 0.85 if store_section is None else 0.5


class AdmittedExpired(AssertionError):
    """More of a tenant's admitted requests expired in the queue than admission aims at."""


TARGET_EXPIRY = CalibrationConfig().target_expiry  # of the admitted requests that queue, 1%
UNLIKELY = 1e-3


def chance_of_at_least(count: int, trials: int, p: float) -> float:
    """The chance of `count` or more in `trials` Bernoulli trials of probability `p`."""
    return 1.0 - sum(math.comb(trials, k) * p**k * (1 - p) ** (trials - k) for k in range(count))


def check_admitted_served_in_time(served, refused, tenants=("team-a", "team-b")) -> None:
    """Raises AdmittedExpired when more of a tenant's admitted requests expired than admission's
    target lets happen by chance (under 1 in 1,000): a few hundred admitted at 1% expire 2-3,
    now and then 5, which a fixed 2% line took for a fault; 5-7%, as on Redis before its grants
    were ordered by Redis and its service times measured as Redis held the slots, fail it. And
    none served started late: a grant Redis made before a withdrawal reached it is served, but
    within the way to Redis and back of the allowance (GRANT_WAY_MS), not up to the grace."""
    late = [wait for _, _, wait in served if wait > ALLOWED_MS + GRANT_WAY_MS]
    assert not late, f"{len(late)} served after waiting up to {max(late):.0f} ms"
    for tenant in tenants:
        expired = sum(b"deadline_expired_in_queue" in body for _, who, body in refused if who == tenant)
        admitted = sum(who == tenant for _, who, _ in served) + expired
        if chance_of_at_least(expired, admitted, TARGET_EXPIRY) < UNLIKELY:
            raise AdmittedExpired(f"{tenant}: {expired} of its {admitted} admitted requests expired")


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_tenants_weighted_3_to_1_flooding_at_2_5x_with_3_s_waits_are_served_3_to_1_and_in_time(
    start_sim, start_gateway, store_section
):
    served, refused = await flood(start_sim, start_gateway, store_section)
    counted = [tenant for at, tenant, _ in served if COUNTED_FROM_S <= at <= SEND_S]
    share_b = counted.count("team-b") / len(counted)
    assert share_b == pytest.approx(0.25, rel=0.10), (counted.count("team-a"), counted.count("team-b"))
    assert len(counted) >= busy_share(store_section) * SLOTS * 1000 / SERVICE_MS * (SEND_S - COUNTED_FROM_S)
    assert sum(who == "team-b" for _, who, _ in refused) > 0.5 * PER_TENANT_RATE * SEND_S  # overloaded
    # The twin hands slots over at once, as the memory store does; through Redis a hand-over takes
    # a round trip and a wake, 3-4 ms of each 50 ms slot on this busy machine (docs/design/architecture.md),
    # which Redis's gateway refuses for: its shares of refusals are the memory store's to match.
    check_the_simulator_agrees(served, refused, refusals=store_section is None)
    check_admitted_served_in_time(served, refused)  # what admission let in, dispatch reached in time


def check_the_simulator_agrees(served, refused, refusals: bool = True) -> None:
    """`inference-gateway simulate`, the gateway's twin, run on the same arrivals, hands each tenant
    the same share and (`refusals`) refuses the same shares of their requests at arrival, within a
    few percent."""
    tenants = {"team-a": 1, "team-b": 2}  # tenant -> its schedule's seed
    arrivals = sorted(
        Arrival(at, 0, tenant, 1.0, SERVICE_MS / 1000 + HTTP_OVERHEAD_S)
        for tenant, seed in tenants.items()
        for at in schedule(seed)
    )
    handed: list[str] = []
    setup = Setup(
        SLOTS,
        bands=(Band(max_wait_s=3.0),),
        weights={"team-a": 3.0, "team-b": 1.0},
        warmup=sum(a.at_s < COUNTED_FROM_S for a in arrivals),
        admission=Admission(SERVICE_MS / 1000),  # expected_service_ms, as the gateway is told
    )

    def counted(handover: Handover) -> None:
        if COUNTED_FROM_S <= handover.at_s + SERVICE_MS / 1000 <= SEND_S:
            handed.append(handover.tenant)

    run = simulate(arrivals, setup, on_handover=counted)
    real = [tenant for at, tenant, _ in served if COUNTED_FROM_S <= at <= SEND_S]
    assert handed.count("team-b") / len(handed) == pytest.approx(real.count("team-b") / len(real), abs=0.03)
    for tenant in tenants if refusals else ():
        tally = run.tallies[(0, tenant)]
        sent = [at for at in schedule(tenants[tenant]) if at >= COUNTED_FROM_S]
        at_arrival = sum(
            who == tenant and at >= COUNTED_FROM_S and b"deadline_expired_in_queue" not in body
            for at, who, body in refused
        )
        assert tally.refused / tally.arrived == pytest.approx(at_arrival / len(sent), abs=0.05), tenant


EIGHT_TO_ONE = {"team-a": 8, "team-b": 1}
ONE_TWO_FOUR = {"team-a": 1, "team-b": 2, "team-c": 4}


# On Redis at 5:1 and 8:1 the lighter tenant lost about 3% of its admitted requests to expiry (4-7
# of ~152 over six runs at 5:1), and 8:1 handed it 4% less than its share, while fair queuing
# tagged requests on arrival: each expiry cost its flow a turn. Tagged as heads: 0-1 of ~150 and
# ~100 (policies.fairness). 5:1 runs no more: 8:1 is the harder case of the same rule, on Redis where
# it failed; the memory store floods at 3:1 and 1:2:4 (one run is 13 s of the suite's 10 minutes).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("store", "weights"),
    [
        pytest.param("memory", ONE_TWO_FOUR, id="memory-1:2:4"),
        pytest.param("redis", EIGHT_TO_ONE, id="redis-8:1", marks=pytest.mark.redis),
        pytest.param("redis", ONE_TWO_FOUR, id="redis-1:2:4", marks=pytest.mark.redis),
    ],
)
async def test_other_weights_and_counts_of_tenants_flooding_are_served_by_weight_and_in_time(
    start_sim, start_gateway, store_section, weights
):
    """The same flood at other weights and with three tenants (3.75x the backend's capacity)."""
    served, refused = await flood(start_sim, start_gateway, store_section, weights)
    counted = [tenant for at, tenant, _ in served if COUNTED_FROM_S <= at <= SEND_S]
    total = sum(weights.values())
    shares = {tenant: counted.count(tenant) / len(counted) for tenant in weights}
    for tenant, weight in weights.items():
        assert shares[tenant] == pytest.approx(weight / total, rel=0.10), shares
    assert len(counted) >= busy_share(store_section) * SLOTS * 1000 / SERVICE_MS * (SEND_S - COUNTED_FROM_S)
    lightest = min(weights, key=weights.__getitem__)  # overloaded: even its flood mostly refused
    assert sum(who == lightest for _, who, _ in refused) > 0.5 * PER_TENANT_RATE * SEND_S
    check_admitted_served_in_time(served, refused, tuple(weights))


BATCH_OF_8 = {"inputs": [{"name": "INPUT0", "shape": [8, 1], "datatype": "FP32", "data": [1] * 8}]}


@pytest.mark.slow
@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_tenant_of_8_item_batches_flooding_beside_single_items_is_handed_its_weight_in_items(
    start_sim, start_gateway, store_section
):
    """The issue's first report, in work: priced by batch items, team-b's batches of 8 against
    team-a's single items, weighted 3:1, both at 2x their share: team-b was handed 6.7 times less
    work where 3 was asked. Its share of the items is its weight's, and what admission lets in of
    either is served in time. (A backend of 80 ms + 10 ms per item, and 14 s of it: a window of 10 s
    holds some 17 of team-b's batches, each 6% of its share.)"""
    base_ms, per_item_ms, send_s = 80.0, 10.0, 14.0
    # The pool's items per second, split 3:1: team-a's take 90 ms each, team-b's 8 take 160 ms.
    items_per_s = SLOTS / (0.75 * (base_ms + per_item_ms) + 0.25 / 8 * (base_ms + 8 * per_item_ms)) * 1000
    sends = {"team-a": (2 * 0.75 * items_per_s, INFER), "team-b": (2 * 0.25 * items_per_s / 8, BATCH_OF_8)}
    served, refused = await flood(
        start_sim,
        start_gateway,
        store_section,
        sends=sends,
        service_ms=base_ms,
        per_item_ms=per_item_ms,
        send_s=send_s,
    )
    counted = [tenant for at, tenant, _ in served if COUNTED_FROM_S <= at <= send_s]
    items = {"team-a": counted.count("team-a"), "team-b": 8 * counted.count("team-b")}
    assert items["team-b"] / sum(items.values()) == pytest.approx(0.25, rel=0.10), items
    assert sum(items.values()) >= busy_share(store_section) * items_per_s * (send_s - COUNTED_FROM_S), items
    assert sum(who == "team-b" for _, who, _ in refused) > 0.2 * sends["team-b"][0] * send_s  # overloaded
    check_admitted_served_in_time(served, refused)
