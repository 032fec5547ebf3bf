"""Request heads have a size, a field count and one Host the gateway holds them to
(gateway.server.connections).

Real processes, the shipped defaults: a head (request line and fields) of at most 32 KiB and 100
fields. One byte or one field more is answered 431 with the gateway's JSON error, the connection
closes and the backend never sees the request; a head that never ends is cut at the limit instead
of being buffered, so that huge heads sent at once leave the gateway's memory as it was.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.settings import Limits
from tests.adversarial.slow_client_support import (
    Answer,
    closed_within,
    connect,
    head_size,
    infer_request,
    read_answer,
)
from tests.integration.servers import Gateway, gateway_config, rss_bytes

pytestmark = pytest.mark.anyio

MAX_HEADER_BYTES = Limits().max_header_bytes
MAX_HEADERS = Limits().max_headers


@pytest.fixture(scope="module")
def sim(module_launcher):
    return module_launcher.sim(slots=4, base_ms=1)


@pytest.fixture(scope="module")
def gateway(module_launcher, sim):
    return module_launcher.gateway(gateway_config([(sim.url, 4)]))


def padded_to(head_bytes: int, *, path: str = "/v2/models/sim/infer") -> bytes:
    """An inference request whose head is exactly `head_bytes` long, padded in one field."""
    bare = head_size(infer_request(("X-Padding", ""), path=path))
    return infer_request(("X-Padding", "p" * (head_bytes - bare)), path=path)


async def exchange(gateway: Gateway, request: bytes) -> Answer:
    reader, writer = await connect(gateway)
    try:
        writer.write(request)
        return await read_answer(reader)
    finally:
        writer.close()


async def refusal(gateway: Gateway, request: bytes, *, send_whole: bool = False) -> Answer:
    """The answer to `request`, which must be the last on its connection: the gateway closes it.
    With `send_whole`, the client reads only once it has sent every byte (as most clients do)."""
    reader, writer = await connect(gateway)
    try:
        writer.write(request)
        if send_whole:
            await writer.drain()
        answer = await read_answer(reader)
        assert await closed_within(reader, 5.0), "the connection stayed open after the refusal"
        return answer
    finally:
        writer.close()


def served(sim) -> int:
    """Inference requests the backend has computed."""
    return sim.stats()["completed"]


async def test_a_head_of_exactly_the_limit_is_served(gateway, sim):
    before = served(sim)
    assert (await exchange(gateway, padded_to(MAX_HEADER_BYTES))).status == 200
    assert served(sim) - before == 1


async def test_one_byte_more_is_431_and_the_backend_never_sees_it(gateway, sim):
    before = served(sim)
    refused = gateway.metric("gateway_client_connections_closed_total", reason="headers_too_large")
    answer = await refusal(gateway, padded_to(MAX_HEADER_BYTES + 1))
    assert (answer.status, answer.headers["content-type"]) == (431, "application/json")
    assert answer.json()["reason"] == "headers_too_large"
    assert f"more than {MAX_HEADER_BYTES} bytes" in answer.json()["error"]
    assert served(sim) == before
    after = gateway.metric("gateway_client_connections_closed_total", reason="headers_too_large")
    assert after - refused == 1


async def test_many_fields_each_small_but_over_the_limit_together_are_431(gateway, sim):
    before = served(sim)
    fields = [(f"X-Field-{i}", "f" * 1000) for i in range(40)]  # 40 KiB in 40 fields
    answer = await refusal(gateway, infer_request(*fields))
    assert (answer.status, answer.json()["reason"]) == (431, "headers_too_large")
    assert served(sim) == before


async def test_a_target_over_the_limit_is_431(gateway, sim):
    before = served(sim)
    answer = await refusal(gateway, infer_request(path="/v2/models/sim/infer?" + "q" * 40_000))
    assert (answer.status, answer.json()["reason"]) == (431, "headers_too_large")
    assert served(sim) == before


async def test_the_most_fields_allowed_are_served_and_one_more_is_431(gateway, sim):
    # Host and Content-Length are fields too.
    most = [(f"X-Field-{i}", "f") for i in range(MAX_HEADERS - 2)]
    before = served(sim)
    assert (await exchange(gateway, infer_request(*most))).status == 200
    answer = await refusal(gateway, infer_request(*most, ("X-One-More", "f")))
    assert (answer.status, answer.json()["reason"]) == (431, "too_many_headers")
    assert f"more than {MAX_HEADERS}" in answer.json()["error"]
    assert served(sim) - before == 1


async def test_on_openai_routes_the_431_is_an_openai_error(gateway):
    answer = await refusal(gateway, padded_to(MAX_HEADER_BYTES + 1, path="/v1/chat/completions"))
    assert answer.status == 431
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "headers_too_large")


async def test_on_openai_routes_a_target_over_the_limit_gets_an_openai_431_too(gateway):
    answer = await refusal(gateway, infer_request(path="/v1/chat/completions?" + "q" * 40_000))
    assert answer.status == 431
    assert answer.json()["error"]["code"] == "headers_too_large"


async def test_an_upgrade_is_ignored_and_its_body_served_then_the_connection_closes(gateway, sim):
    """`curl --http2` on http:// asks for h2c on every request: the gateway, which speaks HTTP/1.1
    only, ignores the Upgrade (RFC 9110 7.8) and serves the request with its body."""
    upgrade = [
        ("Connection", "Upgrade, HTTP2-Settings"),
        ("Upgrade", "h2c"),
        ("HTTP2-Settings", "AAMAAABkAAQAAP__"),
    ]
    before = served(sim)
    for split_at in (None, 10):  # the body in the head's read, and in reads of its own
        request = infer_request(*upgrade)
        reader, writer = await connect(gateway)
        try:
            if split_at is None:
                writer.write(request)
            else:
                body_at = head_size(request)
                writer.write(request[: body_at + split_at])
                await writer.drain()
                writer.write(request[body_at + split_at :])
            answer = await read_answer(reader)
            assert await closed_within(reader, 5.0), "the spent connection stayed open"
        finally:
            writer.close()
        assert answer.status == 200, answer.body
        assert answer.headers["connection"] == "close"
    assert served(sim) - before == 2

    chunked = (
        b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: gateway\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
    )
    chunked += b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    answer = await refusal(gateway, chunked)
    assert answer.status == 400
    assert b"Content-Length" in answer.body
    assert served(sim) - before == 2


async def test_a_pipelined_head_over_the_limit_is_answered_431_after_the_answer_before_it(gateway):
    reader, writer = await connect(gateway)
    try:
        writer.write(infer_request() + padded_to(MAX_HEADER_BYTES + 1))
        first, second = await read_answer(reader), await read_answer(reader)
        assert (first.status, second.status) == (200, 431)
        assert await closed_within(reader, 5.0)
    finally:
        writer.close()


async def test_a_client_that_sends_a_huge_head_whole_still_reads_its_431(gateway, sim):
    before = served(sim)
    answer = await refusal(gateway, infer_request(("X-Huge", "h" * (16 << 20))), send_whole=True)
    assert (answer.status, answer.json()["reason"]) == (431, "headers_too_large")
    assert served(sim) == before


async def test_trailers_over_the_limit_cut_the_connection_and_the_backend_never_sees_them(gateway, sim):
    before = served(sim)
    reader, writer = await connect(gateway)
    head = b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked\r\n\r\n"
    # Past the one read of slack (256 KB) a trailer may take, begun in the read that ended the head.
    writer.write(head + b"2\r\n{}\r\n0\r\nX-Trailer: " + b"t" * (1 << 20))
    try:
        assert await closed_within(reader, 5.0)
    finally:
        writer.close()
    assert served(sim) == before


async def test_concurrent_16_mib_heads_are_cut_at_the_limit_and_leave_memory_as_it_was(gateway):
    await exchange(gateway, padded_to(MAX_HEADER_BYTES))  # warm: the buffers one large head needs
    start = rss_bytes(gateway.process.pid)

    async def huge_head() -> int | None:
        reader, writer = await connect(gateway)
        try:
            writer.write(infer_request(("X-Huge", "h" * (16 << 20))))
            return (await read_answer(reader)).status
        except ConnectionError:
            return None  # cut while still sending: as good as a 431 here
        finally:
            writer.close()

    statuses = await asyncio.gather(*(huge_head() for _ in range(8)))
    assert set(statuses) <= {431, None} and 431 in statuses, statuses
    grown = rss_bytes(gateway.process.pid) - start
    assert grown < 32 << 20, f"the gateway grew by {grown >> 20} MiB over 8 heads of 16 MiB"
    assert (await exchange(gateway, padded_to(1024))).status == 200


def without_host(request: bytes) -> bytes:
    return request.replace(b"Host: gateway\r\n", b"")


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(without_host(infer_request()), id="no-host"),
        pytest.param(infer_request(("Host", "other")), id="two-hosts"),
        pytest.param(infer_request(("Host", "other")).replace(b"HTTP/1.1", b"HTTP/1.0"), id="two-hosts-1.0"),
    ],
)
async def test_a_request_without_its_one_host_field_is_400_and_the_backend_never_sees_it(
    gateway, sim, request_bytes
):
    # RFC 9112, section 3.2: an HTTP/1.1 request carries exactly one Host; none, or two, is a 400.
    before = served(sim)
    counted = gateway.metric("gateway_client_connections_closed_total", reason="bad_host")
    answer = await refusal(gateway, request_bytes)
    assert (answer.status, answer.json()["reason"]) == (400, "bad_host")
    assert "exactly one Host" in answer.json()["error"]
    assert served(sim) == before
    assert gateway.metric("gateway_client_connections_closed_total", reason="bad_host") - counted == 1


async def test_an_http_1_0_request_may_come_without_host(gateway, sim):
    request = without_host(infer_request()).replace(b"HTTP/1.1", b"HTTP/1.0")
    assert (await exchange(gateway, request)).status == 200
