"""The KServe v2 datatypes: each fixed-size one's bytes per element and its struct format.

BYTES elements are length-prefixed (4 bytes, little-endian) and have no fixed size; BF16 has no
struct format (a float32's upper half), so code that packs it says how.
"""

from __future__ import annotations

from typing import Any

# The protocol's table; a test holds it to tritonclient's numpy dtypes, which the gateway does not
# import at start (80 ms).
FIXED_SIZE = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
}

STRUCT_FORMAT = {
    "BOOL": "?",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
"""struct's format of one element (packed little-endian: `<`)."""


def flattened(data: Any) -> list[Any]:
    """JSON tensor data, nested or flat (or one scalar), as its elements in row-major order; without
    recursion, so that data nested as deep as the JSON parser allows cannot exhaust the stack."""
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat
