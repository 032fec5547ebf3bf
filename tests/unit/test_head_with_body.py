"""A response's head leaves with its body's first bytes, or at the end of the loop's turn."""

import asyncio
import gc
import weakref

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.server.client_connections import ClientConnections
from gateway.server.client_limits import ClientLimits
from gateway.server.head_with_body import HeadWithBody
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
HEAD = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n"


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def connection() -> tuple[Transport, HeadWithBody]:
    transport = Transport()
    return transport, HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]


async def test_a_short_answer_leaves_in_one_write():
    transport, through = connection()
    through.write(HEAD)
    through.write(b"{}")
    assert transport.writes == [HEAD + b"{}"]
    await asyncio.sleep(0)  # the turn's end finds nothing left to write
    assert transport.writes == [HEAD + b"{}"]


async def test_a_stream_s_head_leaves_at_the_end_of_the_turn_without_its_body():
    transport, through = connection()
    through.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    assert transport.writes == []
    await asyncio.sleep(0)
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
    through.write(b"a\r\ndata: 1\n\n\r\n")
    assert transport.writes[1:] == [b"a\r\ndata: 1\n\n\r\n"]


async def test_an_interim_answer_before_the_response_leaves_at_once():
    transport, through = connection()
    through.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    through.write(HEAD)
    through.write(b"{}")
    assert transport.writes[1:] == [HEAD + b"{}"]


async def test_closing_writes_a_held_head_first():
    transport, through = connection()
    through.write(HEAD)
    through.close()
    assert (transport.writes, transport.closed) == ([HEAD], True)


async def test_a_served_request_s_cycle_is_freed_without_the_cycle_collector():
    """Through the client protocol the gateway serves with: once answered and closed, the request's
    uvicorn cycle (which holds its HeadWithBody) goes with its last reference."""

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    config = Config(app, lifespan="off", http="httptools", access_log=False)
    config.load()
    protocol_class = ClientConnections(ClientLimits(8192, 100, 10.0, 60.0, 30.0, 100)).protocol
    made = []

    def protocol():
        made.append(protocol_class(config=config, server_state=ServerState(), app_state={}))
        return made[-1]

    server = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", 0)
    gc.disable()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert await reader.readuntil(b"ok") == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        cycle = weakref.ref(made[0].cycle)
        assert isinstance(made[0].cycle.transport, HeadWithBody)
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: made[0].transport.is_closing())
        made.clear()
        await eventually(lambda: cycle() is None)
    finally:
        gc.enable()
        server.close()
