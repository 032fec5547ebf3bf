"""The proxy's HTTP/1.1 client against real sockets: scripted servers on 127.0.0.1 that answer
the way model servers (and broken ones) do."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from gateway.upstream.http1 import CLOSED_AS_WRITTEN_S, UpstreamClient, serialize_request
from gateway.upstream.origin import ConnectionOptions, OnAbandon, Origin, TlsOptions, origin_of
from gateway.upstream.reply import BackendGone, ConnectFailed, Reply, UpstreamBroken
from tests.eventually import eventually
from tests.integration.scripted import (
    OK,
    ScriptedServer,
    answer_each,
    answer_in_two_parts,
    exchange,
    infer,
    server_tls,
    with_options,
)

pytestmark = pytest.mark.anyio


def test_requests_are_serialized_with_host_and_length():
    origin = Origin("127.0.0.1", 8000, tls=False)
    assert serialize_request("POST", "/x?a=1", origin, [(b"x-priority", b"high")], b"{}") == (
        b"POST /x?a=1 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\nx-priority: high\r\ncontent-length: 2\r\n\r\n{}"
    )
    assert serialize_request("GET", "/v2/models/sim", origin, [], b"") == (
        b"GET /v2/models/sim HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n\r\n"
    )
    # A POST without a body still says so, or the backend would wait for one.
    assert b"content-length: 0\r\n" in serialize_request("POST", "/x", origin, [], b"")
    assert Origin("::1", 8000, tls=False).host_header == b"[::1]:8000"


def test_origins_come_from_backend_urls():
    assert origin_of("http://127.0.0.1:8000") == Origin("127.0.0.1", 8000, tls=False)
    assert origin_of("https://triton.example") == Origin("triton.example", 443, tls=True)
    with pytest.raises(ValueError, match="not an http"):
        origin_of("ftp://127.0.0.1")


async def test_answer_is_read_whole_and_the_connection_reused():
    async with ScriptedServer(answer_each(OK, OK, OK)) as server:
        client = UpstreamClient()
        for _ in range(3):
            reply = await exchange(client, server.origin, infer(server.origin))
            assert (reply.status, await reply.read()) == (200, b"{}")
            assert reply.content_length == 2
            assert (b"content-type", b"application/json") in reply.headers
        assert server.connections == 1
        assert server.requests[0].endswith(b'\r\n\r\n{"inputs":[]}')
        await client.close()


async def test_try_send_writes_at_once_on_an_idle_connection_and_only_then():
    async with ScriptedServer(answer_each(OK, OK)) as server:
        client = UpstreamClient()
        loop = asyncio.get_running_loop()
        assert client.try_send(server.origin, infer(server.origin), lambda: Reply(loop, 5.0)) is None
        await (await exchange(client, server.origin, infer(server.origin))).read()
        reply = client.try_send(server.origin, infer(server.origin), lambda: Reply(loop, 5.0))
        assert reply is not None
        await reply.head()
        assert await reply.read() == b"{}"
        assert server.connections == 1
        await client.close()


async def test_chunked_answer_streams_chunk_by_chunk():
    second_chunk_may_go = asyncio.Event()
    handler = answer_in_two_parts(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        b"7\r\ndata: 1\r\n",
        b"7\r\ndata: 2\r\n0\r\n\r\n",
        second_chunk_may_go,
    )

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        assert reply.content_length is None
        chunks = reply.iter_chunks()
        assert await anext(chunks) == b"data: 1"  # before the backend has sent the rest
        second_chunk_may_go.set()
        assert [chunk async for chunk in chunks] == [b"data: 2"]
        assert reply.complete
        await client.close()


async def test_body_ended_by_the_connection_closing_is_complete_and_not_reused():
    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        await writer.drain()

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        for _ in range(2):
            reply = await exchange(client, server.origin, infer(server.origin))
            assert await reply.read() == b"all of it"
        assert server.connections == 2
        await client.close()


async def test_connection_close_answer_is_not_reused():
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    async with ScriptedServer(answer_each(closing)) as server:
        client = UpstreamClient()
        for _ in range(2):
            assert await (await exchange(client, server.origin, infer(server.origin))).read() == b"{}"
        assert server.connections == 2
        await client.close()


async def test_backend_dying_mid_answer_breaks_the_exchange():
    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        with pytest.raises(UpstreamBroken, match="closed the connection"):
            await reply.read()
        await client.close()


async def test_backend_closing_before_any_answer_breaks_the_exchange():
    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0)
        await client.send(server.origin, infer(server.origin), reply)
        with pytest.raises(UpstreamBroken):
            await reply.head()
        await client.close()


async def test_idle_connection_the_backend_closed_is_not_used_again():
    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(OK)
        await writer.drain()
        # then close the idle keep-alive connection, as servers do after their idle timeout

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        await (await exchange(client, server.origin, infer(server.origin))).read()
        await asyncio.sleep(0.05)  # the close reaches the client
        assert await (await exchange(client, server.origin, infer(server.origin))).read() == b"{}"
        assert server.connections == 2
        await client.close()


async def test_idle_connection_past_keepalive_is_closed_instead_of_reused():
    now = [0.0]
    async with ScriptedServer(answer_each(OK, OK)) as server:
        client = UpstreamClient(clock=lambda: now[0])
        origin = with_options(server.origin, keepalive_s=4.0)
        await (await exchange(client, origin, infer(origin))).read()
        now[0] = 3.9
        await (await exchange(client, origin, infer(origin))).read()
        assert server.connections == 1
        now[0] = 8.0
        await (await exchange(client, origin, infer(origin))).read()
        assert server.connections == 2
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)  # the stale one was closed
        await client.close()


async def test_refused_connection_is_a_connect_failure():
    async with ScriptedServer(answer_each()) as server:
        origin = server.origin
    client = UpstreamClient()
    with pytest.raises(ConnectFailed):
        await exchange(client, origin, infer(origin))
    await client.close()


async def test_silent_backend_times_out_and_its_connection_is_dropped():
    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        await server.read_request(reader)  # never answers; returns when the client hangs up

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        with pytest.raises(TimeoutError):
            await exchange(client, server.origin, infer(server.origin), timeout_s=0.1)
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)
        await client.close()


async def test_malformed_answer_breaks_the_exchange():
    async with ScriptedServer(answer_each(b"HTTP/1.1 abc nonsense\r\n\r\n")) as server:
        client = UpstreamClient()
        with pytest.raises(UpstreamBroken, match="malformed"):
            await exchange(client, server.origin, infer(server.origin))
        await client.close()


async def test_answer_with_oversized_headers_breaks_the_exchange():
    limit = ConnectionOptions().max_head_bytes
    flood = b"".join(b"x-pad-%d: %s\r\n" % (i, b"y" * 100) for i in range(limit // 100 + 1))
    async with ScriptedServer(answer_each(b"HTTP/1.1 200 OK\r\n" + flood + b"\r\n")) as server:
        client = UpstreamClient()
        with pytest.raises(UpstreamBroken, match="headers over"):
            await exchange(client, server.origin, infer(server.origin))
        await client.close()


async def test_interim_answer_is_skipped():
    async with ScriptedServer(answer_each(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        assert (reply.status, await reply.read()) == (200, b"{}")
        await client.close()


async def test_head_answer_ends_at_its_headers():
    async with ScriptedServer(answer_each(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n")) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0, head_only=True)
        await client.send(server.origin, serialize_request("HEAD", "/", server.origin, [], b""), reply)
        await reply.head()
        assert (reply.status, reply.content_length, await reply.read()) == (200, 50, b"")
        await client.close()


async def test_abandoned_exchange_closes_its_connection():
    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
        await writer.drain()
        await server.read_request(reader)

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        reply.abort(UpstreamBroken("abandoned"))
        with pytest.raises(UpstreamBroken, match="abandoned"):
            await reply.read()
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)
        await client.close()


async def test_completion_callback_runs_once_before_the_reader_resumes():
    async with ScriptedServer(answer_each(OK)) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0)
        seen: list[bool] = []
        reply.on_complete = lambda: seen.append(reply.complete)
        await client.send(server.origin, infer(server.origin), reply)
        await reply.head()
        await reply.read()
        assert seen == [True]
        await client.close()


async def test_slow_reader_stops_the_backend_socket_being_read():
    body_bytes = 8 << 20

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % body_bytes)
        writer.write(b"x" * body_bytes)
        await writer.drain()
        await server.read_request(reader)

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        await asyncio.sleep(0.2)  # the backend writes as fast as it can; nobody reads yet
        assert reply.buffered_bytes < 1 << 20
        received = 0
        async for chunk in reply.iter_chunks():
            received += len(chunk)
        assert received == body_bytes
        await client.close()


async def test_short_answer_is_announced_once_complete():
    body_may_go = asyncio.Event()
    handler = answer_in_two_parts(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"{}", body_may_go)

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0, whole_up_to_bytes=1 << 20)
        await client.send(server.origin, infer(server.origin), reply)
        head = asyncio.ensure_future(reply.head())
        await asyncio.sleep(0.05)
        assert reply.headers_received and not head.done()
        body_may_go.set()
        await head
        assert reply.complete and await reply.read() == b"{}"
        await client.close()


async def test_answer_held_whole_is_read_past_the_streaming_pause():
    body_bytes = 900 << 10  # above the point where a streamed answer stops being read

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % body_bytes + b"x" * body_bytes)
        await writer.drain()
        await server.read_request(reader)

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0, whole_up_to_bytes=1 << 20)
        await client.send(server.origin, infer(server.origin), reply)
        await reply.head()
        assert len(await reply.read()) == body_bytes
        await client.close()


async def test_https_backend_is_reached_with_a_trusted_certificate(tls_cert):
    cert, key = tls_cert
    async with ScriptedServer(answer_each(OK, OK), tls=server_tls(cert, key)) as server:
        client = UpstreamClient()
        origin = with_options(server.origin, tls=TlsOptions(ca_file=str(cert)))
        for _ in range(2):
            assert await (await exchange(client, origin, infer(origin))).read() == b"{}"
        assert server.connections == 1
        await client.close()


async def test_https_backend_with_an_untrusted_certificate_is_a_connect_failure(tls_cert):
    cert, key = tls_cert
    async with ScriptedServer(answer_each(OK), tls=server_tls(cert, key)) as server:
        client = UpstreamClient()  # the system's CAs do not know the test certificate
        with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
            await exchange(client, server.origin, infer(server.origin))
        await client.close()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), as a process killed mid-answer or a proxy that gives up does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_a_body_ended_by_a_reset_is_broken_not_complete():
    head_read = asyncio.Event()

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: {"partial": ')
        await writer.drain()
        await head_read.wait()  # the reset comes after the head, as from a backend killed mid-answer
        reset(writer)

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        head_read.set()
        with pytest.raises(UpstreamBroken, match="broke before the answer's end"):
            await reply.read()
        assert not reply.complete
        await client.close()


async def test_a_switch_of_protocols_nobody_asked_for_breaks_the_exchange_and_never_hangs_it():
    switch = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
    async with ScriptedServer(answer_each(switch)) as server:
        client = UpstreamClient()
        with pytest.raises(UpstreamBroken, match="malformed"):
            await exchange(client, server.origin, infer(server.origin))
        await client.close()
    # After a complete answer, in the same segment: the answer is whole, the connection not reused.
    async with ScriptedServer(answer_each(OK + switch, OK)) as server:
        client = UpstreamClient()
        reply = await asyncio.wait_for(exchange(client, server.origin, infer(server.origin)), 5)
        assert await reply.read() == b"{}"
        assert await (await exchange(client, server.origin, infer(server.origin))).read() == b"{}"
        assert server.connections == 2
        await client.close()


def close_on_the_second_request(held_s: float):
    """Answers the first request on a connection, then reads the second and closes after `held_s`
    without a word; every later connection answers."""

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        first_connection = server.connections == 1
        if not await server.read_request(reader):
            return
        writer.write(OK)
        await writer.drain()
        if first_connection:
            await server.read_request(reader)
            await asyncio.sleep(held_s)  # the backend's work on it: the time under test
            return  # closed by ScriptedServer
        while await server.read_request(reader):
            writer.write(OK)
            await writer.drain()

    return handler


async def test_a_request_its_backend_closed_the_connection_on_as_it_arrived_is_sent_again():
    async with ScriptedServer(close_on_the_second_request(held_s=0)) as server:
        client = UpstreamClient()
        await (await exchange(client, server.origin, infer(server.origin))).read()
        reply = await exchange(client, server.origin, infer(server.origin))
        assert (await reply.read(), reply.retried, server.connections) == (b"{}", True, 2)
        await client.close()


async def test_an_inference_its_backend_held_and_died_on_is_not_sent_again():
    """The backend read it and worked on it (a crash, an OOM kill): sending it again would run it
    twice. An idempotent request is sent again."""
    held = CLOSED_AS_WRITTEN_S * 3
    async with ScriptedServer(close_on_the_second_request(held)) as server:
        client = UpstreamClient()
        await (await exchange(client, server.origin, infer(server.origin))).read()
        with pytest.raises(BackendGone):
            await exchange(client, server.origin, infer(server.origin))
        assert len(server.requests) == 2 and server.connections == 1
        await client.close()
    async with ScriptedServer(close_on_the_second_request(held)) as server:
        client = UpstreamClient()
        get = serialize_request("GET", "/v2/models/sim", server.origin, [], b"")
        await (await exchange(client, server.origin, get)).read()
        assert await (await exchange(client, server.origin, get)).read() == b"{}"
        assert len(server.requests) == 3
        await client.close()


async def test_a_reused_connection_closed_after_its_reader_left_does_not_say_the_backend_is_gone():
    """The keep-alive race while the client leaves (the drain's give-up waits for the backend):
    a broken exchange, not a dead backend, which would be taken out of dispatch."""
    async with ScriptedServer(close_on_the_second_request(held_s=0.2)) as server:
        client = UpstreamClient()
        await (await exchange(client, server.origin, infer(server.origin))).read()
        reply = Reply(asyncio.get_running_loop(), 5.0, on_abandon=OnAbandon.DRAIN)
        await client.send(server.origin, infer(server.origin), reply)
        reply.give_up(UpstreamBroken("its client left"))
        await eventually(lambda: reply.finished, what="the exchange to end")
        assert isinstance(reply.error, UpstreamBroken) and not isinstance(reply.error, BackendGone)
        await client.close()


async def test_trailers_that_never_end_are_cut_at_the_head_bound():
    """Counted from the reads that carry no body byte (those after the body's last one): one read
    of them at most goes uncounted, which bounds what the parser may hold."""
    limit = ConnectionOptions().max_head_bytes
    head_read = asyncio.Event()

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nx-trailer: ")
        await writer.drain()
        await head_read.wait()  # the trailer line that never ends comes in reads of its own
        for _ in range(limit // 1024 + 4):
            writer.write(b"a" * 1024)
            await writer.drain()
        await server.read_request(reader)

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        head_read.set()
        with pytest.raises(UpstreamBroken, match="trailers over"):
            await asyncio.wait_for(reply.read(), 5)
        await client.close()


async def test_answers_h11_reads_are_read_too():
    bare_lf = b"HTTP/1.1 200 OK\ncontent-length: 2\n\n{}"
    spaced_chunk = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2 \r\n{}\r\n0\r\n\r\n"
    for answer in (bare_lf, spaced_chunk):
        async with ScriptedServer(answer_each(answer)) as server:
            client = UpstreamClient()
            assert await (await exchange(client, server.origin, infer(server.origin))).read() == b"{}"
            await client.close()
