"""The returns each replica has promised refused clients, shared through Redis (base.SharedReturns).

The Redis store exchanges them on its upkeep loop, every wake (`RedisReturns.exchange`): it publishes
this replica's latest promises when they changed and reads the others', so a replica sees another's
promises within about a quarter of a second. A replica that left still has clients coming back:
its promises count until their slices pass (policies.return_schedule drops passed slices and
returning rates older than the rates' memory).

On Redis, per model, a hash `<tag>:returns` holds one field per replica: a JSON list per band of
[origin on Redis's clock, slice_s, returning_per_s, settled_returning_per_s, updated_at, booked...]
(null for a band without promises). The key lives as long as a schedule reaches (the ceiling),
renewed by every write.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence

from redis.exceptions import RedisError

from gateway.queues.redis.clients import RedisClient
from gateway.queues.redis.grants import ModelState
from policies.return_schedule import SLICES, Promised, ReturnSchedule, promised

log = logging.getLogger("gateway.redis")


class RedisReturns:
    def __init__(self, client: RedisClient, replica: str, bands: int) -> None:
        self._client = client
        self._replica = replica
        self._bands = bands
        self._own: dict[str, list[ReturnSchedule | None]] = {}
        self._changed: set[str] = set()
        self._others: dict[str, list[tuple[Promised, ...]]] = {}

    def promise(self, model: str, band: int, schedule: ReturnSchedule) -> None:
        self._own.setdefault(model, [None] * self._bands)[band] = schedule
        self._changed.add(model)

    def elsewhere(self, model: str, band: int) -> Sequence[Promised]:
        others = self._others.get(model)
        return others[band] if others is not None else ()

    async def exchange(self, model: str, state: ModelState) -> None:
        """Publish this replica's promises of `model` if they changed, and read the others'. A
        failure is logged and left for the next wake: the others' promises seen last stay."""
        view, key = state.view, f"{state.tag}:returns"
        if view.redis_now <= 0:
            return  # no reply from Redis yet: its clock is not known here
        to_redis = view.redis_now - view.seen_at  # local clock + this = Redis's clock
        pipe = self._client.pipeline(transaction=False)
        published = model in self._changed
        if published:
            own = [promised(schedule) if schedule is not None else None for schedule in self._own[model]]
            pipe.hset(key, self._replica, json.dumps([_encode(p, to_redis) for p in own]))
            reach_s = max(p.slice_s * (SLICES + 1) for p in own if p is not None)
            pipe.expire(key, math.ceil(reach_s) + 5)
        pipe.hgetall(key)
        self._changed.discard(model)  # a promise made while this runs is published next time
        try:
            replies = await pipe.execute()
        except (RedisError, OSError) as error:
            if published:
                self._changed.add(model)
            log.debug("model %s: could not exchange promised returns: %s", model, error)
            return
        others: list[list[Promised]] = [[] for _ in range(self._bands)]
        for replica, raw in replies[-1].items():
            if (replica.decode() if isinstance(replica, bytes) else replica) == self._replica:
                continue
            try:
                entries = [_decode(e, to_redis) if e is not None else None for e in json.loads(raw)]
            except (ValueError, TypeError) as error:  # another version's, or damaged: not counted
                log.warning("model %s: unreadable promised returns of replica %s: %s", model, replica, error)
                continue
            for band, entry in enumerate(entries[: self._bands]):
                if entry is not None:
                    others[band].append(entry)
        self._others[model] = [tuple(band) for band in others]


def _encode(p: Promised | None, to_redis: float) -> list[float] | None:
    if p is None:
        return None
    head = [
        p.origin_s + to_redis,
        p.slice_s,
        p.returning_per_s,
        p.settled_returning_per_s,
        p.updated_at + to_redis,
    ]
    return head + list(p.booked)


def _decode(entry: list[float], to_redis: float) -> Promised:
    """ValueError or TypeError when `entry` is not numbers in the layout `_encode` writes."""
    origin, slice_s, returning, settled, updated_at, *booked = (float(x) for x in entry)
    return Promised(origin - to_redis, slice_s, tuple(booked), returning, settled, updated_at - to_redis)
