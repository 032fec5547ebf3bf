"""A system of queues through real gateways: tenants flooding one class share the backend by
weight, on both stores; a class's reserved slots stay free for it while another floods; a class
kept to a time window is refused outside it; a tenant borrows idle quota and gives it back to its
owner as its borrowed requests finish; queued work that can no longer be served is told at once."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_post
from tests.redis_server import RedisServer, unique_prefix

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"
PER_TENANT = 200
# Completions counted: past the first (the queue builds up while the clients send) and before the
# heavier tenant's requests run out (it is handed 3 of every 4 slots: after 4/3 x PER_TENANT).
WINDOW = slice(40, 240)


def weighted_config(sim, **overrides):
    overrides.setdefault(
        "priorities", [{"name": "high", "max_wait_ms": 30_000}, {"name": "low", "max_wait_ms": 30_000}]
    )
    overrides.setdefault("expected_service_ms", 20)
    return gateway_config(
        [(sim.url, 4)],
        tenants=[{"name": "team-a", "weight": 3}, {"name": "team-b", "weight": 1}],
        **overrides,
    )


async def flood(gateways, answered: list[str] | None = None) -> list[str]:
    """Both tenants send PER_TENANT requests at once, in turns, spread over `gateways`; the order in
    which they were answered (also into `answered` as they are)."""
    answered = [] if answered is None else answered

    async def infer(http, gateway, tenant):
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Tenant": tenant}) as reply:
            await reply.read()
            assert reply.status == 200, await reply.text()
        answered.append(tenant)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        sends = [
            infer(http, gateways[i % len(gateways)], tenant)
            for i in range(PER_TENANT)
            for tenant in ("team-a", "team-b")
        ]
        await asyncio.gather(*sends)
    return answered


async def set_fault(sim, fault):
    """The simulator's fault from now on (gateway.tools.model_server.faults): {"hang": True}
    holds the inference requests it takes, however slow the machine is, until it is cleared with {}.
    A held request is counted in the faults' "hanging" and "peak_hanging", not in "inflight"."""
    body = json.dumps(fault).encode()
    assert (await asyncio.to_thread(http_post, sim.url + "/sim/fault", body))[0] == 200


async def hanging(sim, count, what):
    await eventually(lambda: sim.stats()["faults"]["hanging"] == count, what=what)


def heavier_share(answered: list[str]) -> float:
    counted = answered[WINDOW]
    return counted.count("team-a") / len(counted)


async def test_two_tenants_weighted_3_to_1_are_served_3_to_1(start_sim, start_gateway):
    sim = start_sim(slots=4, base_ms=20)
    gateway = start_gateway(weighted_config(sim))
    answered: list[str] = []
    flooding = asyncio.ensure_future(flood([gateway], answered))
    # While both are backlogged, the gateway reports what each tenant gets.
    await eventually(lambda: len(answered) >= 150, what="the flood to be under way")
    exported = gateway.metric("gateway_tenant_share", model="sim", priority="low", tenant="team-a")
    share = heavier_share(await flooding)
    assert share == pytest.approx(0.75, rel=0.05)
    assert exported == pytest.approx(0.75, abs=0.1)


async def test_shares_are_counted_in_batch_items_when_one_tenant_sends_8x_larger_batches(
    start_sim, start_gateway
):
    # Priced by batch items, team-b's batches of 8 cost 8 each: with weights 3:1 team-a is handed
    # three items for each of team-b's, 24 of its requests per one of team-b's. Both stay
    # backlogged (150 and 20 requests outstanding on 4 slots of 20 ms: 0.8 s of team-a's turns, so
    # that clients slowed by a busy machine still resend before its queue runs dry; with 100 on
    # 10 ms slots, a CI run's clients once fell 0.25 s behind and team-b was handed team-a's
    # turns) until 1,200 answers are in.
    sim = start_sim(slots=4, base_ms=20)
    config = weighted_config(sim)
    config["models"][0]["cost"] = "batch_items"
    gateway = start_gateway(config)
    big = {"inputs": [{"name": "INPUT0", "shape": [8, 1], "datatype": "FP32", "data": [1] * 8}]}
    answered: list[str] = []

    async def client(http, tenant, body):
        while len(answered) < 1200:  # bounded by the answers counted, each at most 30 s
            async with http.post(gateway.url + PATH, json=body, headers={"X-Tenant": tenant}) as reply:
                await reply.read()
                assert reply.status == 200, await reply.text()
            answered.append(tenant)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(
            *(client(http, "team-a", INFER) for _ in range(150)),
            *(client(http, "team-b", big) for _ in range(20)),
        )
    counted = answered[150:1150]
    work_a, work_b = counted.count("team-a"), 8 * counted.count("team-b")
    assert work_a / work_b == pytest.approx(3.0, rel=0.05)
    assert sim.stats()["peak_inflight"] <= 4


@pytest.mark.redis
async def test_three_redis_replicas_keep_the_same_shares(start_sim, start_gateway):
    redis_server = RedisServer()
    try:
        sim = start_sim(slots=4, base_ms=20)
        store = {"kind": "redis", "url": redis_server.url, "key_prefix": unique_prefix(), "replicas": 3}
        replicas = [start_gateway(weighted_config(sim, store=store)) for _ in range(3)]
        share = heavier_share(await flood(replicas))
        assert share == pytest.approx(0.75, rel=0.05)
        assert sim.stats()["peak_inflight"] <= 4
    finally:
        redis_server.stop()


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_light_tenant_is_admitted_on_its_turn_while_a_heavy_one_floods(
    start_sim, start_gateway, store_section
):
    # 4 slots of 40 ms drain 100 requests a second: a 500 ms queue wait holds about 50 of them,
    # which the heavy tenant's 80 clients keep full (each back as soon as it is answered, or after
    # the Retry-After it is given, up to 50 ms). The light tenant's request is served on its turn
    # in the band's fair queuing, a request or so ahead, and is admitted on that.
    sim = start_sim(slots=4, base_ms=40)
    overrides = {} if store_section is None else {"store": store_section}
    classes = [{"name": "low", "max_wait_ms": 500}]
    gateway = start_gateway(weighted_config(sim, priorities=classes, expected_service_ms=40, **overrides))
    heavy_statuses: list[int] = []
    flooding = True

    async def post(http, tenant):
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Tenant": tenant}) as reply:
            await reply.read()
            return reply.status, float(reply.headers.get("retry-after-ms", 0))

    async def heavy_client(http):
        for _ in range(200):  # bounded; stops once the light tenant is done
            if not flooding:
                return
            status, advice_ms = await post(http, "team-a")
            heavy_statuses.append(status)
            if status == 429:
                await asyncio.sleep(min(advice_ms, 50) / 1000)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        heavy = asyncio.gather(*(heavy_client(http) for _ in range(80)))
        await eventually(lambda: heavy_statuses.count(429) >= 20, what="the heavy tenant to be refused")
        refused_before = heavy_statuses.count(429)
        light = [(await post(http, "team-b"))[0] for _ in range(20)]
        refused_meanwhile = heavy_statuses.count(429) - refused_before
        flooding = False
        await heavy
    assert light == [200] * 20
    assert refused_meanwhile >= 20  # the queue stayed full while the light tenant was served
    assert sim.stats()["peak_inflight"] <= 4


@pytest.mark.parametrize(
    "reservation",
    [{"reserved_slots": 1}, {"reserved_slots_in": {"all-week": 1}}],
    ids=["always", "in-an-open-window"],
)
async def test_a_reserved_slot_is_free_for_an_urgent_request_while_a_batch_class_floods(
    start_sim, start_gateway, reservation
):
    sim = start_sim(slots=4, base_ms=300)
    config = gateway_config(
        [(sim.url, 4)],
        priorities=[
            {"name": "high", "max_wait_ms": 5_000, **reservation},
            {"name": "low", "max_wait_ms": 30_000},
        ],
        expected_service_ms=300,
        windows=[{"name": "all-week", "from": "00:00", "to": "00:00"}],  # the whole day, every day
    )
    gateway = start_gateway(config)
    sim.reset()

    async def infer(http, priority):
        headers = {"X-Priority": priority}
        async with http.post(gateway.url + PATH, json=INFER, headers=headers) as reply:
            await reply.read()
            assert reply.status == 200, await reply.text()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        # The backend holds what it takes until the urgent request has joined the flood on it.
        await set_fault(sim, {"hang": True})
        flood = [asyncio.ensure_future(infer(http, "low")) for _ in range(12)]
        await eventually(lambda: gateway.metric("gateway_queue_depth", priority="low") == 9.0)
        await hanging(sim, 3, "three of the flood on the backend")
        assert gateway.metric("gateway_inflight_requests", model="sim") == 3  # the fourth slot is high's
        urgent = asyncio.ensure_future(infer(http, "high"))
        await hanging(sim, 4, "the urgent request on the backend beside them")
        await set_fault(sim, {})
        await urgent
        await asyncio.gather(*flood)
    # It found a slot free, rather than waiting in the queue for a request of the flood to end.
    waited = {"model": "sim", "priority": "high"}
    assert gateway.metric("gateway_queue_wait_seconds_count", **waited) == 1
    assert gateway.metric("gateway_queue_wait_seconds_bucket", le="0.025", **waited) == 1
    assert gateway.metric("gateway_admission_queued_total", model="sim", priority="low") == 9
    stats = sim.stats()
    assert stats["faults"]["peak_hanging"] == 4 and stats["peak_inflight"] == 4, stats


async def test_a_class_outside_its_window_is_refused_with_the_time_until_it_opens(start_sim, start_gateway):
    sim = start_sim(slots=2, base_ms=5)
    opens = datetime.now(UTC) + timedelta(hours=2)
    window = {"name": "later", "from": f"{opens:%H:%M}", "to": f"{opens + timedelta(hours=1):%H:%M}"}
    config = gateway_config(
        [(sim.url, 2)],
        priorities=[
            {"name": "high", "max_wait_ms": 250},
            {"name": "low", "max_wait_ms": 1000, "only_in": "later"},
        ],
        windows=[window],
    )
    gateway = start_gateway(config)
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Priority": "low"}) as reply:
            body = await reply.json()
            assert reply.status == 429, body
            advice_s = float(reply.headers["retry-after-ms"]) / 1000
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Priority": "high"}) as reply:
            assert reply.status == 200
        # A budget no idle pool can meet is told so, not to come back when the window opens.
        hopeless = {"X-Priority": "low", "X-Request-Timeout-Ms": "1"}
        async with http.post(gateway.url + PATH, json=INFER, headers=hopeless) as reply:
            hopeless_body = await reply.json()
            assert reply.status == 400 and reply.headers["x-should-retry"] == "false", hopeless_body
            assert "retry-after" not in reply.headers
    assert hopeless_body["reason"] == "budget_too_small"
    assert (body["reason"], body["rule"]) == ("outside_window", "windows[later]")
    # Until the window opens: two hours less the seconds into this minute.
    assert 2 * 3600 - 61 <= advice_s <= 2 * 3600
    assert (
        gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="outside_window") == 1
    )


@pytest.mark.parametrize(("borrowing_limit", "peak"), [(None, 4), (0, 2)])
async def test_a_tenant_over_its_quota_borrows_idle_capacity_unless_its_quota_is_hard(
    start_sim, start_gateway, borrowing_limit, peak
):
    sim = start_sim(slots=4, base_ms=200)
    mine = {"name": "team-a", "quota": 2, "borrowing_limit": borrowing_limit}
    tenants = [{k: v for k, v in mine.items() if v is not None}, {"name": "team-b", "quota": 2}]
    gateway = start_gateway(gateway_config([(sim.url, 4)], expected_service_ms=200, tenants=tenants))
    sim.reset()

    async def infer(http):
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Tenant": "team-a"}) as reply:
            await reply.read()
            assert reply.status == 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await set_fault(sim, {"hang": True})  # those that run are held there until counted
        sent = asyncio.gather(*(infer(http) for _ in range(4)))
        await hanging(sim, peak, "team-a's requests to run")
        await eventually(
            lambda: gateway.metric("gateway_queue_depth", priority="low") == 4 - peak,
            what="the rest to queue",
        )
        borrowed = gateway.metric("gateway_tenant_borrowed_work", model="sim", tenant="team-a")
        await set_fault(sim, {})
        await sent
    # The backend's own count: team-b's idle quota lent to team-a, or not.
    stats = sim.stats()
    assert stats["faults"]["peak_hanging"] == peak and stats["peak_inflight"] == peak, stats
    assert borrowed == peak - 2


async def release(sim, count, running):
    """Let the `count` requests that have hung longest finish, and wait for the freed slots to be
    taken again (the backend's own count back at `running`)."""
    received = sim.stats()["faults"]["received"]
    await set_fault(sim, {"hang": True, "release": count})
    await eventually(
        lambda: (
            sim.stats()["faults"]["received"] == received + count
            and sim.stats()["faults"]["hanging"] == running
        ),
        what=f"{count} freed slots to be taken again",
    )


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_borrowed_capacity_goes_back_to_its_owner_as_the_borrowed_requests_finish(
    start_sim, start_gateway, store_section
):
    # team-a (quota 2) runs all 4 slots while team-b (quota 2) is idle, 2 of them on team-b's lent
    # quota, and queues 2 more. Then team-b's 2 requests come: nothing running is stopped, each
    # slot that frees goes to team-b although team-a's requests have waited longer, and team-a
    # starts nothing new until team-b runs its quota; then team-a runs within its own.
    sim = start_sim(slots=4, base_ms=0)
    tenants = [{"name": "team-a", "quota": 2}, {"name": "team-b", "quota": 2}]
    classes = [{"name": "high", "max_wait_ms": 20_000}, {"name": "low", "max_wait_ms": 20_000}]
    config = gateway_config([(sim.url, 4)], expected_service_ms=200, tenants=tenants, priorities=classes)
    # The backend is held on purpose, step by step, which on a busy machine once took past the
    # stall watch's 30 s: it took the held requests for a stalled backend's and cut them (504).
    config["health"]["stall_timeout_ms"] = 600_000
    if store_section is not None:
        config["store"] = store_section
    gateway = start_gateway(config)
    sim.reset()

    async def infer(http, tenant):
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Tenant": tenant}) as reply:
            await reply.read()
            return reply.status

    def borrowed():
        return gateway.metric("gateway_tenant_borrowed_work", model="sim", tenant="team-a")

    def queued():
        return gateway.metric("gateway_queue_depth", model="sim", priority="low")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await set_fault(sim, {"hang": True})  # a request runs until the test lets it finish
        owned = []
        for running in (1, 2):  # one after the other: the backend releases the longest held first
            owned.append(asyncio.ensure_future(infer(http, "team-a")))
            await hanging(sim, running, "team-a's requests within its quota to run")
        lent = [asyncio.ensure_future(infer(http, "team-a")) for _ in range(2)]
        await hanging(sim, 4, "team-a to borrow team-b's idle quota")
        waiting = [asyncio.ensure_future(infer(http, "team-a")) for _ in range(2)]
        await eventually(lambda: queued() == 2, what="team-a's requests beyond the pool to queue")
        assert borrowed() == 2
        owner = [asyncio.ensure_future(infer(http, "team-b")) for _ in range(2)]
        await eventually(lambda: queued() == 4, what="team-b's requests to queue")
        assert sim.stats()["faults"]["hanging"] == 4 and not any(call.done() for call in owned + lent)

        await release(sim, 1, running=4)  # team-a's first: its slot goes to team-b
        assert (await owned[0], queued(), borrowed()) == (200, 3, 1)
        await release(sim, 1, running=4)  # team-a's second: team-b's second request starts
        assert (await owned[1], queued(), borrowed()) == (200, 2, 0)
        assert not any(call.done() for call in waiting + owner)
        await release(sim, 2, running=4)  # team-a's borrowed two: its queued work runs, as owned
        assert [await call for call in lent] == [200, 200]
        assert (queued(), borrowed()) == (0, 0)
        await set_fault(sim, {})
        assert [await call for call in waiting + owner] == [200] * 4
    assert sim.stats()["faults"]["peak_hanging"] == 4  # the backend's own count: never beyond its slots


async def test_at_the_cap_an_urgent_arrival_displaces_a_queued_batch_request_which_is_told_at_once(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=400)
    classes = [{"name": "high", "max_wait_ms": 10_000}, {"name": "low", "max_wait_ms": 10_000}]
    config = gateway_config([(sim.url, 1)], priorities=classes, expected_service_ms=400)
    config["models"][0]["max_queued_work"] = 2
    gateway = start_gateway(config)

    async def infer(http, priority):
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Priority": priority}) as reply:
            return reply.status, await reply.json(), reply.headers.get("retry-after-ms")

    async with aiohttp.ClientSession() as http:
        await set_fault(sim, {"hang": True})  # the slot stays taken until the displacement is seen
        running = asyncio.ensure_future(infer(http, "low"))
        await hanging(sim, 1, "the slot to be taken")
        lows = []
        for expected in (1.0, 2.0):
            lows.append(asyncio.ensure_future(infer(http, "low")))
            await eventually(lambda e=expected: gateway.metric("gateway_queue_depth", priority="low") == e)
        urgent = asyncio.ensure_future(infer(http, "high"))
        status, body, advice = await lows[1]  # the newest low request, answered at once
        assert (status, body["reason"], body["rule"]) == (429, "displaced", "models[sim].max_queued_work")
        assert advice is not None and float(advice) > 0
        assert not urgent.done() and not lows[0].done()
        await set_fault(sim, {})
        results = await asyncio.gather(running, lows[0], urgent)
    assert [status for status, _, _ in results] == [200, 200, 200]


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_queued_work_an_urgent_flood_pushes_past_its_allowance_is_told_at_once(
    start_sim, start_gateway, store_section
):
    # One slot of 50 ms a batch item: 20 hand-overs a second, 30 within the low class's 1.5 s, of
    # which admission counts on 21 while the service times are not yet known (n + 2 sqrt(n) <= 30).
    # Three low requests queue behind a running batch of 40 (2 s); 60 urgent ones then go ahead of
    # them: the low ones cannot be served in time and hear so at once, not when their 1.5 s runs out.
    sim = start_sim(slots=1, base_ms=0, per_item_ms=50)
    classes = [{"name": "high", "max_wait_ms": 30_000}, {"name": "low", "max_wait_ms": 1500}]
    config = gateway_config([(sim.url, 1)], priorities=classes, expected_service_ms=50)
    if store_section is not None:
        config["store"] = store_section
    gateway = start_gateway(config)

    async def infer(http, priority, body=INFER):
        async with http.post(gateway.url + PATH, json=body, headers={"X-Priority": priority}) as reply:
            return reply.status, await reply.json(), reply.headers.get("retry-after-ms")

    long_batch = {"inputs": [{"name": "INPUT0", "shape": [40, 1], "datatype": "FP32", "data": [1] * 40}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        running = asyncio.ensure_future(infer(http, "low", long_batch))
        await eventually(lambda: sim.stats()["inflight"] == 1, what="the slot to be taken")
        lows = [asyncio.ensure_future(infer(http, "low")) for _ in range(3)]
        await eventually(lambda: gateway.metric("gateway_queue_depth", priority="low") == 3.0)
        urgent = [asyncio.ensure_future(infer(http, "high")) for _ in range(60)]
        told = await asyncio.gather(*lows)
        assert not all(u.done() for u in urgent)  # told while the flood still waits
        served = await asyncio.gather(running, *urgent)
    for status, body, advice in told:
        assert (status, body["reason"], body["rule"]) == (429, "displaced", "priorities[low].max_wait_ms")
        assert advice is not None and float(advice) > 0
    assert [status for status, _, _ in served] == [200] * 61
    assert gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="displaced") == 3
    assert sim.stats()["peak_inflight"] <= 1


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_lows_a_few_urgent_requests_push_past_their_allowance_are_displaced_when_they_arrive(
    start_sim, start_gateway, store_section
):
    # One slot of a fixed 200 ms, both classes allowed 1.5 s. Twelve low requests 10 ms apart:
    # the slot hands over at 0.2, 0.4, ... s, so lows 1-7 start within 1.5 s of arriving and are
    # admitted (the rest refused). At 0.3 s four high ones go ahead of the queued lows 2-7: low 2
    # then starts at 1.2 s and low 3 at 1.4 s, in time; lows 4-7 would start at 1.6 s and later,
    # past their 1.54 s and later leave-by times. They are told so when the highs arrive, not when
    # their allowance runs out, and once the gateway has measured the fixed service time it
    # displaces none that would have been served.
    sim = start_sim(slots=1, base_ms=200)
    classes = [{"name": "high", "max_wait_ms": 1500}, {"name": "low", "max_wait_ms": 1500}]
    config = gateway_config([(sim.url, 1)], priorities=classes, expected_service_ms=200)
    if store_section is not None:
        config["store"] = store_section
    gateway = start_gateway(config)
    loop = asyncio.get_running_loop()

    async def infer(http, priority):
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Priority": priority}) as reply:
            body = await reply.json()
            return reply.status, body.get("reason"), loop.time()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for _ in range(10):  # the service time measured: its spread is known from 10 on
            assert (await infer(http, "low"))[0] == 200
        start = loop.time()
        lows = []
        for i in range(12):
            lows.append(asyncio.ensure_future(infer(http, "low")))
            await asyncio.sleep(max(0.0, start + (i + 1) * 0.01 - loop.time()))  # the open loop's pace
        # The lows the slot can serve within 1.5 s are queued behind the running one: lows 2-7,
        # where admission counts as the slot does (5 at least, wherever its margin stands).
        await eventually(lambda: gateway.metric("gateway_queue_depth", priority="low") >= 5)
        await asyncio.sleep(max(0.0, start + 0.3 - loop.time()))  # the highs come at 0.3 s: an input
        highs_at = loop.time()
        highs = [asyncio.ensure_future(infer(http, "high")) for _ in range(4)]
        told = await asyncio.gather(*lows)
        served_highs = await asyncio.gather(*highs)
    outcomes = [(status, reason) for status, reason, _ in told]
    assert outcomes[:3] == [(200, None)] * 3, outcomes
    assert (429, "deadline_expired_in_queue") not in outcomes, outcomes
    displaced = [at for status, reason, at in told if reason == "displaced"]
    assert len(displaced) >= 3, outcomes  # lows 4-7 at least, where admission took them
    assert all(at - highs_at < 0.5 for at in displaced), "displaced when their allowance ran out"
    assert [status for status, _, _ in served_highs] == [200] * 4
    assert sim.stats()["peak_inflight"] <= 1


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_what_a_hard_quota_would_keep_past_its_allowance_is_refused_at_arrival(
    start_sim, start_gateway, store_section
):
    # team-a runs one request at a time (quota 1, borrowing_limit 0), each taken to last 1 s; a
    # request may wait 5.5 s. Behind 1 running and 4 queued the sixth waits 5 s and is admitted;
    # the seventh would wait 6 s, so it is refused at once, naming the quota, although the pool
    # has three idle slots and would admit it on its own drain.
    sim = start_sim(slots=4, base_ms=1000)
    tenants = [{"name": "team-a", "quota": 1, "borrowing_limit": 0}, {"name": "team-b"}]
    classes = [{"name": "high", "max_wait_ms": 5500}, {"name": "low", "max_wait_ms": 5500}]
    config = gateway_config([(sim.url, 4)], expected_service_ms=1000, tenants=tenants, priorities=classes)
    if store_section is not None:
        config["store"] = store_section
    gateway = start_gateway(config)

    async def infer(http, tenant):
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Tenant": tenant}) as reply:
            return reply.status, await reply.json(), reply.headers.get("retry-after-ms")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await set_fault(sim, {"hang": True})  # nothing finishes while the queue is built
        admitted = [asyncio.ensure_future(infer(http, "team-a"))]
        await hanging(sim, 1, "team-a's first request to run")
        for queued in range(1, 5 + 1):
            admitted.append(asyncio.ensure_future(infer(http, "team-a")))
            await eventually(
                lambda n=queued: gateway.assert_metric("gateway_queue_depth", n, model="sim", priority="low")
            )
        for _ in range(2):
            status, body, advice = await infer(http, "team-a")
            assert (status, body["reason"], body["rule"]) == (429, "queue_full", "tenants[team-a].quota")
            assert advice is not None and float(advice) >= 500  # its own queue must come down first
        other = asyncio.ensure_future(infer(http, "team-b"))  # the pool itself has room
        await hanging(sim, 2, "team-b's request to run beside team-a's")
        await set_fault(sim, {})
        assert (await other)[0] == 200
        for call in admitted:
            call.cancel()
    assert gateway.metric_by("gateway_requests_total", "outcome", model="sim").get("queue_full") == 2


async def test_a_request_above_what_a_hard_quota_ever_lets_run_is_refused_without_inviting_a_retry(
    start_sim, start_gateway
):
    # team-a may run 2 batch items at once (quota 1, borrowing_limit 1); a batch of 3 could never
    # start, however idle the pool: a 400 that says so, not a 429 to come back after.
    sim = start_sim(slots=4, base_ms=10)
    tenants = [{"name": "team-a", "quota": 1, "borrowing_limit": 1}, {"name": "team-b"}]
    config = gateway_config([(sim.url, 4)], tenants=tenants)
    config["models"][0]["cost"] = "batch_items"
    gateway = start_gateway(config)
    batch = {"inputs": [{"name": "INPUT0", "shape": [3, 1], "datatype": "FP32", "data": [1, 2, 3]}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + PATH, json=batch, headers={"X-Tenant": "team-a"}) as reply:
            status, headers, body = reply.status, reply.headers, await reply.json()
        async with http.post(gateway.url + PATH, json=INFER, headers={"X-Tenant": "team-a"}) as reply:
            assert reply.status == 200  # one within the cap runs
    assert (status, body["reason"], body["rule"]) == (400, "cost_above_quota", "tenants[team-a].quota")
    assert "it costs 3, at most 2 may run" in body["error"]
    assert headers["x-should-retry"] == "false" and "retry-after" not in headers
    outcomes = gateway.metric_by("gateway_requests_total", "outcome", model="sim")
    assert outcomes.get("cost_above_quota") == 1


@pytest.mark.redis
@pytest.mark.parametrize(("borrowing_limit", "peak"), [(None, 4), (0, 2)])
async def test_three_redis_replicas_keep_a_quota_as_one_gateway_does(
    start_sim, start_gateway, borrowing_limit, peak
):
    # The same quotas as the single-gateway test above, team-a's six requests sent through three
    # replicas sharing one Redis: the backend's own count shows what team-a runs at most.
    redis_server = RedisServer()
    try:
        sim = start_sim(slots=4, base_ms=200)
        mine = {"name": "team-a", "quota": 2, "borrowing_limit": borrowing_limit}
        tenants = [{k: v for k, v in mine.items() if v is not None}, {"name": "team-b", "quota": 2}]
        store = {"kind": "redis", "url": redis_server.url, "key_prefix": unique_prefix(), "replicas": 3}
        classes = [{"name": "high", "max_wait_ms": 20_000}, {"name": "low", "max_wait_ms": 20_000}]
        config = gateway_config(
            [(sim.url, 4)], expected_service_ms=200, tenants=tenants, priorities=classes, store=store
        )
        replicas = [start_gateway(config) for _ in range(3)]
        sim.reset()

        async def infer(http, gateway):
            async with http.post(gateway.url + PATH, json=INFER, headers={"X-Tenant": "team-a"}) as reply:
                await reply.read()
                assert reply.status == 200

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            await set_fault(sim, {"hang": True})  # those that run are held there until counted
            sent = asyncio.gather(*(infer(http, replicas[i % 3]) for i in range(6)))
            await hanging(sim, peak, "team-a's requests to run")
            await eventually(
                lambda: replicas[0].assert_metric("gateway_queue_depth", 6 - peak, priority="low"),
                what="the rest to queue in the shared queue",
            )
            await set_fault(sim, {})
            await sent
        stats = sim.stats()
        assert stats["faults"]["peak_hanging"] == peak and stats["peak_inflight"] == peak, stats
    finally:
        redis_server.stop()
