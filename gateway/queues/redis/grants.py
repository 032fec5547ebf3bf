"""The Redis store's record of one model on this replica: its waiting tickets, the slots it holds,
and grants on their way.

A grant can reach the listener before the reply to the offer that queued its ticket, or after the
ticket was withdrawn; a batch grant names several tickets, each in any of those states. The rules:
- a grant's slot goes to each of its tickets that is still waiting (they share it);
- a ticket not claimed yet gets the slot when its offer's reply comes (`claim`);
- a slot none of whose tickets takes it is given back: at once when all of them are settled,
  or after `UNCLAIMED_AFTER_S` (an offer whose reply was lost);
- a batch's slot counts its tickets not told yet (`Slot.awaiting`) and says when the last is
  settled (`Slot.on_settled`): whoever runs the batch's call waits for every member;
so a grant never leaves a slot held by nobody.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
from anyio.abc import TaskStatus
from redis.exceptions import RedisError

from gateway.queues.base import Batching, Flow, Slot, Ticket
from gateway.queues.estimates import PoolEstimates
from gateway.queues.redis.clients import RedisClient
from gateway.queues.redis.codec import Displaced, Grant, View, grants, message
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from policies.outcomes import Outcome
from policies.wait import Throughput

log = logging.getLogger("gateway.redis")

# An offer's reply comes within a command timeout, or never: a grant unclaimed this long is freed.
UNCLAIMED_AFTER_S = 10.0
# A view younger than this may refuse an arrival without asking Redis: scripts run for every
# admitted request and every release, so under load it is rarely older than a millisecond or two.
VIEW_FRESH_S = 0.05


@dataclass(slots=True, eq=False)
class _Pending:
    """A grant with tickets this replica has not claimed yet."""

    slot: Slot
    since: float
    unclaimed: set[str] = field(default_factory=set)
    delivered: int = 0


class ModelState:
    def __init__(self, pool: ModelPool, tag: str, estimates: PoolEstimates, bands: int, now: float) -> None:
        self.pool = pool
        self.tag = tag
        self.estimates = estimates
        self.view = View.empty(bands, now)
        self.waiting: dict[str, Ticket] = {}
        self.held: dict[str, Slot] = {}
        self.releasing: set[str] = set()
        """Leases let go whose release script has not answered yet, or failed (see `freeing`)."""
        self.reserved: dict[str, str] = {}
        """Leases held for the fallback store's work after a rejoin (lease id -> backend url)."""
        self.beat_sent_at: float | None = None
        """When the last beat (or join) that Redis answered was sent, on the local clock."""
        self.beat_share: dict[str, int] = {}
        """Backend url -> the fallback share that beat recorded: how many of this replica's leases
        there Redis holds for its fallback once it is absent (the limit may have moved since)."""
        self.refused_locally = [0.0] * bands
        """Work refused from a fresh view without a round trip, counted with the next script."""
        self.timed: dict[str, tuple[float, str]] = {}
        """Leases whose request's service was timed -> (that time, the request's kind), until
        Redis frees them (`released`)."""
        self._pending: dict[str, _Pending] = {}
        self._withdrawn: dict[str, float] = {}
        """Tickets withdrawn after Redis had granted them: their grants are on the way."""
        self._displaced_early: dict[str, bool] = {}
        """Tickets displaced before their offer's reply was read -> whether as overdue."""

    @classmethod
    def of(
        cls, pool: ModelPool, key_prefix: str, bands: int, estimation: Estimation, now: float
    ) -> ModelState:
        """The state of `pool`'s model under `key_prefix` (its keys' hash tag)."""
        estimates = PoolEstimates(bands, pool.expected_service_s, estimation)
        return cls(pool, f"{{{key_prefix}:{pool.name}}}", estimates, bands, now)

    def view_fresh(self, now: float) -> bool:
        """Whether the last view is a few milliseconds old (VIEW_FRESH_S): a script may then leave
        out of its view the work in flight, which costs Redis a read lease by lease."""
        return self.view.redis_now > 0 and now - self.view.seen_at < VIEW_FRESH_S

    def take_view(self, raw: dict[str, Any], now: float, reserved: tuple[int, ...]) -> None:
        """The view a script returned, unless a later one came first."""
        view = View.parse(raw, now, reserved, self.view)
        if view.redis_now >= self.view.redis_now:
            self.view = view
            self.estimates.observe(view.counters, view.redis_now)

    def throughput(self, now: float, reservations: tuple[int, ...]) -> Throughput:
        """The pool's speeds, of the slots its requests can use: those Redis holds for absent
        replicas serve none until their reservations end (seconds to minutes), so a pool that
        lost a replica is read as the smaller one it is, and refuses at once what it cannot serve
        in time instead of admitting it to expire."""
        at = self.view.redis_now + (now - self.view.seen_at)  # the estimates run on Redis's clock
        usable = max(0, self.pool.total_slots - self.view.held_absent)
        return self.estimates.throughput(usable, at, reservations)

    def record_service(self, service_s: float, slot: Slot | None) -> None:
        """A request's service time; a lease's is taken when Redis frees it (`released`), unless
        it is released already."""
        if slot is None or not slot.lease or slot.released:
            self.estimates.record_service(service_s, "" if slot is None else slot.kind)
        else:
            self.timed[slot.lease] = (service_s, slot.kind)

    def released(self, lease: str, held_s: float | None) -> None:
        """Redis freed `lease` after holding it `held_s` seconds (None: not known). Where its
        request's service was timed, that is its sample: the time Redis held the slot, from the
        grant to the release, which the pool reading of admission counts hand-overs by. The
        backend's time leaves out the grant's way to its replica, the replica's turns before the
        send and after the answer, and the release's way back: at 50 ms, a pool reading of the
        backend's time expired 3% of the work admitted at the edge, and the time this replica
        held the slot plus its mean round trip, 1% of it (0.2% in memory, where a hand-over is
        instant; delaying each there by 0.8 ms expired as many)."""
        if (timed := self.timed.pop(lease, None)) is not None:
            service_s, kind = timed
            self.estimates.record_service(max(service_s, held_s or 0.0), kind)

    def backend(self, url: str) -> BackendState:
        """The backend a grant names. One that left the pool since (endpoint discovery) is kept
        as a detached, unready record: the grant's slot is real and is given back through it."""
        for backend in self.pool.backends:
            if backend.url == url:
                return backend
        return BackendState(self.pool.name, url, 0, "", ready=False)

    def abandon(self) -> list[Ticket]:
        tickets, self.waiting = list(self.waiting.values()), {}
        return tickets

    def refused_from_view(
        self, flow: Flow, cost: float, max_work: float, reach: Mapping[str, float], now: float
    ) -> bool:
        """Whether a view a few milliseconds old (VIEW_FRESH_S) clearly puts the offer over its
        limit: then it is refused without a round trip (under overload most arrivals end here),
        its work counted with the next script."""
        view, handover = self.view, self.estimates.handover_cost
        if now - view.seen_at > VIEW_FRESH_S:
            return False
        if view.stats.work_before_grant(flow.band, flow.tenant, handover, cost, reach) <= max_work:
            return False
        self.refused_locally[flow.band] += cost
        return True

    def take_refused_locally(self) -> list[float]:
        work, self.refused_locally = self.refused_locally, [0.0] * len(self.refused_locally)
        return work

    def hold(self, lease: str, url: str, cost: float, band: int, kind: str = "") -> Slot:
        backend = self.backend(url)
        backend.inflight += 1  # this replica's share, for its metrics
        slot = Slot(self.pool.name, backend, cost, band=band, lease=lease, kind=kind)
        self.held[lease] = slot
        return slot

    def left_behind(self, reply: dict[str, Any], flow: Flow, cost: float) -> Slot | Ticket | None:
        """What an offer's script granted or queued for a caller that left while it ran: the slot
        to give back unused, or the ticket to withdraw (its grant, if one comes, starts nothing)."""
        if reply["kind"] == "granted":
            return self.hold(reply["lease"], reply["url"], cost, flow.band)
        if reply["kind"] == "queued":
            return self.queued(flow, cost, reply["ticket"], None, math.inf)
        return None

    def in_use(self) -> list[Slot]:
        """The slots held for requests: not those of grants no ticket has taken yet."""
        untaken = {pending.slot for pending in self._pending.values() if pending.delivered == 0}
        return [slot for slot in self.held.values() if slot not in untaken]

    def leases_in_use(self) -> dict[str, int]:
        """Backend url -> the leases held on it for work: the requests' and those reserved for the
        fallback store's. What Redis keeps counted for this replica while it is cut off."""
        urls = [slot.backend.url for slot in self.in_use()] + list(self.reserved.values())
        return {url: urls.count(url) for url in urls}

    def known_leases(self) -> list[str]:
        """The leases this replica holds or is releasing: any other Redis counts for it is lost."""
        return [*self.held, *self.releasing]

    def let_go(self, slot: Slot) -> None:
        self.held.pop(slot.lease, None)
        slot.backend.inflight -= 1

    def freeing(self, lease: str, release: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """`release` runs the lease's release script: the lease is known here until Redis freed it.
        One whose release failed stays known (until a rejoin): Redis lets it lapse unrenewed, and
        recovery must not take it for a lost grant and hold it again."""
        self.releasing.add(lease)
        release.add_done_callback(functools.partial(self._released, lease))
        return release

    def _released(self, lease: str, release: asyncio.Task[Any]) -> None:
        if not release.cancelled() and release.exception() is None:
            self.releasing.discard(lease)

    def deliver(self, grant: Grant, now: float) -> Slot | None:
        """Hand a grant's slot to its waiting tickets; the slot to give back when none takes it."""
        pending = _Pending(self.hold(grant.lease, grant.url, grant.cost, grant.band, grant.kind), now)
        batch = len(grant.tickets) > 1
        for ticket_id in grant.tickets:
            ticket = self.waiting.pop(ticket_id, None)
            if ticket is not None:
                if not ticket.wakeup.done():  # done: its waiter left, its withdrawal is under way
                    self._give(pending, ticket, batch)
            elif self._withdrawn.pop(ticket_id, None) is None:
                pending.unclaimed.add(ticket_id)
                self._pending[ticket_id] = pending
        pending.slot.awaiting = len(pending.unclaimed)
        return self._unused(pending)

    def displace(self, ticket_id: str, overdue: bool = False) -> None:
        """A more urgent arrival took the ticket's place (Redis already dropped it), at the
        queue's cap or because it could no longer get a slot in time (`overdue`)."""
        ticket = self.waiting.pop(ticket_id, None)
        if ticket is None:
            self._displaced_early[ticket_id] = overdue  # before its offer's reply was read
        else:
            ticket.overdue = overdue
            ticket.interrupt(Outcome.DISPLACED)

    def queued(
        self,
        flow: Flow,
        cost: float,
        ticket_id: str,
        batching: Batching | None,
        leave_by: float,
        on_grant: Callable[[Slot], None] | None = None,
        kind: str = "",
    ) -> Ticket:
        """The ticket an offer queued (see `claim`)."""
        wakeup = asyncio.get_running_loop().create_future()
        ticket = Ticket(
            flow,
            cost,
            wakeup,
            id=ticket_id,
            batching=batching,
            leave_by=leave_by,
            kind=kind,
            on_grant=on_grant,
        )
        self.claim(ticket)
        return ticket

    def claim(self, ticket: Ticket) -> None:
        """The offer that queued `ticket` replied: it waits, or takes the grant that came first."""
        if (overdue := self._displaced_early.pop(ticket.id, None)) is not None:
            ticket.overdue = overdue
            ticket.interrupt(Outcome.DISPLACED)
            return
        pending = self._pending.pop(ticket.id, None)
        if pending is None:
            self.waiting[ticket.id] = ticket
            return
        pending.unclaimed.discard(ticket.id)
        self._give(pending, ticket, batch=bool(pending.slot.batch) or pending.delivered > 0)
        pending.slot.settle(len(pending.unclaimed))

    def granted_before_withdrawal(self, ticket_id: str, now: float) -> Slot | None:
        """Redis had granted the withdrawn ticket: the slot to give back when no ticket takes it."""
        pending = self._pending.pop(ticket_id, None)
        if pending is None:
            self._withdrawn[ticket_id] = now  # its grant is still on the way
            return None
        pending.unclaimed.discard(ticket_id)
        pending.slot.settle(len(pending.unclaimed))
        return self._unused(pending)

    def sweep(self, now: float) -> list[Slot]:
        """Forget what waited too long to be claimed; the slots nobody took, to give back."""
        old = now - UNCLAIMED_AFTER_S
        unused: list[Slot] = []
        for ticket_id, pending in list(self._pending.items()):
            if pending.since < old:
                del self._pending[ticket_id]
                pending.unclaimed.discard(ticket_id)
                pending.slot.settle(len(pending.unclaimed))
                if (slot := self._unused(pending)) is not None:
                    unused.append(slot)
        for ticket_id, at in list(self._withdrawn.items()):
            if at < old:
                del self._withdrawn[ticket_id]
        return unused

    def _give(self, pending: _Pending, ticket: Ticket, batch: bool) -> None:
        pending.delivered += 1
        if batch:
            pending.slot.batch = (*pending.slot.batch, ticket)
        ticket.grant(pending.slot)

    @staticmethod
    def _unused(pending: _Pending) -> Slot | None:
        return pending.slot if not pending.unclaimed and pending.delivered == 0 else None


GRANT_ON_ITS_WAY_S = 0.5
"""How long a ticket whose leave-by passed waits for the grant Redis made before its withdrawal
reached it: a grant reaches its replica within a round trip, in the reply to a release or from
its list; one lost on the way is given back when it comes (`granted_before_withdrawal`)."""


async def expire_in_order(
    state: ModelState, ticket: Ticket, withdrawn: Callable[[], Awaitable[bool]]
) -> None:
    """End `ticket`'s wait, its leave-by passed on this replica's clock, in the order Redis saw:
    `withdrawn` runs the withdraw script (whether Redis took the ticket out). Where Redis had
    granted it first the grant is the request's, on its way here: with several replicas a grant
    reaches its ticket a hand-over's round trip after Redis made it, and ending the wait at once
    expired requests granted in time (on a 3:1 flood, a third of the lighter tenant's expiries)
    and gave back a slot Redis had just handed over."""
    if state.waiting.get(ticket.id) is not ticket:  # granted, or its wait ended otherwise
        ticket.interrupt(Outcome.DEADLINE_EXPIRED_IN_QUEUE)
        return
    try:
        removed = await withdrawn()
    except Exception as error:  # the waiter's own withdrawal asks again (a failover takes it on)
        log.warning("model %s: withdrawing expired ticket %s: %r", ticket.model, ticket.id, error)
        ticket.interrupt(Outcome.DEADLINE_EXPIRED_IN_QUEUE)
        return
    if removed:
        state.waiting.pop(ticket.id, None)
        ticket.interrupt(Outcome.DEADLINE_EXPIRED_IN_QUEUE)
    elif not ticket.wakeup.done():
        loop = asyncio.get_running_loop()
        loop.call_later(GRANT_ON_ITS_WAY_S, ticket.interrupt, Outcome.DEADLINE_EXPIRED_IN_QUEUE)


async def listen(
    listener: RedisClient,
    state: ModelState,
    replica: str,
    wake_s: float,
    deliver: Callable[[Grant | Displaced], None],
    run: Callable[[str, ModelState, dict[str, Any]], Awaitable[Any]],
    on_failure: Callable[[BaseException], None],
    stopping: Callable[[], bool],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Deliver the grants pushed onto the replica's list as they come (BLMPOP on its own
    connection), until `stopping`; it wakes every `wake_s` to look. After a BLMPOP fails, what it
    may have popped (its reply lost with the connection) is recovered before the next one pops more."""
    task_status.started()  # grants pushed before the first BLMPOP wait in their list
    key, suspect = f"{state.tag}:grants:{replica}", False
    while not stopping():
        try:
            if suspect:
                await recover_lost(state, run, replica, deliver)
                suspect = False
            popped = await listener.blmpop(wake_s, 1, key, direction="LEFT", count=64)
        except RedisError as error:
            suspect = True
            on_failure(error)
            await asyncio.sleep(wake_s)
            continue
        # BLMPOP answers [key, [element, ...]]; redis-py types the elements loosely.
        for raw in cast(list[bytes], popped[1]) if popped else ():
            deliver(message(raw))


async def recover_lost(
    state: ModelState,
    run: Callable[[str, ModelState, dict[str, Any]], Awaitable[Any]],
    replica: str,
    deliver: Callable[[Grant | Displaced], None],
) -> None:
    """Deliver the grants a failed BLMPOP popped without their reply (see lua/recover.lua)."""
    reply = await run("recover", state, {"replica": replica, "known": state.known_leases()})
    for grant in grants(reply["grants"]):
        deliver(grant)
