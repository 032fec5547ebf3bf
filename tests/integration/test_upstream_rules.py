"""The upstream client's correctness rules against scripted servers on real sockets: the buffer is
parsed to its end before a connection is reused, heads are bounded as they arrive, trailers stay
apart, idle connections age out per origin, one retry for a reused connection that died unanswered,
and TLS per backend."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from gateway.upstream.http1 import UpstreamClient
from gateway.upstream.origin import ConnectionOptions, TlsOptions
from gateway.upstream.reply import BackendGone, ConnectFailed, Reply, UpstreamBroken
from tests.integration.scripted import (
    OK,
    ScriptedServer,
    answer_each,
    exchange,
    infer,
    server_tls,
    with_options,
)

pytestmark = pytest.mark.anyio


async def test_bytes_past_an_answer_close_its_connection_and_spare_the_next_request():
    async with ScriptedServer(answer_each(OK + b"xx", OK)) as server:
        client = UpstreamClient()
        loop = asyncio.get_running_loop()
        reply = Reply(loop, 5.0)
        sent_from_completion: list[Reply | None] = []
        # As the grant hook does: the next request is written from inside the completion.
        reply.on_complete = lambda: sent_from_completion.append(
            client.try_send(server.origin, infer(server.origin), lambda: Reply(loop, 5.0))
        )
        await client.send(server.origin, infer(server.origin), reply)
        await reply.head()
        assert (reply.status, await reply.read()) == (200, b"{}")
        assert sent_from_completion == [None]  # the connection that carried garbage is not reused
        assert await (await exchange(client, server.origin, infer(server.origin))).read() == b"{}"
        assert server.connections == 2
        await client.close()


async def test_head_that_never_ends_is_cut_at_its_limit_not_at_the_timeout():
    endless = b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (4 << 20)
    async with ScriptedServer(answer_each(endless)) as server:
        client = UpstreamClient()
        with pytest.raises(UpstreamBroken, match="head over 16384 bytes"):
            await asyncio.wait_for(exchange(client, server.origin, infer(server.origin), timeout_s=300), 10)
        await client.close()


async def test_head_limit_is_set_per_origin():
    big_head = b"HTTP/1.1 200 OK\r\nx-pad: " + b"y" * 3000 + b"\r\ncontent-length: 2\r\n\r\n{}"
    async with ScriptedServer(answer_each(big_head, big_head)) as server:
        client = UpstreamClient()
        assert await (await exchange(client, server.origin, infer(server.origin))).read() == b"{}"
        strict = with_options(server.origin, max_head_bytes=2048)
        with pytest.raises(UpstreamBroken, match="over 2048 bytes"):
            await exchange(client, strict, infer(strict))
        await client.close()


async def test_trailers_are_kept_apart_from_the_headers():
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum\r\n\r\n"
        b"2\r\n{}\r\n0\r\nx-checksum: abc\r\n\r\n"
    )
    async with ScriptedServer(answer_each(chunked)) as server:
        client = UpstreamClient()
        reply = await exchange(client, server.origin, infer(server.origin))
        assert await reply.read() == b"{}"
        assert all(name.lower() != b"x-checksum" for name, _ in reply.headers)
        assert reply.trailers == [(b"x-checksum", b"abc")]
        await client.close()


def test_default_idle_keepalive_is_below_common_servers_idle_timeouts():
    assert ConnectionOptions().keepalive_s < 2.0  # gunicorn closes idle connections after 2 s


def close_unanswered_after(answers: int) -> ScriptedServer:
    """A server that answers the first `answers` requests of its first connection, then reads the
    next one and closes without a byte; later connections are answered normally."""

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        first = server.connections == 1
        for _ in range(answers if first else 100):
            if not await server.read_request(reader):
                return
            writer.write(OK)
            await writer.drain()
        if first:
            await server.read_request(reader)  # and close: the keep-alive race of a closing server

    return ScriptedServer(handler)


async def test_request_on_a_reused_connection_that_died_unanswered_is_sent_once_more():
    async with close_unanswered_after(1) as server:
        client = UpstreamClient()
        assert await (await exchange(client, server.origin, infer(server.origin))).read() == b"{}"
        reply = await exchange(client, server.origin, infer(server.origin))
        assert (reply.status, await reply.read(), reply.retried) == (200, b"{}", True)
        assert (server.connections, len(server.requests)) == (2, 3)
        await client.close()


async def test_request_on_a_fresh_connection_that_died_unanswered_is_not_sent_again():
    async with close_unanswered_after(0) as server:
        client = UpstreamClient()
        with pytest.raises(BackendGone, match="without answering"):
            await exchange(client, server.origin, infer(server.origin))
        assert (server.connections, len(server.requests)) == (1, 1)
        await client.close()


async def test_request_answered_in_part_is_not_sent_again():
    partial = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart"

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        for answer in (OK, partial):
            await server.read_request(reader)
            writer.write(answer)
            await writer.drain()

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        await (await exchange(client, server.origin, infer(server.origin))).read()
        reply = await exchange(client, server.origin, infer(server.origin))
        with pytest.raises(UpstreamBroken):
            await reply.read()
        assert server.connections == 1
        await client.close()


async def test_a_request_is_sent_again_only_once():
    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if server.connections == 1:
            await server.read_request(reader)
            writer.write(OK)
            await writer.drain()
        await server.read_request(reader)  # then close unanswered, on every connection

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        await (await exchange(client, server.origin, infer(server.origin))).read()
        with pytest.raises(UpstreamBroken):
            await exchange(client, server.origin, infer(server.origin))
        assert server.connections == 2
        await client.close()


async def test_https_backend_with_verification_off_takes_any_certificate(tls_cert):
    cert, key = tls_cert
    async with ScriptedServer(answer_each(OK), tls=server_tls(cert, key)) as server:
        client = UpstreamClient()
        origin = with_options(server.origin, tls=TlsOptions(verify=False))
        assert await (await exchange(client, origin, infer(origin))).read() == b"{}"
        await client.close()


async def test_https_backend_that_asks_for_a_client_certificate_gets_the_configured_one(tls_cert):
    cert, key = tls_cert
    demanding = server_tls(cert, key)
    demanding.verify_mode = ssl.CERT_REQUIRED
    demanding.load_verify_locations(cert)
    async with ScriptedServer(answer_each(OK), tls=demanding) as server:
        client = UpstreamClient()
        known = TlsOptions(ca_file=str(cert), cert_file=str(cert), key_file=str(key))
        origin = with_options(server.origin, tls=known)
        assert await (await exchange(client, origin, infer(origin))).read() == b"{}"
        anonymous = with_options(server.origin, tls=TlsOptions(ca_file=str(cert)))
        with pytest.raises((ConnectFailed, UpstreamBroken)):
            await exchange(client, anonymous, infer(anonymous))
        await client.close()
