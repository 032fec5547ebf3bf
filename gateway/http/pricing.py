"""What a KServe v2 inference request costs in work units, where a model prices by batch items.

A request's batch is dimension 0 of its first input's shape (KServe v2 puts the batch first on every
input of a batching model). For a binary-tensor body only its JSON header is read (its length is
the `Inference-Header-Content-Length` field); a JSON body is parsed whole, which costs CPU in
proportion to its size: a model whose requests are large JSON tensors may rather be priced by
request. A body whose batch cannot be read costs 1: pricing never refuses a request, the backend
judges its body.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from gateway.tensors.batch import HEADER_LENGTH


def batch_items(body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> float:
    """The request's batch size, or 1 where it cannot be read."""
    document = body
    for name, value in headers:
        if name == HEADER_LENGTH:
            if not value.isdigit() or int(value) > len(body):
                return 1.0
            document = body[: int(value)]
            break
    try:
        request = json.loads(document)
        first = request["inputs"][0]["shape"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return 1.0
    if isinstance(first, bool) or not isinstance(first, int) or first < 1:
        return 1.0
    return float(first)
