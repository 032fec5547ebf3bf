"""RedisQueue: one queue and one slot count per model, shared by every gateway replica.

Each check-and-change is one Lua script (lua/*.lua, by EVALSHA), so replicas never read and then
write across a round trip. Redis holds metadata only (named fields: gateway.queues.redis.codec): the
replica that holds a client's connection sends its request when the ticket is granted.

- Offer: admission check, then a slot (a lease) or a place in its flow's sorted set.
- Grants: the script that frees a slot takes the next ticket (or a batch of one flow) and pushes
  the grant onto the owning replica's list; each replica waits on its lists with BLMPOP on its own
  connection (no polling). gateway.queues.redis.grants keeps each replica's side of it.
- Leases: a slot is a lease with a TTL, renewed by its replica's heartbeat while its request runs.
  A replica whose heartbeat lapsed keeps its leases reserved until its work could have ended, its
  tickets are purged, and it comes back by rejoining (gateway.queues.redis.presence).
- Estimates: raw totals on Redis's clock, made rates with PoolEstimates; service times measured
  locally. Returns promised to refused clients go round on the upkeep loop (redis/returns.py).
- Sequences: pinned to a backend on arrival, their requests wait apart for it (policies.sequences).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from anyio.abc import TaskStatus
from redis.exceptions import RedisError

from gateway.queues.background import Background
from gateway.queues.base import Batching, Flow, Full, Granted, Offer, Queued, Slot, Ticket, Unavailable
from gateway.queues.redis.clients import RedisClient, close, drop_idle_connections
from gateway.queues.redis.codec import Displaced, Grant, OfferArgs, grants, ready_arg
from gateway.queues.redis.grants import ModelState, expire_in_order, listen
from gateway.queues.redis.peers import BeaconAt, Peers
from gateway.queues.redis.presence import Holding, Presence, ReplicaAbsent
from gateway.queues.redis.returns import RedisReturns
from gateway.queues.redis.scripts import ScriptRunning, Scripts
from gateway.settings import Estimation
from gateway.supervision import Loop, Supervisor
from gateway.upstream.backends import ModelPool
from policies.ordering import Ordering
from policies.outcomes import Outcome
from policies.quotas import Quota
from policies.sequences import SequenceRef
from policies.wait import QueueStats, Throughput

log = logging.getLogger("gateway.redis")

LISTEN_WAKE_S = 0.25  # BLMPOP returns at once when a grant is pushed: this bounds a stop's wait


class RedisQueue:
    def __init__(
        self,
        client: RedisClient,
        listener: RedisClient,
        pools: Iterable[ModelPool],
        bands: int,
        estimation: Estimation,
        *,
        key_prefix: str,
        replica_id: str,
        lease_ttl_s: float,
        ordering: Ordering = Ordering.FIFO,
        weights: Callable[[str], float] = lambda tenant: 1.0,
        reserved: tuple[int, ...] | Callable[[], tuple[int, ...]] = (),
        quotas: Mapping[str, Quota] | None = None,
        clock: Callable[[], float] = time.monotonic,
        redis_clock: Callable[[], float] | None = None,
        on_failure: Callable[[BaseException], None] = lambda error: None,
        close_clients: bool = False,
        expected_replicas: int = 1,
        fallback_max_s: float = 0.0,
        supervisor: Supervisor | None = None,
        tenants: bool = True,
        running: ScriptRunning | None = None,  # how its scripts run: at most how many at once, counted
        beacon_at: BeaconAt | None = None,  # None: a killed replica's slots stay reserved to their bounds
    ) -> None:
        self._client, self._listener, self._close_clients = client, listener, close_clients
        self._bands, self._estimation, self._ordering = bands, estimation, ordering
        self._replica, self._ttl_s, self._clock, self._on_failure = replica_id, lease_ttl_s, clock, on_failure
        self._weight_of = weights  # a tenant's weight in its bands' fair queuing now (unnamed: 1)
        scripts = (client, bands, lease_ttl_s, redis_clock, reserved, quotas, tenants, running)
        self._scripts = Scripts(*scripts)
        presence_args = (replica_id, lease_ttl_s, expected_replicas, fallback_max_s, clock)
        self._presence = Presence(self._run, *presence_args)
        self._models = {
            pool.name: ModelState.of(pool, key_prefix, bands, estimation, clock()) for pool in pools
        }
        self.supervisor = supervisor if supervisor is not None else Supervisor()  # its loops, stopped with it
        self._listeners: dict[str, Loop] = {}
        self._upkeep_loop: Loop | None = None
        self._stopping = False
        self._background = Background(on_failure)
        self._spawn = self._background.spawn  # runs work to its end, whatever happens to its starter
        self.shared_returns = RedisReturns(client, replica_id, bands)
        self._peers = Peers(replica_id, beacon_at, self._run, self._spawn, self._scripts.calls)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Publish readiness, join as a live replica, and start the listeners and the upkeep loops.

        Returns once they run. They start even when Redis fails here (the error still propagates):
        they keep trying, and once the replica rejoins they are what keeps its leases alive.
        """
        self._presence.beacon = await self._peers.open()
        try:
            for model in self._models.values():
                await self._presence.join(model, {})
                await self._refresh(model)
        except RedisError:
            await self._start_loops()
            raise
        await self._start_loops()

    async def _start_loops(self) -> None:
        for name, model in self._models.items():  # each model's grants to this replica
            body = functools.partial(listen, self._listener, model, self._replica, LISTEN_WAKE_S)
            loop = functools.partial(
                body, functools.partial(self._deliver, model), self._run, self._on_failure
            )
            self._listeners[name] = await self.supervisor.start(
                "redis_grants", functools.partial(loop, lambda: self._stopping), required=True
            )
        self._upkeep_loop = await self.supervisor.start("redis_upkeep", self._upkeep, required=True)

    async def stop(self) -> None:
        """Stop the loops and leave Redis, which reclaims what is left once its work has surely
        ended; not while the fallback may still run work: the heartbeat lapses, so it stays covered."""
        # A flag, not cancellation, stops the loops: a cancelled BLMPOP can leave its connection torn.
        self._stopping = True
        await self.supervisor.stop(grace_s=2 * LISTEN_WAKE_S + 1)
        with contextlib.suppress(RedisError):
            for model in self._models.values():
                if not self._presence.detached and not model.reserved:
                    await self._presence.reap(model, leaving=True)
        await self._peers.close()  # the process is done with its work: a probe may say so now
        if self._close_clients:
            await close(self._client)
            await close(self._listener)

    # -- the RequestQueue protocol ---------------------------------------------------------------

    def stats(self, model: str) -> QueueStats:
        return self._models[model].view.stats

    def throughput(self, model: str, now: float) -> Throughput:
        return self._models[model].throughput(now, self._scripts.reservations())

    def identify(self, config_hash: str) -> None:
        self._presence.config_hash = config_hash

    def replicas(self) -> Mapping[str, str]:
        return self._peers.live()

    def record_service(self, model: str, service_s: float, slot: Slot | None = None) -> None:
        self._models[model].record_service(service_s, slot)

    async def offer(
        self,
        flow: Flow,
        cost: float,
        allowed_wait_s: float,
        max_work: float,
        now: float,
        batching: Batching | None = None,
        on_grant: Callable[[Slot], None] | None = None,
        kind: str = "",
        reach: Mapping[str, float] | None = None,
        sequence: SequenceRef | None = None,
    ) -> Offer:
        state = self._models[flow.model]
        if (down := self._loop_down(flow.model)) is not None:
            return Unavailable(retry_after_s=max(LISTEN_WAKE_S, down.restart_in_s))
        if state.refused_from_view(flow, cost, max_work, reach or {}, self._clock()):
            return Full(state.view.stats)
        handover = state.estimates.handover_cost
        edf, weight = self._ordering is Ordering.EDF, self._weight_of(flow.tenant)
        displacing = flow.band < self._bands - 1 or self._scripts.has_quotas  # a reclaiming owner may
        pool = self.throughput(flow.model, now) if displacing else None
        args = OfferArgs(
            self._replica, flow, cost, max_work, handover, edf, weight, allowed_wait_s, self._ttl_s
        )
        args = replace(args, displacing=pool, kind=kind, reach=dict(reach or {}), sequence=sequence)
        running = self._spawn(self._run("offer", state, args.fields(state.take_refused_locally(), batching)))
        try:
            reply = await asyncio.shield(running)
        except asyncio.CancelledError:  # no slot or ticket may stay for a caller that left
            running.add_done_callback(functools.partial(self._undo_offer, state, flow, cost))
            raise
        if reply["kind"] == "absent":
            raise ReplicaAbsent(f"model {flow.model}: this replica's heartbeat lapsed")
        self._take_view(state, reply["view"])
        if reply["kind"] == "granted":
            return Granted(state.hold(reply["lease"], reply["url"], cost, flow.band, kind))
        if reply["kind"] == "queued":
            ticket = state.queued(flow, cost, reply["ticket"], batching, now + allowed_wait_s, on_grant, kind)
            return Queued(ticket)
        return Full(state.view.stats, at_cap=bool(reply.get("cap")))

    def expire(self, ticket: Ticket) -> None:
        state = self._models[ticket.model]
        withdrawn = functools.partial(self._withdrawn, state, ticket.id)
        self._spawn(expire_in_order(state, ticket, withdrawn))

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        state = self._models[ticket.model]
        ticket.interrupt(outcome)
        if state.waiting.pop(ticket.id, None) is not None:
            if not await asyncio.shield(self._spawn(self._withdrawn(state, ticket.id))):
                # Redis had granted it: free the grant, now or when it arrives.
                self._give_back(state.granted_before_withdrawal(ticket.id, self._clock()))
        if not ticket.wakeup.cancelled() and isinstance(slot := ticket.wakeup.result(), Slot):
            # A batch's slot is released by whoever runs the batch's call; a claimed one by its caller.
            if not slot.batch and not ticket.claimed and (task := self._release_task(slot, used=False)):
                await asyncio.shield(task)

    async def release(self, slot: Slot, now: float) -> None:
        if (task := self._release_task(slot)) is not None:
            await asyncio.shield(task)

    def release_soon(self, slot: Slot, now: float) -> bool:
        self._release_task(slot)
        return False

    def dispatch_held(self, model: str) -> None:
        state = self._models[model]
        self._spawn(self._granting("dispatch", state, {"replica": self._replica}))

    async def share_limit(self, model: str, url: str, slots: int, lead_s: float) -> tuple[bool, int]:
        args = {"replica": self._replica, "url": url, "slots": slots, "lead_ttl": lead_s}
        reply = await self._run("limit", self._models[model], args)
        return bool(reply["lead"]), int(reply["slots"])

    def backends_changed(self, model: str) -> None:
        state = self._models[model]
        self._spawn(self._publish_ready(state))
        if not state.pool.any_ready:
            for ticket in list(state.waiting.values()):
                self._spawn(self.withdraw(ticket, Outcome.NO_BACKEND))

    # -- losing and finding Redis (driven by FailoverQueue) ---------------------------------------

    def detach(self) -> dict[str, Holding]:
        """Redis is lost, a fallback takes over: no beat, no lease freed until rejoined. Returns, per
        model, what this replica holds, which Redis keeps counted for it meanwhile."""
        self._presence.detached = True
        return {name: self._presence.holding(state) for name, state in self._models.items()}

    @property
    def fallback_max_s(self) -> float:  # how long after its last beat it may serve from a fallback
        return self._presence.fallback_max_s

    def abandon(self) -> list[Ticket]:
        """Redis is gone: hand back every waiting ticket, since no grant can reach them now."""
        return [ticket for state in self._models.values() for ticket in state.abandon()]

    async def rejoin(self, reserve: dict[str, dict[str, int]]) -> set[str]:
        """Redis is back: rejoin in one script per model (see lua/rejoin.lua). `reserve` maps
        model -> backend url -> slots the fallback store may still use; they are held as leases
        until `release_reserved`. Returns the models that have some."""
        await drop_idle_connections(self._client)
        await drop_idle_connections(self._listener)
        for name, state in self._models.items():
            await self._presence.join(state, reserve.get(name, {}))
            await self._refresh(state)
        self._presence.detached = False
        return {name for name, state in self._models.items() if state.reserved}

    async def release_reserved(self, model: str) -> None:
        """Free the leases reserved for the fallback's work (detached: its next rejoin does)."""
        state = self._models[model]
        leases, state.reserved = list(state.reserved), {}
        if not self._presence.detached:
            for lease in leases:
                await self._free(state, lease, sample=False)  # reserved, never used

    async def settle(self) -> None:
        """Wait until every operation started in the background has finished (tests, shutdown)."""
        await self._background.settle()

    # -- internals -------------------------------------------------------------------------------

    def _loop_down(self, model: str) -> Loop | None:
        """The upkeep loop or the model's grant listener, when down: no new slot may be taken then.
        Without heartbeats the others reap this one's leases in use; without the listener no grant comes."""
        loops = (self._upkeep_loop, self._listeners.get(model))
        return next((loop for loop in loops if loop is not None and not loop.up), None)

    def _release_task(self, slot: Slot, *, used: bool = True) -> asyncio.Task[Any] | None:
        """Free the slot in the background (`used` False: unused); detached, it stays counted."""
        if slot.released:
            return None
        slot.released = True
        state = self._models[slot.model]
        state.let_go(slot)
        if self._presence.detached:
            state.released(slot.lease, None)  # no script: its backend's time is its service's
            return None
        return state.freeing(slot.lease, self._spawn(self._free(state, slot.lease, sample=used)))

    def _undo_offer(self, state: ModelState, flow: Flow, cost: float, running: asyncio.Task[Any]) -> None:
        if not running.cancelled() and running.exception() is None:
            left = state.left_behind(running.result(), flow, cost)
            if isinstance(left, Ticket):
                self._spawn(self.withdraw(left, Outcome.CLIENT_DISCONNECTED))
            self._give_back(left if isinstance(left, Slot) else None)

    def _give_back(self, slot: Slot | None) -> None:
        if slot is not None:
            self._release_task(slot, used=False)

    async def _free(self, state: ModelState, lease: str, *, sample: bool = True) -> None:
        """Run the release script: its reply brings this replica's grants, and the lease's time held."""
        args, held = {"lease": lease, "replica": self._replica, "sample": sample}, None
        try:
            held = (await self._granting("release", state, args)).get("held")
        finally:
            state.released(lease, held)

    async def _granting(self, script: str, state: ModelState, args: dict[str, Any]) -> Any:
        reply = await self._run(script, state, args)
        self._take_view(state, reply["view"])
        for grant in grants(reply["mine"]):
            self._deliver(state, grant)
        return reply

    def _deliver(self, state: ModelState, grant: Grant | Displaced) -> None:
        try:
            if isinstance(grant, Displaced):
                state.displace(grant.ticket, grant.overdue)
                return
            self._give_back(state.deliver(grant, self._clock()))
        except Exception:  # one broken grant must not stop the others (their slots would leak)
            log.exception("model %s: could not deliver grant %s", state.pool.name, grant)

    def _take_view(self, state: ModelState, raw: dict[str, Any]) -> None:
        state.take_view(raw, self._clock(), self._scripts.reservations())

    async def _withdrawn(self, state: ModelState, ticket_id: str) -> bool:
        """Run the withdraw script: whether Redis took the ticket out (else it had granted it)."""
        reply = await self._run("withdraw", state, {"ticket": ticket_id})
        self._take_view(state, reply["view"])
        return bool(reply["removed"])

    async def _run(self, script: str, state: ModelState, args: dict[str, Any]) -> Any:
        args["per_slot"] = state.estimates.handover_cost  # the work a slot takes, for quotas
        # A view's work in flight costs Redis a read lease by lease: not sent where this one's is fresh.
        args["fresh"] = script != "snapshot" and state.view_fresh(self._clock())
        return await self._scripts.run(script, state.tag, state.pool, args)

    async def _publish_ready(self, state: ModelState) -> None:
        await self._run("ready", state, {"ttl": self._ttl_s, "ready": ready_arg(state.pool)})

    async def _refresh(self, state: ModelState) -> None:
        reply = await self._run("snapshot", state, {"refused": state.take_refused_locally()})
        self._take_view(state, reply)

    async def _upkeep(self, *, task_status: TaskStatus[None]) -> None:
        """Heartbeat (renews leases) every third of the TTL, reap and refresh on the way; exchange
        promised returns every wake (LISTEN_WAKE_S). It beats at once when it starts, and only then
        reports itself up: a restarted loop must renew the leases before this replica takes new ones."""
        beat_s = self._ttl_s / 3
        next_beat = self._clock()
        while not self._stopping:
            for name, state in self._models.items():
                for slot in state.sweep(self._clock()):
                    self._give_back(slot)
                if not self._presence.detached:
                    await self.shared_returns.exchange(name, state)
                    self._peers.look(state)
            if self._clock() >= next_beat:
                next_beat = self._clock() + beat_s * random.uniform(0.9, 1.1)
                for state in self._models.values():
                    if not self._presence.detached:  # a detached replica comes back by rejoining
                        await self._keep_up(state)
                task_status.started()
            await asyncio.sleep(LISTEN_WAKE_S)

    async def _keep_up(self, state: ModelState) -> None:
        try:
            await self._beat(state)
            await self._presence.reap(state)
            await self._refresh(state)
        except ReplicaAbsent as error:
            self._on_failure(error)  # a fallback store detaches this replica, and rejoins it later
            if not self._presence.detached:  # none: it was only slow, and rejoins with its work
                with contextlib.suppress(RedisError):
                    await self._presence.rejoin_as_it_is(state)
        except RedisError as error:  # keep beating through a passing failure
            self._on_failure(error)

    async def _beat(self, state: ModelState) -> None:  # a seam for tests that fail a beat
        await self._presence.beat(state)
