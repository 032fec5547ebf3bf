"""How the simulator writes its answers: whole bodies, and server-sent events."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Send

JSON_TYPE = b"application/json"


async def reply(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON_TYPE,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


async def reply_json(send: Send, status: int, payload: Any) -> None:
    await reply(send, status, json.dumps(payload).encode())


async def start_events(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        }
    )


async def send_event(send: Send, payload: Any) -> None:
    await send(
        {
            "type": "http.response.body",
            "body": b"data: " + json.dumps(payload).encode() + b"\n\n",
            "more_body": True,
        }
    )


async def end_events(send: Send) -> None:
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
