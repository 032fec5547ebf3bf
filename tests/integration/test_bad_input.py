"""Bad input gets a clear 4xx in the style of its route, and is counted, never forwarded."""

import http.client
import json

import aiohttp
import pytest

from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
KEYS = {"gold": "gold-key-0123456789", "bronze": "bronze-key-0123456789"}


@pytest.fixture(scope="module")
def open_gateway(module_launcher):
    sim = module_launcher.sim(slots=2, base_ms=1)
    config = gateway_config([(sim.url, 2)], limits={"max_body_bytes": 1024})
    return sim, module_launcher.gateway(config)


@pytest.fixture(scope="module")
def keyed_gateway(module_launcher, open_gateway):
    sim, _ = open_gateway
    tenants = [
        {"name": "gold", "api_keys": [KEYS["gold"]]},
        {"name": "bronze", "api_keys": [KEYS["bronze"]], "max_priority": "low"},
    ]
    return module_launcher.gateway(gateway_config([(sim.url, 2)], tenants=tenants))


async def call(gateway, path, *, json=None, data=None, headers=None):
    async with aiohttp.ClientSession() as http:
        reply = await http.post(gateway.url + path, json=json, data=data, headers=headers or {})
        body = await reply.json(content_type=None)
        return reply.status, body


def kserve_reason(body):
    assert isinstance(body["error"], str) and body["error"]
    return body["reason"]


def openai_reason(body):
    assert body["error"]["message"] and body["error"]["type"]
    return body["error"]["code"]


@pytest.mark.parametrize(
    ("path", "payload", "headers", "status", "reason"),
    [
        ("/v2/models/nope/infer", INFER, {}, 404, "unknown_model"),
        ("/v2/models/sim/infer", INFER, {"X-Priority": "urgent"}, 400, "unknown_priority"),
        ("/v2/models/sim/infer", INFER, {"X-Priority": "h" * 65}, 400, "unknown_priority"),
        ("/v2/models/sim/infer", INFER, {"X-Request-Timeout-Ms": "soon"}, 400, "bad_request"),
        ("/v2/models/sim/infer", INFER, {"X-Request-Timeout-Ms": "0"}, 400, "bad_request"),
        ("/v2/models/sim/infer", INFER, {"X-Request-Timeout-Ms": "-5"}, 400, "bad_request"),
        ("/v2/models/sim/infer", INFER, {"X-Request-Timeout-Ms": "9" * 12}, 400, "bad_request"),
        ("/v2/models/sim/infer", INFER, {"X-Tenant": "t" * 200}, 400, "bad_request"),
        ("/v2/models/sim/infer", INFER, [("X-Priority", "high"), ("X-Priority", "low")], 400, "bad_request"),
        (
            "/v2/models/sim/infer",
            INFER,
            [("X-Request-Timeout-Ms", "abc"), ("X-Request-Timeout-Ms", "9")],
            400,
            "bad_request",
        ),
        ("/v2/models/sim/infer", {"pad": "x" * 2000}, {}, 413, "body_too_large"),
    ],
)
async def test_kserve_bad_input(open_gateway, path, payload, headers, status, reason):
    sim, gateway = open_gateway
    before = sim.stats()["completed"]
    got_status, body = await call(gateway, path, json=payload, headers=headers)
    assert (got_status, kserve_reason(body)) == (status, reason)
    assert sim.stats()["completed"] == before


@pytest.mark.parametrize(
    ("data", "status", "reason"),
    [
        (b"{not json", 400, "bad_request"),
        (b"[1, 2]", 400, "bad_request"),
        (b'{"messages": []}', 400, "bad_request"),
        (b'{"model": 7}', 400, "bad_request"),
        (b'{"model": "sim", "stream": "yes"}', 400, "bad_request"),
        (b'{"model": "sim", "stream": 0}', 400, "bad_request"),
        (b'{"model": "gpt-9"}', 404, "unknown_model"),
        (b"\xff\xfe", 400, "bad_request"),
    ],
)
async def test_openai_bad_body(open_gateway, data, status, reason):
    _, gateway = open_gateway
    got_status, body = await call(
        gateway, "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    assert (got_status, openai_reason(body)) == (status, reason)


async def test_a_null_stream_is_the_schemas_default_not_streaming(open_gateway):
    _, gateway = open_gateway
    body = {"model": "sim", "stream": None, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, answer = await call(gateway, "/v1/chat/completions", json=body)
    assert status == 200
    assert answer["object"] == "chat.completion"


async def test_body_over_the_limit_is_refused_while_streaming_in(open_gateway):
    """Chunked upload with no Content-Length: the limit applies as the bytes arrive."""
    _, gateway = open_gateway

    async def chunks():
        for _ in range(10):
            yield b"x" * 512

    status, body = await call(gateway, "/v2/models/sim/infer", data=chunks())
    assert (status, kserve_reason(body)) == (413, "body_too_large")


async def test_backend_errors_pass_through_unchanged(open_gateway):
    sim, gateway = open_gateway
    bad = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "NOPE", "data": [1]}]}
    direct = await call(sim, "/v2/models/sim/infer", json=bad)
    assert await call(gateway, "/v2/models/sim/infer", json=bad) == direct
    assert direct[0] == 400
    # Counted as what it was, not as a success.
    counted = gateway.metric_by("gateway_requests_total", "outcome", model="sim", priority="low")
    assert counted["backend_client_error"] >= 1


async def test_unknown_route_and_method_are_json_errors_in_the_style_of_the_path(open_gateway):
    _, gateway = open_gateway
    async with aiohttp.ClientSession() as http:
        missing = await http.get(gateway.url + "/v3/whatever")
        assert (missing.status, kserve_reason(await missing.json())) == (404, "not_found")
        wrong = await http.get(gateway.url + "/v2/models/sim/infer")
        assert (wrong.status, kserve_reason(await wrong.json())) == (405, "method_not_allowed")
        assert wrong.headers["Allow"] == "POST"
        # Under /v1/, OpenAI's shape, which its SDKs read; a 405 names the methods the route takes.
        for method, path, status, allow in [
            ("GET", "/v1/chat/completions", 405, {"POST"}),
            ("POST", "/v1/models", 405, {"GET", "HEAD"}),
            ("GET", "/v1/nothing", 404, None),
        ]:
            async with http.request(method, gateway.url + path) as answer:
                body = await answer.json()
                expected = "not_found" if status == 404 else "method_not_allowed"
                assert (answer.status, openai_reason(body)) == (status, expected), (method, path, body)
                assert body["error"]["type"] == "invalid_request_error"
                allowed = answer.headers.get("Allow")
                assert (allowed and set(allowed.split(", "))) == allow, (method, path)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-key-0123456789", f"Basic {KEYS['gold']}", "Bearer", "Bearer " + "k" * 2000],
)
async def test_missing_or_unknown_key_is_401(keyed_gateway, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    status, body = await call(keyed_gateway, "/v2/models/sim/infer", json=INFER, headers=headers)
    assert (status, kserve_reason(body)) == (401, "unauthorized")
    status, body = await call(keyed_gateway, "/v1/chat/completions", json=CHAT, headers=headers)
    assert (status, openai_reason(body)) == (401, "unauthorized")


async def test_tenant_cap_lowers_an_ambitious_priority(keyed_gateway):
    headers = {"Authorization": f"Bearer {KEYS['bronze']}", "X-Priority": "high"}
    status, _ = await call(keyed_gateway, "/v2/models/sim/infer", json=INFER, headers=headers)
    assert status == 200
    # The only request served so far on this gateway, counted as low: none as high.
    assert keyed_gateway.metric_by("gateway_requests_total", "priority", outcome="ok") == {"low": 1}


async def test_uncapped_tenant_keeps_its_priority(keyed_gateway):
    headers = {"Authorization": f"Bearer {KEYS['gold']}", "X-Priority": "high"}
    status, _ = await call(keyed_gateway, "/v1/chat/completions", json=CHAT, headers=headers)
    assert status == 200
    assert keyed_gateway.metric("gateway_requests_total", priority="high", outcome="ok") == 1


def test_an_escaped_model_name_cannot_pass_the_served_name(module_launcher, open_gateway):
    """`/v2/models/%73im` is `sim` once decoded: it is routed, rewritten and forwarded as `sim`."""
    sim, _ = open_gateway
    config = gateway_config([(sim.url, 2)])
    config["models"][0]["backends"][0]["served_model"] = "real"
    gateway = module_launcher.gateway(config)
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    for path in ("/v2/models/sim/infer", "/v2/models/%73im/infer"):
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            connection.request(
                "POST", path, body=json.dumps(INFER), headers={"Content-Type": "application/json"}
            )
            reply = connection.getresponse()
            answer = json.loads(reply.read())
        finally:
            connection.close()
        assert (reply.status, answer["model_name"]) == (200, "real"), path
