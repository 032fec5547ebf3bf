"""The Redis store's Lua scripts, loaded once and run on one model's keys with named arguments.

Every script gets the arguments all of them read (the band count, the backends, the lease TTL, how
long a request may hold a lease, the slots each class reserves, the tenants' quotas, and the time
a test injects);
gateway.queues.redis.codec encodes and decodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

from gateway.queues.base import Reservations, reserved_now
from gateway.queues.redis.clients import RedisClient
from gateway.queues.redis.codec import backends_arg, decode, encode
from gateway.queues.redis.presence import lease_bound_s
from gateway.telemetry.store_calls import StoreCalls
from gateway.upstream.backends import ModelPool
from policies.quotas import Quota

_NAMES = (
    "offer",
    "release",
    "withdraw",
    "heartbeat",
    "reap",
    "ready",
    "snapshot",
    "rejoin",
    "dispatch",
    "limit",
    "recover",
    "gone",
    "peers",
)


@dataclass(frozen=True, slots=True)
class ScriptRunning:
    """How a replica runs its scripts."""

    in_flight: int | None = None
    """At most this many at once (a cluster client's pools raise past their size); None: no bound
    here (a blocking pool makes commands wait for a connection)."""
    calls: StoreCalls = field(default_factory=StoreCalls)
    """Counts of the scripts run and their round trips, for /metrics."""


def script_source(name: str) -> str:
    lua = files("gateway.queues.redis") / "lua"
    return (lua / "common.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class Scripts:
    def __init__(
        self,
        client: RedisClient,
        bands: int,
        lease_ttl_s: float,
        redis_clock: Callable[[], float] | None,
        reserved: Reservations = (),
        quotas: Mapping[str, Quota] | None = None,
        tenants: bool = True,
        running: ScriptRunning | None = None,
    ) -> None:
        """`tenants`: requests may come in flows of several tenants, so the views the scripts
        return carry each band's fair-queuing state (without tenants a turn is the whole band)."""
        self._tenants = tenants
        running = running if running is not None else ScriptRunning()
        self.calls = running.calls
        """Scripts run and their round trips, for /metrics."""
        in_flight = running.in_flight
        self._turns = asyncio.Semaphore(in_flight) if in_flight is not None else contextlib.nullcontext()
        """At most `in_flight` scripts at once, where the client's pools raise rather than wait."""
        self._quotas = {
            tenant: {"n": q.nominal}
            | ({"b": q.borrowing_limit} if math.isfinite(q.borrowing_limit) else {})
            | ({"l": q.lending_limit} if math.isfinite(q.lending_limit) else {})
            for tenant, q in (quotas or {}).items()
        }
        """Tenant -> its quota as the scripts read it (policies.quotas; no key: no limit)."""
        self.has_quotas = bool(self._quotas)
        """Whether any tenant has a quota."""
        self._reserved = reserved
        """Per band, the slots its class keeps from the less urgent ones (none: an empty list)."""
        self._registered = {name: client.register_script(script_source(name)) for name in _NAMES}
        self._bands = bands
        self._ttl_s = lease_ttl_s
        self._redis_clock = redis_clock
        """Tests: the time the scripts use instead of Redis's TIME."""

    def reservations(self) -> tuple[int, ...]:
        """Per band, the slots its class reserves now (the scripts get the same)."""
        return reserved_now(self._reserved)

    async def run(self, name: str, tag: str, pool: ModelPool, args: dict[str, Any]) -> Any:
        """Run script `name` (EVALSHA, reloaded on NOSCRIPT) on the keys of `tag`."""
        args["bands"] = self._bands
        args["backends"] = backends_arg(pool)
        args.setdefault("ttl", self._ttl_s)
        args["bound_s"] = lease_bound_s(pool, self._ttl_s)
        if pool.max_queued_work is not None:
            args["cap"] = pool.max_queued_work
        if reserved := self.reservations():
            args["reserved"] = list(reserved)
        if callable(self._reserved):
            args["reserved_move"] = True
        if self._quotas:
            args["quotas"] = self._quotas
        if self._tenants:
            args["tenants"] = True
        if self._redis_clock is not None:
            args["now"] = self._redis_clock()
        async with self._turns:
            sent = time.perf_counter()
            reply = await self._registered[name](keys=[tag], args=[encode(args)])
            self.calls.record(name, time.perf_counter() - sent)
        return decode(reply) if isinstance(reply, bytes | str) else reply
