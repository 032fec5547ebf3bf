"""OpenAI-compatible routes: the model comes from the JSON body; `stream: true` passes SSE through."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorStyle, error_response
from gateway.flow.request_meta import Problem, RequestClassifier
from gateway.http.asgi_io import read_body
from gateway.http.intake import AdmittedEndpoint
from gateway.http.pricing import UsageLearner, choices_of, max_tokens_of, prompt_chars
from gateway.http.usage_stream import UsageChunkDropper, asking_usage
from policies.outcomes import Outcome


class OpenAIEndpoint(AdmittedEndpoint):
    """POST /v1/chat/completions, /v1/completions, /v1/embeddings."""

    style = ErrorStyle.OPENAI

    def route(self, scope: Scope) -> str:
        path: str = scope["path"]
        return path.removeprefix("/v1/")

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        intake = self.intake
        meta = intake.classifier.classify(scope["headers"])
        if isinstance(meta, Problem):
            await self.fail(scope, send, meta.outcome, detail=meta.detail)
            return
        body = await read_body(scope, receive, intake.max_body_bytes)
        if isinstance(body, Outcome):
            await self.fail(scope, send, body, priority=meta.priority)
            return
        parsed = await _parse(body) if len(body) > _PARSE_INLINE_BYTES else _request_in(body)
        if isinstance(parsed, Problem):
            await self.fail(scope, send, parsed.outcome, priority=meta.priority, detail=parsed.detail)
            return
        model, payload = parsed
        pool = intake.pools.get(model)
        if pool is None:
            await self.fail(scope, send, Outcome.UNKNOWN_MODEL, priority=meta.priority, detail=repr(model))
            return
        costs, stream = pool.token_costs, payload.get("stream") is True
        if costs is None or scope["path"] == "/v1/embeddings":
            admitted = self.admit(scope, receive, send, pool, meta, body, stream=stream)
        else:
            chars, choices = prompt_chars(payload), choices_of(payload)
            estimate = costs.estimate(chars, max_tokens_of(payload), meta.flow_tenant, choices)
            on_error = partial(intake.admission.metrics.set_cost_model_error, pool.name)
            learner = UsageLearner(costs, chars, estimate, meta.flow_tenant, on_error, choices)
            # A stream carries usage only when asked: the gateway asks, and drops it again.
            dropper = None
            if (asked := asking_usage(body, payload)) is not None:
                body, dropper = asked, UsageChunkDropper()
            admitted = self.admit(
                scope,
                receive,
                send,
                pool,
                meta,
                body,
                estimate.cost,
                observe=learner,
                rewrite_stream=dropper,
                stream=stream,
            )
        del body, payload, parsed  # the exchange holds the body now, and gives it up once it is serialized
        await admitted


# Bodies larger than this are parsed on a worker thread: a 60 MiB body takes the event loop
# (every other request) for a good tenth of a second.
_PARSE_INLINE_BYTES = 1 << 20


async def _parse(body: bytes) -> tuple[str, dict[str, Any]] | Problem:
    return await asyncio.to_thread(_request_in, body)


def _request_in(body: bytes) -> tuple[str, dict[str, Any]] | Problem:
    """The `model` field of an OpenAI request body and the body, or what is wrong with it."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Problem(Outcome.BAD_REQUEST, "the body is not valid JSON")
    except RecursionError:
        return Problem(Outcome.BAD_REQUEST, "the body's JSON nests too deep")
    if not isinstance(payload, dict):
        return Problem(Outcome.BAD_REQUEST, "the body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return Problem(Outcome.BAD_REQUEST, "the body needs a string field 'model'")
    if (stream := payload.get("stream")) is not None and not isinstance(stream, bool):  # null: false
        return Problem(Outcome.BAD_REQUEST, "'stream' must be true, false or null")
    return model, payload


def openai_routes(models: Iterable[str], classifier: RequestClassifier) -> list[BaseRoute]:
    """/v1/models; the inference routes are routed by `InferenceRoutes`."""
    listing: dict[str, Any] = {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "inference-gateway"} for name in models
        ],
    }

    by_id = {model["id"]: model for model in listing["data"]}

    def refused(request: Request) -> Response | None:
        """The key is checked here too: with tenants, only they may list the models."""
        checked = classifier.classify(request.scope["headers"])
        if not isinstance(checked, Problem):
            return None
        status, _, body = error_response(checked.outcome, ErrorStyle.OPENAI, detail=checked.detail)
        return Response(body, status_code=status, media_type="application/json")

    async def models_route(request: Request) -> Response:
        return refused(request) or JSONResponse(listing)

    async def model_route(request: Request) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        model = by_id.get(request.path_params["model"])
        if model is None:
            status, _, body = error_response(Outcome.UNKNOWN_MODEL, ErrorStyle.OPENAI)
            return Response(body, status_code=status, media_type="application/json")
        return JSONResponse(model)

    return [
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/v1/models/{model:path}", model_route, methods=["GET"]),
    ]
