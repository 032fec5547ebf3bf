"""The access log through a real gateway: one line per request on its admitted routes, in JSON
here, with what the request asked and how it ended; never a key; a storm cut to the rate."""

from __future__ import annotations

import json
import time

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.servers import Gateway, gateway_config

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
KEY = "team-a-key-0123456789"


def access_lines(gateway: Gateway) -> list[dict]:
    marker = " gateway.access: "
    return [json.loads(line.split(marker, 1)[1]) for line in gateway.log().splitlines() if marker in line]


async def post(http, gateway, path: str, request_id: str, key: str | None = KEY) -> int:
    headers = {"X-Request-Id": request_id} | ({"Authorization": f"Bearer {key}"} if key else {})
    async with http.post(gateway.url + path, json=INFER, headers=headers) as reply:
        await reply.read()
        assert reply.headers["x-request-id"] == request_id  # carried back
        return reply.status


async def test_each_request_leaves_one_line_that_says_how_it_ended_and_never_the_key(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=5)
    config = gateway_config(
        [(sim.url, 1)], tenants=[{"name": "team-a", "api_keys": [KEY]}], access_log={"format": "json"}
    )
    gateway = start_gateway(config)
    async with aiohttp.ClientSession() as http:
        assert await post(http, gateway, "/v2/models/sim/infer", "r-ok") == 200
        assert await post(http, gateway, "/v2/models/nope/infer", "r-404") == 404
        assert await post(http, gateway, "/v2/models/sim/infer", "r-401", key=None) == 401
        async with http.post(gateway.url + "/v2/models/sim/infer", json=INFER) as reply:  # no id sent
            assert reply.status == 401
            made = reply.headers["x-request-id"]
    await eventually(lambda: len(access_lines(gateway)) == 4, what="a line for each request")
    lines = {line["id"]: line for line in access_lines(gateway)}

    def said(request_id: str, *fields: str) -> tuple:
        return tuple(lines[request_id][field] for field in fields)

    assert said("r-ok", "status", "outcome", "model", "class") == (200, "ok", "sim", "low")
    assert said("r-ok", "tenant", "route", "cost") == ("team-a", "infer", 1.0)
    assert lines["r-ok"]["queue_ms"] >= 0 and lines["r-ok"]["upstream_ms"] > 0
    assert said("r-404", "status", "outcome", "model") == (404, "unknown_model", "")
    assert said("r-401", "status", "outcome") == (401, "unauthorized")
    assert said(made, "status", "outcome") == (401, "unauthorized")  # the id made here, told back
    assert KEY not in gateway.log()


async def test_a_storm_of_refusals_is_cut_to_the_rate_and_what_was_dropped_is_told(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=5)
    config = gateway_config([(sim.url, 1)], access_log={"format": "json", "max_lines_per_s": 5})
    gateway = start_gateway(config)
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        statuses = [
            await post(http, gateway, "/v2/models/nope/infer", f"s-{i}", key=None) for i in range(200)
        ]
        elapsed = time.monotonic() - started
        assert statuses == [404] * 200
        await eventually(lambda: len(access_lines(gateway)) >= 5, what="the storm's first lines")
        assert len(access_lines(gateway)) <= 5 + 5 * elapsed + 1
        told: list[int] = []

        async def one_more_tells() -> None:
            await post(http, gateway, "/v2/models/nope/infer", "after", key=None)
            told[:] = [line["suppressed"] for line in access_lines(gateway) if "suppressed" in line]

        deadline = time.monotonic() + 10
        while not told:  # each try waits on an answer: bounded by the deadline
            assert time.monotonic() < deadline, "no line told what was dropped"
            await one_more_tells()
    assert sum(told) >= 200 - (5 + 5 * elapsed + 1)


async def test_a_models_metadata_readiness_and_config_passed_through_leave_a_line_each(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=5)
    config = gateway_config(
        [(sim.url, 1)], tenants=[{"name": "team-a", "api_keys": [KEY]}], access_log={"format": "json"}
    )
    gateway = start_gateway(config)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        for path, request_id in (("/v2/models/sim", "m-meta"), ("/v2/models/sim/ready", "m-ready")):
            async with http.get(gateway.url + path, headers=headers | {"X-Request-Id": request_id}) as reply:
                assert reply.status == 200 and reply.headers["x-request-id"] == request_id
        async with http.get(
            gateway.url + "/v2/models/nope/config", headers=headers | {"X-Request-Id": "m-404"}
        ) as reply:
            assert reply.status == 404
    await eventually(lambda: len(access_lines(gateway)) == 3, what="a line for each")
    lines = {line["id"]: line for line in access_lines(gateway)}
    assert {k: lines["m-meta"][k] for k in ("route", "model", "tenant", "status", "outcome")} == {
        "route": "model.metadata", "model": "sim", "tenant": "team-a", "status": 200, "outcome": "ok",
    }  # fmt: skip
    assert (lines["m-ready"]["route"], lines["m-ready"]["outcome"]) == ("model.ready", "ok")
    assert (lines["m-404"]["route"], lines["m-404"]["outcome"], lines["m-404"]["status"]) == (
        "model.config", "unknown_model", 404,
    )  # fmt: skip
    assert KEY not in gateway.log()
