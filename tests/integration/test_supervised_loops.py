"""Every background loop of the gateway survives a crash: it restarts and does its job again."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.programs.app import build_runtime, create_app
from gateway.programs.runtime import Runtime
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Autoscaling, Estimation, Settings, Signals, parse_settings
from gateway.signals.scraper import SignalBoard, SourceState
from gateway.supervision import Backoff, Supervisor
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.scaling import ScalingHints
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.discovery import TritonDiscovery, TritonModel
from gateway.upstream.endpoints import EndpointDiscovery
from tests.eventually import eventually
from tests.faults import HeldDown, fail_once
from tests.redis_server import redis_url_or_skip, unique_prefix

pytestmark = pytest.mark.anyio

VLLM_METRICS = (Path(__file__).parent.parent / "data" / "vllm-sample.txt").read_text()
VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FAST = Backoff(first_s=0.01, max_s=0.05)


class Backend:
    """A backend on 127.0.0.1 that answers its readiness path and serves vLLM metrics."""

    def __init__(self) -> None:
        self.health_hits = 0
        self.url = ""

    async def _ready(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Backend]:
        app = web.Application()
        app.router.add_get("/v2/health/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        try:
            yield self
        finally:
            await runner.cleanup()


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    async with Backend().running() as running:
        yield running


@pytest.fixture
async def supervisor() -> AsyncIterator[Supervisor]:
    supervisor = Supervisor(backoff=FAST)
    yield supervisor
    await supervisor.stop()


def settings_for(backend: Backend, **extra: Any) -> Settings:
    return parse_settings(
        {
            "priorities": [{"name": "low", "max_wait_ms": 1000}],
            "default_priority": "low",
            "models": [
                {
                    "name": "m",
                    "backends": [
                        {"url": backend.url, "max_concurrency": 2, "metrics_url": backend.url + "/metrics"}
                    ],
                }
            ],
            "health": {"interval_ms": 20, "timeout_ms": 1000},
            **extra,
        }
    )


@asynccontextmanager
async def serving(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(runtime.settings, runtime=runtime)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                yield client
    finally:
        gc.unfreeze()  # the lifespan freezes what it built; a test process goes on


def loop_sample(registry: CollectorRegistry, metric: str, loop: str) -> float | None:
    return registry.get_sample_value(metric, {"loop": loop})


async def test_the_gateway_runs_its_loops_supervised_and_exports_that_they_are_up(backend):
    registry = CollectorRegistry()
    runtime = build_runtime(settings_for(backend), registry=registry)
    async with serving(runtime) as client:
        for loop in ("health", "triton_discovery", "scaling_hints", "signal_scrape"):
            assert loop_sample(registry, "gateway_loop_up", loop) == 1.0, loop
            assert loop_sample(registry, "gateway_loop_restarts_total", loop) == 0.0, loop
        reply = await client.get("/readyz")
        assert reply.status_code == 200
        assert reply.json()["loops_down"] == []


async def test_the_health_checker_restarts_after_a_crash_and_checks_again(backend, monkeypatch):
    registry = CollectorRegistry()
    runtime = build_runtime(settings_for(backend), registry=registry, supervisor=Supervisor(backoff=FAST))
    async with serving(runtime):
        assert runtime.health is not None
        calls = fail_once(runtime.health, "check_all", monkeypatch)
        await eventually(lambda: len(calls) >= 1, what="the injected crash")
        hits = backend.health_hits
        await eventually(lambda: backend.health_hits > hits, what="a health check after the restart")
        assert loop_sample(registry, "gateway_loop_restarts_total", "health") == 1.0
        assert loop_sample(registry, "gateway_loop_up", "health") == 1.0


async def test_triton_discovery_restarts_after_a_crash_and_reads_the_model_again(supervisor, monkeypatch):
    backend = BackendState("m", "http://127.0.0.1:1", 0, "/v2/health/ready", kind="triton", served_model="m")
    backend.configured_slots = False
    pool = ModelPool(name="m", backends=[backend], expected_service_s=0.1)
    changed: list[str] = []
    discovery = TritonDiscovery([pool], changed.append, interval_s=0.01, timeout_s=1)

    async def read(backend: BackendState) -> TritonModel:
        return TritonModel(ready=True, instances=2, max_batch_size=4, dynamic_batching=True)

    monkeypatch.setattr(discovery, "_read", read)
    fail_once(discovery, "discover_all", monkeypatch)
    loop = await supervisor.start("triton_discovery", discovery.run)
    await eventually(lambda: backend.max_concurrency == 8, what="discovered slots")
    assert loop.restarts == 1 and changed == ["m"]


async def test_endpoint_discovery_restarts_after_a_crash_and_follows_the_name(supervisor):
    settings = parse_settings(
        {
            "priorities": [{"name": "low", "max_wait_ms": 1000}],
            "default_priority": "low",
            "models": [
                {
                    "name": "m",
                    "backends": [{"url": "http://pods:8000", "discover": "dns", "max_concurrency": 1}],
                }
            ],
        }
    )
    pool = ModelPool.from_settings(settings.models[0])
    calls: list[int] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure in resolve")  # not an OSError: the loop crashes
        return ["127.0.0.1", "127.0.0.2"]

    discovery = EndpointDiscovery(
        [pool], settings.models, lambda model: None, interval_s=0.01, timeout_s=1, resolve=resolve
    )
    loop = await supervisor.start("endpoint_discovery", discovery.run)
    await eventually(lambda: len(pool.backends) == 2, what="backends from the name")
    assert loop.restarts == 1


async def test_scaling_hints_restart_after_a_crash_and_update_again(supervisor, monkeypatch):
    pool = ModelPool(
        name="m",
        backends=[BackendState("m", "http://127.0.0.1:1", 2, "/", ready=True)],
        expected_service_s=0.1,
    )
    store = MemoryQueue([pool], 1, Estimation())
    hints = ScalingHints([pool], store, Autoscaling(interval_ms=10))
    calls = fail_once(hints, "update", monkeypatch)
    loop = await supervisor.start("scaling_hints", hints.run)
    await eventually(lambda: len(calls) >= 3, what="updates after the restart")
    assert loop.restarts == 1 and loop.up


async def test_a_signal_scraper_restarts_after_a_crash_and_scrapes_again(backend, supervisor, monkeypatch):
    target = BackendState(
        "m", backend.url, 2, "/v2/health/ready", metrics_url=backend.url + "/metrics", served_model=VLLM_MODEL
    )
    pool = ModelPool(name="m", backends=[target], expected_service_s=0.1)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    board = SignalBoard([pool], Signals(scrape_interval_ms=10), None, metrics, supervisor=supervisor)
    # The loop itself crashes (a failed scrape does not: it counts toward the source's staleness).
    fail_once(board, "_run", monkeypatch)
    async with aiohttp.ClientSession() as session:
        await board.start(session)
        try:
            # The backend is marked inside the scrape, the source's gauge once the scrape is over.
            up = {"source": target.metrics_url}
            await eventually(
                lambda: target.signal_up and registry.get_sample_value("gateway_signal_up", up) == 1.0,
                what="a scrape after the restart",
            )
            assert target.reported_waiting == 9.0  # the sample's two engines
            assert supervisor.restarts() == {"signal_scrape": 1}
        finally:
            await board.stop()


# -- the Redis store's loops, through the app ---------------------------------------------------


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    url = redis_url_or_skip()
    prefix = unique_prefix()
    yield prefix
    client = Redis.from_url(url)
    keys = [key async for key in client.scan_iter(match=f"{{{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.mark.redis
@pytest.mark.parametrize("loop", ["redis_upkeep", "redis_grants"])
async def test_readyz_is_503_naming_a_redis_loop_while_it_is_down(backend, redis_prefix, monkeypatch, loop):
    store = {"kind": "redis", "url": redis_url_or_skip(), "key_prefix": redis_prefix, "lease_ttl_ms": 600}
    runtime = build_runtime(settings_for(backend, store=store))
    async with serving(runtime) as client:
        await eventually(lambda: runtime.ready, what="ready")
        redis_store = runtime.store._redis  # type: ignore[attr-defined]
        held = HeldDown()
        monkeypatch.setattr(redis_store.supervisor, "sleep", held.sleep)
        if loop == "redis_upkeep":
            fail_once(redis_store, "_beat", monkeypatch)
        else:
            fail_once(redis_store._listener, "blmpop", monkeypatch)
        await eventually(lambda: held.waiting == 1, what=f"{loop} to crash")
        reply = await client.get("/readyz")
        assert reply.status_code == 503
        assert reply.json()["loops_down"] == [loop]
        held.release()
        await eventually(lambda: runtime.ready, what=f"{loop} back")
        reply = await client.get("/readyz")
        assert reply.status_code == 200 and reply.json()["loops_down"] == []


async def test_a_scrape_loop_cancelled_as_its_scrape_completes_stops(supervisor):
    # The cancellation lands while the scrape is finishing: Python 3.11's asyncio.wait_for returned
    # the scrape's result instead and the loop went on forever, so that stopping it hung.
    pool = ModelPool(name="m", backends=[], expected_service_s=0.1)
    metrics = GatewayMetrics(CollectorRegistry())
    board = SignalBoard([pool], Signals(scrape_interval_ms=10), None, metrics, supervisor=supervisor)
    scrapes = 0
    loop_task: asyncio.Task[None] | None = None

    async def scrape(session: aiohttp.ClientSession, state: SourceState) -> None:
        nonlocal scrapes
        scrapes += 1
        assert loop_task is not None
        loop_task.cancel()  # then returns at once: done before the cancellation is seen

    async with aiohttp.ClientSession() as session:
        loop_task = asyncio.ensure_future(
            board._run(session, SourceState("s"), scrape, task_status=anyio.TASK_STATUS_IGNORED)
        )
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(loop_task), 5)
    assert scrapes == 1


async def test_a_backend_that_is_gone_leaves_no_rates_behind(backend, supervisor):
    """Endpoint churn: the rates of a backend gone go with it (its id may be a new backend's)."""
    targets = [
        BackendState(
            "m", url, 2, "/v2/health/ready", metrics_url=backend.url + "/metrics", served_model=VLLM_MODEL
        )
        for url in (backend.url, backend.url + "/")
    ]
    pool = ModelPool(name="m", backends=list(targets), expected_service_s=0.1)
    board = SignalBoard(
        [pool],
        Signals(scrape_interval_ms=10),
        None,
        GatewayMetrics(CollectorRegistry()),
        supervisor=supervisor,
    )
    async with aiohttp.ClientSession() as session:
        await board.start(session)
        try:
            await eventually(lambda: len(board.backend_signals) == 2, what="both backends' rates")
            pool.backends.remove(targets[1])
            board.follow("m")
            assert set(board.backend_signals) == {id(targets[0])}
        finally:
            await board.stop()
