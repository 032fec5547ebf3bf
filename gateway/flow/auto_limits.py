"""AutoLimits: the concurrency limits of the backends configured `max_concurrency: auto`.

Each scrape of such a backend's metrics (gateway.signals.scraper) brings an EngineSample; the
control law (policies.concurrency_limit) turns it into the backend's limit, which becomes its
slots in the stores at once (`backends_changed` dispatches into new ones; a lower limit lets the
requests in flight finish and grants no more until they are under it). On the Redis store one
replica leads each backend's limit and the others take it (`RequestQueue.share_limit`), so the
replicas run on one limit. While a backend's metrics are stale no sample comes: its limit holds.

Each sample also carries the clients' objective: the share of the requests with deadlines that
ended on the backend past them, over the last DEADLINE_ENDINGS or more of them (this replica's:
on Redis the leading replica's requests decide).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from gateway.queues.base import RequestQueue
from gateway.settings import Model
from gateway.upstream.backends import BackendState, ModelPool
from policies.concurrency_limit import EngineSample, LimitConfig, LimitState, limit_binds, next_limit, start

log = logging.getLogger("gateway.limits")

# A leader that missed this many scrapes in a row hands the lead to whoever asks next.
LEAD_SCRAPES = 3
DEADLINE_ENDINGS = 8
"""Requests with deadlines that tell a share of them missed: fewer say nothing yet."""


class AutoLimits:
    def __init__(
        self,
        models: Iterable[Model],
        store: RequestQueue,
        scrape_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._clock = clock
        self._lead_s = LEAD_SCRAPES * scrape_interval_s
        self._configs: dict[tuple[str, str], LimitConfig] = {}
        """(model, configured URL) -> the law's configuration, for the auto backends."""
        for model in models:
            for backend in model.backends:
                if backend.auto_concurrency:
                    ttft_s, itl_s = backend.latency_objectives_s
                    self._configs[model.name, backend.url] = LimitConfig(
                        min_limit=backend.min_concurrency,
                        max_limit=backend.max_concurrency_cap,
                        ttft_objective_s=ttft_s,
                        itl_objective_s=itl_s,
                    )
        self._states: dict[tuple[str, str], LimitState] = {}
        self._deadlines_told: dict[tuple[str, str], tuple[int, int]] = {}
        """(model, backend URL) -> its (kept, missed) deadlines when a late share was last told."""

    @property
    def any(self) -> bool:
        return bool(self._configs)

    async def on_sample(self, pool: ModelPool, backend: BackendState, sample: EngineSample) -> None:
        config = self._configs.get((pool.name, backend.origin))
        if config is None:
            return
        key = (pool.name, backend.url)
        state = self._states.get(key) or start(config)
        late_share = self._late_share(key, backend)
        if late_share is not None:
            sample = replace(sample, late_share=late_share)
        stats = self._store.stats(pool.name)
        throughput = self._store.throughput(pool.name, self._clock())
        demand = limit_binds(
            any(stats.queued_by_band),
            stats.free_slots,
            backend.known_slots,
            sum(throughput.offered_rate_by_band),
            sum(throughput.admitted_rate_by_band),
        )
        proposed = next_limit(state, sample, demand, config)
        try:
            leads, slots = await self._store.share_limit(pool.name, backend.url, proposed.slots, self._lead_s)
        except Exception as error:  # the store is unreachable: the limit holds, as when stale
            log.warning("%s at %s: the shared limit is out of reach: %r", pool.name, backend.url, error)
            return
        # A follower takes the leader's limit, and would go on from there if it came to lead:
        # probing above it, not starting slowly again as if nothing were known.
        self._states[key] = proposed if leads else LimitState(float(slots), ceiling=float(slots))
        slots = int(min(config.max_limit, max(config.min_limit, slots)))
        if slots != backend.known_slots:
            cause = proposed.cause if leads else "the leading replica's"
            log.info(
                "%s at %s: concurrency limit %d -> %d (%s)",
                pool.name, backend.url, backend.known_slots, slots, cause,
            )  # fmt: skip
            backend.max_concurrency = slots
            backend.limit_moved_at = self._clock()
            self._store.backends_changed(pool.name)

    def _late_share(self, key: tuple[str, str], backend: BackendState) -> float | None:
        """The share of deadlines missed on `backend` since the last share told, once enough ended."""
        kept, missed = backend.deadlines_kept, backend.deadlines_missed
        kept_before, missed_before = self._deadlines_told.get(key, (0, 0))
        ended = (kept - kept_before) + (missed - missed_before)
        if ended < DEADLINE_ENDINGS:
            return None
        self._deadlines_told[key] = (kept, missed)
        return (missed - missed_before) / ended
