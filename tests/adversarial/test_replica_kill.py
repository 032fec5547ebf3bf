"""A replica killed with -9 while its requests outlive the lease TTL: the backend computes on (the
sim, like Triton, finishes a request whose client went away), so the survivor must not take those
slots at the TTL.

Without beacons (`store.peer_port: null`), or where a probe cannot tell, Redis cannot tell a dead
replica from a cut-off one: the survivor gets the slots back once the dead replica's work has
surely ended, each lease when its request's upstream timeout (and a TTL) has passed since its
grant, and, when the dead replica might have been serving from its fallback, its share only once
that fallback's time is over too. Meanwhile the survivor admits for the slots left to it, and its
refusals' advice holds for them.

With beacons (the default), the survivor's probe finds the dead replica's port closed: the slots
come back as soon as the backend has stopped its work, at once where it stops on a closed
connection, within the measured service bound where it finishes the work, seconds after the kill.
The sim's own count of requests in flight is the judge throughout."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis

from tests.adversarial.replicas import replica_config as shared_config
from tests.eventually import eventually
from tests.integration.servers import Gateway
from tests.redis_server import redis_url_or_skip, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"
SLOTS = 4
SHARE = SLOTS // 2  # store.replicas: 2
TTL_S = 0.6
SERVICE_S = 2.0  # more than three TTLs: the old reaper freed these slots while they ran
UPSTREAM_TIMEOUT_S = 3.5
BOUND_S = UPSTREAM_TIMEOUT_S + TTL_S  # a lease's work is over within this of its grant
SLACK_S = 3.0  # reaping runs every third of a TTL; a loaded machine adds its own delays


def replica_config(
    sim_url: str, redis_url: str, prefix: str, on_store_failure: str, peer_port: int | None = None
) -> dict:
    return shared_config(
        sim_url,
        redis_url,
        prefix,
        slots=SLOTS,
        service_s=SERVICE_S,
        lease_ttl_s=TTL_S,
        upstream_timeout_s=UPSTREAM_TIMEOUT_S,
        on_store_failure=on_store_failure,
        peer_port=peer_port,
    )


async def infer(http: aiohttp.ClientSession, gateway: Gateway) -> int:
    async with http.post(gateway.url + PATH, json=INFER) as reply:
        await reply.read()
        return reply.status


class Watch:
    """The sim's in-flight count, sampled, and when it was first at `SLOTS` again after the dead
    replica's requests had ended."""

    def __init__(self, sim) -> None:
        self.sim = sim
        self.drained_at: float | None = None
        self.full_again_at: float | None = None
        self.samples: list[tuple[float, int]] = []

    def full_again(self) -> bool:
        self.look()
        return self.full_again_at is not None

    def look(self) -> int:
        inflight = int(self.sim.stats()["inflight"])
        now = time.monotonic()
        self.samples.append((now, inflight))
        if self.drained_at is None and inflight == 0:
            self.drained_at = now
        if self.drained_at is not None and self.full_again_at is None and inflight == SLOTS:
            self.full_again_at = now
        return inflight


@pytest.mark.parametrize("on_store_failure", ["reject", "local"])
async def test_a_killed_replicas_slots_are_not_reused_while_its_work_may_still_run(
    start_sim, start_gateway, on_store_failure
):
    url = redis_url_or_skip()
    prefix = unique_prefix()
    tag = f"{{{prefix}:sim}}"
    admin = redis.Redis.from_url(url)
    admin.hset(f"{tag}:stats", "epoch", "1")  # a deployment that has run a while, not a new state
    sim = start_sim(slots=2 * SLOTS, base_ms=SERVICE_S * 1000)  # room for an over-commit to show
    doomed = start_gateway(replica_config(sim.url, url, prefix, on_store_failure))
    survivor = start_gateway(replica_config(sim.url, url, prefix, "local"))
    watch = Watch(sim)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        # The doomed replica runs every slot and queues more behind them, then dies with them.
        doomed_work = [asyncio.ensure_future(infer(http, doomed)) for _ in range(SLOTS + 2)]
        await eventually(lambda: watch.look() == SLOTS, what="the doomed replica on every slot")
        await eventually(lambda: doomed.assert_metric("gateway_queue_depth", 2, priority="low"))
        sim.reset()  # the peak from here on
        waiting = [asyncio.ensure_future(infer(http, survivor)) for _ in range(2 * SLOTS)]
        await eventually(lambda: survivor.assert_metric("gateway_queue_depth", 2 + 2 * SLOTS, priority="low"))
        doomed.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.gather(*doomed_work, return_exceptions=True)

        if on_store_failure == "reject":
            # No fallback: each lease is the survivor's again once its request is surely over.
            await eventually(
                watch.full_again,
                timeout_s=BOUND_S + SERVICE_S + SLACK_S,
                interval_s=0.05,
                what="the survivor on every slot",
            )
            assert watch.full_again_at is not None
            assert watch.full_again_at - killed_at <= BOUND_S + SLACK_S
            statuses = await asyncio.gather(*waiting)
            assert statuses == [200] * len(waiting)
        else:
            # It might have been cut off and serving from its fallback on its share: that share
            # stays reserved (for store.fallback_max_ms, then the longest a request runs), and
            # only the slots beyond it come back when their requests are surely over.
            deadline = killed_at + BOUND_S + SLACK_S
            await eventually(
                lambda: watch.look() == SLOTS - SHARE and time.monotonic() > deadline,
                timeout_s=BOUND_S + SERVICE_S + 2 * SLACK_S,
                interval_s=0.05,
                what="the survivor on the slots beyond the dead replica's share, and no more",
            )
            assert max(inflight for at, inflight in watch.samples if at > deadline) == SLOTS - SHARE
            assert sum(int(v) for v in admin.hvals(f"{tag}:slots")) == SLOTS, "its share still held"
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
    assert sim.stats()["peak_inflight"] <= SLOTS, [f"{at - killed_at:.1f}:{n}" for at, n in watch.samples]
    admin.close()


SHORT_S = 0.1  # the load's service: 2 slots serve 20 requests a second
ALLOWED_MS = 1000
LOAD_RPS, LOAD_S = 40.0, 6.0  # twice what the slots left to the survivor serve


@contextlib.asynccontextmanager
async def survivor_of_a_kill(start_sim, start_gateway) -> AsyncIterator[Gateway]:
    """Two replicas on SLOTS slots of requests of SHORT_S; one is killed -9 while it runs on every
    slot. Yields the survivor once the dead one's share alone is held: reserved, as it
    might be serving from its fallback (the slots beyond it come back once their requests are
    surely over). The survivor then has half the slots, for minutes."""
    url = redis_url_or_skip()
    prefix = unique_prefix()
    tag = f"{{{prefix}:sim}}"
    admin = redis.Redis.from_url(url)
    admin.hset(f"{tag}:stats", "epoch", "1")
    sim = start_sim(slots=2 * SLOTS, base_ms=SHORT_S * 1000)
    configs = [replica_config(sim.url, url, prefix, "local") for _ in range(2)]
    for config in configs:
        config["priorities"] = [{"name": "low", "max_wait_ms": ALLOWED_MS}]
        config["models"][0]["expected_service_ms"] = SHORT_S * 1000
    doomed, survivor = (start_gateway(config) for config in configs)
    watch = Watch(sim)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        busy = asyncio.Event()

        async def keep_busy() -> None:
            while not busy.is_set():  # bounded: the kill ends it
                await infer(http, doomed)

        doomed_work = [asyncio.ensure_future(keep_busy()) for _ in range(2 * SLOTS)]
        await eventually(lambda: watch.look() == SLOTS, what="the doomed replica on every slot")
        doomed.signal(signal.SIGKILL)
        busy.set()
        await asyncio.gather(*doomed_work, return_exceptions=True)
    await eventually(
        lambda: sum(int(v) for v in admin.hvals(f"{tag}:slots")) == SHARE,
        timeout_s=BOUND_S + SLACK_S,
        what="the dead replica's share alone held",
    )
    try:
        yield survivor
    finally:
        admin.close()
    assert sim.stats()["peak_inflight"] <= SLOTS


async def test_after_a_kill_the_survivor_admits_only_what_the_slots_left_to_it_serve_in_time(
    start_sim, start_gateway
):
    # Read as the whole pool, with the reserved slots' requests as work long overdue, due to end any
    # moment, the survivor admitted work that then waited past its allowance.
    async with survivor_of_a_kill(start_sim, start_gateway) as survivor:
        answers: list[tuple[int, bytes]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def send() -> None:
                async with http.post(survivor.url + PATH, json=INFER) as reply:
                    answers.append((reply.status, await reply.read()))

            sends, started = [], time.monotonic()
            for k in range(int(LOAD_RPS * LOAD_S)):
                await asyncio.sleep(max(0.0, started + k / LOAD_RPS - time.monotonic()))
                sends.append(asyncio.ensure_future(send()))
            await asyncio.gather(*sends)
    served = sum(status == 200 for status, _ in answers)
    expired = sum(b"deadline_expired_in_queue" in body for _, body in answers)
    assert all(status in (200, 429) for status, _ in answers), answers
    # What admission lets in is served in time (its 1% target, and a few of slack for the first
    # second), and the slots left are kept busy.
    assert expired <= 0.03 * (served + expired), (served, expired)
    assert served >= 0.85 * SHARE / SHORT_S * LOAD_S, (served, expired)


BURST = 60  # three seconds of what the slots left serve, at once


async def test_after_a_kill_a_burst_refused_by_the_survivor_is_told_when_to_come_back_and_is_served_then(
    start_sim, start_gateway
):
    # Advice read from a pool of SLOTS slots, half of them reserved, sent clients back before the
    # queue had room for them: they waited out their allowance or were refused again.
    async with survivor_of_a_kill(start_sim, start_gateway) as survivor:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def client() -> tuple[int, int]:
                """(attempts, the last status), following Retry-After up to 3 times."""
                for attempt in range(1, 5):
                    async with http.post(survivor.url + PATH, json=INFER) as reply:
                        await reply.read()
                        if reply.status != 429 or attempt == 4:
                            return attempt, reply.status
                        await asyncio.sleep(int(reply.headers["retry-after-ms"]) / 1000)
                raise AssertionError("unreachable")

            outcomes = await asyncio.gather(*(client() for _ in range(BURST)))
    refused_first = [o for o in outcomes if o[0] > 1]
    assert refused_first, "the burst was more than the slots left serve within the allowance"
    on_first_retry = sum(1 for attempts, status in refused_first if attempts == 2 and status == 200)
    assert on_first_retry >= 0.8 * len(refused_first), outcomes
    assert all(status == 200 for _, status in outcomes), outcomes


KILL_TIMEOUT_S = 300.0  # the default upstream timeout: without a beacon, the bound of a dead replica's slots


@pytest.mark.parametrize(
    ("on_abandon", "service_s", "upstream_timeout_s"),
    [
        ("abort", SHORT_S, KILL_TIMEOUT_S),
        ("drain", SHORT_S, KILL_TIMEOUT_S),
        # Longer than the lease TTL: on abort the sim stops them as the kill closes their
        # connections; on drain it computes on, and the slots wait for the drain bound (here the
        # lease's own, 4 s + a TTL: a model measured on a few 2 s requests has a long tail yet).
        ("abort", SERVICE_S, KILL_TIMEOUT_S),
        ("drain", SERVICE_S, UPSTREAM_TIMEOUT_S + 0.5),
    ],
)
async def test_with_beacons_a_killed_replicas_slots_come_back_within_seconds_and_never_early(
    start_sim, start_gateway, on_abandon, service_s, upstream_timeout_s
):
    url = redis_url_or_skip()
    prefix = unique_prefix()
    admin = redis.Redis.from_url(url)
    admin.hset(f"{{{prefix}:sim}}:stats", "epoch", "1")
    # abort: the sim stops a request whose connection closed, as vLLM does; drain: it finishes it.
    sim = start_sim(
        slots=2 * SLOTS, base_ms=service_s * 1000, on_disconnect="stop" if on_abandon == "abort" else "finish"
    )
    configs = [replica_config(sim.url, url, prefix, "local", peer_port=0) for _ in range(2)]
    for config in configs:
        config["models"][0]["upstream_timeout_ms"] = upstream_timeout_s * 1000
        config["models"][0]["expected_service_ms"] = service_s * 1000
        config["models"][0]["backends"][0]["on_abandon"] = on_abandon
    doomed, survivor = (start_gateway(config) for config in configs)
    watch = Watch(sim)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        stop = asyncio.Event()

        async def keep_busy(gateway: Gateway) -> None:
            while not stop.is_set():  # bounded: the test's end sets it
                with contextlib.suppress(aiohttp.ClientError):
                    await infer(http, gateway)

        doomed_work = [asyncio.ensure_future(keep_busy(doomed)) for _ in range(2 * SLOTS)]
        await eventually(lambda: watch.look() == SLOTS, what="the doomed replica on every slot")
        survivor_work = [asyncio.ensure_future(keep_busy(survivor)) for _ in range(2 * SLOTS)]
        sim.reset()  # the peak from here on
        doomed.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        # Its grants stay untaken, or its heartbeat lapses after a TTL; the survivor's probe finds
        # it gone, and the slots follow at once (abort) or within the drain bound (drain).
        drain_s = upstream_timeout_s + TTL_S if on_abandon == "drain" and service_s > TTL_S else 0.0

        def survivor_on_every_slot() -> bool:
            watch.look()  # the sim's count, sampled for the message should the peak check fail
            return survivor.metric("gateway_inflight_requests", model="sim") == SLOTS

        await eventually(
            survivor_on_every_slot,
            timeout_s=TTL_S + drain_s + SLACK_S,
            interval_s=0.02,
            what="the survivor on every slot, seconds after the kill",
        )
        back_after_s = time.monotonic() - killed_at
        stop.set()
        await asyncio.gather(*doomed_work, *survivor_work, return_exceptions=True)
    assert back_after_s < KILL_TIMEOUT_S / 10
    assert survivor.metric("gateway_replica_probes_total", verdict="gone") >= 1
    assert sim.stats()["peak_inflight"] <= SLOTS, [f"{at - killed_at:.2f}:{n}" for at, n in watch.samples]
    admin.close()


STOPPED_SERVICE_S = 4.0  # outlives the lapse of the heartbeat and a probe's timeout (1 s)


async def test_a_stopped_replica_is_not_taken_for_a_dead_one(start_sim, start_gateway):
    # SIGSTOP: the kernel still accepts on its beacon's port, and nothing answers. Its requests
    # run on (the sim stops one only when its connection closes): were it judged gone, the
    # survivor would take their slots at once and the sim would run more than its slots.
    url = redis_url_or_skip()
    prefix = unique_prefix()
    admin = redis.Redis.from_url(url)
    admin.hset(f"{{{prefix}:sim}}:stats", "epoch", "1")
    sim = start_sim(slots=2 * SLOTS, base_ms=STOPPED_SERVICE_S * 1000, on_disconnect="stop")
    # No fallback: its leases come back at their bounds, with no share held beyond them.
    configs = [replica_config(sim.url, url, prefix, "reject", peer_port=0) for _ in range(2)]
    bound_s = STOPPED_SERVICE_S + 2 + TTL_S
    for config in configs:
        config["models"][0]["upstream_timeout_ms"] = (STOPPED_SERVICE_S + 2) * 1000
        config["models"][0]["backends"][0]["on_abandon"] = "abort"
    stopped, survivor = (start_gateway(config) for config in configs)
    watch = Watch(sim)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        stopped_work = [asyncio.ensure_future(infer(http, stopped)) for _ in range(SLOTS)]
        await eventually(lambda: watch.look() == SLOTS, what="the stopped replica on every slot")
        waiting = [asyncio.ensure_future(infer(http, survivor)) for _ in range(SLOTS)]
        await eventually(lambda: survivor.assert_metric("gateway_queue_depth", SLOTS, priority="low"))
        sim.reset()
        stopped.signal(signal.SIGSTOP)
        try:
            # Its requests end on the sim while it is stopped; only then do their slots serve again.
            await eventually(
                lambda: watch.look() == 0, timeout_s=STOPPED_SERVICE_S + SLACK_S, what="its requests over"
            )
            await eventually(
                lambda: watch.look() == SLOTS, timeout_s=bound_s + SLACK_S, what="the survivor on them"
            )
            # It was probed, and not taken for dead.
            assert survivor.metric("gateway_replica_probes_total", verdict="unknown") >= 1
            assert survivor.metric("gateway_replica_probes_total", verdict="gone") == 0
        finally:
            stopped.signal(signal.SIGCONT)
        assert await asyncio.gather(*waiting) == [200] * SLOTS
        await asyncio.gather(*stopped_work, return_exceptions=True)
    assert sim.stats()["peak_inflight"] <= SLOTS, [f"{n}" for _, n in watch.samples]
    admin.close()
