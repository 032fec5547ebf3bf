"""The RequestQueue protocol that every store (memory, Redis) implements, and its values.

A store holds, per model, the waiting requests (metadata only, never bodies) and the count of
backend slots in use. Requests wait in flows, (model, band, tenant), each ordered by a score
computed once at enqueue (policies.ordering), so that a heap and a sorted set order alike. Every
request carries a cost in work units (1 for a plain request; batch items or tokens where requests
differ in size): queue statistics, admission limits and drain rates are in work. Its rules:
- `offer` checks the admission limit and inserts (or grants a free slot) in one atomic step;
- a slot that frees goes to the most urgent band with work waiting, and within it to the flow
  whose head has the lowest score: under FIFO its start tag in the band's fair queuing, so that
  backlogged flows share the band by their tenants' weights (policies.fairness);
- a grant may hand one slot to several tickets of one flow at once, when they share a batch key:
  the head and the tickets right behind it with its key, up to the head's batch cost; they share
  one Slot (one upstream call serves them, and it is released once);
- `withdraw` and `release` are idempotent, so cleanup paths may call them without bookkeeping,
  and they run to completion even when their caller is cancelled (a store that does I/O shields
  it), so cleanup in a `finally` never leaks a slot;
- a ticket's `wakeup` is resolved exactly once: with a Slot (granted, through `Ticket.grant`) or
  an Outcome (it left).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.upstream.backends import BackendState
from policies.outcomes import Outcome
from policies.return_schedule import Promised, ReturnSchedule
from policies.sequences import SequenceRef
from policies.wait import QueueStats, Throughput

log = logging.getLogger("gateway.queues")


@dataclass(frozen=True, slots=True)
class Flow:
    """Whose work a request is, within which band: the unit that fairness and quotas divide
    between. `tenant` is a configured tenant's name, or "" for the one default flow."""

    model: str
    band: int
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class Batching:
    """A request that may share its slot: with the tickets of its flow queued right behind it
    that have the same `key` (the shell's word for "mergeable"), up to `max_cost` of work in all."""

    key: str
    max_cost: float
    max_delay_s: float = 0.0
    """How long a batch may wait for companions while a slot is free (policies.batching)."""
    preferred_sizes: tuple[int, ...] = ()
    hold: bool = False
    """Queue it even though a slot is free: its batch waits for companions, and leaves with the
    next dispatch (a release, an offer that is not held, or `dispatch_held` when its wait is up)."""


@dataclass(slots=True, eq=False)
class Slot:
    """One backend slot held by one request, or by a batch of them; released exactly once."""

    model: str
    backend: BackendState
    cost: float = 1.0
    """The work it carries: the sum of its tickets' costs."""
    band: int = 0
    """The band it was granted to (whose reservations it counts against)."""
    tenant: str = ""
    """The tenant whose flow it was granted to (whose quota it counts against)."""
    batch: tuple[Ticket, ...] = ()
    """The tickets granted this one slot together, when it went to a batch."""
    released: bool = False
    lease: str = ""
    """The store's id for the slot, where it keeps one (Redis)."""
    kind: str = ""
    """The kind of request it serves (policies.request_kinds); "" for a batch of several."""
    charged: bool = False
    """Also counted against the fallback store's share (held when the shared store failed)."""
    awaiting: int = 0
    """Tickets granted this slot whose waiters have not been told yet (a Redis grant read before
    the replies of the offers that queued them): a batch is complete once it is 0."""
    on_settled: Callable[[], None] | None = field(default=None, repr=False)
    """Run once when `awaiting` drops to 0 (set by whoever waits for the whole batch)."""

    def settle(self, awaiting: int) -> None:
        """`awaiting` tickets are still to be told; at 0 run `on_settled`, once."""
        self.awaiting = awaiting
        if awaiting == 0 and (settled := self.on_settled) is not None:
            self.on_settled = None
            settled()


@dataclass(slots=True, eq=False)
class Ticket:
    """A request waiting for a slot."""

    flow: Flow
    cost: float
    wakeup: asyncio.Future[Slot | Outcome] = field(repr=False)
    id: str = ""
    """The store's id for the ticket, where it keeps one (Redis)."""
    batching: Batching | None = None
    leave_by: float = math.inf
    """When its allowed wait runs out, on the local clock (policies.displacement)."""
    overdue: bool = False
    """Displaced because it could no longer get a slot in time (else: at the queue's cap)."""
    kind: str = ""
    """Its kind of request (policies.request_kinds), which the slot it is granted serves."""
    on_grant: Callable[[Slot], None] | None = field(default=None, repr=False)
    """Called inside the store's grant, before the waiter runs: it may start the request's
    exchange at once (the proxy writes it on an idle connection). It must not raise."""
    claimed: bool = False
    """Its hook took the granted slot: the caller releases it (once its backend is done), even if
    the wait is withdrawn before the waiter runs. Else a withdrawn grant goes back unused."""
    sequence: SequenceRef | None = None
    """The sequence it belongs to (policies.sequences), whose backend it is pinned to."""
    backend: str | None = None
    """The backend (url) it may take a slot on only, its sequence's; None: any."""

    @property
    def model(self) -> str:
        return self.flow.model

    @property
    def band(self) -> int:
        return self.flow.band

    def grant(self, slot: Slot) -> None:
        """End the wait with `slot` (the store checked that the wait had not ended)."""
        self.wakeup.set_result(slot)
        if self.on_grant is not None:
            try:
                self.on_grant(slot)
            except Exception:  # the store's dispatch must go on whatever a hook does
                log.exception("a grant hook failed")
            else:
                self.claimed = True

    def interrupt(self, outcome: Outcome) -> None:
        """End the wait with `outcome` unless a slot or another outcome came first."""
        if not self.wakeup.done():
            self.wakeup.set_result(outcome)


@dataclass(frozen=True, slots=True)
class Granted:
    slot: Slot


@dataclass(frozen=True, slots=True)
class Queued:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Full:
    """The admission limit was exceeded; `stats` is the state the check saw. `at_cap`: the model's
    queue was at its cap (`max_queued_work`) with nothing less urgent to displace."""

    stats: QueueStats
    at_cap: bool = False


STORE_PROBE_INTERVAL_S = 0.5
"""How often a shared store that went away is probed: when a request it could not take, or whose
wait it ended, may come back."""


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The store cannot take requests now (a shared store is unreachable and must not be replaced)."""

    retry_after_s: float


Offer = Granted | Queued | Full | Unavailable


class SharedReturns(Protocol):
    """The returns each replica has promised refused clients, shared between the replicas of a
    queue: a refused client comes back to whichever replica its load balancer picks, so replicas
    sharing one queue share its spare rate too, and each books its returns in the room the others'
    promises leave (policies.return_schedule.Promised)."""

    def promise(self, model: str, band: int, schedule: ReturnSchedule) -> None:
        """Share the returns this replica has promised `band`: its latest schedule, on its clock."""
        ...

    def elsewhere(self, model: str, band: int) -> Sequence[Promised]:
        """The returns the other replicas have promised `band`, as last seen, on this one's clock."""
        ...


class _Alone:
    def promise(self, model: str, band: int, schedule: ReturnSchedule) -> None:
        pass

    def elsewhere(self, model: str, band: int) -> Sequence[Promised]:
        return ()


ALONE: SharedReturns = _Alone()
"""A store of one replica: no one else promises returns."""


class RequestQueue(Protocol):
    @property
    def shared_returns(self) -> SharedReturns:
        """The returns promised by the replicas of this queue (ALONE for a store of one replica)."""
        ...

    async def start(self) -> None:
        """Connect and start background work (called in the app's lifespan)."""
        ...

    async def stop(self) -> None: ...

    def stats(self, model: str) -> QueueStats: ...

    def throughput(self, model: str, now: float) -> Throughput:
        """The pool's measured speeds; `now` is on the store's clock."""
        ...

    def identify(self, config_hash: str) -> None:
        """The hash of the config this replica runs, told to the others that share the store."""
        ...

    def replicas(self) -> Mapping[str, str]:
        """The replicas seen live on this store -> the hash of the config each runs ({} in memory)."""
        ...

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
        """Grant a free slot, queue, or refuse when the work to drain before it gets a slot
        exceeds `max_work`: the work queued ahead of it (its band and the more urgent ones) plus
        the room it takes (policies.wait.room_taken: its cost behind queued work, else one
        hand-over, by the store's measure of the work a hand-over takes); none with a slot free
        and nothing ahead. A negative limit refuses even then.

        `allowed_wait_s` is how long the request may wait; the store orders its flow by its
        configured Ordering, on its own clock. A queued ticket carries `on_grant` from the start,
        so that it runs in its grant whenever that comes (a batch's members all join it there).
        `kind`: the request's kind (policies.request_kinds), kept with the slot it is granted.
        `reach`: the most work each other flow of its band may send within its allowance
        (policies.admission.offer_reach); what of it goes ahead of its turn counts in the check
        (policies.wait.work_before_grant), from the store's state at the check.
        `sequence`: the sequence it belongs to (policies.sequences): it is granted a slot only on
        its sequence's backend, pinned on its arrival.
        """
        ...

    def expire(self, ticket: Ticket) -> None:
        """The ticket's leave-by passed on this replica's clock: end its wait with
        DEADLINE_EXPIRED_IN_QUEUE (then `withdraw` it), unless the store had granted it a slot
        first. The store orders the two: a grant it made before the withdrawal reached it is the
        request's, though it reaches the replica a little later."""
        ...

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        """End the ticket's wait with `outcome` and take it out of its queue (idempotent).

        A slot it was granted in the meantime goes back to the pool.
        """
        ...

    async def release(self, slot: Slot, now: float) -> None:
        """Give the slot back, handing it to the next waiter (idempotent)."""
        ...

    def release_soon(self, slot: Slot, now: float) -> bool:
        """`release` for synchronous code (a protocol callback); a store that needs I/O for it
        starts that in the background. True when the slot went straight to a local waiter."""
        ...

    def record_service(self, model: str, service_s: float, slot: Slot | None = None) -> None:
        """Feed one measured service time into the model's estimate; `slot`: the one it was
        served on, about to be released (a shared store counts how long it held it)."""
        ...

    def backends_changed(self, model: str) -> None:
        """Readiness changed: dispatch into newly ready slots, fail waiters when none is left."""
        ...

    def dispatch_held(self, model: str) -> None:
        """Hand free slots to waiting tickets: a batch held for companions has waited long enough."""
        ...

    async def share_limit(self, model: str, url: str, slots: int, lead_s: float) -> tuple[bool, int]:
        """A backend's found concurrency limit, one for every replica: (whether this replica leads
        it and its `slots` stand, the limit to use). A replica leads until it has not asked for
        `lead_s`; a store of one replica always leads."""
        ...


Reservations = tuple[int, ...] | Callable[[], tuple[int, ...]]
"""Per band, the slots its class reserves (policies.reservations): fixed, or as they are now (they
may change with time windows)."""


def reserved_now(reservations: Reservations) -> tuple[int, ...]:
    """The reservations as they are now; () when no class reserves any."""
    reserved = reservations() if callable(reservations) else reservations
    return reserved if any(reserved) else ()


def weight_lookup(weights: Mapping[str, float] | Callable[[str], float] | None) -> Callable[[str], float]:
    """A tenant's weight by name: from a table (1 for a name not in it), or the given function."""
    if callable(weights):
        return weights
    table = dict(weights or {})
    return lambda tenant: table.get(tenant, 1.0)
