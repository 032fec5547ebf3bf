"""Traces with a real OTLP/HTTP receiver the test runs (decoded with opentelemetry-proto): spans
in the client's trace, the queue wait a span of its own, the backend told the gateway's upstream
span as its parent, a refusal's span an error; over HTTP and gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.eventually import eventually
from tests.integration.servers import gateway_config
from tests.integration.test_backpressure import (
    clear_the_fault,
    hang_the_backend,
    wait_for_hanging,
    wait_for_metric,
)

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: the spans it was sent, by name."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.resources: list[dict[str, str]] = []

    async def export(self, request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in message.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            self.resources.append(attributes)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    def in_trace(self, trace_id: str) -> dict[str, trace_pb2.Span]:
        return {span.name: span for span in self.spans if span.trace_id.hex() == trace_id}


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", found.export)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield found, f"http://127.0.0.1:{port}/v1/traces"
    finally:
        await runner.cleanup()


def traced_env(endpoint: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms, so that the test waits little
        "OTEL_SERVICE_NAME": "gateway-under-test",
    }


async def test_a_request_is_traced_in_the_clients_trace_with_its_queue_wait_and_its_upstream_call(
    start_sim, start_gateway, receiver
):
    found, endpoint = receiver
    sim = start_sim(slots=1, base_ms=20)
    gateway = start_gateway(gateway_config([(sim.url, 1)]), env=traced_env(endpoint))
    url = gateway.url + "/v2/models/sim/infer"
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    async with aiohttp.ClientSession() as http:
        await hang_the_backend(sim)  # the first holds the slot, so that the traced one queues
        first = asyncio.ensure_future(http.post(url, json=INFER))
        await wait_for_hanging(sim, 1)
        traced = asyncio.ensure_future(http.post(url, json=INFER, headers={"traceparent": traceparent}))
        await wait_for_metric(gateway, "gateway_queue_depth", 1.0, priority="low")
        await clear_the_fault(sim)
        for reply in await asyncio.gather(first, traced):
            assert reply.status == 200
            reply.release()

    def all_three() -> bool:
        return {"POST infer", "queue wait", "POST upstream"} <= set(found.in_trace(CLIENT_TRACE))

    await eventually(all_three, what="the request's three spans at the receiver")
    spans = found.in_trace(CLIENT_TRACE)
    server, queue, upstream = (spans[n] for n in ("POST infer", "queue wait", "POST upstream"))
    assert server.parent_span_id.hex() == CLIENT_SPAN and server.kind == trace_pb2.Span.SPAN_KIND_SERVER
    for child in (queue, upstream):
        assert child.parent_span_id == server.span_id, child.name
    assert upstream.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    # The admission decision is the server span's: the request's class, tenant and cost, the verdict.
    decision = _attributes(server)
    assert decision["gateway.decision"] == "admitted"
    assert decision["gateway.class"] == "low" and decision["gateway.cost"] == 1.0
    assert decision["gateway.admission_ms"] >= 0
    # The queue wait is its own span, ending before the upstream call starts.
    assert queue.end_time_unix_nano - queue.start_time_unix_nano > 0
    assert queue.end_time_unix_nano <= upstream.start_time_unix_nano
    # The backend was told the gateway's upstream span as its parent, in the client's trace.
    sent = [t for t in sim.stats()["traceparents"] if CLIENT_TRACE in t]
    assert sent == [f"00-{CLIENT_TRACE}-{upstream.span_id.hex()}-01"]
    assert found.resources[0]["service.name"] == "gateway-under-test"


async def test_the_queue_wait_and_upstream_histograms_keep_a_sampled_traces_id_as_their_exemplar(
    start_sim, start_gateway, receiver
):
    _, endpoint = receiver
    sim = start_sim(slots=1, base_ms=20)
    gateway = start_gateway(gateway_config([(sim.url, 1)]), env=traced_env(endpoint))
    async with aiohttp.ClientSession() as http:
        headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        async with http.post(gateway.url + "/v2/models/sim/infer", json=INFER, headers=headers) as reply:
            assert reply.status == 200
        # An unsampled client trace leaves no exemplar of its own.
        unsampled = {"traceparent": f"00-{'ab' * 16}-{CLIENT_SPAN}-00"}
        async with http.post(gateway.url + "/v2/models/sim/infer", json=INFER, headers=unsampled) as reply:
            assert reply.status == 200
        accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
        async with http.get(gateway.url + "/metrics", headers=accept) as reply:
            assert reply.content_type == "application/openmetrics-text"
            exposition = await reply.text()
    exemplars: dict[str, set[str]] = {}
    for family in openmetrics_families(exposition):  # the whole exposition parses as OpenMetrics
        for sample in family.samples:
            if sample.exemplar is not None:
                exemplars.setdefault(family.name, set()).add(sample.exemplar.labels["trace_id"])
    assert exemplars["gateway_queue_wait_seconds"] == {CLIENT_TRACE}
    assert exemplars["gateway_upstream_latency_seconds"] == {CLIENT_TRACE}
    async with aiohttp.ClientSession() as http:  # the text format stays the default
        async with http.get(gateway.url + "/metrics") as reply:
            assert reply.content_type == "text/plain" and "# {" not in await reply.text()


async def test_a_batchs_call_is_one_span_linked_to_each_members_trace(start_sim, start_gateway, receiver):
    import numpy as np
    import tritonclient.http.aio as triton

    from tests.integration.test_batching import batching_config, hold_the_slot, infer, let_go, queued, rows

    found, endpoint = receiver
    sim = start_sim(slots=4, base_ms=20)
    gateway = start_gateway(batching_config(sim), env=traced_env(endpoint))
    members = {"a" * 32: "m-a", "b" * 32: "m-b"}  # each its own client trace
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        blocker = await hold_the_slot(client, sim)
        sent = [
            asyncio.ensure_future(
                infer(client, rows(1, n), request_id, headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
            )
            for n, (trace, request_id) in enumerate(members.items())
        ]
        await queued(gateway, 2)
        await let_go(sim)
        await blocker
        for result in await asyncio.gather(*sent):
            assert np.asarray(result.as_numpy("OUTPUT0")).shape == (1, 3)
    finally:
        await client.close()

    def batch_span():
        return next((span for span in found.spans if span.name == "batch"), None)

    await eventually(lambda: batch_span() is not None, what="the batch's span at the receiver")
    batch = batch_span()
    assert {link.trace_id.hex() for link in batch.links} == set(members)
    assert batch.trace_id.hex() in members  # in its first member's trace
    attributes = {a.key: a.value.int_value for a in batch.attributes}
    assert attributes == {"gateway.batch.members": 2, "gateway.batch.rows": 2}
    await eventually(lambda: "POST upstream" in found.in_trace(batch.trace_id.hex()), what="its call's span")
    call = found.in_trace(batch.trace_id.hex())["POST upstream"]
    assert call.parent_span_id == batch.span_id
    # The backend was told the batch's call as its parent.
    assert f"00-{batch.trace_id.hex()}-{call.span_id.hex()}-01" in sim.stats()["traceparents"]


async def test_a_refused_request_is_an_error_span_with_its_reason_and_advice(
    start_sim, start_gateway, receiver
):
    found, endpoint = receiver
    sim = start_sim(slots=1, base_ms=400)
    config = gateway_config([(sim.url, 1)], expected_service_ms=400)
    config["priorities"] = [{"name": "high", "max_wait_ms": 50}, {"name": "low", "max_wait_ms": 50}]
    config["grpc_listen"] = {"host": "127.0.0.1", "port": 0}
    gateway = start_gateway(config, env=traced_env(endpoint))
    async with aiohttp.ClientSession() as http:
        replies = await asyncio.gather(
            *(http.post(gateway.url + "/v2/models/sim/infer", json=INFER) for _ in range(4))
        )
        statuses = [r.status for r in replies]
        for reply in replies:
            reply.release()
    assert 429 in statuses
    async with grpc.aio.insecure_channel(gateway.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="sim")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
        calls = await asyncio.gather(*(stub.ModelInfer(request) for _ in range(3)), return_exceptions=True)
    assert any(isinstance(c, grpc.aio.AioRpcError) for c in calls)

    def refused_spans() -> list:
        servers = [s for s in found.spans if s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
        return [s for s in servers if _attributes(s).get("gateway.decision") == "refused"]

    def both_ingresses() -> bool:
        names = {s.name for s in refused_spans()}
        return names == {"POST infer", "inference.GRPCInferenceService/ModelInfer"}

    await eventually(both_ingresses, what="the refusals' server spans, over HTTP and gRPC")
    for server in refused_spans():
        attributes = _attributes(server)
        assert attributes["gateway.reason"] in {"queue_full", "deadline_unmeetable"}
        assert attributes["gateway.retry_after_s"] > 0
        assert server.status.code == trace_pb2.Status.STATUS_CODE_ERROR
        # A refusal's trace is its server span alone: nothing waited, nothing went upstream.
        assert [s.name for s in found.spans if s.parent_span_id == server.span_id] == []


def _attributes(span: trace_pb2.Span) -> dict[str, object]:
    found: dict[str, object] = {}
    for attribute in span.attributes:
        value = attribute.value
        found[attribute.key] = getattr(value, value.WhichOneof("value"))
    return found


def test_traces_are_off_without_an_endpoint(tmp_path):
    from gateway.telemetry.tracing import tracing_from_environment

    assert tracing_from_environment() is None  # the suite sets no OTEL_EXPORTER_OTLP_* variable


async def test_an_openai_calls_upstream_span_follows_the_genai_conventions(
    start_sim, start_gateway, receiver
):
    found, endpoint = receiver
    sim = start_sim(slots=2, base_ms=5, token_ms=1)
    gateway = start_gateway(gateway_config([(sim.url, 2)]), env=traced_env(endpoint))
    chat = {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            gateway.url + "/v1/chat/completions", json=chat, headers={"traceparent": traceparent}
        ) as reply,
    ):
        assert reply.status == 200
        usage = (await reply.json())["usage"]
    await eventually(lambda: "chat sim" in found.in_trace(CLIENT_TRACE), what="the upstream span 'chat sim'")
    upstream = found.in_trace(CLIENT_TRACE)["chat sim"]
    attributes = _attributes(upstream)
    assert upstream.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    assert (attributes["gen_ai.operation.name"], attributes["gen_ai.request.model"]) == ("chat", "sim")
    assert attributes["http.response.status_code"] == 200

    # The engine's token counts, on the server span (the answer is read after the call's span ended).
    def server_span() -> trace_pb2.Span | None:
        spans = found.in_trace(CLIENT_TRACE).values()
        return next((span for span in spans if span.kind == trace_pb2.Span.SPAN_KIND_SERVER), None)

    await eventually(lambda: server_span() is not None, what="the server span")
    served = _attributes(server_span())
    assert served["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert served["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 3
