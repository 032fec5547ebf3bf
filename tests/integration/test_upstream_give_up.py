"""A reader that leaves before the answer ends (its client went away, its budget ran out): it gets
its error at once, while the exchange ends as the backend's on_abandon says, and `on_complete`
(which frees the request's slot) runs only once the backend is done."""

from __future__ import annotations

import asyncio

import pytest

from gateway.upstream.http1 import UpstreamClient
from gateway.upstream.origin import OnAbandon
from gateway.upstream.reply import Reply, UpstreamBroken
from tests.integration.scripted import OK, Reader, ScriptedServer, Writer, infer

pytestmark = pytest.mark.anyio
HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n"


class Left(Exception):
    pass


def answer_when(rest_may_go: asyncio.Event, *, then_close: bool = False) -> ScriptedServer:
    """Answer the first request with its head and half its body, the rest once `rest_may_go` is
    set; later requests on the connection get OK. With `then_close`, close instead of the rest."""

    async def handler(server: ScriptedServer, reader: Reader, writer: Writer) -> None:
        await server.read_request(reader)
        writer.write(HEAD + b"half")
        await writer.drain()
        await rest_may_go.wait()
        if then_close:
            return
        writer.write(b"rest")
        await writer.drain()
        while await server.read_request(reader):
            writer.write(OK)
            await writer.drain()

    return ScriptedServer(handler)


class Completions(list[bool]):
    """Each run of a reply's on_complete, with whether the answer was complete then."""

    def __init__(self, reply: Reply) -> None:
        super().__init__()
        self.ran = asyncio.Event()
        reply.on_complete = self._record
        self._reply = reply

    def _record(self) -> None:
        self.append(self._reply.complete)
        self.ran.set()

    async def wait(self) -> None:
        await asyncio.wait_for(self.ran.wait(), 5)


async def test_drain_frees_the_reader_at_once_and_completes_when_the_answer_ends():
    rest_may_go = asyncio.Event()
    async with answer_when(rest_may_go) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0, on_abandon=OnAbandon.DRAIN)
        completions = Completions(reply)
        await client.send(server.origin, infer(server.origin), reply)
        await reply.head()
        reply.give_up(Left())
        with pytest.raises(Left):
            await reply.read()
        assert completions == []  # the backend still works on it
        rest_may_go.set()
        await completions.wait()
        assert completions == [True]
        # The drained connection was clean: it carries the next exchange.
        follow = Reply(asyncio.get_running_loop(), 5.0)
        await client.send(server.origin, infer(server.origin), follow)
        await follow.head()
        assert (await follow.read(), server.connections) == (b"{}", 1)
        await client.close()


async def test_abort_hangs_up_and_completes_only_once_the_backend_has_closed():
    backend_may_close = asyncio.Event()

    async def handler(server: ScriptedServer, reader: Reader, writer: Writer) -> None:
        await server.read_request(reader)
        writer.write(HEAD + b"half")
        await writer.drain()
        await server.read_request(reader)  # returns at the client's hang-up (closed_by_peer)
        await backend_may_close.wait()

    async with ScriptedServer(handler) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0, on_abandon=OnAbandon.ABORT)
        completions = Completions(reply)
        await client.send(server.origin, infer(server.origin), reply)
        await reply.head()
        reply.give_up(Left())
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)  # the backend sees its client leave
        assert completions == []  # and is taken to compute until it closes its side
        backend_may_close.set()
        await completions.wait()
        assert completions == [False]
        assert isinstance(reply.error, UpstreamBroken)
        await client.close()


async def test_budget_gives_up_the_reader_but_not_the_exchange():
    rest_may_go = asyncio.Event()
    async with answer_when(rest_may_go) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0, on_abandon=OnAbandon.DRAIN, give_up_after_s=0.05)
        completions = Completions(reply)
        await client.send(server.origin, infer(server.origin), reply)
        await reply.head()
        with pytest.raises(TimeoutError, match="budget"):
            await reply.read()
        assert completions == []
        rest_may_go.set()
        await completions.wait()
        assert completions == [True]
        await client.close()


async def test_hard_deadline_ends_an_exchange_that_is_drained_forever():
    never = asyncio.Event()
    async with answer_when(never) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 0.2, on_abandon=OnAbandon.DRAIN)
        completions = Completions(reply)
        await client.send(server.origin, infer(server.origin), reply)
        await reply.head()
        reply.give_up(Left())
        await completions.wait()
        assert completions == [False] and isinstance(reply.error, TimeoutError)
        await client.close()


async def test_a_reader_that_left_before_sending_sends_nothing_and_completes_at_once():
    async with ScriptedServer(lambda server, reader, writer: server.read_request(reader)) as server:
        client = UpstreamClient()
        reply = Reply(asyncio.get_running_loop(), 5.0, on_abandon=OnAbandon.DRAIN)
        completions = Completions(reply)
        reply.give_up(Left())
        assert completions == [False]
        await client.send(server.origin, infer(server.origin), reply)
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)
        assert server.requests == []
        await client.close()
