"""The command pool: more commands in flight than it has connections is a wait, not a failure."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from gateway.queues.redis.clients import command_pool
from tests.redis_server import redis_url_or_skip, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


async def test_commands_wait_for_a_connection_longer_than_the_command_timeout():
    """Six commands of 0.5 s on two connections and a 0.8 s timeout: the last two wait 1 s for a
    connection. Were that wait bounded by the timeout they would fail as if Redis were gone, and
    the replica would detach from a Redis that is only busy."""
    redis = Redis(connection_pool=command_pool(redis_url_or_skip(), 2, timeout_s=0.8))
    key = unique_prefix() + "never-pushed"
    try:
        replies = await asyncio.gather(*(redis.blpop([key], timeout=0.5) for _ in range(6)))
    finally:
        await redis.aclose(close_connection_pool=True)
    assert replies == [None] * 6
