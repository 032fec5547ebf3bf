"""The status page: `/status` (HTML), `/status.json`, `/status/stream` (SSE) and
`/status/requests/{id}` (where a queued request stands), all read from gateway.flow.status.

The page is rendered here, in one place, from the JSON document; its few lines of plain
JavaScript fetch the page's body again every second and swap it in, so there is one renderer and
no build step. The stream sends the document at most every 500 ms, for tools.

The aggregate routes are operator routes, served where /metrics is (the admin listener when there
is one). A request's own status is served on the client listener too: with tenant keys a caller
finds only its own tenant's requests (another's id is a 404, as an unknown one).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from html import escape
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from gateway.flow.queued_requests import QueuedRequests
from gateway.flow.request_meta import Problem, RequestClassifier
from gateway.flow.status import StatusBoard

STREAM_INTERVAL_S = 0.5

_CLASS_COLUMNS = [
    "class", "queued", "queued work", "predicted wait ms", "oldest wait ms", "refused /min",
    "last Retry-After s",
]  # fmt: skip
_BACKEND_COLUMNS = ["backend", "ready", "in flight", "slots", "circuit", "its queue", "read s ago"]

_HEAD = "<!doctype html><html><head><meta charset='utf-8'><title>inference-gateway status</title>"
_SCRIPT = """
<script>
setInterval(async () => {
  try {
    const reply = await fetch(location.pathname + "?part=body", {cache: "no-store"});
    if (reply.ok) document.getElementById("status").innerHTML = await reply.text();
  } catch (e) { /* the next tick tries again */ }
}, 1000);
</script>
"""
_STYLE = """
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.4em 0 1.2em; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
caption { text-align: left; font-weight: bold; padding: 4px 0; }
.down { color: #b00; }
</style>
</head>
"""


def status_routes(board: StatusBoard) -> list[BaseRoute]:
    """The aggregate routes: the page, the document and its stream."""

    async def page(request: Request) -> Response:
        body = render_body(board.document())
        if request.query_params.get("part") == "body":
            return HTMLResponse(body)
        return HTMLResponse(f"{_HEAD}{_STYLE}<body><div id='status'>{body}</div>{_SCRIPT}</body></html>")

    async def document(request: Request) -> JSONResponse:
        return JSONResponse(board.document())

    async def stream(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            while True:
                yield f"data: {json.dumps(board.document(), separators=(',', ':'))}\n\n"
                await asyncio.sleep(STREAM_INTERVAL_S)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"cache-control": "no-store"}
        )

    return [Route("/status", page), Route("/status.json", document), Route("/status/stream", stream)]


def request_status_route(
    board: StatusBoard, queued: QueuedRequests, classifier: RequestClassifier | None
) -> Route:
    """`/status/requests/{id}`; `classifier` given on the client listener, where a caller with a
    tenant key sees only its tenant's requests."""

    async def locate(request: Request) -> JSONResponse:
        wanted = request.path_params["request_id"]
        tenant: str | None = None
        if classifier is not None and classifier.keyed:
            meta = classifier.classify(request.scope["headers"])
            if isinstance(meta, Problem):
                return JSONResponse({"error": meta.detail, "reason": meta.outcome.value}, status_code=401)
            tenant = meta.flow_tenant
        found = queued.get(wanted)
        if found is None or (tenant is not None and found.tenant != tenant):
            message = "no request queued here by that id (served, refused, unknown, or on another replica)"
            return JSONResponse({"error": message, "reason": "not_queued"}, status_code=404)
        return JSONResponse(board.locate(found))

    return Route("/status/requests/{request_id}", locate)


def _seen(store: dict[str, Any]) -> str:
    """The replicas seen live on a shared store, and whether they run one config."""
    if not store["seen"]:
        return ""
    configs = ", ".join(
        f"<span data-replica='{name}'>{name} {escape(r['config_hash'][:12])}</span>"
        for r in store["seen"]
        for name in [escape(r["replica"])]
    )
    differ = " <b class='down'>configs differ</b>" if store["configs"] > 1 else ""
    return f", {len(store['seen'])} seen ({configs}){differ}"


def render_body(document: dict[str, Any]) -> str:
    """The page's body: a table of classes, of tenants and of backends per model."""
    store = document["store"]
    parts = [
        "<h1>inference-gateway</h1>",
        f"<p>store <b>{escape(store['kind'])}</b> ({escape(store['mode'])}), "
        f"{store['replicas']} replica(s) expected"
        + _seen(store)
        + f"; config {escape(document['config_hash'][:12])}"
        + (" &mdash; <b class='down'>draining</b>" if document["draining"] else "")
        + "</p>",
    ]
    for model in document["models"]:
        name = escape(model["name"])
        ready = "ready" if model["ready"] else "<span class='down'>no backend ready</span>"
        use = f"{model['in_flight']} of {model['slots']} slots in use"
        pace = f"service {model['service_time_ms']:.1f} ms; {model['drain_rate_per_s']:.1f} hand-overs/s"
        parts.append(f"<h2 data-model='{name}'>{name}</h2><p>{ready}; {use}; {pace}</p>")
        rows = [
            _row(
                c["name"],
                c["queued"],
                _num(c["queued_work"]),
                _num(c["predicted_wait_ms"]),
                _num(c["oldest_wait_ms"]),
                ", ".join(f"{r}: {n}" for r, n in sorted(c["refusals_per_minute"].items())) or "-",
                _num(c["last_retry_after_s"], 2),
            )
            for c in model["classes"]
        ]
        parts.append(
            _table(
                "classes",
                [
                    "class",
                    "queued",
                    "queued work",
                    "predicted wait ms",
                    "oldest wait ms",
                    "refused /min",
                    "last Retry-After s",
                ],
                rows,
            )
        )
        tenant_rows = [
            _row(f"{c['name']} / {t['name'] or '-'}", _num(t["queued_work"]), f"{t['share']:.0%}")
            for c in model["classes"]
            for t in c["tenants"]
        ]
        if tenant_rows:
            parts.append(
                _table("tenants queued", ["class / tenant", "queued work", "share served"], tenant_rows)
            )
        if model["tenants"]:
            flight = [
                _row(t["name"], _num(t["in_flight_work"]), _num(t["quota"]), _num(t["borrowed_work"]))
                for t in model["tenants"]
            ]
            parts.append(
                _table("tenants in flight", ["tenant", "work in flight", "quota", "borrowed"], flight)
            )
        backends = [
            _row(
                b["url"],
                "yes" if b["ready"] else "<span class='down'>no</span>",
                b["in_flight"],
                b["slots"],
                b["circuit"],
                _num(b["reported_waiting"]),
                _num(b["scrape_age_s"], 1),
            )
            for b in model["backends"]
        ]
        parts.append(
            _table(
                "backends",
                ["backend", "ready", "in flight", "slots", "circuit", "its queue", "read s ago"],
                backends,
            )
        )
    return "\n".join(parts)


def _table(caption: str, headers: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f"<table><caption>{escape(caption)}</caption><tr>{head}</tr>{''.join(rows)}</table>"


def _row(first: str, *cells: object) -> str:
    rest = "".join(f"<td>{c}</td>" for c in cells)
    return f"<tr><td>{escape(first)}</td>{rest}</tr>"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
