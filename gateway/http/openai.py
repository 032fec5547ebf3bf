"""OpenAI-compatible routes: the model comes from the JSON body; `stream: true` passes SSE through."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorStyle
from gateway.http.exchange import read_body
from gateway.http.proxy import AdmittedEndpoint, Exchange
from gateway.http.request_meta import Problem
from gateway.runtime import Runtime
from policies.outcomes import Outcome


class OpenAIEndpoint(AdmittedEndpoint):
    """POST /v1/chat/completions, /v1/completions, /v1/embeddings."""

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(scope, receive, send, ErrorStyle.OPENAI)
        meta = self.runtime.classifier.classify(scope["headers"])
        if isinstance(meta, Problem):
            await self.proxy.fail(exchange, meta.outcome, detail=meta.detail)
            return
        body = await read_body(scope, receive, self.runtime.settings.limits.max_body_bytes)
        if isinstance(body, Outcome):
            await self.proxy.fail(exchange, body, priority=meta.priority)
            return
        model = _model_of(body)
        if isinstance(model, Problem):
            await self.proxy.fail(exchange, model.outcome, priority=meta.priority, detail=model.detail)
            return
        pool = self.runtime.pools.get(model)
        if pool is None:
            await self.proxy.fail(exchange, Outcome.UNKNOWN_MODEL, priority=meta.priority, detail=repr(model))
            return
        exchange.body = body
        await self.proxy.admitted(exchange, pool, meta)


def _model_of(body: bytes) -> str | Problem:
    """The `model` field of an OpenAI request body, or what is wrong with the body."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Problem(Outcome.BAD_REQUEST, "the body is not valid JSON")
    if not isinstance(payload, dict):
        return Problem(Outcome.BAD_REQUEST, "the body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return Problem(Outcome.BAD_REQUEST, "the body needs a string field 'model'")
    if not isinstance(payload.get("stream", False), bool):
        return Problem(Outcome.BAD_REQUEST, "'stream' must be true or false")
    return model


def openai_routes(runtime: Runtime) -> list[BaseRoute]:
    """/v1/models; the inference routes are routed by `InferenceRoutes`."""
    listing = {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "inference-gateway"}
            for name in runtime.pools
        ],
    }

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(listing)

    return [Route("/v1/models", models, methods=["GET"])]
