"""A proxy forwards end-to-end headers and drops hop-by-hop ones (RFC 9110 section 7.6.1)."""

import json

from gateway.http.intake import upstream_request
from gateway.settings import parse_settings
from gateway.upstream.client import HeaderRules, downstream_response_headers, upstream_request_headers
from gateway.upstream.exchange import served_names


def test_request_drops_hop_by_hop_and_connection_named_fields():
    headers = [
        (b"host", b"gateway:8080"),
        (b"connection", b"keep-alive, X-Trace-Hop"),
        (b"keep-alive", b"timeout=5"),
        (b"x-trace-hop", b"1"),
        (b"te", b"trailers"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
        (b"proxy-authorization", b"Basic abc"),
        (b"content-length", b"12"),
        (b"inference-header-content-length", b"99"),
        (b"x-priority", b"high"),
        (b"content-type", b"application/octet-stream"),
    ]
    assert upstream_request_headers(headers) == [
        (b"inference-header-content-length", b"99"),
        (b"x-priority", b"high"),
        (b"content-type", b"application/octet-stream"),
    ]


def test_response_keeps_end_to_end_fields_and_lowercases_names():
    raw = (
        (b"Content-Type", b"text/event-stream"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"close"),
        (b"Content-Length", b"10"),
        (b"Date", b"Mon, 30 Nov 2026 00:00:00 GMT"),
        (b"Inference-Header-Content-Length", b"42"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
    )
    assert downstream_response_headers(raw) == [
        (b"content-type", b"text/event-stream"),
        (b"inference-header-content-length", b"42"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]


def test_served_names_rewrite_the_kserve_path():
    assert served_names("/v2/models/sim/infer", b"x", "sim", "sleep_ms", False) == (
        "/v2/models/sleep_ms/infer",
        b"x",
    )
    assert served_names("/v2/models/sim", b"", "sim", "sleep_ms", False)[0] == "/v2/models/sleep_ms"
    assert served_names("/v2/models/simple/infer", b"", "sim", "s", False)[0] == "/v2/models/simple/infer"


def test_served_names_rewrite_the_openai_body():
    target, body = served_names(
        "/v1/chat/completions", b'{"model": "chat", "n": 1}', "chat", "org/Llama-8B", True
    )
    assert target == "/v1/chat/completions"
    assert json.loads(body) == {"model": "org/Llama-8B", "n": 1}


SETTINGS = {
    "priorities": [{"name": "low", "max_wait_ms": 1000}],
    "default_priority": "low",
    "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9", "max_concurrency": 1}]}],
}
CLIENT_HEADERS = [
    (b"authorization", b"Bearer the-tenants-key"),
    (b"x-tenant", b"someone-else"),
    (b"x-priority", b"high"),
    (b"x-request-timeout-ms", b"500"),
    (b"x-forwarded-for", b"10.1.2.3"),
    (b"content-type", b"application/json"),
]


def test_the_gateways_control_headers_and_the_tenants_key_stay_at_the_gateway():
    settings = parse_settings({**SETTINGS, "tenants": [{"name": "t", "api_keys": ["the-tenants-key"]}]})
    forwarded = upstream_request_headers(CLIENT_HEADERS, HeaderRules.from_settings(settings), "127.0.0.9")
    assert forwarded == [
        (b"content-type", b"application/json"),
        (b"x-forwarded-for", b"10.1.2.3, 127.0.0.9"),
    ]


def test_without_tenants_the_authorization_is_the_backends_and_passes():
    rules = HeaderRules.from_settings(parse_settings(SETTINGS))
    forwarded = dict(upstream_request_headers(CLIENT_HEADERS, rules, "127.0.0.9"))
    assert forwarded[b"authorization"] == b"Bearer the-tenants-key"
    assert b"x-tenant" not in forwarded and b"x-priority" not in forwarded


def test_what_is_stripped_and_added_is_configurable():
    settings = parse_settings(
        {**SETTINGS, "forwarding": {"strip_request_headers": [], "forwarded_for": False}}
    )
    forwarded = upstream_request_headers(CLIENT_HEADERS, HeaderRules.from_settings(settings), "127.0.0.9")
    assert forwarded == CLIENT_HEADERS


def test_the_upstream_request_carries_the_clients_address():
    scope = {
        "method": "POST",
        "path": "/v2/models/m/infer",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.7", 50000),
    }
    request = upstream_request(scope, b"{}", HeaderRules(forwarded_for=True))
    assert (b"x-forwarded-for", b"127.0.0.7") in request.headers


def test_a_backends_retry_after_passes_as_the_gateway_writes_its_own_or_not_at_all():
    sane = downstream_response_headers([(b"Content-Type", b"text/plain"), (b"Retry-After", b"5")])
    assert sane == [(b"content-type", b"text/plain"), (b"retry-after", b"5"), (b"retry-after-ms", b"5000")]
    for insane in (b"-5", b"Tue, 01 Dec 2099 00:00:00 GMT", b"soon"):
        assert downstream_response_headers([(b"Retry-After", insane), (b"retry-after-ms", b"-1")]) == []
