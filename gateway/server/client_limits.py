"""What the gateway holds its clients to (gateway.server.connections keeps it): the limits, why a
connection was cut, and the 431's body."""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.settings import Limits


class Cut(StrEnum):
    """Why the gateway closed a client's connection: a closed set, used as a metric label."""

    HEADER_TIMEOUT = "header_timeout"
    BODY_TIMEOUT = "body_timeout"
    HEADERS_TOO_LARGE = "headers_too_large"
    TOO_MANY_HEADERS = "too_many_headers"
    BAD_HOST = "bad_host"  # a request without its one Host field (RFC 9112, 3.2): 400
    SEND_TIMEOUT = "send_timeout"  # the client did not take its answer's bytes
    EVICTED = "evicted"  # closed for a new connection at `max_connections`
    REFUSED = "refused"  # a new connection at `max_connections`, every other one busy


def connections_for(open_files: int, backend_files: int = 0) -> int:
    """Client connections a process with this open-file limit may hold: a quarter of the limit, and
    at least the connections its backends and Redis may take (`backend_files`) plus 64 for
    listeners and files, stays free for them."""
    return max(16, open_files - max(64 + backend_files, open_files // 4))


@dataclass(frozen=True, slots=True)
class ClientLimits:
    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float
    max_connections: int
    body_idle_s: float = 5.0

    @classmethod
    def from_settings(
        cls, limits: Limits, open_files: int | None = None, backend_files: int = 0
    ) -> ClientLimits:
        if open_files is None:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            open_files = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        return cls(
            max_header_bytes=limits.max_header_bytes,
            max_headers=limits.max_headers,
            header_timeout_s=limits.header_timeout_ms / 1000,
            body_timeout_s=limits.body_timeout_ms / 1000,
            send_timeout_s=limits.send_timeout_ms / 1000,
            max_connections=limits.max_connections or connections_for(open_files, backend_files),
            body_idle_s=limits.body_idle_ms / 1000,
        )


REFUSAL_STATUS = {Cut.BAD_HOST: 400}
"""The status a refused head is answered with: 431 unless named here."""


def refusal_body(cut: Cut, limits: ClientLimits, *, openai: bool) -> bytes:
    """The refused head's JSON (431, or 400 for its Host), shaped like the gateway's other errors
    (gateway.errors) for the route's style."""
    if cut is Cut.TOO_MANY_HEADERS:
        message = f"too many request header fields: more than {limits.max_headers}"
    elif cut is Cut.BAD_HOST:
        message = "an HTTP/1.1 request carries exactly one Host header field (RFC 9112, section 3.2)"
    else:
        message = f"request header fields too large: more than {limits.max_header_bytes} bytes"
    payload: dict[str, Any]
    if openai:
        payload = {"error": {"message": message, "type": "invalid_request_error", "code": cut.value}}
    else:
        payload = {"error": message, "reason": cut.value}
    return json.dumps(payload).encode()
