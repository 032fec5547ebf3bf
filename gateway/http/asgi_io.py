"""ASGI plumbing shared by every route: read the body under a limit, send a response, see a disconnect."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.fields import decimal
from policies.outcomes import Outcome

RawHeaders = list[tuple[bytes, bytes]]


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


async def read_body(scope: Scope, receive: Receive, limit_bytes: int) -> bytes | Outcome:
    """The whole request body, or BODY_TOO_LARGE / CLIENT_DISCONNECTED.

    A declared Content-Length over the limit is refused before reading anything.
    """
    declared = header(scope, b"content-length")
    if declared is not None and (decimal(declared) or 0) > limit_bytes:
        return Outcome.BODY_TOO_LARGE
    message = await receive()
    if message["type"] == "http.disconnect":
        return Outcome.CLIENT_DISCONNECTED
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return Outcome.BODY_TOO_LARGE if len(body) > limit_bytes else body
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            return Outcome.CLIENT_DISCONNECTED
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            return Outcome.BODY_TOO_LARGE
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(receive: Receive) -> None:
    """Return when the client goes away (call only after the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_response(send: Send, status: int, headers: RawHeaders, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: Any, headers: RawHeaders | None = None) -> None:
    body = json.dumps(payload).encode()
    base = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send_response(send, status, base + (headers or []), body)
