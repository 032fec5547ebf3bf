"""RedisQueue: one queue and one slot count per model, shared by every gateway replica.

Each check-and-change is one Lua script (lua/*.lua, run by EVALSHA and reloaded on NOSCRIPT), so
replicas never read and then write across a round trip. Redis holds metadata only: the replica that
holds a client's connection sends its request when the ticket is granted.

- Offer: admission check, then a slot (a lease) or a place in the band's sorted set.
- Grants: the script that frees a slot pops the next ticket and pushes the grant onto the owning
  replica's list; each replica waits on its lists with BLPOP on its own connection (no polling).
- Leases: a slot is a lease with a TTL, renewed by its replica's heartbeat. The reaper, run by every
  replica, frees the leases and purges the queued tickets of a replica that stopped beating.
- Estimates: the drain rate and the arrival rates are kept in Redis, on Redis's clock, so that
  admission and Retry-After use the global queue; every script returns a fresh snapshot of them.
  Service times are measured locally (every replica measures the same backends).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

from anyio.abc import TaskStatus
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.flow.estimates import JUMP_Z, TICK_S, PoolEstimates, rate_taus
from gateway.queues.base import Full, Granted, Offer, Queued, Slot, Ticket, Unavailable
from gateway.settings import Estimation
from gateway.supervision import Loop, Supervisor
from gateway.upstream.backends import BackendState, ModelPool
from policies.estimators import JUMP_MIN_EVENTS
from policies.ordering import Ordering
from policies.outcomes import Outcome
from policies.wait import QueueStats, Throughput, pool_drain_rate_per_s, positions_to_drain

log = logging.getLogger("gateway.redis")

# BLPOP returns at once when a grant is pushed; this only bounds how long a stop waits for it.
LISTEN_WAKE_S = 0.25
# A snapshot younger than this may refuse an arrival without asking Redis: scripts run for every
# admitted request and every release, so under load it is rarely older than a millisecond or two.
_VIEW_FRESH_S = 0.05
# An offer's reply comes within a command timeout, or never: a grant unclaimed this long is freed.
_UNCLAIMED_AFTER_S = 10.0
_SCRIPTS = ("offer", "release", "withdraw", "heartbeat", "reap", "ready", "snapshot", "rejoin")


def _script_source(name: str) -> str:
    lua = files("gateway.queues") / "lua"
    return (lua / "common.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


@dataclass(slots=True)
class _GlobalView:
    """The last snapshot a script returned, in local clock time."""

    seen_at: float
    redis_now: float
    """When the script that produced it ran, on Redis's clock: replies may arrive out of order."""
    free_slots: int
    queued_by_band: tuple[int, ...]
    offered: tuple[float, ...]
    admitted: tuple[float, ...]
    drain_handovers: float
    drain_backlog_s: float
    """Hand-overs seen in seconds of backlog, forgotten over the drain window (0, 0 when stale)."""

    def positions_to_drain(self, band: int) -> int:
        return positions_to_drain(QueueStats(self.queued_by_band, self.free_slots), band)

    @classmethod
    def parse(cls, raw: list[Any], bands: int, seen_at: float, stale_after_s: float) -> _GlobalView:
        now = float(raw[0])
        events, observed, drain_at = float(raw[2]), float(raw[3]), float(raw[4])
        fresh = observed > 0 and now - drain_at <= stale_after_s
        per_band = raw[5:]
        return cls(
            seen_at=seen_at,
            redis_now=now,
            free_slots=int(raw[1]),
            queued_by_band=tuple(int(per_band[3 * b]) for b in range(bands)),
            offered=tuple(float(per_band[3 * b + 1]) for b in range(bands)),
            admitted=tuple(float(per_band[3 * b + 2]) for b in range(bands)),
            drain_handovers=events if fresh else 0.0,
            drain_backlog_s=observed if fresh else 0.0,
        )


@dataclass(slots=True, eq=False)
class _Model:
    pool: ModelPool
    tag: str
    estimates: PoolEstimates
    view: _GlobalView
    waiting: dict[str, Ticket] = field(default_factory=dict)
    held: dict[str, Slot] = field(default_factory=dict)
    refused_locally: list[int] = field(default_factory=list)
    # A grant can reach the listener before the reply to the offer that queued its ticket:
    # it waits here (with when it came) for the offer to claim it.
    early_grants: dict[str, tuple[float, str]] = field(default_factory=dict)
    # Tickets withdrawn after Redis had granted them: their grants are on the way, to be freed.
    withdrawn: dict[str, float] = field(default_factory=dict)

    def backend(self, url: str) -> BackendState:
        """The backend a grant names. One that left the pool since (endpoint discovery) is kept
        as a detached, unready record: the grant's slot is real and is given back through it."""
        for backend in self.pool.backends:
            if backend.url == url:
                return backend
        return BackendState(self.pool.name, url, 0, "", ready=False)

    @property
    def backend_args(self) -> list[Any]:
        """The backends as the scripts read them: count, then (url, slots, queued inside) each.

        Built per call: slots may be discovered late, and the reported queues change every scrape.
        """
        args: list[Any] = [len(self.pool.backends)]
        for b in self.pool.backends:
            args += [b.url, b.max_concurrency, b.external_waiting]
        return args

    def take_refused_locally(self) -> list[int]:
        counts, self.refused_locally = self.refused_locally, [0] * len(self.refused_locally)
        return counts


class RedisQueue:
    def __init__(
        self,
        client: Redis,
        listener: Redis,
        pools: Iterable[ModelPool],
        bands: int,
        estimation: Estimation,
        *,
        key_prefix: str,
        replica_id: str,
        lease_ttl_s: float,
        ordering: Ordering = Ordering.FIFO,
        clock: Callable[[], float] = time.monotonic,
        on_failure: Callable[[BaseException], None] = lambda error: None,
        close_clients: bool = False,
        expected_replicas: int = 1,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._client = client
        self._close_clients = close_clients
        self._expected_replicas = expected_replicas
        self._on_failure = on_failure
        self._listener = listener
        self._bands = bands
        self._estimation = estimation
        self._rate_taus = rate_taus(estimation)
        self._replica = replica_id
        self._ttl_s = lease_ttl_s
        self._ordering = ordering
        self._clock = clock
        self._scripts = {name: client.register_script(_script_source(name)) for name in _SCRIPTS}
        self._models: dict[str, _Model] = {}
        for pool in pools:
            empty = _GlobalView(clock(), 0.0, 0, (0,) * bands, (0.0,) * bands, (0.0,) * bands, 0.0, 0.0)
            self._models[pool.name] = _Model(
                pool=pool,
                tag=f"{{{key_prefix}:{pool.name}}}",
                estimates=PoolEstimates(bands, pool.expected_service_s, estimation),
                view=empty,
                refused_locally=[0] * bands,
            )
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        """Runs the grant listeners and the upkeep loop; stopped with the store."""
        self._listeners: dict[str, Loop] = {}
        self._upkeep_loop: Loop | None = None
        self._stopping = False
        self._background: set[asyncio.Task[Any]] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Publish readiness, join as a live replica, and start the listeners and the upkeep loops.

        Returns once they run. They start even when Redis fails here (the error still propagates):
        they keep trying, and once the replica rejoins they are what keeps its leases alive.
        """
        try:
            for model in self._models.values():
                await self._publish_ready(model)
                await self._beat(model)
                await self._refresh(model)
        except RedisError:
            await self._start_loops()
            raise
        await self._start_loops()

    async def _start_loops(self) -> None:
        for name, model in self._models.items():
            self._listeners[name] = await self.supervisor.start(
                "redis_grants", functools.partial(self._listen, model), required=True
            )
        self._upkeep_loop = await self.supervisor.start("redis_upkeep", self._upkeep, required=True)

    async def stop(self) -> None:
        """Leave: stop the loops and let the reaper reclaim whatever this replica still holds."""
        # The loops watch a flag rather than being cancelled: cancelling a blocking BLPOP can leave
        # its connection half torn down. The listener wakes every LISTEN_WAKE_S to see the flag.
        self._stopping = True
        await self.supervisor.stop(grace_s=2 * LISTEN_WAKE_S + 1)
        with contextlib.suppress(RedisError):
            for model in self._models.values():
                await self._client.zadd(f"{model.tag}:replicas", {self._replica: 0})
                await self._reap(model)
        if self._close_clients:
            await self._client.aclose(close_connection_pool=True)
            await self._listener.aclose(close_connection_pool=True)

    # -- the RequestQueue protocol ---------------------------------------------------------------

    def stats(self, model: str) -> QueueStats:
        view = self._models[model].view
        return QueueStats(queued_by_band=view.queued_by_band, free_slots=view.free_slots)

    def throughput(self, model: str, now: float) -> Throughput:
        state = self._models[model]
        estimates, view = state.estimates, state.view
        drain = pool_drain_rate_per_s(
            view.drain_handovers, view.drain_backlog_s, state.pool.total_slots, estimates.service_time_s
        )
        return Throughput(
            service_time_s=estimates.service_time_s,
            drain_rate_per_s=drain,
            admitted_rate_by_band=view.admitted,
            offered_rate_by_band=view.offered,
            service_spread_s=estimates.service_spread_s,
            service_cv=estimates.service_cv,
        )

    def record_service(self, model: str, service_s: float) -> None:
        self._models[model].estimates.record_service(service_s)

    async def offer(
        self, model: str, band: int, allowed_wait_s: float, max_positions: int, now: float
    ) -> Offer:
        state = self._models[model]
        if (down := self._loop_down(model)) is not None:
            return Unavailable(retry_after_s=max(LISTEN_WAKE_S, down.restart_in_s))
        view = self._clock() - state.view.seen_at <= _VIEW_FRESH_S and state.view
        if view and view.positions_to_drain(band) > max_positions:
            # Clearly over the limit by a snapshot a few milliseconds old: refuse without a round
            # trip (under overload most arrivals end here), and count the arrival with the next script.
            state.refused_locally[band] += 1
            return Full(self.stats(model))
        args = [
            self._replica,
            band,
            max_positions,
            self._bands,
            self._ordering.value,
            allowed_wait_s,
            self._ttl_s,
            *self._rate_taus,
            TICK_S,
            JUMP_Z,
            JUMP_MIN_EVENTS,
            *state.take_refused_locally(),
            *state.backend_args,
        ]
        reply = await self._run("offer", state, args)
        kind = _text(reply[0])
        self._take_view(state, reply[-1])
        if kind == "granted":
            slot = self._slot(state, _text(reply[1]), _text(reply[2]))
            return Granted(slot)
        if kind == "queued":
            ticket = Ticket(model, band, asyncio.get_running_loop().create_future(), id=_text(reply[1]))
            state.waiting[ticket.id] = ticket
            if (early := state.early_grants.pop(ticket.id, None)) is not None:
                self._deliver(state, early[1])
            return Queued(ticket)
        return Full(self.stats(model))

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        state = self._models[ticket.model]
        ticket.interrupt(outcome)
        if state.waiting.pop(ticket.id, None) is not None:
            args = [
                ticket.id,
                ticket.band,
                self._replica,
                self._bands,
                *self._rate_taus,
                *state.backend_args,
            ]
            reply = await self._shielded(self._run("withdraw", state, args))
            self._take_view(state, reply[1])
            if not reply[0]:  # Redis had granted it: free the grant, now or when it arrives
                if (early := state.early_grants.pop(ticket.id, None)) is not None:
                    self._free_grant(state, early[1])
                else:
                    state.withdrawn[ticket.id] = self._clock()
        if not ticket.wakeup.cancelled() and isinstance(slot := ticket.wakeup.result(), Slot):
            await self.release(slot, self._clock())

    async def release(self, slot: Slot, now: float) -> None:
        task = self._release_task(slot)
        if task is not None:
            await asyncio.shield(task)

    def release_soon(self, slot: Slot, now: float) -> bool:
        self._release_task(slot)
        return False

    def backends_changed(self, model: str) -> None:
        state = self._models[model]
        self._spawn(self._publish_ready(state))
        if not state.pool.any_ready:
            for ticket in list(state.waiting.values()):
                self._spawn(self.withdraw(ticket, Outcome.NO_BACKEND))

    # -- losing and finding Redis (driven by FailoverQueue) ---------------------------------------

    def in_flight(self) -> list[Slot]:
        """The slots this replica holds and still uses."""
        return [slot for state in self._models.values() for slot in state.held.values()]

    def abandon(self) -> list[Ticket]:
        """Redis is gone: hand back every waiting ticket, since no grant can reach them now."""
        tickets: list[Ticket] = []
        for state in self._models.values():
            tickets += state.waiting.values()
            state.waiting.clear()
        return tickets

    async def rejoin(self, reserve: dict[str, dict[str, int]]) -> dict[str, list[str]]:
        """Redis is back: rejoin in one script per model (see lua/rejoin.lua).

        `reserve` maps model -> backend url -> slots the fallback store still uses; they are held
        as leases, whose ids are returned per model.
        """
        # Pooled connections to the Redis that went away would fail once each: drop them first.
        await self._client.connection_pool.disconnect()
        await self._listener.connection_pool.disconnect()
        reserved: dict[str, list[str]] = {}
        for name, state in self._models.items():
            ready = [item for b in state.pool.backends for item in (b.url, "1" if b.ready else "0")]
            share = [item for url, n in reserve.get(name, {}).items() if n for item in (url, n)]
            kept = [item for lease, slot in state.held.items() for item in (lease, slot.backend.url)]
            args = [
                self._replica,
                self._bands,
                self._ttl_s,
                self._estimation.drain_window_s,
                # Long enough for every live replica to notice Redis is back and rejoin.
                self._ttl_s + 1.0,
                self._expected_replicas,
                *state.backend_args,
                len(state.pool.backends),
                *ready,
                len(share) // 2,
                *share,
                *kept,
            ]
            dropped, freed, _, leases, renamed = await self._run("rejoin", state, args)
            if dropped or freed:
                log.info("model %s: dropped %d stale ticket(s) and %d stale lease(s)", name, dropped, freed)
            for old, new in zip(renamed[::2], renamed[1::2], strict=True):
                slot = state.held.pop(_text(old))
                slot.lease = _text(new)
                state.held[slot.lease] = slot
            reserved[name] = [_text(lease) for lease in leases]
            await self._refresh(state)
        return reserved

    async def release_leases(self, model: str, leases: Iterable[str]) -> None:
        state = self._models[model]
        for lease in leases:
            await self._free(state, lease)

    async def settle(self) -> None:
        """Wait until every operation started in the background has finished (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- internals -------------------------------------------------------------------------------

    def _loop_down(self, model: str) -> Loop | None:
        """The upkeep loop or the model's grant listener, when down: no new slot may be taken then.

        Without heartbeats the other replicas reap this one's leases while it uses them (a backend
        would run more than its slots); without the listener a queued request's grant never comes.
        """
        for loop in (self._upkeep_loop, self._listeners.get(model)):
            if loop is not None and not loop.up:
                return loop
        return None

    def _slot(self, state: _Model, lease: str, url: str) -> Slot:
        backend = state.backend(url)
        backend.inflight += 1  # this replica's share, for its metrics
        slot = Slot(state.pool.name, backend, lease=lease)
        state.held[lease] = slot
        return slot

    def _release_task(self, slot: Slot) -> asyncio.Task[Any] | None:
        if slot.released:
            return None
        slot.released = True
        state = self._models[slot.model]
        state.held.pop(slot.lease, None)
        slot.backend.inflight -= 1
        return self._spawn(self._free(state, slot.lease))

    async def _free(self, state: _Model, lease: str) -> None:
        """Run the release script; grants it made for this replica are delivered from its reply."""
        args = [
            lease,
            self._bands,
            self._ttl_s,
            self._estimation.drain_window_s,
            *self._rate_taus,
            self._replica,
            *state.backend_args,
        ]
        reply = await self._run("release", state, args)
        self._take_view(state, reply[2])
        for grant in reply[3]:
            self._deliver(state, grant)

    def _deliver(self, state: _Model, grant: bytes | str) -> None:
        grant = _text(grant)
        ticket_id = grant.split("|", 1)[0]
        ticket = state.waiting.pop(ticket_id, None)
        if ticket is None:
            if state.withdrawn.pop(ticket_id, None) is not None:
                self._free_grant(state, grant)
            else:
                state.early_grants[ticket_id] = (self._clock(), grant)
            return
        if ticket.wakeup.done():
            self._free_grant(state, grant)  # its waiter left in the meantime
            return
        _, lease, url = grant.split("|", 2)
        ticket.grant(self._slot(state, lease, url))

    def _free_grant(self, state: _Model, grant: str) -> None:
        _, lease, url = grant.split("|", 2)
        self._release_task(self._slot(state, lease, url))

    def _sweep(self, state: _Model) -> None:
        """Free grants no offer claimed (its reply was lost), forget withdrawals long settled."""
        old = self._clock() - _UNCLAIMED_AFTER_S
        for ticket_id, (at, grant) in list(state.early_grants.items()):
            if at < old:
                del state.early_grants[ticket_id]
                self._free_grant(state, grant)
        for ticket_id, at in list(state.withdrawn.items()):
            if at < old:
                del state.withdrawn[ticket_id]

    def _take_view(self, state: _Model, raw: list[Any]) -> None:
        view = _GlobalView.parse(raw, self._bands, self._clock(), self._estimation.drain_stale_after_s)
        if view.redis_now >= state.view.redis_now:
            state.view = view

    async def _run(self, script: str, state: _Model, args: list[Any]) -> Any:
        return await self._scripts[script](keys=[state.tag], args=args)

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run `work` to the end in the background, whatever happens to whoever started it."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            if isinstance(error, RedisError):
                self._on_failure(error)
            else:
                log.warning("redis store operation failed: %r", error)

    async def _shielded(self, work: Awaitable[Any]) -> Any:
        return await asyncio.shield(self._spawn(work))

    async def _beat(self, state: _Model) -> None:
        await self._run("heartbeat", state, [self._replica, self._ttl_s, self._expected_replicas])

    async def _publish_ready(self, state: _Model) -> None:
        pairs: list[Any] = []
        for backend in state.pool.backends:
            pairs += [backend.url, "1" if backend.ready else "0"]
        args = [self._bands, self._ttl_s, self._estimation.drain_window_s, *state.backend_args, *pairs]
        await self._run("ready", state, args)

    async def _refresh(self, state: _Model) -> None:
        args = [self._bands, *self._rate_taus, *state.take_refused_locally(), *state.backend_args]
        reply = await self._run("snapshot", state, args)
        self._take_view(state, reply)

    async def _reap(self, state: _Model) -> None:
        args = [self._bands, self._ttl_s, self._estimation.drain_window_s, *state.backend_args]
        dead, expired, granted = await self._run("reap", state, args)
        if dead or expired:
            log.warning(
                "model %s: reclaimed %d dead replica(s) and %d expired lease(s), %d grant(s) followed",
                state.pool.name,
                dead,
                expired,
                granted,
            )

    async def _listen(self, state: _Model, *, task_status: TaskStatus[None]) -> None:
        """Deliver this replica's grants to their waiting requests, as soon as they are pushed."""
        key = f"{state.tag}:grants:{self._replica}"
        task_status.started()  # grants pushed before the first BLMPOP wait in their list
        while not self._stopping:
            try:
                popped = await self._listener.blmpop(LISTEN_WAKE_S, 1, key, direction="LEFT", count=64)
            except RedisError as error:
                self._on_failure(error)
                await asyncio.sleep(LISTEN_WAKE_S)
                continue
            for grant in popped[1] if popped else ():
                self._deliver(state, grant)

    async def _upkeep(self, *, task_status: TaskStatus[None]) -> None:
        """Heartbeat (renews leases) every third of the TTL; reap and refresh on the way.

        It beats at once when it starts, and only then reports itself up: a restarted loop must
        renew the leases before this replica takes new ones.
        """
        beat_s = self._ttl_s / 3
        next_beat = self._clock()
        while not self._stopping:
            for state in self._models.values():
                self._sweep(state)
            if self._clock() >= next_beat:
                next_beat = self._clock() + beat_s * random.uniform(0.9, 1.1)
                for state in self._models.values():
                    try:
                        await self._beat(state)
                        await self._reap(state)
                        await self._refresh(state)
                    except RedisError as error:  # keep beating through a passing failure
                        self._on_failure(error)
                task_status.started()
            await asyncio.sleep(LISTEN_WAKE_S)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
