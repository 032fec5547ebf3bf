"""One replica cut off from Redis while both are saturated: the backend never runs more than its
slots. The cut-off replica serves from its fallback on the leases it holds, the other keeps those
reserved instead of reaping them at the TTL, and once the link is back both serve again and nothing
stays counted. The sim's own count of requests in flight is the judge."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import pytest
import redis

from tests.adversarial.replicas import replica_config as shared_config
from tests.adversarial.tcp_proxy import CuttableProxy
from tests.eventually import eventually
from tests.integration.servers import Gateway
from tests.redis_server import redis_url_or_skip, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"
SLOTS = 8
TTL_S = 0.9
SERVICE_S = 1.5  # longer than it takes the cut-off replica to notice the cut (store.timeout_ms)
UPSTREAM_TIMEOUT_S = 5.0
CUT_FOR_S = 4 * TTL_S  # at least, and until both replicas served through it


def replica_config(sim_url: str, redis_url: str, prefix: str) -> dict:
    return shared_config(
        sim_url,
        redis_url,
        prefix,
        slots=SLOTS,
        service_s=SERVICE_S,
        lease_ttl_s=TTL_S,
        upstream_timeout_s=UPSTREAM_TIMEOUT_S,
        timeout_ms=300,
    )


class SharedState:
    """What Redis holds for the model, read directly."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.tag = f"{{{prefix}:sim}}"

    def seed(self) -> None:
        """A state that was not just created (a deployment that has run a while), so that no window
        of presumed fallback work after a new state covers for the reservations under test."""
        self.client.hset(f"{self.tag}:stats", "epoch", "1")

    def slots_in_use(self) -> int:
        return sum(int(v) for v in self.client.hvals(f"{self.tag}:slots"))

    def replica_of(self, gateway: Gateway) -> str:
        """The gateway's replica id (gateway.queues.configured.replica_name: host-pid-tag)."""
        start = f"{socket.gethostname()}-{gateway.process.pid}-"
        names = self.live_replicas()
        matching = [n for n in names if n.startswith(start)]
        assert len(matching) == 1, names
        return matching[0]

    def live_replicas(self) -> list[str]:
        return [n.decode() for n in self.client.zrange(f"{self.tag}:replicas", 0, -1)]

    def lease_ages_s(self, replica: str) -> list[float]:
        """How long ago each lease the replica holds was granted, by Redis's clock."""
        seconds, micros = self.client.time()
        now = seconds + micros / 1e6
        leases = self.client.smembers(f"{self.tag}:held:{replica}")
        bounds = self.client.hmget(f"{self.tag}:bound", list(leases)) if leases else []
        # A lease's bound is its grant time + the upstream timeout + one TTL (queues/redis/presence.py).
        return [now - (float(b) - UPSTREAM_TIMEOUT_S - TTL_S) for b in bounds if b is not None]

    def nothing_counted(self) -> None:
        queued = {k.decode(): float(v) for k, v in self.client.hgetall(f"{self.tag}:queued").items()}
        assert self.slots_in_use() == 0, self.slots_in_use()
        assert self.client.zcard(f"{self.tag}:leases") == 0
        assert all(v == 0 for v in queued.values()), queued


@dataclass(frozen=True)
class Answer:
    replica: str
    status: int
    sent_at: float
    answered_at: float


@pytest.fixture
def proxy():
    parts = urlsplit(redis_url_or_skip())
    made = CuttableProxy(parts.hostname or "127.0.0.1", parts.port or 6379).start()
    yield made
    made.close()


async def test_a_replica_cut_off_from_redis_never_overcommits_the_backend(start_sim, start_gateway, proxy):
    url = redis_url_or_skip()
    prefix = unique_prefix()
    through_proxy = f"redis://127.0.0.1:{proxy.port}{urlsplit(url).path or '/0'}"
    sim = start_sim(slots=2 * SLOTS, base_ms=SERVICE_S * 1000)  # room for an over-commit to show
    shared = SharedState(url, prefix)
    shared.seed()
    cut_off = start_gateway(replica_config(sim.url, through_proxy, prefix))
    other = start_gateway(replica_config(sim.url, url, prefix))
    cut_off_id, other_id = shared.replica_of(cut_off), shared.replica_of(other)
    answers: list[Answer] = []
    stop = asyncio.Event()
    give_up_at = time.monotonic() + 50

    async def client(http: aiohttp.ClientSession, name: str, gateway: Gateway) -> None:
        for _ in range(200):
            if stop.is_set() or time.monotonic() > give_up_at:
                return
            sent_at = time.monotonic()
            async with http.post(gateway.url + PATH, json=INFER) as reply:
                await reply.read()
                answers.append(Answer(name, reply.status, sent_at, time.monotonic()))

    def served(name: str, *, sent_after: float = 0.0, answered_after: float = 0.0) -> int:
        return sum(
            1
            for a in answers
            if a.replica == name
            and a.status == 200
            and a.sent_at > sent_after
            and a.answered_at > answered_after
        )

    def ready_to_cut() -> bool:
        # Running requests that started just now (granted long enough ago to have been delivered):
        # they still run when it notices the cut, so its fallback has slots to serve on. Not also
        # "within its share": with a fixed service time the grants come in waves that split alike
        # between the replicas every time, so that moment may never come.
        return any(0.05 < age < SERVICE_S / 3 for age in shared.lease_ages_s(cut_off_id))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        load = [
            asyncio.ensure_future(client(http, name, gw))
            for name, gw in [("cut_off", cut_off), ("other", other)]
            for _ in range(8)
        ]
        try:
            await eventually(
                lambda: served("cut_off") >= 4 and served("other") >= 4 and shared.slots_in_use() == SLOTS,
                timeout_s=20,
                what="both replicas serving, every slot in use",
            )
            sim.reset()  # the peak from here on
            await eventually(
                ready_to_cut, timeout_s=15, what="a fresh part of the slots on the replica to cut"
            )
            proxy.cut()
            cut_at = time.monotonic()
            await eventually(lambda: cut_off.metric("gateway_store_up") == 0, what="the cut to be noticed")
            down_at = time.monotonic()
            await eventually(
                lambda: shared.live_replicas() == [other_id], what="the cut-off replica's heartbeat to lapse"
            )
            lapsed_at = time.monotonic()
            # What it answers once all it ran when it noticed the cut has ended, its fallback granted.
            fallback_from = down_at + SERVICE_S + 0.5
            await eventually(
                lambda: (
                    time.monotonic() - cut_at >= CUT_FOR_S
                    and served("other", sent_after=lapsed_at) >= 4
                    and served("cut_off", answered_after=fallback_from) >= 2
                ),
                timeout_s=20,
                what="both serving through the partition (the cut-off one from its fallback)",
            )
            during = sim.stats()
            proxy.restore()
            restored_at = time.monotonic()
            await eventually(lambda: cut_off.metric("gateway_store_up") == 1, what="the replica to rejoin")
            await eventually(
                lambda: (
                    served("cut_off", sent_after=restored_at) >= 3
                    and served("other", sent_after=restored_at) >= 3
                ),
                timeout_s=20,
                what="both replicas serving again",
            )
        finally:
            stop.set()
            await asyncio.gather(*load)

    after = sim.stats()
    assert during["peak_inflight"] <= SLOTS, during
    assert after["peak_inflight"] <= SLOTS, after
    assert after["peak_inflight"] == SLOTS, after  # it ran at full use: nothing held in vain
    statuses = Counter((a.replica, a.status) for a in answers)
    assert set(statuses) == {("cut_off", 200), ("other", 200)}, statuses
    await eventually(shared.nothing_counted, what="no slot, lease or ticket left counted in Redis")
    assert sim.stats()["inflight"] == 0
    assert "Redis unreachable" in cut_off.log() and "Redis is back" in cut_off.log()
    shared.client.close()
