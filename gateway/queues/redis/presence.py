"""This replica's presence in Redis: joining, the heartbeat, and rejoining (lua/heartbeat.lua,
lua/rejoin.lua), and how long its leases may have to stay reserved.

The rules it keeps with the scripts, so that a backend never runs more than its slots whatever
happens to a replica or to its link to Redis:
- a lease is renewed by the work it covers: each beat names the leases this replica still uses
  (its requests', and those reserved for its fallback's work); one it no longer names lapses within
  a TTL (its release was lost);
- a replica whose heartbeat lapsed is absent: Redis keeps each of its leases reserved until the
  work on it could have ended (`lease_bound_s` after its grant), and up to its fallback's share of
  each backend until `hold_s` after its last beat (the work its fallback may start meanwhile runs
  that long); it refuses the replica's beats, offers and releases, and takes it back only through a
  rejoin, which replaces the reservation by the work the replica still runs;
- while it is detached (serving from its fallback) it neither beats nor frees a lease: its
  fallback runs on the capacity of the leases it holds, so they stay counted until it rejoins.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.queues.base import Slot
from gateway.queues.redis.codec import as_list, ready_arg
from gateway.queues.redis.grants import ModelState
from gateway.queues.shares import fallback_share
from gateway.upstream.backends import ModelPool
from policies.service_times import surely_ended_s

log = logging.getLogger("gateway.redis")


class ReplicaAbsent(RedisError):
    """Redis counts this replica as absent (its heartbeat lapsed): it must rejoin."""


def lease_bound_s(pool: ModelPool, lease_ttl_s: float) -> float:
    """The longest a request holds its slot once granted: the upstream timeout cuts the exchange
    short, and a TTL covers the hand-over and the release on their way."""
    return pool.upstream_timeout_s + lease_ttl_s


def hold_s(pool: ModelPool, lease_ttl_s: float, fallback_max_s: float) -> float:
    """How long after a replica's last beat its leases stay reserved once it is absent: it may
    serve from its fallback until `fallback_max_s` after that beat, on their capacity, and what it
    started then runs `lease_bound_s` more. 0 without a fallback: each lease until its own bound."""
    if fallback_max_s <= 0:
        return 0.0
    return fallback_max_s + lease_bound_s(pool, lease_ttl_s)


@dataclass(frozen=True, slots=True)
class Holding:
    """What a replica that lost Redis holds of one model, which Redis keeps counted for it."""

    slots: tuple[Slot, ...]
    """The slots of its requests."""
    leases: dict[str, int]
    """Backend url -> its leases there for work (its requests' and those reserved for its
    fallback's: in_use and reserved of ModelState), at most the share its last beat recorded."""
    serve_until: float
    """Until when, on the local clock, it may start work on them from a fallback: the others hold
    its leases that long after its last beat (-inf: it never joined)."""


class Presence:
    """This replica's steps in each model's presence: join (or rejoin), beat, reap, leave."""

    def __init__(
        self,
        run: Callable[[str, ModelState, dict[str, Any]], Awaitable[Any]],
        replica: str,
        lease_ttl_s: float,
        expected_replicas: int,
        fallback_max_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._run = run
        self.replica = replica
        self._ttl_s = lease_ttl_s
        self._expected = expected_replicas
        self.fallback_max_s = fallback_max_s
        self._clock = clock
        self.detached = False
        """Serving from a fallback store: no beat, no lease freed, until it rejoins."""
        self.beacon: str | None = None
        """host:port of this process's beacon (peers.py), published with each beat."""
        self.config_hash = ""
        """The hash of the config this replica runs, published with each beat (the status page)."""

    def holding(self, state: ModelState) -> Holding:
        sent_at = state.beat_sent_at
        until = float("-inf") if sent_at is None else sent_at + self.fallback_max_s
        # Within the share Redis recorded at the last beat: a limit raised since is not held for it.
        leases = {url: min(n, state.beat_share.get(url, 0)) for url, n in state.leases_in_use().items()}
        return Holding(tuple(state.in_use()), leases, until)

    async def join(self, state: ModelState, reserve: dict[str, int]) -> None:
        """Join or rejoin (lua/rejoin.lua); `reserve`: backend url -> slots the fallback store may
        still use, held as leases until they are released."""
        sent_at = self._clock()
        args = {
            "replica": self.replica,
            "ttl": self._ttl_s,
            **self._hold_args(state),
            **self._identity_args(state),
            # A new state forgot what replicas it does not know yet may run from their fallbacks.
            "window": self.fallback_max_s + lease_bound_s(state.pool, self._ttl_s),
            "lost": int(state.beat_sent_at is not None),  # joined before: a new state is a lost one
            "expected": self._expected,
            "ready": ready_arg(state.pool),
            "reserve": [{"u": url, "n": n} for url, n in reserve.items() if n],
            "keep": [{"l": lease, "u": slot.backend.url} for lease, slot in state.held.items()],
        }
        reply = await self._run("rejoin", state, args)
        if reply["dropped"] or reply["freed"]:
            log.info(
                "model %s: dropped %d stale ticket(s) and %d stale lease(s)",
                state.pool.name,
                reply["dropped"],
                reply["freed"],
            )
        # Leases Redis had forgotten, all moved at once: a new id may be another's old one.
        moved = [(new, state.held.pop(old)) for old, new in as_list(reply["renamed"])]
        for new, slot in moved:
            slot.lease = new
            state.held[new] = slot
        # The script grants the reserved leases in the order of `reserve`, each entry's n in turn.
        urls = [share["u"] for share in args["reserve"] for _ in range(share["n"])]
        state.reserved = dict(zip(as_list(reply["reserved"]), urls, strict=True))
        state.beat_sent_at, state.beat_share = sent_at, shares(args)
        state.releasing.clear()  # what failed to be released is freed by the join (not kept)

    async def beat(self, state: ModelState) -> None:
        """Stay live and renew the leases still in use; ReplicaAbsent when the heartbeat lapsed."""
        sent_at = self._clock()
        args = {
            "replica": self.replica,
            "ttl": self._ttl_s,
            "expected": self._expected,
            **self._hold_args(state),
            **self._identity_args(state),
            "leases": [*state.held, *state.reserved],
        }
        if (await self._run("heartbeat", state, args))["absent"]:
            raise ReplicaAbsent(f"model {state.pool.name}: this replica's heartbeat lapsed")
        state.beat_sent_at, state.beat_share = sent_at, shares(args)

    def _hold_args(self, state: ModelState) -> dict[str, Any]:
        """How long Redis is to hold this replica's leases once it is absent, and how many of them
        per backend its fallback may reuse (what FailoverQueue lets it: its share, at most)."""
        if self.fallback_max_s <= 0:
            return {"hold_s": 0.0, "share": []}
        return {
            "hold_s": hold_s(state.pool, self._ttl_s, self.fallback_max_s),
            "share": [
                {"u": b.url, "n": fallback_share(b.max_concurrency, self._expected)}
                for b in state.pool.backends
            ],
        }

    def _identity_args(self, state: ModelState) -> dict[str, Any]:
        """The config this replica runs (c); with a beacon, where the others probe this process
        once it is absent (a), and how long a request of its may compute on a backend after its
        connection closed (d, lua/gone.lua): the measured bound, never beyond the lease's own (a
        dead process has no release on its way)."""
        if self.beacon is None:
            return {"peer": {"c": self.config_hash}}
        estimates = state.estimates
        measured = surely_ended_s([estimates.service_times, *estimates.service_times_by_kind.values()])
        bound = lease_bound_s(state.pool, self._ttl_s)
        return {"peer": {"c": self.config_hash, "a": self.beacon, "d": min(bound, measured)}}

    async def rejoin_as_it_is(self, state: ModelState) -> None:
        """Rejoin after the heartbeat lapsed without Redis being lost: with the work it has."""
        urls = list(state.reserved.values())
        await self.join(state, {url: urls.count(url) for url in set(urls)})

    async def reap(self, state: ModelState, *, leaving: bool = False) -> None:
        """Reserve what absent replicas hold and free expired leases (lua/reap.lua); `leaving`:
        this replica leaves too, its leases reserved until their bounds."""
        args: dict[str, Any] = {"ttl": self._ttl_s}
        if leaving:
            args["leaving"] = self.replica
        reply = await self._run("reap", state, args)
        absent = reply["dead"] - leaving  # this one, when it leaves
        if absent or reply["expired"]:
            log.warning(
                "model %s: reserved %d absent replica(s)' leases, freed %d expired lease(s), %d grant(s)",
                state.pool.name,
                absent,
                reply["expired"],
                reply["granted"],
            )


def shares(args: dict[str, Any]) -> dict[str, int]:
    """Backend url -> the fallback share a beat's (or join's) arguments record."""
    return {entry["u"]: entry["n"] for entry in args["share"]}
