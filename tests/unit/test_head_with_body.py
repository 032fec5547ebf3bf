"""A response's head leaves with its body's first bytes, or at the end of the loop's turn."""

import asyncio

import pytest

from gateway.head_with_body import HeadWithBody

pytestmark = pytest.mark.anyio


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


class Cycle:
    response_started = False


def connection() -> tuple[Transport, Cycle, HeadWithBody]:
    transport, cycle = Transport(), Cycle()
    return transport, cycle, HeadWithBody(transport, cycle, asyncio.get_running_loop())  # type: ignore[arg-type]


async def test_a_short_answer_leaves_in_one_write():
    transport, cycle, through = connection()
    cycle.response_started = True
    through.write(b"HTTP/1.1 429 \r\n\r\n")
    through.write(b"{}")
    assert transport.writes == [b"HTTP/1.1 429 \r\n\r\n{}"]
    await asyncio.sleep(0)  # the turn's end finds nothing left to write
    assert transport.writes == [b"HTTP/1.1 429 \r\n\r\n{}"]


async def test_a_stream_s_head_leaves_at_the_end_of_the_turn_without_its_body():
    transport, cycle, through = connection()
    cycle.response_started = True
    through.write(b"HTTP/1.1 200 \r\n\r\n")
    assert transport.writes == []
    await asyncio.sleep(0)
    assert transport.writes == [b"HTTP/1.1 200 \r\n\r\n"]
    through.write(b"data: 1\n\n")
    assert transport.writes == [b"HTTP/1.1 200 \r\n\r\n", b"data: 1\n\n"]


async def test_an_interim_answer_before_the_response_leaves_at_once():
    transport, _, through = connection()
    through.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]


async def test_closing_writes_a_held_head_first():
    transport, cycle, through = connection()
    cycle.response_started = True
    through.write(b"HTTP/1.1 200 \r\n\r\n")
    through.close()
    assert (transport.writes, transport.closed) == ([b"HTTP/1.1 200 \r\n\r\n"], True)
