"""A request's class, written into its body for a backend that schedules by priority.

OpenAI bodies get the configured top-level field (vLLM's `priority`); KServe v2 inference bodies
get it among the request's `parameters` (Triton's `priority`), in the JSON header of a binary
body too, whose `Inference-Header-Content-Length` is then set anew. Whatever the client put in
that field is replaced, or removed where its class has no value: a tenant can never reach the
engine with a priority its class does not give it. A body that is not a JSON object passes as it
is (the backend will refuse it, as it would without the gateway).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.fields import decimal
from gateway.settings import ForwardPriority
from gateway.tensors.batch import HEADER_LENGTH
from gateway.upstream.client import RawHeaders


def with_priority(
    rule: ForwardPriority,
    priority: str,
    headers: RawHeaders,
    body: bytes,
    *,
    model_in_body: bool,
) -> tuple[RawHeaders, bytes]:
    """(headers, body) as the backend gets them, told `priority`'s value under `rule`."""
    value = rule.values.get(priority)
    if model_in_body:
        document = _object(body)
        if document is None:
            return headers, body
        _put(document, rule.field, value)
        return headers, json.dumps(document).encode()
    header_length = _header_length(headers, len(body))
    header = _object(body if header_length is None else body[:header_length])
    if header is None:
        return headers, body
    parameters = header.get("parameters")
    if not isinstance(parameters, dict):
        parameters = header["parameters"] = {}
    _put(parameters, rule.field, value)
    if not parameters:
        del header["parameters"]
    written = json.dumps(header).encode()
    if header_length is None:
        return headers, written
    resized = [(k, str(len(written)).encode()) if k == HEADER_LENGTH else (k, v) for k, v in headers]
    return resized, written + body[header_length:]


def _put(document: dict[str, Any], field: str, value: int | None) -> None:
    if value is None:
        document.pop(field, None)
    else:
        document[field] = value


def _object(document: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(document)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _header_length(headers: RawHeaders, body_length: int) -> int | None:
    for name, value in headers:
        if name == HEADER_LENGTH:
            length = decimal(value)
            return length if length is not None and length <= body_length else None
    return None
