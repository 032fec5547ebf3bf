"""Streams that carry usage for the gateway alone.

A model priced in tokens learns from the `usage` the engine returns (gateway.http.pricing), but an
OpenAI-style engine puts usage in a stream only when the request asks for it
(`stream_options.include_usage`), and most streaming clients do not. So the gateway asks on their
behalf, and takes the usage chunk (the last event before `[DONE]`, with no choices) out of the
stream again: the client gets the stream it asked for, and the cost model learns from every
answer. The chunks before it carry `"usage": null`, a field of the schema, which is left alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

_ASK = b'"stream_options":{"include_usage":true},'
_USAGE_CHUNK_MAX_BYTES = 4096
"""A usage chunk is a few hundred bytes: longer events are passed on without a look."""


def asking_usage(body: bytes, payload: dict[str, Any]) -> bytes | None:
    """`body` (whose JSON is `payload`) rewritten to ask for usage in its stream; None when it
    does not stream, asks already, or has `stream_options` the gateway cannot extend."""
    if payload.get("stream") is not True:
        return None
    options = payload.get("stream_options")
    # Spliced in where the body is UTF-8 (a NUL in its first bytes is UTF-16 or UTF-32, which
    # json.loads takes too); written anew, in UTF-8, otherwise.
    if options is None and "stream_options" not in payload and b"\x00" not in body[:4]:
        opening = body.find(b"{")  # the payload is an object with members (a model at least)
        return body[: opening + 1] + _ASK + body[opening + 1 :]
    if options is not None and (not isinstance(options, dict) or options.get("include_usage") is True):
        return None
    return json.dumps({**payload, "stream_options": {**(options or {}), "include_usage": True}}).encode()


class UsageChunkDropper:
    """Takes the usage-only chunk out of an event stream, event by event (a Relay's stream rewrite).

    Bytes are passed on at event boundaries (a blank line), so an event split across reads is held
    until it is whole; what is left when the stream ends is passed on as it is.
    """

    __slots__ = ("_dropped_cr", "_pending")

    def __init__(self) -> None:
        self._pending = b""
        self._dropped_cr = False

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        if self._dropped_cr and data.startswith(b"\n"):
            data = data[1:]  # the LF of the CRLF that ended the event taken out
        self._dropped_cr = False
        kept: list[bytes] = []
        start = 0
        while (end := _event_end(data, start)) >= 0:
            event = data[start:end]
            if not _is_usage_chunk(event):
                kept.append(event)
            elif end == len(data) and event.endswith(b"\r"):
                # Its blank line ended in a CR at the end of this read: an LF in the next one is
                # the rest of that line's CRLF, and goes with the event.
                self._dropped_cr = True
            start = end
        self._pending = data[start:]
        return b"".join(kept)

    def close(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest


# An event stream's lines end in CRLF, LF or CR, and an event with an empty line (the WHATWG
# HTML standard's event-stream grammar).
_LINE_END = re.compile(rb"\r\n|\r|\n")


def _event_end(data: bytes, start: int) -> int:
    """The end (past its blank line) of the event that starts at `start`, or -1 if incomplete."""
    line_start = start
    for end in _LINE_END.finditer(data, start):
        if end.start() == line_start:  # an empty line; were it a CR whose LF is in the next read,
            return end.end()  # that LF is an empty line of its own, which dispatches nothing
        line_start = end.end()
    return -1


def _is_usage_chunk(event: bytes) -> bool:
    if len(event) > _USAGE_CHUNK_MAX_BYTES or b'"usage"' not in event:
        return False
    data: list[bytes] = []
    for line in _LINE_END.split(event):
        if line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif line and not line.startswith((b":", b"id:")):
            return False  # a named event, or a field OpenAI's chunks do not have
    if not data:
        return False
    try:
        chunk = json.loads(b"\n".join(data))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)
