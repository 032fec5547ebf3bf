"""Scrapers: one background loop per metrics source, with a timeout and jittered intervals.

A backend's source updates what that backend reports (its queue, its running count); Kueue's
updates the cluster backlog. A source that fails `stale_after_failures` scrapes in a row is stale
(`gateway_signal_up{source} 0`): a backend's reports are then ignored, so decisions fall back to
the gateway's own counts, and the cluster backlog keeps its last known value (a source going
quiet is no reason to believe the cluster recovered).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import anyio
from anyio.abc import TaskStatus

from gateway.settings import Kueue, Signals
from gateway.signals.exposition import Exposition
from gateway.signals.readings import KueueReading, ServerReading, is_server_page, read_kueue, read_server
from gateway.supervision import Loop, Supervisor
from gateway.telemetry.metrics import GatewayMetrics
from gateway.upstream.backends import BackendState, ModelPool
from policies.concurrency_limit import EngineSample
from policies.estimators import counter_increase
from policies.histograms import bucket_deltas, quantile
from policies.shedding import BacklogLimits, ClusterBacklog

log = logging.getLogger("gateway.signals")


class ScrapeError(Exception):
    """The source did not answer with usable metrics."""


Scrape = Callable[[aiohttp.ClientSession, "SourceState"], Awaitable[None]]


@dataclass(slots=True)
class SourceState:
    name: str
    failures: int = 0
    up: bool = False


@dataclass(slots=True)
class BackendSignal:
    """Rates derived from a backend's counters between two scrapes."""

    previous: ServerReading | None = None
    previous_at: float = 0.0
    queue_wait_s: float | None = None
    """Mean time requests waited inside the backend over the last interval (Triton)."""
    completions_per_s: float | None = None
    engine: EngineSample | None = None
    """What the last interval says of its scheduling, for an auto concurrency limit."""


@dataclass(slots=True)
class ClusterState:
    """The serving ClusterQueue as Kueue last reported it."""

    limits: BacklogLimits
    backlog: ClusterBacklog | None = None
    previous_buckets: dict[float, float] = field(default_factory=dict)


class SignalBoard:
    """Everything scraped, and the loops that keep it current."""

    def __init__(
        self,
        pools: list[ModelPool],
        config: Signals,
        kueue: Kueue | None,
        metrics: GatewayMetrics,
        *,
        supervisor: Supervisor,
        on_backend_signal: Callable[[str], None] = lambda model: None,
        on_engine_sample: Callable[[ModelPool, BackendState, EngineSample], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_engine_sample = on_engine_sample
        """Told each interval's EngineSample of every backend (set by whoever limits them)."""
        self._pools = pools
        self._config = config
        self._kueue = kueue
        self._metrics = metrics
        self._supervisor = supervisor
        self._on_backend_signal = on_backend_signal
        self._clock = clock
        self.cluster = (
            ClusterState(BacklogLimits(kueue.backlog_pending_workloads, kueue.backlog_admission_wait_p95_s))
            if kueue is not None
            else None
        )
        self.backend_signals: dict[int, BackendSignal] = {}
        self._loops: list[Loop] = []
        self._own_sessions: list[aiohttp.ClientSession] = []
        self._backend_loops: dict[str, Loop] = {}
        """One loop per metrics page: one server may serve several models (and backends)."""
        self._watched: dict[str, list[tuple[ModelPool, BackendState]]] = {}
        """The backends each page reports on, every model's."""
        self._session: aiohttp.ClientSession | None = None

    def external_waiting(self, model: str) -> float:
        pool = next(p for p in self._pools if p.name == model)
        return pool.external_waiting

    def backlog(self) -> ClusterBacklog | None:
        return self.cluster.backlog if self.cluster is not None else None

    async def start(self, session: aiohttp.ClientSession) -> None:
        await self._supervisor.open()
        self._session = session
        for pool in self._pools:
            self.follow(pool.name)
        if self._kueue is not None:
            self._own_sessions.append(self._kueue_session(self._kueue))
            self._loops.append(self._loop(self._own_sessions[-1], "kueue", self._kueue_scrape(self._kueue)))

    def follow(self, model: str) -> None:
        """Scrape the model's backends as they are now: endpoint discovery adds and removes them."""
        if self._session is None:
            return
        pool = next(p for p in self._pools if p.name == model)
        watched: dict[str, list[tuple[ModelPool, BackendState]]] = {}
        for url, pairs in self._watched.items():  # the other models' backends stay as they are
            if others := [(p, b) for p, b in pairs if p is not pool]:
                watched[url] = others
        for backend in pool.backends:
            if backend.metrics_url:
                watched.setdefault(backend.metrics_url, []).append((pool, backend))
        self._watched = watched
        # A backend gone (endpoint churn) leaves its rates behind, and its id may be a new one's.
        live = {id(backend) for pairs in watched.values() for _, backend in pairs}
        for gone in [key for key in self.backend_signals if key not in live]:
            del self.backend_signals[gone]
        for url in [url for url in self._backend_loops if url not in watched]:
            self._backend_loops.pop(url).cancel()
            self._metrics.signal_up.remove(url)
        for url in watched:
            if url not in self._backend_loops:
                self._backend_loops[url] = self._loop(self._session, url, self._page_scrape(url))

    async def stop(self) -> None:
        loops = self._loops + list(self._backend_loops.values())
        for loop in loops:
            loop.cancel()
        for loop in loops:
            await loop.wait()
        for session in self._own_sessions:
            await session.close()

    # -- the loop --------------------------------------------------------------------------------

    def _loop(self, session: aiohttp.ClientSession, name: str, scrape: Scrape) -> Loop:
        state = SourceState(name)  # outside the loop: a restart keeps the count of failures
        self._metrics.signal_up.labels(name).set(0)
        # One loop name for every source keeps the label set closed (gateway_signal_up names the source).
        body = functools.partial(self._run, session, state, scrape)
        return self._supervisor.start_soon("signal_scrape", body)

    async def _run(
        self,
        session: aiohttp.ClientSession,
        state: SourceState,
        scrape: Scrape,
        *,
        task_status: TaskStatus[None],
    ) -> None:
        interval_s = self._config.scrape_interval_ms / 1000
        task_status.started()
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that
                # comes as the scrape completes, and this loop would then never stop.
                async with asyncio.timeout(self._config.scrape_timeout_ms / 1000):
                    await scrape(session, state)
            except Exception as error:  # any failure counts toward staleness; the supervisor sees none
                state.failures += 1
                if state.up and state.failures >= self._config.stale_after_failures:
                    state.up = False
                    self._metrics.signal_up.labels(state.name).set(0)
                    log.warning(
                        "signal source %s is stale after %d failures: %r", state.name, state.failures, error
                    )
                    self._stale(state.name)
            else:
                if not state.up:
                    log.info("signal source %s is up", state.name)
                state.failures = 0
                state.up = True
                self._metrics.signal_up.labels(state.name).set(1)
            # Jitter keeps many replicas from scraping a server in step.
            await asyncio.sleep(interval_s * random.uniform(0.8, 1.2))

    def _stale(self, name: str) -> None:
        if name == "kueue" and self.cluster is not None:
            self.cluster.backlog = None  # decisions fall back to the gateway's own counts
            self.cluster.previous_buckets = {}
            return
        for pool in self._pools:
            for backend in pool.backends:
                if backend.metrics_url == name and backend.signal_up:
                    backend.signal_up = False
                    self._on_backend_signal(pool.name)

    # -- sources ---------------------------------------------------------------------------------

    def _page_scrape(self, url: str) -> Scrape:
        """One metrics page, read for every backend (of any model) it reports on."""

        async def scrape(session: aiohttp.ClientSession, state: SourceState) -> None:
            page = await _fetch(session, url)
            if not is_server_page(page):
                raise ScrapeError("neither Triton nor vLLM metrics")
            now = self._clock()
            for pool, backend in list(self._watched.get(url, ())):
                reading = read_server(page, backend.served_model)
                if reading is None:
                    self._not_on_page(pool, backend, url)
                    continue
                signal = self.backend_signals.setdefault(id(backend), BackendSignal())
                self._derive(signal, reading, now)
                backend.reported_waiting = reading.waiting
                backend.reported_running = reading.running
                backend.signal_up = True
                backend.scraped_at = now
                if signal.engine is not None and self.on_engine_sample is not None:
                    await self.on_engine_sample(pool, backend, signal.engine)
                self._on_backend_signal(pool.name)

        return scrape

    def _not_on_page(self, pool: ModelPool, backend: BackendState, url: str) -> None:
        """The page has no series of the backend's model (unloaded, or `served_model` misspelt):
        its queue is unknown, not empty. Said once each time it goes missing: when it had been read
        (its signal up), or on the first look (no rates kept for it yet, which this look adds)."""
        if backend.signal_up or id(backend) not in self.backend_signals:
            log.warning("%s reports nothing of model %r: its queue is not counted", url, backend.served_model)
            self.backend_signals.setdefault(id(backend), BackendSignal())
        if backend.signal_up:
            backend.signal_up = False
            self._on_backend_signal(pool.name)

    @staticmethod
    def _derive(signal: BackendSignal, reading: ServerReading, now: float) -> None:
        before = signal.previous
        signal.engine = None
        if before is not None and now > signal.previous_at:
            elapsed_s = now - signal.previous_at
            if reading.request_success is not None:
                done = counter_increase(before.request_success, reading.request_success)
                signal.completions_per_s = done / elapsed_s
                if done > 0 and reading.queue_duration_us is not None:
                    queued_us = counter_increase(before.queue_duration_us, reading.queue_duration_us)
                    signal.queue_wait_s = queued_us / done / 1e6
            signal.engine = engine_sample(before, reading, elapsed_s, signal)
        signal.previous, signal.previous_at = reading, now

    def _kueue_scrape(self, config: Kueue) -> Scrape:
        assert self.cluster is not None
        cluster = self.cluster

        async def scrape(session: aiohttp.ClientSession, state: SourceState) -> None:
            headers = {}
            if config.bearer_token_file:
                # Read each time: projected service-account tokens rotate.
                token = (await anyio.Path(config.bearer_token_file).read_text()).strip()
                headers["Authorization"] = f"Bearer {token}"
            reading = read_kueue(await _fetch(session, config.url, headers), config.cluster_queue)
            if reading is None:
                raise ScrapeError("no kueue_pending_workloads in the metrics")
            self._take_kueue(cluster, reading, config.cluster_queue)

        return scrape

    def _take_kueue(self, cluster: ClusterState, reading: KueueReading, cluster_queue: str) -> None:
        # The wait of this interval's admissions: the first scrape has no interval, and the
        # controller's whole history is no measure of the wait now.
        first = cluster.backlog is None
        window = bucket_deltas(cluster.previous_buckets, reading.admission_wait_buckets)
        cluster.previous_buckets = reading.admission_wait_buckets
        p95: float | None = None
        if not first and window and any(window.values()):
            p95 = quantile(0.95, window.items())
        elif reading.pending_active > 0 and cluster.backlog is not None:
            p95 = cluster.backlog.admission_wait_p95_s  # none admitted while some wait: the wait goes on
        cluster.backlog = ClusterBacklog(pending_workloads=reading.pending_active, admission_wait_p95_s=p95)
        self._metrics.pending_workloads.labels(cluster_queue).set(reading.pending_active)

    @staticmethod
    def _kueue_session(config: Kueue) -> aiohttp.ClientSession:
        context: ssl.SSLContext | bool
        if config.insecure_skip_verify:
            context = False
        else:
            context = ssl.create_default_context(cafile=config.ca_file)
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=2))


def engine_sample(
    before: ServerReading, after: ServerReading, elapsed_s: float, signal: BackendSignal
) -> EngineSample:
    """The interval between two readings, as policies.concurrency_limit reads an engine."""
    old, new = before.engine, after.engine
    if old is None or new is None:  # Triton: its queue, its queue time, its completions
        return EngineSample(after.waiting, queue_s=signal.queue_wait_s, throughput=signal.completions_per_s)
    tokens = None
    if new.generation_tokens is not None:
        tokens = counter_increase(old.generation_tokens, new.generation_tokens) / elapsed_s
    preempted = 0.0
    if new.preemptions is not None:
        preempted = counter_increase(old.preemptions, new.preemptions)
    return EngineSample(
        waiting=after.waiting,
        preempted=preempted,
        ttft_s=_interval_mean(old.ttft, new.ttft),
        itl_s=_interval_mean(old.itl, new.itl),
        throughput=tokens,
        queue_s=_interval_mean(old.queue_time, new.queue_time),
    )


def _interval_mean(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """A histogram's mean over the interval: None when nothing was observed in it (or on a reset)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


async def _fetch(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> Exposition:
    async with session.get(url, headers=headers) as reply:
        if reply.status != 200:
            raise ScrapeError(f"{url} answered {reply.status}")
        return Exposition.parse(await reply.text())
