"""What the Redis store's scripts take and give back: one JSON object each way, with named fields.

The Lua side reads the same names (lua/common.lua documents the keys). Timestamps come back as
strings, since Redis's cjson keeps only 14 digits; an empty Lua table comes back as {} where a
list was meant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.queues.base import Batching, Flow
from gateway.queues.estimates import StoreCounters
from gateway.upstream.backends import ModelPool
from policies.displacement import OVERDUE_CHECKED, OVERDUE_SIGMAS, displacement_handovers_per_s
from policies.fairness import FairTurns
from policies.reservations import usable_by_band
from policies.sequences import SequenceRef
from policies.wait import QueueStats, Throughput


@dataclass(frozen=True, slots=True)
class OfferArgs:
    """What offer.lua takes (its header names each field)."""

    replica: str
    flow: Flow
    cost: float
    max_work: float
    handover: float
    edf: bool
    weight: float
    allowed_s: float
    ttl: float
    displacing: Throughput | None = None
    """The pool's measured speeds where this offer may push less urgent requests past their
    allowance (policies.displacement): the script checks them at the pool's hand-overs per second
    while busy as displacement counts them (`drain`) and its service times' spread (`service_cv`);
    None: none to check."""
    kind: str = ""
    """The request's kind (policies.request_kinds), kept with its lease."""
    reach: Mapping[str, float] = field(default_factory=dict)
    """The most work each other flow of its band may send within its allowance
    (policies.admission.offer_reach): the script counts what of it goes ahead of its turn."""
    sequence: SequenceRef | None = None
    """The sequence it belongs to (policies.sequences): the script pins it to its backend."""

    def fields(self, refused: list[float], batching: Batching | None) -> dict[str, Any]:
        """The script's arguments, with the work refused locally since the last script."""
        apart = ("flow", "displacing", "sequence")
        fields = {name: getattr(self, name) for name in self.__slots__ if name not in apart}
        fields |= {"band": self.flow.band, "tenant": self.flow.tenant, "refused": refused, "drain": 0.0}
        if (pool := self.displacing) is not None and (drain := displacement_handovers_per_s(pool)) > 0:
            fields |= {"drain": drain, "service_cv": pool.service_cv}
            fields |= {"overdue_sigmas": OVERDUE_SIGMAS, "overdue_checked": OVERDUE_CHECKED}
        if (sequence := self.sequence) is not None:
            fields["seq"] = {"k": sequence.key} | ({"s": True} if sequence.start else {})
            fields["seq"] |= {"e": True} if sequence.end else {}
        if batching is not None:
            fields["batch"] = {"key": batching.key, "max": batching.max_cost}
            if batching.hold:
                fields["batch"]["hold"] = True
        return fields


def encode(args: dict[str, Any]) -> str:
    return json.dumps(args, separators=(",", ":"))


def decode(raw: bytes | str) -> Any:
    return json.loads(raw)


def as_list(value: Any) -> list[Any]:
    """A list from Lua: cjson turns an empty table into {}."""
    return value if isinstance(value, list) else []


def backends_arg(pool: ModelPool) -> list[dict[str, Any]]:
    """The backends as the scripts read them. Built per call: slots may be discovered late, and
    the reported queues change every scrape."""
    return [{"url": b.url, "cap": b.max_concurrency, "queued": b.external_waiting} for b in pool.backends]


def ready_arg(pool: ModelPool) -> list[dict[str, str]]:
    return [{"u": b.url, "r": "1" if b.ready else "0"} for b in pool.backends]


@dataclass(frozen=True, slots=True)
class View:
    """The global state a script saw, as it returned it."""

    seen_at: float
    """When it arrived, on the local clock."""
    redis_now: float
    """When the script ran, on Redis's clock (replies may arrive out of order)."""
    stats: QueueStats
    counters: StoreCounters
    held_absent: int = 0
    """Slots held for absent replicas (their leases reserved until their work may have ended):
    left out of the pool admission reads, and of `stats.started_at`."""

    @classmethod
    def empty(cls, bands: int, seen_at: float) -> View:
        stats = QueueStats((0,) * bands, 0, (0.0,) * bands)
        return cls(seen_at, 0.0, stats, StoreCounters.empty(bands))

    @classmethod
    def parse(
        cls, raw: dict[str, Any], seen_at: float, reserved: tuple[int, ...] = (), last: View | None = None
    ) -> View:
        """The view a script returned; with `reserved` slots per band, each band's usable free slots
        from the slots each band holds (`ib`). Where it left out the work in flight (many slots in
        use, and the replica's own view fresh: lua/common.lua, view), `last`'s stands."""
        redis_now = float(raw["now"])
        if "st" in raw or last is None:
            # Grant times on Redis's clock, moved to the local one: the reply left Redis about now.
            started_at = tuple(seen_at - (redis_now - float(t)) for t in as_list(raw.get("st")))
            kinds, held_absent = tuple(as_list(raw.get("sk"))), int(raw.get("ra") or 0)
        else:
            started_at, kinds, held_absent = last.stats.started_at, last.stats.started_kinds, last.held_absent
        free = int(raw["free"])
        held = [int(n) for n in as_list(raw.get("ib"))]
        stats = QueueStats(
            queued_by_band=tuple(int(n) for n in raw["n"]),
            free_slots=free,
            free_by_band=usable_by_band(free, held, reserved) if reserved and held else (),
            inflight_by_tenant=_pairs(as_list(raw.get("th"))),
            queued_work_by_band=tuple(float(w) for w in raw["w"]),
            started_at=started_at,
            started_kinds=kinds,
            fair_turns=tuple(_fair_turns(band) for band in as_list(raw.get("ft"))),
            pinned_by_band=tuple(int(n) for n in as_list(raw.get("p"))),
        )
        counters = StoreCounters(
            offered_work=[float(x) for x in raw["off"]],
            admitted_work=[float(x) for x in raw["adm"]],
            drained_work=float(raw["dw"]),
            drained_s=float(raw["ds"]),
            drained_at=float(raw["da"]) if raw["da"] else float("-inf"),
            handovers=int(raw["h"]),
            handed_work=float(raw["hw"]),
            granted_by_flow=_granted(as_list(raw.get("g"))),
            admitted_by_flow=_granted(as_list(raw.get("a"))),
        )
        return cls(seen_at, redis_now, stats, counters, held_absent)


def _fair_turns(raw: Any) -> FairTurns | None:
    """A band's fair-queuing state as the view script sends it: 0, or [virtual time, where a
    request joining each flow starts, queued work, weights] with each table as a flat list of
    tenant, value pairs."""
    if not raw:
        return None
    virtual_time, finish, queued, weights = as_list(raw)
    tables = (_pairs(as_list(table)) for table in (finish, queued, weights))
    return FairTurns(float(virtual_time), *tables)


def _pairs(flat: list[Any]) -> dict[str, float]:
    """HGETALL's [field, value, ...] as a dict of numbers."""
    return {str(k): float(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}


def _granted(flat: list[Any]) -> dict[tuple[int, str], float]:
    """HGETALL's [field, value, ...] of "<band>:<tenant>" -> work, by (band, tenant)."""
    granted: dict[tuple[int, str], float] = {}
    for field_name, value in zip(flat[::2], flat[1::2], strict=True):
        band, _, tenant = str(field_name).partition(":")
        granted[int(band), tenant] = float(value)
    return granted


@dataclass(frozen=True, slots=True)
class Grant:
    """A slot one script granted to tickets of one replica: one ticket, or a batch of them."""

    tickets: tuple[str, ...]
    lease: str
    url: str
    cost: float
    band: int
    kind: str = ""
    """The kind of request its slot serves ("" for a batch of several)."""

    @classmethod
    def parse(cls, raw: bytes | str) -> Grant:
        return cls.of(decode(raw))

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Grant:
        kind = fields.get("q") or ""
        return cls(tuple(fields["t"]), fields["l"], fields["u"], float(fields["c"]), int(fields["b"]), kind)


@dataclass(frozen=True, slots=True)
class Displaced:
    """A queued ticket of this replica's that a more urgent arrival displaced: at the queue's cap,
    or as `overdue` (it could no longer get a slot in time)."""

    ticket: str
    overdue: bool = False


def message(raw: bytes | str) -> Grant | Displaced:
    """What a replica's list carries: a grant, or a displaced ticket."""
    fields = decode(raw)
    return Displaced(fields["d"], bool(fields.get("o"))) if "d" in fields else Grant.of(fields)


def grants(raw: Sequence[bytes | str] | dict[str, Any]) -> list[Grant]:
    return [Grant.parse(item) for item in as_list(raw)]
