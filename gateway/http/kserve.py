"""KServe v2 / Triton HTTP routes: inference through admission, the rest passed through or answered here."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorStyle
from gateway.flow.drain import DRAINING_RETRY_S, Drain
from gateway.flow.readiness import Readiness
from gateway.flow.request_meta import Problem, RequestClassifier
from gateway.http.asgi_io import read_body, send_response
from gateway.http.batches import batch_part
from gateway.http.intake import AdmittedEndpoint, upstream_request
from gateway.http.pricing import batch_items, json_part, request_parameter, request_parameters
from gateway.http.relay import send_error
from gateway.telemetry.access_log import AccessLog, AccessRecord
from gateway.telemetry.metrics import GatewayMetrics
from gateway.upstream.backends import ModelPool
from gateway.upstream.client import HeaderRules, downstream_response_headers
from gateway.upstream.exchange import Forwarder
from gateway.upstream.reply import UpstreamError
from gateway.version import package_version
from policies.outcomes import Outcome
from policies.sequences import sequence_of


class InferEndpoint(AdmittedEndpoint):
    """POST /v2/models/{model}[/versions/{version}]/infer: the body passes byte for byte."""

    style = ErrorStyle.KSERVE

    def route(self, scope: Scope) -> str:
        return "infer"

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        intake = self.intake
        # The key first: a caller without one must not learn which model names exist.
        meta = intake.classifier.classify(scope["headers"])
        if isinstance(meta, Problem):
            await self.fail(scope, send, meta.outcome, detail=meta.detail)
            return
        model = scope["path_params"]["model"]
        pool = intake.pools.get(model)
        if pool is None:
            await self.fail(scope, send, Outcome.UNKNOWN_MODEL, priority=meta.priority, detail=repr(model))
            return
        body = await read_body(scope, receive, intake.max_body_bytes)
        if isinstance(body, Outcome):
            await self.fail(scope, send, body, model=model, priority=meta.priority)
            return
        if intake.classifier.reads_levels and not any(k == b"x-priority" for k, _ in scope["headers"]):
            meta = intake.classifier.at_level(meta, request_parameter(body, scope["headers"], "priority"))
            if isinstance(meta, Problem):
                await self.fail(scope, send, meta.outcome, model=model, detail=meta.detail)
                return
        if pool.pins_sequences and b"sequence_id" in json_part(body, scope["headers"]):
            sequence = sequence_of(request_parameters(body, scope["headers"]))
            if isinstance(sequence, str):
                await self.fail(scope, send, Outcome.BAD_REQUEST, model=model, detail=sequence)
                return
            meta = replace(meta, sequence=sequence)
        limits = pool.batch_limits
        part = None if limits is None else batch_part(scope, body, limits, intake.header_rules)
        if part is not None and limits is not None:
            admitted = self.admit(scope, receive, send, pool, meta, body, part.rows, (part, limits))
        else:
            cost = batch_items(body, scope["headers"]) if pool.priced_by_items else 1.0
            admitted = self.admit(scope, receive, send, pool, meta, body, cost)
        del body  # the exchange holds it now, and gives it up once it is serialized
        await admitted


class ModelPassthrough:
    """Model metadata, config and readiness: forwarded to a ready backend, no slot taken."""

    def __init__(
        self,
        pools: Mapping[str, ModelPool],
        forwarder: Forwarder,
        metrics: GatewayMetrics,
        drain: Drain,
        *,
        no_backend_retry_s: float,
        header_rules: HeaderRules,
        classifier: RequestClassifier,
        access: AccessLog | None = None,
    ) -> None:
        self._access = access
        self._header_rules = header_rules
        self._classifier = classifier
        self._pools = pools
        self._forwarder = forwarder
        self._metrics = metrics
        self._drain = drain
        self._no_backend_retry_s = no_backend_retry_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Counted in the drain like admitted requests, so that its cut answers a hung backend's
        # metadata call with 503 rather than leaving it to the server's cancel (a 500).
        drain, access, record = self._drain, self._access, None
        drain.started()
        if access is not None and access.enabled:  # its line too: route, model, tenant, status, outcome
            record = access.start(scope, "model." + _passthrough_route(scope["path"]))
            send = access.watch(record, send)
        try:
            outcome = await self._forward(scope, send, record)
        except asyncio.CancelledError:
            if not drain.absorb_cut():
                raise
            self._metrics.count("", "", Outcome.DRAINING)  # nothing is sent before the backend answers
            outcome = Outcome.DRAINING
            await self._error(send, outcome, retry_after_s=DRAINING_RETRY_S)
        finally:
            drain.finished()
        if record is not None and access is not None:
            record.outcome = outcome.value
            access.write(record)

    async def _forward(self, scope: Scope, send: Send, record: AccessRecord | None) -> Outcome:
        checked = self._classifier.classify(scope["headers"])  # the key, before the model name
        if isinstance(checked, Problem):
            self._metrics.count("", "", checked.outcome)
            await self._error(send, checked.outcome, detail=checked.detail)
            return checked.outcome
        model = scope["path_params"]["model"]
        pool = self._pools.get(model)
        if pool is None:
            self._metrics.count("", "", Outcome.UNKNOWN_MODEL)
            await self._error(send, Outcome.UNKNOWN_MODEL, detail=repr(model))
            return Outcome.UNKNOWN_MODEL
        if record is not None:
            record.asks(model, "", checked.tenant or "")
        backend = next((b for b in pool.backends if b.ready), None)
        if backend is None:
            await self._error(send, Outcome.NO_BACKEND, retry_after_s=self._no_backend_retry_s)
            return Outcome.NO_BACKEND
        try:
            request = upstream_request(scope, b"", self._header_rules)
            reply, body = await self._forwarder.fetch(pool, backend, request)
        except TimeoutError:
            await self._error(send, Outcome.UPSTREAM_TIMEOUT)
            return Outcome.UPSTREAM_TIMEOUT
        except UpstreamError as error:
            await self._error(send, Outcome.UPSTREAM_ERROR, detail=type(error).__name__)
            return Outcome.UPSTREAM_ERROR
        headers = downstream_response_headers(reply.headers)
        # An answer to HEAD has no body but tells the length the GET's would have.
        length = reply.content_length if request.method == "HEAD" else len(body)
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        await send_response(send, reply.status, headers, body)
        return Outcome.OK

    async def _error(
        self, send: Send, outcome: Outcome, *, detail: str | None = None, retry_after_s: float | None = None
    ) -> None:
        await send_error(
            send, ErrorStyle.KSERVE, outcome, self._drain, detail=detail, retry_after_s=retry_after_s
        )


def _passthrough_route(path: str) -> str:
    """metadata, ready or config: what of a model a passthrough path asks."""
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last if last in ("ready", "config") else "metadata"


def kserve_routes(readiness: Readiness, passthrough: ModelPassthrough) -> list[BaseRoute]:
    """The control-plane routes; inference itself is routed by `InferenceRoutes`."""

    async def live(request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> JSONResponse:
        ready = readiness.ready
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def server_metadata(request: Request) -> JSONResponse:
        return JSONResponse({"name": "inference-gateway", "version": package_version(), "extensions": []})

    model_paths = ["/v2/models/{model}", "/v2/models/{model}/versions/{version}"]
    return [
        *(
            Route(base + suffix, passthrough, methods=["GET"])
            for base in model_paths
            for suffix in ("", "/ready", "/config")
        ),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
    ]
