"""Config reload without a restart, on a real process: SIGHUP applies an edited config (a new
tenant's key goes from 401 to 200) without cutting a stream open across it; a broken config leaves
the old one serving and is counted; the file watch and the admin route reload too, and say what
only a restart would change."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import pytest
import yaml

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_get, http_post
from tests.integration.test_backpressure import (
    clear_the_fault,
    hang_the_backend,
    wait_for_hanging,
    wait_for_metric,
)

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
ACME, BETA = "key-of-acme-0001", "key-of-beta-0002"


def reload_config(sim, *tenants):
    config = gateway_config([(sim.url, 4)], tenants=list(tenants))
    config["admin_listen"] = {"host": "127.0.0.1", "port": 0}
    return config


def tenant(name, key, **more):
    return {"name": name, "api_keys": [key], **more}


async def status_for(http, gateway, key):
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(gateway.url + "/v2/models/sim/infer", json=INFER, headers=headers) as reply:
        await reply.read()
        return reply.status


def rewrite(gateway, config):
    gateway.config_path.write_text(yaml.safe_dump(config))


async def test_sighup_applies_a_new_tenant_without_cutting_an_open_stream(start_sim, start_gateway):
    sim = start_sim(slots=4, base_ms=5, token_ms=60)
    config = reload_config(sim, tenant("acme", ACME))
    gateway = start_gateway(config)
    async with aiohttp.ClientSession() as http:
        assert await status_for(http, gateway, BETA) == 401
        chat = {
            "model": "sim",
            "stream": True,
            "max_tokens": 25,
            "messages": [{"role": "user", "content": "hi"}],
        }
        headers = {"Authorization": f"Bearer {ACME}"}
        async with http.post(gateway.url + "/v1/chat/completions", json=chat, headers=headers) as stream:
            assert stream.status == 200
            first = await stream.content.readline()  # the stream is open: its first event is here
            assert first.startswith(b"data: ")
            rewrite(gateway, reload_config(sim, tenant("acme", ACME), tenant("beta", BETA)))
            gateway.signal(signal.SIGHUP)
            await eventually(lambda: gateway.assert_metric("gateway_config_reloads_total", 1, result="ok"))
            assert await status_for(http, gateway, BETA) == 200
            rest = await stream.read()
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]  # it ended whole
    assert "config reloaded (SIGHUP): applied tenants[beta] added" in gateway.log()
    assert BETA not in gateway.log() and ACME not in gateway.log()


async def test_a_broken_config_leaves_the_old_one_serving_and_is_counted(start_sim, start_gateway):
    sim = start_sim(slots=4, base_ms=5)
    gateway = start_gateway(reload_config(sim, tenant("acme", ACME)))
    hash_before = json.loads(http_get(gateway.admin_url + "/status.json")[1])["config_hash"]
    gateway.config_path.write_text("priorities: [\n")  # not YAML
    gateway.signal(signal.SIGHUP)
    await eventually(lambda: gateway.assert_metric("gateway_config_reloads_total", 1, result="error"))
    # A valid YAML whose tenants break a rule of the whole config: refused as well.
    broken = reload_config(sim, tenant("acme", ACME), {"name": "keyless"})
    status, body = http_post(gateway.admin_url + "/admin/config/reload", b"")
    assert status == 422 and json.loads(body)["result"] == "error"
    rewrite(gateway, broken)
    status, body = http_post(gateway.admin_url + "/admin/config/reload", b"")
    assert status == 422 and "api_keys" in json.loads(body)["problems"][0]
    assert gateway.metric("gateway_config_reloads_total", result="error") == 3
    async with aiohttp.ClientSession() as http:
        assert await status_for(http, gateway, ACME) == 200
    assert gateway.metric("gateway_config_info", hash=hash_before) == 1
    assert "the last good config goes on" in gateway.log()


async def test_the_admin_route_and_the_file_watch_reload_and_name_what_takes_a_restart(
    start_sim, start_gateway
):
    sim = start_sim(slots=4, base_ms=5)
    config = reload_config(sim, tenant("acme", ACME))
    gateway = start_gateway(config)
    edited = reload_config(sim, tenant("acme", ACME, weight=3, quota=2), tenant("beta", BETA))
    edited["priorities"][0]["max_wait_ms"] = 123
    rewrite(gateway, edited)
    status, body = http_post(gateway.admin_url + "/admin/config/reload", b"")
    done = json.loads(body)
    assert status == 200 and done["result"] == "ok"
    assert done["applied"] == [
        "tenants[acme]: weight",
        "tenants[beta] added",
        "priorities[high]: max_wait_ms",
    ]
    assert done["restart_only"] == ["tenants[acme]: quota"]
    document = json.loads(http_get(gateway.admin_url + "/status.json")[1])
    assert document["config_hash"] == done["hash"]
    assert gateway.metric("gateway_config_info", hash=done["hash"]) == 1
    # The file watch: a third tenant, written without a signal, is taken up within seconds.
    gamma = "key-of-gamma-003"
    rewrite(gateway, reload_config(sim, tenant("acme", ACME), tenant("beta", BETA), tenant("gamma", gamma)))
    await eventually(lambda: gateway.assert_metric("gateway_config_reloads_total", 2, result="ok"))
    async with aiohttp.ClientSession() as http:
        assert await status_for(http, gateway, gamma) == 200


async def test_a_class_allowance_reloaded_applies_to_arrivals_and_spares_what_is_queued(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=50)
    config = reload_config(sim, tenant("acme", ACME))
    config["models"][0]["backends"][0]["max_concurrency"] = 1
    config["priorities"] = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]
    gateway = start_gateway(config)
    url = gateway.url + "/v2/models/sim/infer"
    headers = {"Authorization": f"Bearer {ACME}"}
    async with aiohttp.ClientSession() as http:

        async def send():
            async with http.post(url, json=INFER, headers=headers) as reply:
                return reply.status, await reply.json()

        await hang_the_backend(sim)
        running = asyncio.ensure_future(send())
        await wait_for_hanging(sim, 1)
        queued = asyncio.ensure_future(send())
        await wait_for_metric(gateway, "gateway_queue_depth", 1.0, priority="low")
        config["priorities"][1]["max_wait_ms"] = 20  # less than a slot takes to free: nothing fits now
        rewrite(gateway, config)
        status, body = http_post(gateway.admin_url + "/admin/config/reload", b"")
        assert status == 200 and json.loads(body)["applied"] == ["priorities[low]: max_wait_ms"]
        refused_status, refused = await send()
        assert refused_status == 429 and refused["rule"] == "priorities[low].max_wait_ms", refused
        await clear_the_fault(sim)
        assert [(await running)[0], (await queued)[0]] == [200, 200]  # admitted under the old allowance


@pytest.mark.redis
async def test_replicas_on_redis_show_each_others_config_and_a_reload_that_reached_one_of_them(
    start_sim, start_gateway
):
    from tests.redis_server import RedisServer, unique_prefix

    server = RedisServer()
    try:
        sim = start_sim(slots=4)
        config = reload_config(sim, tenant("acme", ACME))
        prefix = unique_prefix()
        config["store"] = {
            "kind": "redis",
            "url": server.url,
            "key_prefix": prefix,
            "replicas": 2,
            "lease_ttl_ms": 600,
        }
        first, second = start_gateway(config), start_gateway(config)

        def store_seen(gateway) -> dict:
            return json.loads(http_get(gateway.admin_url + "/status.json")[1])["store"]

        def both_seen_with_one_config() -> bool:
            seen = store_seen(first)
            return len(seen["seen"]) == 2 and seen["configs"] == 1 and seen["mode"] == "single"

        await eventually(both_seen_with_one_config, what="both replicas on the first's page, one config")
        rewrite(
            second,
            reload_config(sim, tenant("acme", ACME), tenant("beta", BETA)) | {"store": config["store"]},
        )
        assert json.loads(http_post(second.admin_url + "/admin/config/reload", b"")[1])["result"] == "ok"
        await eventually(
            lambda: store_seen(first)["configs"] == 2, what="the first's page showing two configs"
        )
        page = http_get(first.admin_url + "/status")[1].decode()
        assert "configs differ" in page
    finally:
        server.stop()


async def test_the_access_log_is_turned_on_by_a_reload(start_sim, start_gateway):
    sim = start_sim(slots=2)
    config = reload_config(sim, tenant("acme", ACME)) | {"access_log": {"enabled": False}}
    gateway = start_gateway(config)
    marker = " gateway.access: "
    async with aiohttp.ClientSession() as http:
        assert await status_for(http, gateway, ACME) == 200
        rewrite(gateway, config | {"access_log": {"enabled": True, "format": "json"}})
        done = json.loads(http_post(gateway.admin_url + "/admin/config/reload", b"")[1])
        assert (done["result"], done["applied"], done["restart_only"]) == ("ok", ["access_log"], [])
        assert await status_for(http, gateway, ACME) == 200
    await eventually(lambda: marker in gateway.log(), what="a line once it is on")
    lines = [json.loads(line.split(marker, 1)[1]) for line in gateway.log().splitlines() if marker in line]
    assert [(line["tenant"], line["status"]) for line in lines] == [("acme", 200)]  # none from before
