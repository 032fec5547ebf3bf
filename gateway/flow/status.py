"""The status document: what waits where, what runs, what was refused, read from admission's state.

One read of what admission itself reads (the store's `stats` and `throughput` per model, the pool's
backends), so the page shows what the decisions see: per model, each class's queue (requests and
work, each tenant's work in it, the predicted wait of a request arriving now, the oldest wait), its
refusals of the last minute by reason and its last Retry-After; each tenant's work in flight and
what it borrows; each backend's slots, requests in flight, circuit, its own queue and how old that
reading is. And where one queued request stands (`locate`): what is surely ahead of it, when it
may start at the latest, and why it waits.

The document is versioned (`SCHEMA`): a field is added under the same version, never renamed or
dropped without a new one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gateway.flow.queued_requests import QueuedRequest, QueuedRequests
from gateway.telemetry.recent import RecentRefusals
from gateway.upstream.backends import ModelPool
from policies.fairness import shares as fair_shares
from policies.quotas import Quota, borrowed
from policies.wait import QueueStats, Throughput, band_drain_rate_per_s, predicted_wait_s

SCHEMA = 1


class QueueView(Protocol):
    """What the board reads of the store (gateway.queues.base.RequestQueue has it)."""

    def stats(self, model: str) -> QueueStats: ...
    def throughput(self, model: str, now: float) -> Throughput: ...
    def replicas(self) -> Mapping[str, str]: ...


class StatusBoard:
    def __init__(
        self,
        pools: Sequence[ModelPool],
        class_names: Sequence[str],
        store: QueueView,
        recent: RecentRefusals,
        queued: QueuedRequests,
        *,
        store_kind: str,
        replicas: int,
        store_mode: str = "memory",
        config_hash: str,
        quotas: Mapping[str, Quota] | None = None,
        draining: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pools = {pool.name: pool for pool in pools}
        self._classes = list(class_names)
        self._store = store
        self._recent = recent
        self._queued = queued
        self._store_kind = store_kind
        self._store_mode = store_mode
        self._replicas = replicas
        self.config_hash = config_hash
        self._quotas = dict(quotas or {})
        self._draining = draining
        self._clock = clock

    def document(self) -> dict[str, Any]:
        now = self._clock()
        oldest = self._oldest_waits(now)
        return {
            "schema": SCHEMA,
            "time": time.time(),
            "draining": self._draining(),
            "config_hash": self.config_hash,
            "store": self._store_state(),
            "models": [self._model(pool, now, oldest) for pool in self._pools.values()],
        }

    def _store_state(self) -> dict[str, Any]:
        """The store, and the replicas seen live on it with the hash of the config each runs: a
        reload that reached only some of them shows as more than one config."""
        seen = self._store.replicas()
        return {
            "kind": self._store_kind,
            "mode": self._store_mode,
            "replicas": self._replicas,
            "seen": [{"replica": replica, "config_hash": config} for replica, config in sorted(seen.items())],
            "configs": len(set(seen.values())),
        }

    def _model(self, pool: ModelPool, now: float, oldest: Mapping[tuple[str, int], float]) -> dict[str, Any]:
        stats = self._store.stats(pool.name)
        throughput = self._store.throughput(pool.name, now)
        classes = []
        for band, name in enumerate(self._classes):
            turns = stats.fair_turns[band] if band < len(stats.fair_turns) else None
            by_tenant = turns.queued if turns is not None else {}
            granted = (
                throughput.tenant_granted_by_band[band]
                if band < len(throughput.tenant_granted_by_band)
                else {}
            )
            shares = fair_shares(granted)
            tenants = sorted(set(by_tenant) | set(shares))
            classes.append(
                {
                    "name": name,
                    "queued": stats.queued_by_band[band],
                    "queued_work": stats.work(band),
                    "predicted_wait_ms": 1000 * predicted_wait_s(stats, throughput, band),
                    "oldest_wait_ms": 1000 * oldest[(pool.name, band)]
                    if (pool.name, band) in oldest
                    else None,
                    "refusals_per_minute": self._recent.per_minute(pool.name, name),
                    "last_retry_after_s": self._recent.last_retry_after_s.get((pool.name, name)),
                    "tenants": [
                        {"name": t, "queued_work": by_tenant.get(t, 0.0), "share": shares.get(t, 0.0)}
                        for t in tenants
                    ],
                }
            )
        inflight = stats.inflight_by_tenant
        return {
            "name": pool.name,
            "ready": pool.any_ready,
            "in_flight": sum(b.inflight for b in pool.backends),
            "slots": pool.total_slots,
            "free_slots": stats.free_slots,
            "service_time_ms": 1000 * throughput.service_time_s,
            "drain_rate_per_s": throughput.drain_rate_per_s,
            "classes": classes,
            "tenants": [
                {
                    "name": tenant or "-",
                    "in_flight_work": work,
                    "quota": q.nominal if (q := self._quotas.get(tenant)) is not None else None,
                    "borrowed_work": borrowed(tenant, inflight, self._quotas)
                    if tenant in self._quotas
                    else 0.0,
                }
                for tenant, work in sorted(inflight.items())
            ],
            "backends": [
                {
                    "url": b.url,
                    "ready": b.ready,
                    "in_flight": b.inflight,
                    "slots": b.max_concurrency,
                    "circuit": b.circuit.state.value,
                    "reported_waiting": b.reported_waiting if b.signal_up else None,
                    "scrape_age_s": None if b.scraped_at is None else round(now - b.scraped_at, 3),
                }
                for b in pool.backends
            ],
        }

    def _oldest_waits(self, now: float) -> dict[tuple[str, int], float]:
        """(model, band) -> the longest a request queued here has waited."""
        oldest: dict[tuple[str, int], float] = {}
        for request in self._queued.all():
            key = (request.model, request.band)
            oldest[key] = max(oldest.get(key, 0.0), now - request.queued_at)
        return oldest

    def locate(self, request: QueuedRequest) -> dict[str, Any]:
        """Where a queued request stands: the work surely ahead of it (more urgent classes') and at
        most ahead of it (its own class's, up to the turn of its flow), when it starts at the latest
        at the present drain rate, and what it waits for."""
        now = self._clock()
        pool = self._pools[request.model]
        stats = self._store.stats(request.model)
        throughput = self._store.throughput(request.model, now)
        band = request.band
        urgent = sum(stats.work(b) for b in range(band))
        own = max(0.0, stats.work_ahead(band, request.tenant or None) - urgent)
        rate = band_drain_rate_per_s(throughput, band)
        latest_start_s = (urgent + own) * throughput.handover_cost / rate if rate > 0 else None
        waited_s = now - request.queued_at
        return {
            "schema": SCHEMA,
            "id": request.request_id,
            "model": request.model,
            "class": request.priority,
            "tenant": request.tenant or "-",
            "cost": request.cost,
            "waited_ms": 1000 * waited_s,
            "budget_left_ms": None if request.budget_s is None else 1000 * (request.budget_s - waited_s),
            "work_ahead": {"more_urgent_classes": urgent, "own_class_at_most": own},
            "starts_within_ms": None if latest_start_s is None else 1000 * latest_start_s,
            "sequence": request.sequence,
            "waits_for": self._waits_for(pool, stats, request, urgent),
        }

    def _waits_for(self, pool: ModelPool, stats: QueueStats, request: QueuedRequest, urgent: float) -> str:
        if not pool.any_ready:
            return "no_backend"
        quota = self._quotas.get(request.tenant)
        if quota is not None and math.isfinite(quota.borrowing_limit):
            cap = quota.nominal + quota.borrowing_limit
            if stats.inflight_by_tenant.get(request.tenant, 0.0) + request.cost > cap:
                return "quota"
        if urgent > 0:
            return "more_urgent_classes"
        if request.sequence is not None:
            return "its_sequence_backend"  # pinned: a slot on that backend, whatever is free elsewhere
        return "its_turn"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds
