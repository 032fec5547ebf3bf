"""InferenceRoutes: pure ASGI middleware that sends inference requests straight to their endpoints.

Inference is the hot path: matching it by string prefix here skips Starlette's exception layer and
its route regexes for every request. Everything else (health, metadata, metrics) goes on to the
Starlette router.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import route_error
from gateway.http.asgi_io import send_json

OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
INFER_ROUTES = ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer")
"""The KServe routes `v2_infer_params` matches, as route templates (for listings and route sweeps)."""
_V2_MODELS = "/v2/models/"
_INFER = "/infer"


def v2_infer_params(path: str) -> dict[str, str] | None:
    """`model` (and `version`) of /v2/models/{model}[/versions/{version}]/infer, else None."""
    if not (path.startswith(_V2_MODELS) and path.endswith(_INFER)):
        return None
    parts = path[len(_V2_MODELS) : -len(_INFER)].split("/")
    if len(parts) == 1 and parts[0]:
        return {"model": parts[0]}
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
        return {"model": parts[0], "version": parts[2]}
    return None


class InferenceRoutes:
    def __init__(self, app: ASGIApp, *, kserve_infer: ASGIApp, openai: ASGIApp) -> None:
        self._app = app
        self._kserve_infer = kserve_infer
        self._openai = openai

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            endpoint: ASGIApp | None = None
            if path in OPENAI_PATHS:
                endpoint = self._openai
            elif (params := v2_infer_params(path)) is not None:
                scope["path_params"] = params
                endpoint = self._kserve_infer
            if endpoint is not None:
                if scope["method"] != "POST":
                    error = route_error(405, path, scope["method"])
                    await send_json(send, 405, error, [(b"allow", b"POST")])
                    return
                await endpoint(scope, receive, send)
                return
        await self._app(scope, receive, send)
