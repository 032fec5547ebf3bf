"""A proxy forwards end-to-end headers and drops hop-by-hop ones (RFC 9110 section 7.6.1)."""

import json

from gateway.upstream.client import downstream_response_headers, upstream_request_headers
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
