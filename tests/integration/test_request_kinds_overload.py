"""Service times per kind of request under sustained open-loop overload, at the default budgets
(high 250 ms, low 1 s), on both stores: long streams and short inferences flood one pool at 1.55x
its capacity, urgent inferences among them. Each kind is predicted from its own times, so most of
the urgent inferences are admitted and served in time while the streams hold most slots, what
admission lets in of either class is served in time, and the backend never runs more than its
slots (the simulator's count)."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from tests.integration.servers import gateway_config
from tests.integration.test_overload_shares import (
    GRANT_WAY_MS,
    INFER,
    PATH,
    TARGET_EXPIRY,
    UNLIKELY,
    chance_of_at_least,
    schedule,
)

pytestmark = [pytest.mark.anyio, pytest.mark.flood]
SLOTS = 4
BASE_MS, TOKEN_MS, TOKENS = 100, 40, 16  # an inference takes 100 ms, a stream 100 + 15 x 40 = 700 ms
CHAT = [{"role": "user", "content": "hi"}]
STREAM = {"model": "sim", "messages": CHAT, "max_tokens": TOKENS, "stream": True}
ALLOWED_MS = {"high": 250, "low": 1000}  # gateway_config's classes, as they come
# (kind, class) -> requests a second. Slot-seconds a second: streams 4.2, low inferences 1.2, urgent
# 0.8, on 4 slots: 1.55x.
RATES = {("stream", "low"): 6.0, ("infer", "low"): 12.0, ("infer", "high"): 8.0}
SEND_S = 9.0
COUNTED_FROM_S = 3.0  # each kind has its own times by then (policies.request_kinds.KIND_TRUSTED_SAMPLES)


async def mixed_open_loop(url: str, started: float, answers: list) -> None:
    """Each (kind, class) sends on its own Poisson schedule, whatever the answers; each answer is
    recorded as (sent at, kind, class, status, queue wait in ms or the refusal's body)."""

    async def send(http: aiohttp.ClientSession, kind: str, band: str, at: float) -> None:
        path, body = ("/v1/chat/completions", STREAM) if kind == "stream" else (PATH, INFER)
        async with http.post(url + path, json=body, headers={"X-Priority": band}) as reply:
            answer = await reply.read()
        if reply.status == 200:
            waited = float(re.search(r"queue;dur=([0-9.]+)", reply.headers["Server-Timing"]).group(1))
            answers.append((at, kind, band, 200, waited))
        else:
            assert reply.status == 429, answer
            answers.append((at, kind, band, 429, answer))

    async def one_flow(http: aiohttp.ClientSession, kind: str, band: str, seed: int) -> None:
        sends = []
        for due in schedule(seed, RATES[(kind, band)], SEND_S):
            await asyncio.sleep(max(0.0, started + due - time.monotonic()))
            sends.append(asyncio.ensure_future(send(http, kind, band, due)))
        await asyncio.gather(*sends)

    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await asyncio.gather(
            *(one_flow(http, kind, band, seed) for seed, (kind, band) in enumerate(RATES, start=1))
        )


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_streams_and_inferences_flooding_leave_the_urgent_inferences_served_in_time(
    start_sim, start_gateway, store_section
):
    sim = start_sim(slots=SLOTS, base_ms=BASE_MS, token_ms=TOKEN_MS)
    overrides = {} if store_section is None else {"store": store_section}
    gateway = start_gateway(gateway_config([(sim.url, SLOTS)], expected_service_ms=200, **overrides))
    answers: list = []
    await mixed_open_loop(gateway.url, time.monotonic(), answers)
    assert sim.stats()["peak_inflight"] <= SLOTS
    counted = [a for a in answers if a[0] >= COUNTED_FROM_S]
    assert sum(status == 429 and band == "low" for _, _, band, status, _ in counted) > 0.2 * len(counted)
    for band, allowed_ms in ALLOWED_MS.items():
        served = [w for _, _, b, status, w in counted if b == band and status == 200]
        expired = sum(
            status == 429 and b"deadline_expired_in_queue" in body
            for _, _, b, status, body in counted
            if b == band
        )
        late = [w for w in served if w > allowed_ms + GRANT_WAY_MS]
        assert not late, f"{band}: {len(late)} served after waiting up to {max(late):.0f} ms"
        admitted = len(served) + expired
        assert chance_of_at_least(expired, admitted, TARGET_EXPIRY) >= UNLIKELY, (band, expired, admitted)
    urgent = [status for _, _, band, status, _ in counted if band == "high"]
    # Served here with each kind's own times: 28-32 of some 35 (the rest refused at once while streams
    # held every slot). Read as the blend of both kinds (KIND_TRUSTED_SAMPLES out of reach): 20-29,
    # so this bar catches the blend about half the time; the focused test in test_request_kinds
    # catches it always.
    assert urgent.count(200) >= 0.75 * len(urgent), (urgent.count(200), len(urgent))
