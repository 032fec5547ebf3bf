"""The connections to Redis the store's commands and grant listeners take: to one Redis server,
to the master a set of sentinels names (followed when they promote a replica), or to a Redis
Cluster (each command to the master of its key's slot)."""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from gateway.settings.store import RedisSentinel, Store

RedisClient: TypeAlias = Redis | RedisCluster

CLUSTER_SPARE_CONNECTIONS = 8
"""A cluster client's pools raise rather than wait once a node's connections are all in use: the
store's scripts wait their turn for one of `pool_size` (Scripts), and the few other commands
(the returns' exchange, once per wake) take these spare ones."""


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


def redis_clients(config: Store, listen_wake_s: float) -> tuple[RedisClient, RedisClient]:
    """(commands, grant listeners) for the store `config` names. The listeners' BLMPOP holds its
    connection up to `listen_wake_s`: they get their own, with a timeout beyond it."""
    if config.cluster:
        return _cluster_clients(config, listen_wake_s)
    if config.sentinel is not None:
        return _sentinel_clients(config, config.sentinel, listen_wake_s)
    assert config.url is not None, "validated by settings"
    timeout_s = config.timeout_ms / 1000
    listener = Redis.from_url(
        config.url, socket_timeout=listen_wake_s + timeout_s, socket_connect_timeout=timeout_s
    )
    return Redis(connection_pool=command_pool(config.url, config.pool_size, timeout_s)), listener


def _cluster_clients(config: Store, listen_wake_s: float) -> tuple[RedisCluster, RedisCluster]:
    assert config.url is not None, "validated by settings"
    timeout_s = config.timeout_ms / 1000
    commands = RedisCluster.from_url(
        config.url,
        max_connections=config.pool_size + CLUSTER_SPARE_CONNECTIONS,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    listener = RedisCluster.from_url(
        config.url, socket_timeout=listen_wake_s + timeout_s, socket_connect_timeout=timeout_s
    )
    return commands, listener


def _sentinel_clients(config: Store, sentinel: RedisSentinel, listen_wake_s: float) -> tuple[Redis, Redis]:
    # The URL beside sentinel gives the master's password, db and scheme; Sentinel gives its host.
    timeout_s = config.timeout_ms / 1000
    master: dict[str, Any] = {}
    if config.url:
        parsed = parse_url(config.url)
        master = {key: parsed[key] for key in ("db", "username", "password") if key in parsed}
        master["ssl"] = urlsplit(config.url).scheme == "rediss"
    sentinels = Sentinel(sentinel.addresses(), socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    commands = sentinels.master_for(
        sentinel.master,
        connection_pool_class=BlockingSentinelPool,
        max_connections=config.pool_size,
        timeout=None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        **master,
    )
    listener = sentinels.master_for(
        sentinel.master, socket_timeout=listen_wake_s + timeout_s, socket_connect_timeout=timeout_s, **master
    )
    return commands, listener


async def drop_idle_connections(client: RedisClient) -> None:
    """Drop the idle pooled connections to a Redis that went away (each would fail once), not those
    in use: a command in flight would fail with an error that is not a RedisError. A cluster
    client finds its nodes again by itself."""
    if isinstance(client, Redis):
        await client.connection_pool.disconnect(inuse_connections=False)


async def close(client: RedisClient) -> None:
    if isinstance(client, Redis):
        await client.aclose(close_connection_pool=True)
    else:
        await client.aclose()
