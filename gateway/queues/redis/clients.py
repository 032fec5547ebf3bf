"""The connections to Redis the store's commands and grant listeners take: to one Redis server,
or to the master a set of sentinels names (followed when they promote a replica)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from gateway.settings.serving import Store


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (connections to the master it names, reconnected to a promoted one) that
    waits for a free connection as `command_pool` does instead of raising."""


def command_pool(url: str, size: int, timeout_s: float) -> BlockingConnectionPool:
    """The connections commands take turns on. The default pool raises once more than its size of
    commands are in flight, and a blocking one past its wait timeout, as an unreachable Redis
    would: the replica would detach from a Redis that is only busy. So a command waits for a
    connection as long as it takes; the ones in flight end within their socket timeout."""
    return BlockingConnectionPool.from_url(
        url,
        max_connections=size,
        timeout=None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


def redis_clients(config: Store, listen_wake_s: float) -> tuple[Redis, Redis]:
    """(commands, grant listeners) for the store `config` names. The listeners' BLMPOP holds its
    connection up to `listen_wake_s`: they get their own, with a timeout beyond it."""
    timeout_s = config.timeout_ms / 1000
    if config.sentinel is None:
        assert config.url is not None, "validated by settings"
        listener = Redis.from_url(
            config.url, socket_timeout=listen_wake_s + timeout_s, socket_connect_timeout=timeout_s
        )
        return Redis(connection_pool=command_pool(config.url, config.pool_size, timeout_s)), listener
    # The URL beside sentinel gives the master's password, db and scheme; Sentinel gives its host.
    master: dict[str, Any] = {}
    if config.url:
        parsed = parse_url(config.url)
        master = {key: parsed[key] for key in ("db", "username", "password") if key in parsed}
        master["ssl"] = urlsplit(config.url).scheme == "rediss"
    sentinels = Sentinel(
        config.sentinel.addresses(), socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    commands = sentinels.master_for(
        config.sentinel.master,
        connection_pool_class=BlockingSentinelPool,
        max_connections=config.pool_size,
        timeout=None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        **master,
    )
    listener = sentinels.master_for(
        config.sentinel.master,
        socket_timeout=listen_wake_s + timeout_s,
        socket_connect_timeout=timeout_s,
        **master,
    )
    return commands, listener
