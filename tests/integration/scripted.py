"""Scripted HTTP servers on 127.0.0.1 that answer the way model servers (and broken ones) do, and
helpers to drive the upstream client against them."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.upstream.http1 import UpstreamClient, serialize_request
from gateway.upstream.origin import ConnectionOptions, Origin
from gateway.upstream.reply import Reply

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Handler = Callable[["ScriptedServer", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class ScriptedServer:
    """A TCP server on an ephemeral port whose every connection runs `handler`."""

    def __init__(self, handler: Handler, *, tls: ssl.SSLContext | None = None) -> None:
        self._handler = handler
        self._tls = tls
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = asyncio.Event()

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._tls)
        port = self._server.sockets[0].getsockname()[1]
        self.origin = Origin("127.0.0.1", port, tls=self._tls is not None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request, head and Content-Length body; b"" when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_peer.set()
            return b""
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


def answer_each(*responses: bytes) -> Handler:
    """Answer every request on a connection with the next of `responses`, then keep reading."""

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        for response in responses:
            if not await server.read_request(reader):
                return
            writer.write(response)
            await writer.drain()
        await server.read_request(reader)

    return handler


def answer_in_two_parts(first: bytes, rest: bytes, rest_may_go: asyncio.Event) -> Handler:
    """Answer one request with `first`, and with `rest` once `rest_may_go` is set."""

    async def handler(
        server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.read_request(reader)
        writer.write(first)
        await writer.drain()
        await rest_may_go.wait()
        writer.write(rest)
        await writer.drain()
        await server.read_request(reader)

    return handler


async def exchange(client: UpstreamClient, origin: Origin, request: bytes, timeout_s: float = 5.0) -> Reply:
    reply = Reply(asyncio.get_running_loop(), timeout_s)
    await client.send(origin, request, reply)
    await reply.head()
    return reply


def with_options(origin: Origin, **options: object) -> Origin:
    return Origin(origin.host, origin.port, origin.tls, ConnectionOptions(**options))  # type: ignore[arg-type]


def infer(origin: Origin, body: bytes = b'{"inputs":[]}') -> bytes:
    return serialize_request(
        "POST", "/v2/models/sim/infer", origin, [(b"content-type", b"application/json")], body
    )


def server_tls(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context
