"""The event loop of `inference-gateway simulate`: slots, priority bands and tenant flows on simulated time.

It decides nothing itself; the gateway's policies do, called where the memory store calls them
(gateway/queues/memory/store.py, model_queue.py):
- An arrival that finds a slot it may use free (`policies.reservations.usable_free_slots` when
  classes reserve slots) and nothing queued in its own or a more urgent band is handed one at once,
  untagged, as the store grants it.
- Otherwise it is queued in its tenant's flow, first come, first served, and tagged
  (`policies.fairness.head_start`) as it becomes the flow's head, as in the memory store.
- A slot that frees goes where `policies.dispatch.next_flow` sends it, the memory store's own
  decision (strict priority between bands, reservations, the lowest flow head, quotas), and the
  band's virtual time moves by `policies.fairness.virtual_time_after`, the flow's finish tag by
  `policies.fairness.finish_after`.
- With `Admission` and a class `max_wait_s`, the gateway's admission (gateway/tools/simulate/admitting.py)
  refuses at arrival, and a queued request leaves the queue when its allowance runs out; it stays in its
  heap until it reaches the top (lazy deletion, as in the memory store) but no longer counts.
  Without them the queue is unbounded, as queueing theory assumes.
- A request queued behind which less urgent work waits displaces, as the memory store does
  (policies.displacement), the newest of that work that can no longer get a slot in time: told at
  once (`displaced`) rather than left to expire. (An owner reclaiming its quota does not displace
  borrowers here.)
- With tenant quotas, an arrival starts at once only when `policies.quotas.may_start` lets it (no
  new borrowing while an owner under its quota waits), and a capped quota's wait
  (`policies.quotas.quota_wait_s`) past the allowance is refused at arrival.

Events at the same instant run completions first, then expiries, then arrivals. A slot is held for
the request's `service_s`. Requests numbered `warmup` and later are measured; hand-overs are
counted from the arrival of the first measured request until the horizon `until_s` (or the last
event). The loop is a plain heapq loop over tuples: no asyncio, no object per event.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from gateway.tools.simulate.admitting import Admission, Admitting
from gateway.tools.simulate.flows import Entry, Flow, band_heads, every_head, follow_head, new_flow
from gateway.tools.simulate.leaving import displace_overdue, leave_queue
from gateway.tools.simulate.quota_book import QuotaBook
from gateway.tools.simulate.tally import Run
from gateway.tools.simulate.workload import Arrival
from policies.dispatch import next_flow
from policies.fairness import FairTurns, finish_after, joining_start, virtual_time_after
from policies.quotas import Quota
from policies.reservations import usable_by_band, usable_free_slots
from policies.wait import QueueStats


@dataclass(frozen=True, slots=True)
class Band:
    """One priority class's rules."""

    max_wait_s: float | None = None
    """Its bound on time in the queue; None: unbounded (and no admission for it)."""
    deadline_s: float | None = None
    """The client's whole budget (wait plus service): goodput counts what finishes within it, and
    with admission it is the request's budget."""
    reserved_slots: int = 0
    """Slots less urgent classes never hold (policies.reservations)."""


@dataclass(frozen=True, slots=True)
class Setup:
    """The simulated pool and what is measured of it."""

    slots: int
    bands: tuple[Band, ...] = (Band(),)
    weights: Mapping[str, float] = field(default_factory=dict)
    """Tenant -> fair-share weight (> 0); a tenant not named has weight 1."""
    warmup: int = 0
    """Requests at the start left out of the statistics (the queue starts empty)."""
    until_s: float | None = None
    """Stop at this simulated time; what is still queued then is left unserved."""
    admission: Admission | None = None
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    """Tenant -> its quota of work in flight (policies.quotas); none: nothing is held back."""
    displace: bool = True
    """Displace queued work that an urgent arrival pushes past its allowance, as the memory store
    does; off, that work waits until it expires (the counterfactual that shows what displacement
    took: only work that would have expired anyway)."""
    advise: bool = True
    """Tell each request admission refuses its Retry-After, booking its return as the gateway does
    (under overload that costs about as much as the rest of the simulation; nothing else reads it)."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"need at least one slot, got {self.slots}")
        if not self.bands:
            raise ValueError("need at least one band")


class Handover(NamedTuple):
    """A slot handed to a request, as `simulate`'s observer sees it."""

    at_s: float
    band: int
    tenant: str
    cost: float
    waited_s: float
    queued_by_band: tuple[int, ...]
    """What still waits in each band right after this hand-over."""
    running_by_tenant: Mapping[str, float] = {}
    """With quotas, the work each tenant runs right after this hand-over."""


Observer = Callable[[Handover], None]
Progress = Callable[[int], None]
_NO_MORE = Arrival(math.inf, 0, "", 0.0, 0.0)  # what follows the last arrival


def simulate(
    arrivals: Iterable[Arrival],
    setup: Setup,
    *,
    seed: int = 0,
    on_handover: Observer | None = None,
    progress: Progress | None = None,
    progress_every: int = 0,
) -> Run:
    """Run `arrivals` (in time order) through the pool of `setup`; `progress(n)` is called after
    every `progress_every` arrivals; `seed` draws the jitter of Retry-After."""
    nbands = len(setup.bands)
    warmup, weights, displacing = setup.warmup, setup.weights, setup.displace
    until = math.inf if setup.until_s is None else setup.until_s
    limited = [setup.admission is not None and band.max_wait_s is not None for band in setup.bands]
    deadlines = [math.inf if band.deadline_s is None else band.deadline_s for band in setup.bands]
    reserved = (
        [band.reserved_slots for band in setup.bands] if any(b.reserved_slots for b in setup.bands) else []
    )
    admitting = None
    if setup.admission is not None:
        jitter = random.Random(seed).random
        admitting = Admitting(setup.admission, nbands, setup.slots, tuple(reserved), jitter)
    book = QuotaBook(setup.quotas, setup.slots) if setup.quotas else None
    advises = setup.advise
    report_at = progress_every if progress is not None and progress_every > 0 else -1

    free = setup.slots
    held = [0] * nbands  # slots in use per band, which reservations bound
    done: list[tuple[float, int, float, str, float]] = []  # (finish, band, cost, tenant, start) of each slot
    depth = [0] * nbands  # live requests per band: what next_flow reads
    work = [0.0] * nbands
    known: list[dict[str, Flow]] = [{} for _ in range(nbands)]
    active: list[dict[str, Flow]] = [{} for _ in range(nbands)]  # the flows with a heap to pop
    vtime = [0.0] * nbands
    expiries: list[tuple[float, int]] = []
    waiting: dict[int, Entry] = {}  # arrival number -> entry, for those that can still expire
    gone: set[int] = set()  # expired, still in a heap
    queued = 0
    measured_from = math.inf
    last_arrival = now = 0.0
    push, pop, inf = heapq.heappush, heapq.heappop, math.inf

    heads_of = partial(band_heads, active, vtime, gone)  # each band's live flow heads (policies.dispatch)

    def per_slot() -> float:
        return admitting.estimates.handover_cost if admitting is not None else 1.0

    stream = iter(arrivals)
    upcoming = next(stream, _NO_MORE)
    index = 0
    while True:
        granted: Entry | None = None
        released = 0  # a slot freed: its hand-over is the first (the memory store's drain sample)
        next_at = upcoming[0]
        next_done = done[0][0] if done else inf
        next_expiry = expiries[0][0] if expiries else inf
        if next_done <= next_at and next_done <= next_expiry:
            if next_done > until or not done:  # not done: nothing is left at all
                break
            now, band, cost, tenant, started = pop(done)
            free += 1
            released = 1
            if admitting is not None:
                admitting.ended(started, now - started)
            held[band] -= 1
            if book is not None:
                book.finish(tenant, cost)
        elif next_expiry <= next_at:
            if next_expiry > until:
                break
            now, seq = pop(expiries)
            if seq in waiting:
                assert admitting is not None  # only admitted requests expire
                flow = leave_queue(seq, waiting, gone, depth, work, vtime, admitting)
                queued -= 1
                if waiting[seq][6]:
                    flow.tally.expired += 1
                del waiting[seq]
        else:
            if next_at > until or upcoming is _NO_MORE:
                break
            now, band, tenant, cost, service = upcoming
            upcoming = next(stream, _NO_MORE)
            last_arrival = now
            measured = index >= warmup
            if index == warmup:
                measured_from = now
            index += 1
            if index == report_at:
                assert progress is not None
                progress(index)
                report_at += progress_every
            flow = known[band].get(tenant) or new_flow(known[band], band, tenant, weights)
            if measured:
                flow.tally.arrived += 1
            usable = usable_free_slots(band, free, held, reserved) if reserved else free
            stats = None
            if limited[band] or (queued and usable):  # a slot free: whether it starts at once
                started_at = admitting.started_at if admitting is not None else []
                stats = _stats(flow, free, held, reserved, depth, work, vtime, started_at)
            expire_at = inf
            if admitting is not None:
                admitting.arrived(band, cost, now)
            if limited[band]:
                assert admitting is not None and stats is not None
                rules = setup.bands[band]
                assert rules.max_wait_s is not None
                request = admitting.request(band, rules.max_wait_s, rules.deadline_s, cost, tenant)
                expire_at = admitting.admitted_until(request, stats, now)
                # Refused by admission, it is told when to come back (its return booked).
                advice = admitting.advise(request, stats, now) if expire_at < now and advises else None
                if book is not None and expire_at >= now:
                    ahead = sum(flows[tenant].queued for flows in known[: band + 1] if tenant in flows)
                    service_s = admitting.throughput(now).service_time_s
                    if book.wait_s(tenant, cost, ahead, service_s) > expire_at - now:
                        expire_at = -inf  # its capped quota keeps it waiting past its allowance
                if expire_at < now:
                    if measured:
                        flow.tally.refused += 1
                        if advice is not None:
                            flow.tally.retry_after_s.append(advice)
                    continue
            flow.admitted = True  # its weight counts in the others' turns from now on, as the stores'
            if admitting is not None:
                admitting.admitted(band, tenant, cost)
            # As the memory store: at once with a usable slot free and no work ahead in its turn.
            slack = admitting.estimates.handover_cost if admitting is not None else 1.0
            ahead = stats.work_ahead(band, tenant, slack) if stats is not None and queued and usable else 0.0
            if (
                usable
                and ahead == 0
                and (
                    book is None
                    or book.state(per_slot()).allows(tenant, cost, every_head(active, vtime, gone))
                )
            ):
                granted = (0.0, index, now, cost, service, flow, measured)  # untagged, as the store
            else:
                entry = (0.0, index, now, cost, service, flow, measured)
                if not flow.heap:
                    active[band][tenant] = flow
                push(flow.heap, entry)
                follow_head(flow, gone, vtime[band])
                flow.queued += cost
                depth[band] += 1
                work[band] += cost
                queued += 1
                if expire_at < inf:
                    waiting[index] = entry
                    flow.live[index] = expire_at
                    push(expiries, (expire_at, index))
                    if displacing and any(depth[band + 1 :]):
                        assert admitting is not None
                        queued -= displace_overdue(
                            band, now, known, waiting, gone, depth, work, vtime, admitting
                        )
        # Hand slots over: to the arrival granted at once, or, while slots are free, to the queue.
        while granted is not None or (free and queued):
            if granted is None:
                found = next_flow(
                    depth,
                    heads_of,
                    partial(usable_free_slots, free_slots=free, held_by_band=held, reserved_by_band=reserved)
                    if reserved
                    else None,
                    book.state(per_slot()) if book is not None else None,
                )
                if found is None:
                    break  # held back by quotas or kept by a reservation
                band, head = found
                flow = active[band][head.tenant]
                _, seq, at, cost, service, _, measured = pop(flow.heap)
                start = flow.head_start
                flow.queued = flow.queued - cost if flow.heap else 0.0
                if not flow.heap:
                    del active[band][flow.tenant]
                depth[band] -= 1
                work[band] = work[band] - cost if depth[band] else 0.0  # no float residue when empty
                queued -= 1
                if not queued and admitting is not None:
                    admitting.queue_emptied()
                if waiting and waiting.pop(seq, None) is not None:
                    assert admitting is not None
                    del flow.live[seq]
                    admitting.settled(band, flow.tenant, expired=False)
                vtime[band] = virtual_time_after(vtime[band], start)
                flow.finish = finish_after(start, cost, flow.weight)
                follow_head(flow, gone, vtime[band])
                from_queue = True
            else:
                _, seq, at, cost, service, flow, measured = granted
                band, granted, from_queue = flow.band, None, False
            free -= 1
            held[band] += 1
            push(done, (now + service, band, cost, flow.tenant, now))
            if admitting is not None:
                admitting.handed_over(now, band, flow.tenant, cost, from_queue, released, queued > 0)
                released += 1 if released and from_queue else 0
            if book is not None:
                book.start(flow.tenant, cost)
            tally = flow.tally
            waited = now - at
            if measured:
                tally.waits_s.append(waited)
                tally.service_s += service
                tally.service_squares_s2 += service * service
                if waited + service > deadlines[band]:
                    tally.late += 1
            if now >= measured_from:
                tally.handed_work += cost
                tally.busy_s += service
            if on_handover is not None:
                running = dict(book.inflight) if book is not None else {}
                on_handover(Handover(now, band, flow.tenant, cost, waited, tuple(depth), running))
    end = until if until < math.inf else now
    tallies = {(band, tenant): flow.tally for band in range(nbands) for tenant, flow in known[band].items()}
    return Run(tallies, index, min(measured_from, end), last_arrival, end, queued)


def _stats(
    flow: Flow,
    free: int,
    held: list[int],
    reserved: list[int],
    depth: list[int],
    work: list[float],
    vtime: list[float],
    started_at: list[float],
) -> QueueStats:
    """The pool as the stores tell it to admission for an arrival of `flow`: it waits for its
    flow's turn in its band (QueueStats.fair_turns)."""
    return QueueStats(
        queued_by_band=tuple(depth),
        free_slots=free,
        queued_work_by_band=tuple(work),
        free_by_band=usable_by_band(free, held, reserved) if reserved else (),
        fair_turns=_turns(flow, vtime[flow.band], len(depth)) if depth[flow.band] else (),
        started_at=tuple(started_at),
    )


def _turns(flow: Flow, virtual_time: float, nbands: int) -> tuple[FairTurns | None, ...]:
    """The fair-queuing state of `flow`'s band while work waits in it, as the stores tell it."""
    queued = {f.tenant: f.queued for f in flow.siblings.values() if f.queued > 0}
    # Every flow admitted, queued or granted at once, backlogged or not, as the stores name them.
    weights = {f.tenant: f.weight for f in flow.siblings.values() if f.admitted}
    head = flow.head_start if flow.heap else None
    own = joining_start(virtual_time, flow.finish, head, flow.queued, flow.weight)
    turns = FairTurns(virtual_time, {flow.tenant: own}, queued, weights)
    return tuple(turns if b == flow.band else None for b in range(nbands))
