"""`max_concurrency: auto` in front of the continuous simulator: the gateway finds the engine's
limit from its vLLM metrics, with every default under open-loop overload from clients with
deadlines, follows it when the engine slows, never goes above the cap, and replicas on one Redis
run on one limit."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
import redis

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_post
from tests.redis_server import RedisServer, unique_prefix

pytestmark = pytest.mark.anyio

LOAD_S = 60.0  # no load below runs longer, whatever happens


def auto_config(sim, *, cap=64, **backend):
    config = gateway_config([(sim.url, 1)])
    config["models"][0]["backends"][0].update(
        {
            "kind": "vllm",
            "max_concurrency": "auto",
            "metrics_url": sim.metrics_url,
            "min_concurrency": 1,
            "max_concurrency_cap": cap,
            **backend,
        }
    )
    config["priorities"] = [{"name": "high", "max_wait_ms": 60_000}, {"name": "low", "max_wait_ms": 60_000}]
    config["signals"] = {"scrape_interval_ms": 100}
    return config


def engine(start_sim, max_num_seqs: int, step_ms: float = 5):
    return start_sim(
        extra_args=("--engine", "continuous", "--max-num-seqs", str(max_num_seqs), "--step-ms", str(step_ms))
    )


class ClosedLoop:
    """`clients` that each send a chat request as soon as their last one is answered, until stopped."""

    def __init__(self, gateways, clients: int, tokens: int = 30) -> None:
        self.gateways = gateways
        self.clients = clients
        self.body = {"model": "sim", "prompt": "x", "max_tokens": tokens, "ignore_eos": True}
        self.statuses: list[int] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> ClosedLoop:
        self._http = aiohttp.ClientSession()
        self._tasks = [asyncio.ensure_future(self._client(i)) for i in range(self.clients)]
        return self

    async def _client(self, index: int) -> None:
        gateway = self.gateways[index % len(self.gateways)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOAD_S
        while not self._stop.is_set() and loop.time() < deadline:
            async with self._http.post(gateway.url + "/v1/completions", json=self.body) as reply:
                await reply.read()
                self.statuses.append(reply.status)

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.close()


def limit_of(gateway, sim) -> float:
    return gateway.metric("gateway_backend_slots", model="sim", backend=sim.url)


async def test_the_limit_rises_to_what_the_engine_runs_and_stays_under_the_cap(start_sim, start_gateway):
    sim = engine(start_sim, max_num_seqs=8)
    gateway = start_gateway(auto_config(sim, cap=12))
    assert limit_of(gateway, sim) == 1  # it starts at min_concurrency
    async with ClosedLoop([gateway], clients=24) as load:
        await eventually(lambda: 7 <= limit_of(gateway, sim) <= 9, timeout_s=20, what="a limit near 8")
        sim.reset()  # from now on, peaks are those at the found limit
        await eventually(lambda: len(load.statuses) > 100, timeout_s=20, what="some work at the limit")
        assert 7 <= limit_of(gateway, sim) <= 9
    stats = sim.stats()
    assert stats["peak_inflight"] <= 12  # the cap, whatever the controller does
    assert set(load.statuses) == {200}


@pytest.mark.flood
async def test_with_every_default_it_climbs_to_the_knee_under_overload_from_clients_with_deadlines(
    start_sim, start_gateway
):
    # A big model: 120 ms a step alone, 240 ms with its 16 sequences running. Its clients give each
    # request 8 s, which it keeps at 16; a fixed inter-token objective of 200 ms (the old default)
    # held the limit at 11, 0.8x the goodput. Chat requests of 4-12 tokens arrive at 1.5x what it
    # serves at 16 (16 / (8 tokens x 240 ms) = 8.3 a second).
    max_num_seqs, step_s, tokens, deadline_ms = 16, 0.120, (4, 12), 8000
    engine_args = (
        "--engine", "continuous", "--max-num-seqs", str(max_num_seqs), "--step-ms", str(step_s * 1000),
        "--step-growth", "1",
    )  # fmt: skip
    sim = start_sim(extra_args=engine_args)
    config = gateway_config([(sim.url, 1)])
    backend = config["models"][0]["backends"][0]
    backend.update({"kind": "vllm", "max_concurrency": "auto", "metrics_url": sim.metrics_url})
    gateway = start_gateway(config)
    capacity_rps = max_num_seqs / (sum(tokens) / 2 * 2 * step_s)
    rng = random.Random(7)
    good: list[float] = []  # when each request that ended within its deadline ended
    limits: list[float] = []

    async def chat(http: aiohttp.ClientSession) -> None:
        body = {"model": "sim", "prompt": "x", "max_tokens": rng.randint(*tokens), "ignore_eos": True}
        sent = time.monotonic()
        headers = {"X-Request-Timeout-Ms": str(deadline_ms)}
        async with http.post(gateway.url + "/v1/completions", json=body, headers=headers) as reply:
            await reply.read()
        if reply.status == 200 and time.monotonic() - sent <= deadline_ms / 1000:
            good.append(time.monotonic())

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        started, sends = time.monotonic(), []
        due, until = 0.0, 15.0
        while (due := due + rng.expovariate(1.5 * capacity_rps)) < until:  # bounded: 15 s of arrivals
            await asyncio.sleep(max(0.0, started + due - time.monotonic()))
            sends.append(asyncio.ensure_future(chat(http)))
            if not limits or time.monotonic() - started >= len(limits):
                limits.append(limit_of(gateway, sim))  # one reading a second
        await asyncio.gather(*sends)
    # Slow start from 1 on the default 1 s scrapes, each rise judged before the next: at the knee
    # within 11 s (9 on an earlier machine, 10 on one half as fast, where the gateway's and the
    # engine's loops run late), then near it (a rise past it is taken back as the engine's queue shows).
    reached = next((i for i, limit in enumerate(limits) if limit >= max_num_seqs - 1), None)
    assert reached is not None and reached <= 11, limits
    assert min(limits[reached:]) >= max_num_seqs - 2, limits
    assert max(limits) <= 1.5 * max_num_seqs, limits  # it rises only while the limit binds
    steady = [at for at in good if started + 9 <= at <= started + until]
    assert len(steady) / (until - 9) >= 0.8 * capacity_rps, (len(steady), capacity_rps, limits)
    assert sim.stats()["peak_inflight"] <= 2 * max_num_seqs  # the engine queues, never the gateway's fault


async def test_when_the_engine_slows_down_the_limit_follows_its_latency_objective(start_sim, start_gateway):
    # 10 ms steps that double from 1 to 16 running: within 15 ms it runs 8 (10 x (1 + 7/15) = 14.7).
    sim = engine(start_sim, max_num_seqs=16, step_ms=10)
    gateway = start_gateway(auto_config(sim, itl_objective_ms=15, ttft_objective_ms=10_000))
    async with ClosedLoop([gateway], clients=32):
        # A step takes a little longer than its nominal time on a busy machine (the event loop's
        # lag): the limit found may be a slot or two below 8, never far above.
        await eventually(lambda: 5 <= limit_of(gateway, sim) <= 9, timeout_s=30, what="a limit near 8")
        # Another tenant on the GPU: every step 25% longer; within 15 ms it now runs 4.
        assert http_post(sim.url + "/sim/speed", json.dumps({"slowdown": 1.25}).encode())[0] == 200
        await eventually(lambda: limit_of(gateway, sim) <= 4, timeout_s=10, what="the limit to follow")
        await eventually(lambda: limit_of(gateway, sim) >= 2, timeout_s=5, what="no collapse")


@pytest.mark.redis
async def test_replicas_on_one_redis_run_on_one_limit(start_sim, start_gateway):
    server = RedisServer()
    try:
        sim = engine(start_sim, max_num_seqs=8)
        prefix = unique_prefix()
        store = {"kind": "redis", "url": server.url, "key_prefix": prefix, "replicas": 2}
        replicas = [start_gateway(auto_config(sim, cap=16) | {"store": store}) for _ in range(2)]
        async with ClosedLoop(replicas, clients=24):
            await eventually(
                lambda: all(7 <= limit_of(g, sim) <= 9 for g in replicas), timeout_s=30, what="limits near 8"
            )
            sim.reset()
            await eventually(
                lambda: sim.stats()["completed"] > 100, timeout_s=20, what="some work at the shared limit"
            )
            limits = {limit_of(g, sim) for g in replicas}
            shared = redis.Redis.from_url(server.url).hget(f"{{{prefix}:sim}}:limit:{sim.url}", "slots")
        assert len(limits) <= 2 and max(limits) - min(limits) <= 1  # one limit (a scrape apart at most)
        assert shared is not None and abs(float(shared) - min(limits)) <= 1  # the leader's, in Redis
        assert sim.stats()["peak_inflight"] <= 16  # the cap holds for both replicas together
    finally:
        server.stop()
