"""The backends' own metrics and Kueue's drive admission: bypass traffic, stale sources, backlogs."""

from __future__ import annotations

import asyncio
import gc
import ssl
import time

import aiohttp
import pytest
from aiohttp import web

from tests.eventually import eventually
from tests.integration.servers import gateway_config
from tests.redis_server import free_port

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
LEADER = 'replica_role="leader"'  # only from Kueue v0.16 on: parsers must not need it
FAST_SIGNALS = {"scrape_interval_ms": 100, "scrape_timeout_ms": 500, "stale_after_failures": 2}


async def infer(url, **headers):
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v2/models/sim/infer", json=INFER, headers=headers) as reply,
    ):
        return reply.status, dict(reply.headers), await reply.json(content_type=None)


def signal_config(sim, metrics_url, **overrides):
    config = gateway_config([(sim.url, 1)], expected_service_ms=100, signals=FAST_SIGNALS, **overrides)
    config["models"][0]["backends"][0]["metrics_url"] = metrics_url
    config["priorities"] = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]
    return config


async def test_requests_that_bypass_the_gateway_make_it_refuse_sooner(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=100)
    gateway = start_gateway(signal_config(sim, sim.metrics_url))
    await eventually(
        lambda: gateway.metric("gateway_signal_up", source=sim.metrics_url) == 1, what="scraping"
    )
    assert (await infer(gateway.url, **{"X-Request-Timeout-Ms": "800"}))[0] == 200

    async with aiohttp.ClientSession() as http:
        # 30 at 100 ms each: the backend's queue stays at 8 or more for 2 s, time enough for the
        # gateway's scrapes (and this test's) to see it on a slow machine.
        bypass = [
            asyncio.ensure_future(http.post(sim.url + "/v2/models/sim/infer", json=INFER)) for _ in range(30)
        ]
        await eventually(lambda: gateway.metric("gateway_backend_queue") >= 8, what="the backend's queue")
        started = time.monotonic()
        status, headers, body = await infer(gateway.url, **{"X-Request-Timeout-Ms": "800"})
        refused_in = time.monotonic() - started
        saturation = gateway.metric("gateway_backend_saturation")
        for reply in await asyncio.gather(*bypass):
            reply.release()
    # 8 or more requests ahead inside the backend at 10 per second: it cannot finish within 800 ms.
    assert (status, body["reason"]) == (429, "deadline_unmeetable")
    assert int(headers["retry-after-ms"]) > 0
    assert refused_in < 0.5  # refused at arrival, not after waiting behind them
    assert saturation > 1  # the backend runs and queues more than its one slot
    await eventually(lambda: gateway.metric("gateway_backend_queue") == 0, what="the queue to drain")
    assert (await infer(gateway.url, **{"X-Request-Timeout-Ms": "800"}))[0] == 200


async def serve(app: web.Application, ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    """`app` on a free port of 127.0.0.1: its runner (to clean up) and the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context).start()
    return runner, port


class FakeVllm:
    """A vLLM-style /metrics reporting `waiting` queued requests, or answering 500 while `failing`."""

    def __init__(self) -> None:
        self.waiting = 0.0
        self.failing = False

    async def metrics(self, request: web.Request) -> web.Response:
        if self.failing:
            return web.Response(status=500, text="engine gone")
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="served-name"}} {self.waiting}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="served-name"} 1.0\n'
        )
        return web.Response(text=text)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}/metrics"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def test_a_stale_metrics_source_falls_back_to_the_gateways_own_counts(start_sim, start_gateway):
    vllm = FakeVllm()
    url = await vllm.start()
    try:
        sim = start_sim(slots=1, base_ms=10)
        gateway = start_gateway(signal_config(sim, url))
        vllm.waiting = 6.0
        await eventually(lambda: gateway.assert_metric("gateway_backend_queue", 6))
        vllm.failing = True
        await eventually(lambda: gateway.assert_metric("gateway_signal_up", 0, source=url))
        # Its last report no longer counts: nothing waits inside the backend, and with nothing in
        # flight the pool is idle by the gateway's own count.
        assert gateway.metric("gateway_backend_queue") == 0
        assert gateway.metric("gateway_backend_saturation") == 0
        assert (await infer(gateway.url, **{"X-Request-Timeout-Ms": "800"}))[0] == 200
    finally:
        await vllm.stop()


async def test_a_metrics_source_that_never_answers_holds_no_request_back(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=10)
    dead_url = f"http://127.0.0.1:{free_port()}/metrics"
    gateway = start_gateway(signal_config(sim, dead_url))
    assert gateway.metric("gateway_signal_up", source=dead_url) == 0
    assert gateway.metric("gateway_backend_queue") == 0
    assert (await infer(gateway.url, **{"X-Request-Timeout-Ms": "800"}))[0] == 200


async def test_vllm_metrics_feed_the_backend_queue(start_sim, start_gateway):
    vllm = FakeVllm()
    url = await vllm.start()
    try:
        sim = start_sim(slots=1, base_ms=10)
        gateway = start_gateway(signal_config(sim, url))
        vllm.waiting = 6.0
        await eventually(lambda: gateway.assert_metric("gateway_backend_queue", 6))
        assert gateway.metric("gateway_backend_saturation") == pytest.approx(7.0)
    finally:
        await vllm.stop()


class FakeKueue:
    """Kueue's controller metrics over HTTPS with a bearer-token check, as the real one serves them."""

    def __init__(self, cert, key, token: str | None) -> None:
        self.cert, self.key, self.token = cert, key, token
        self.pending = 0
        self.wait_buckets = {1.0: 0, 2.5: 0, 5.0: 0, 10.0: 0, 20.0: 0, 40.0: 0, 80.0: 0, float("inf"): 0}

    def admit(self, count: int, wait_s: float) -> None:
        for bound in self.wait_buckets:
            if wait_s <= bound:
                self.wait_buckets[bound] += count

    async def metrics(self, request: web.Request) -> web.Response:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401, text="Unauthorized")
        lines = [
            "# TYPE kueue_pending_workloads gauge",
            f'kueue_pending_workloads{{cluster_queue="gpu-serving",{LEADER},status="active"}} {self.pending}',
            f'kueue_pending_workloads{{cluster_queue="gpu-serving",{LEADER},status="inadmissible"}} 2',
            "# TYPE kueue_admission_wait_time_seconds histogram",
        ]
        for bound, count in self.wait_buckets.items():
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(
                f'kueue_admission_wait_time_seconds_bucket{{cluster_queue="gpu-serving",priority_class="p",'
                f'replica_role="leader",le="{le}"}} {count}'
            )
        return web.Response(text="\n".join(lines) + "\n")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        self.runner, port = await serve(app, context)
        return f"https://127.0.0.1:{port}/metrics"

    async def stop(self) -> None:
        """Stop serving, and let the collector take the TLS sockets asyncio leaves behind now.

        asyncio's SSL server transports of connections the gateway still held open (and of refused
        handshakes) are left to the garbage collector unclosed; collected later they would warn
        during some other test. They are this fake server's, not the gateway's (another process).
        """
        await self.runner.cleanup()
        # Not a wait for state the test could observe: it lets the loop run the closing callbacks
        # asyncio scheduled for those transports, so that what is left is garbage by now.
        await asyncio.sleep(0.05)
        gc.collect()


# See FakeKueue.stop.
_FAKE_KUEUE_SOCKETS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_FAKE_KUEUE_SOCKETS
async def test_kueue_backlog_sheds_the_least_urgent_class(start_sim, start_gateway, tls_cert, tmp_path):
    cert, key = tls_cert
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    kueue = FakeKueue(cert, key, "s3cret-token")
    url = await kueue.start()
    try:
        sim = start_sim(slots=2, base_ms=10)
        config = gateway_config([(sim.url, 2)], signals=FAST_SIGNALS)
        config["kueue"] = {
            "url": url,
            "cluster_queue": "gpu-serving",
            "bearer_token_file": str(token_file),
            "ca_file": str(cert),
            "backlog_pending_workloads": 5,
            "backlog_admission_wait_p95_s": 600,
        }
        gateway = start_gateway(config)
        await eventually(lambda: gateway.metric("gateway_signal_up", source="kueue") == 1, what="Kueue")
        assert (await infer(gateway.url, **{"X-Priority": "low"}))[0] == 200

        kueue.pending = 20  # four times the limit: of two classes, low is shed
        kueue.admit(10, wait_s=35.0)
        await eventually(
            lambda: gateway.metric("gpu_queue_waiting_workloads", cluster_queue="gpu-serving") == 20,
            what="the backlog",
        )
        status, headers, body = await infer(gateway.url, **{"X-Priority": "low"})
        assert (status, body["reason"]) == (429, "cluster_backlogged")
        assert int(headers["retry-after-ms"]) >= 30_000  # the cluster's own admission wait, p95 in (20, 40]
        assert (await infer(gateway.url, **{"X-Priority": "high"}))[0] == 200

        kueue.token = "rotated-elsewhere"  # the gateway's token is no longer accepted
        await eventually(lambda: gateway.metric("gateway_signal_up", source="kueue") == 0, what="staleness")
        # Stale, the backlog is unknown: admission falls back to the gateway's own counts.
        assert (await infer(gateway.url, **{"X-Priority": "low"}))[0] == 200

        kueue.token = "s3cret-token"
        kueue.pending = 1
        await eventually(
            lambda: gateway.metric("gpu_queue_waiting_workloads", cluster_queue="gpu-serving") == 1,
            what="recovery",
        )
        assert (await infer(gateway.url, **{"X-Priority": "low"}))[0] == 200
    finally:
        await kueue.stop()


@_FAKE_KUEUE_SOCKETS
async def test_kueue_with_an_untrusted_certificate_is_refused_unless_told_otherwise(
    start_sim, start_gateway, tls_cert
):
    cert, key = tls_cert
    kueue = FakeKueue(cert, key, token=None)
    url = await kueue.start()
    try:
        sim = start_sim(slots=1, base_ms=10)
        base = {"url": url, "cluster_queue": "gpu-serving"}
        strict = start_gateway({**gateway_config([(sim.url, 1)], signals=FAST_SIGNALS), "kueue": base})
        lax = start_gateway(
            {
                **gateway_config([(sim.url, 1)], signals=FAST_SIGNALS),
                "kueue": {**base, "insecure_skip_verify": True},
            }
        )
        await eventually(lambda: lax.metric("gateway_signal_up", source="kueue") == 1, what="the lax scrape")
        assert strict.metric("gateway_signal_up", source="kueue") == 0  # self-signed: not trusted
    finally:
        await kueue.stop()


class FakePages:
    """Metrics pages at /<name>/metrics: Triton's format, `waiting` per model on each page; and a
    Triton model API whose model config is not JSON (a proxy's error page, say)."""

    def __init__(self) -> None:
        self.pages: dict[str, dict[str, float]] = {}

    async def metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE nv_inference_pending_request_count gauge"]
        for model, waiting in self.pages.get(request.match_info["name"], {}).items():
            lines.append(f'nv_inference_pending_request_count{{model="{model}",version="1"}} {waiting}')
        return web.Response(text="\n".join(lines) + "\n")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/{name}/metrics", self.metrics)
        app.router.add_get("/v2/health/ready", _ok)
        app.router.add_get("/v2/models/{model}/ready", _ok)
        app.router.add_get("/v2/models/{model}/config", _not_json)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def _ok(request: web.Request) -> web.Response:
    return web.Response()


async def _not_json(request: web.Request) -> web.Response:
    return web.Response(text="<html>Bad gateway</html>")


def two_models(sim, urls: tuple[str, str]) -> dict:
    config = signal_config(sim, urls[0])
    other = {**config["models"][0], "name": "other", "backends": [dict(config["models"][0]["backends"][0])]}
    other["backends"][0]["metrics_url"] = urls[1]
    config["models"].append(other)
    return config


async def test_every_models_backends_are_scraped_on_their_own_pages_and_on_a_shared_one(
    start_sim, start_gateway
):
    fake = FakePages()
    base = await fake.start()
    try:
        sim = start_sim(slots=1, base_ms=10)
        fake.pages = {"a": {"sim": 3.0}, "b": {"other": 5.0}, "both": {"sim": 2.0, "other": 7.0}}
        for urls, expected in [
            ((f"{base}/a/metrics", f"{base}/b/metrics"), {"sim": 3, "other": 5}),
            ((f"{base}/both/metrics", f"{base}/both/metrics"), {"sim": 2, "other": 7}),
        ]:
            gateway = start_gateway(two_models(sim, urls))
            for model, waiting in expected.items():
                await eventually(
                    lambda g=gateway, m=model, w=waiting: (
                        g.metric_by("gateway_backend_queue", "model")[m] == w
                    ),
                    what=f"{model}'s queue",
                )
            fake.pages = {name: {m: w + 1 for m, w in page.items()} for name, page in fake.pages.items()}
            for model, waiting in expected.items():  # and kept up to date, every one
                await eventually(
                    lambda g=gateway, m=model, w=waiting: (
                        g.metric_by("gateway_backend_queue", "model")[m] == w + 1
                    ),
                    what=f"{model}'s queue to move",
                )
            fake.pages = {"a": {"sim": 3.0}, "b": {"other": 5.0}, "both": {"sim": 2.0, "other": 7.0}}
    finally:
        await fake.stop()


async def test_a_page_without_the_model_is_an_unknown_queue_not_an_empty_one(start_sim, start_gateway):
    fake = FakePages()
    base = await fake.start()
    try:
        sim = start_sim(slots=1, base_ms=10)
        fake.pages = {"a": {"sim": 4.0}}
        gateway = start_gateway(signal_config(sim, f"{base}/a/metrics"))
        await eventually(lambda: gateway.assert_metric("gateway_backend_queue", 4))
        fake.pages = {"a": {"unloaded-elsewhere": 1.0}}  # the model is not on the page any more
        await eventually(lambda: "reports nothing of model 'sim'" in gateway.log(), what="the warning")
        assert gateway.metric("gateway_signal_up", source=f"{base}/a/metrics") == 1  # the page is fine
        assert gateway.metric("gateway_backend_queue") == 0  # its last report no longer counts
    finally:
        await fake.stop()


async def test_a_triton_backend_whose_model_config_is_no_json_does_not_stop_the_gateway(start_gateway):
    fake = FakePages()
    base = await fake.start()
    try:
        config = gateway_config([(base, 1)])
        config["models"][0]["backends"][0]["kind"] = "triton"
        gateway = await asyncio.to_thread(start_gateway, config)  # its lifespan ran discovery
        assert "discovery of sim at" in gateway.log()
    finally:
        await fake.stop()


@_FAKE_KUEUE_SOCKETS
async def test_kueue_history_before_the_gateway_and_a_spent_backlog_shed_nothing(
    start_sim, start_gateway, tls_cert
):
    """The admission wait that sheds is this interval's: not the controller's history at the first
    scrape, and not an old interval's once nothing waits."""
    cert, key = tls_cert
    kueue = FakeKueue(cert, key, token=None)
    kueue.admit(5, wait_s=70.0)  # long ago, before the gateway started
    url = await kueue.start()
    try:
        sim = start_sim(slots=2, base_ms=10)
        config = gateway_config([(sim.url, 2)], signals=FAST_SIGNALS)
        config["kueue"] = {
            "url": url,
            "cluster_queue": "gpu-serving",
            "insecure_skip_verify": True,
            "backlog_pending_workloads": 5,
            "backlog_admission_wait_p95_s": 30,
        }
        gateway = start_gateway(config)
        await eventually(lambda: gateway.metric("gateway_signal_up", source="kueue") == 1, what="Kueue")
        assert (await infer(gateway.url, **{"X-Priority": "low"}))[0] == 200

        kueue.admit(4, wait_s=70.0)  # now: admitted after waiting past the limit
        kueue.pending = 3
        await eventually(lambda: waiting_workloads(gateway) == 3, what="the scrape that saw them")
        assert (await infer(gateway.url, **{"X-Priority": "low"}))[0] == 429
        kueue.pending = 0  # nothing waits, nothing more admitted: the backlog is spent
        await eventually(lambda: waiting_workloads(gateway) == 0, what="the scrape that saw it spent")
        assert (await infer(gateway.url, **{"X-Priority": "low"}))[0] == 200
    finally:
        await kueue.stop()


def waiting_workloads(gateway) -> float:
    return gateway.metric("gpu_queue_waiting_workloads", cluster_queue="gpu-serving")


@_FAKE_KUEUE_SOCKETS
async def test_a_scrape_that_fails_in_any_way_counts_toward_staleness(
    start_sim, start_gateway, tls_cert, tmp_path
):
    """The bearer token's file gone (an OSError, not an HTTP failure): the source goes stale, rather
    than its loop being restarted for ever while it still reads as up."""
    cert, key = tls_cert
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    kueue = FakeKueue(cert, key, "s3cret-token")
    url = await kueue.start()
    try:
        sim = start_sim(slots=1, base_ms=10)
        config = gateway_config([(sim.url, 1)], signals=FAST_SIGNALS)
        config["kueue"] = {"url": url, "cluster_queue": "gpu-serving", "bearer_token_file": str(token_file)}
        config["kueue"]["ca_file"] = str(cert)
        gateway = start_gateway(config)
        await eventually(lambda: gateway.metric("gateway_signal_up", source="kueue") == 1, what="Kueue")
        token_file.unlink()
        await eventually(lambda: gateway.metric("gateway_signal_up", source="kueue") == 0, what="staleness")
        assert "is stale after" in gateway.log()
    finally:
        await kueue.stop()
