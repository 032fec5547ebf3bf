"""Outcome -> HTTP status and error body, in one table, rendered in the style of the route."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from enum import Enum

from policies.outcomes import Outcome
from policies.retry_after import header_values


class ErrorStyle(Enum):
    KSERVE = "kserve"
    """`{"error": "<message>", "reason": "<outcome>"}`: tritonclient reads `error`."""
    OPENAI = "openai"
    """`{"error": {"message", "type", "code"}}`, as OpenAI clients expect."""


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    status: int
    openai_type: str
    message: str


_RATE = "rate_limit_error"
_INVALID = "invalid_request_error"
_SERVER = "server_error"

NOT_RETRYABLE = frozenset({Outcome.BUDGET_TOO_SMALL, Outcome.COST_ABOVE_QUOTA})
"""Refusals that say so (`x-should-retry: false`, which the openai SDK obeys): the same request
would be refused again whatever the load."""

ERRORS: dict[Outcome, ErrorSpec] = {
    Outcome.QUEUE_FULL: ErrorSpec(429, _RATE, "the queue for this priority class is full"),
    Outcome.DEADLINE_UNMEETABLE: ErrorSpec(429, _RATE, "the request cannot be served within its deadline"),
    Outcome.DEADLINE_EXPIRED_IN_QUEUE: ErrorSpec(429, _RATE, "the deadline ran out while queued"),
    Outcome.CLUSTER_BACKLOGGED: ErrorSpec(429, _RATE, "the cluster is backlogged; this class is shed"),
    Outcome.DISPLACED: ErrorSpec(429, _RATE, "a more urgent request took its place in the full queue"),
    Outcome.OUTSIDE_WINDOW: ErrorSpec(429, _RATE, "served only within its time window, which is closed now"),
    Outcome.NO_BACKEND: ErrorSpec(503, _SERVER, "no backend of this model is ready"),
    Outcome.DRAINING: ErrorSpec(503, _SERVER, "the gateway is shutting down"),
    Outcome.STORE_UNAVAILABLE: ErrorSpec(503, _SERVER, "the shared queue is unreachable"),
    Outcome.UPSTREAM_ERROR: ErrorSpec(502, _SERVER, "the backend failed to answer"),
    Outcome.UPSTREAM_TIMEOUT: ErrorSpec(504, _SERVER, "the backend did not answer in time"),
    Outcome.BAD_REQUEST: ErrorSpec(400, _INVALID, "malformed request"),
    Outcome.UNKNOWN_PRIORITY: ErrorSpec(400, _INVALID, "unknown priority class"),
    Outcome.UNAUTHORIZED: ErrorSpec(401, "authentication_error", "missing or unknown API key"),
    Outcome.UNKNOWN_MODEL: ErrorSpec(404, _INVALID, "unknown model"),
    Outcome.BODY_TOO_LARGE: ErrorSpec(413, _INVALID, "request body too large"),
    Outcome.BUDGET_TOO_SMALL: ErrorSpec(
        400, _INVALID, "X-Request-Timeout-Ms is below what the model needs even with no queue"
    ),
    Outcome.COST_ABOVE_QUOTA: ErrorSpec(
        400, _INVALID, "the request costs more than its tenant's quota lets run"
    ),
    # Never rendered by the gateway: the backend's own answer passes through.
    Outcome.BACKEND_CLIENT_ERROR: ErrorSpec(400, _INVALID, "the backend refused the request"),
    Outcome.BACKEND_SERVER_ERROR: ErrorSpec(500, _SERVER, "the backend failed the request"),
    # Never sent (the client is gone); 499 is the status proxies log for it.
    Outcome.CLIENT_DISCONNECTED: ErrorSpec(499, _INVALID, "client closed the request"),
}


MAX_DETAIL_CHARS = 200
"""A detail may echo what the client sent (a model name, a header): never more than this of it."""


def echoed(text: str) -> str:
    """`text` as an error message may show it when it comes from the client: cut short."""
    if len(text) <= MAX_DETAIL_CHARS:
        return text
    return text[:MAX_DETAIL_CHARS] + f"... ({len(text)} characters)"


def error_response(
    outcome: Outcome,
    style: ErrorStyle,
    *,
    detail: str | None = None,
    retry_after_s: float | None = None,
    rule: str | None = None,
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and JSON body for a request that ends with `outcome`; `rule` names the
    setting or header that caused a refusal (a configured name, never request input)."""
    if detail is None:
        status, body = _plain_error_body(outcome, style, rule)
    else:
        # Not cached: a detail carries request input, and a cache keyed by it is memory anyone can fill.
        status, body = _error_body(outcome, style, echoed(detail), rule)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after_s is not None:
        seconds, millis = header_values(retry_after_s)
        headers += [(b"retry-after", seconds.encode()), (b"retry-after-ms", millis.encode())]
    if outcome in NOT_RETRYABLE:
        headers.append((b"x-should-retry", b"false"))
    return status, headers, body


@functools.lru_cache(maxsize=1024)
def _plain_error_body(outcome: Outcome, style: ErrorStyle, rule: str | None) -> tuple[int, bytes]:
    # Cached: under overload the same few refusals are rendered thousands of times a second. The
    # rules are configured names, a closed set.
    return _error_body(outcome, style, None, rule)


def _error_body(
    outcome: Outcome, style: ErrorStyle, detail: str | None, rule: str | None
) -> tuple[int, bytes]:
    spec = ERRORS[outcome]
    message = f"{spec.message}: {detail}" if detail else spec.message
    if style is ErrorStyle.OPENAI:
        error: dict[str, object] = {"message": message, "type": spec.openai_type, "code": outcome.value}
        if rule is not None:
            error["param"] = rule
        payload: dict[str, object] = {"error": error}
    else:
        payload = {"error": message, "reason": outcome.value}
        if rule is not None:
            payload["rule"] = rule
    return spec.status, json.dumps(payload).encode()


_ROUTE_ERRORS = {404: "not_found", 405: "method_not_allowed"}
ROUTE_REASONS = frozenset(_ROUTE_ERRORS.values())
"""The reasons of errors no request outcome is counted for: a path or a method no route serves."""


def route_error(status: int, path: str, method: str) -> dict[str, object]:
    """The JSON error for a path no route serves (404) or a method its route does not take (405),
    in the style of the routes under that path (OpenAI's under /v1/)."""
    reason = _ROUTE_ERRORS.get(status, "not_found")
    what = "no route for" if status == 404 else "the route does not take"
    message = f"{what} {method} {echoed(path)}"
    if path.startswith("/v1/"):
        return {"error": {"message": message, "type": _INVALID, "code": reason}}
    return {"error": message, "reason": reason}
