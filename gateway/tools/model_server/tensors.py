"""KServe v2 tensors for the simulator: parse an infer request (JSON or binary extension), answer it.

The simulated model is the identity: output i (`OUTPUT<i>`) is input i, returned as JSON data or as
binary data as the request asks, so a client can check that every byte came back.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from gateway.tensors.datatypes import STRUCT_FORMAT, flattened


class TensorError(ValueError):
    """The request is not a valid KServe v2 inference request."""


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str
    shape: list[int]
    json_data: list[Any] | None = None
    raw: bytes | None = None

    def as_raw(self) -> bytes:
        if self.raw is not None:
            return self.raw
        flat = flattened(self.json_data or [])
        if self.datatype == "BF16":  # a float32's upper half (truncated: the sim needs no rounding)
            return b"".join(struct.pack("<f", v)[2:] for v in flat)
        if self.datatype == "BYTES":
            encoded = [v.encode() if isinstance(v, str) else bytes(v) for v in flat]
            return b"".join(struct.pack("<I", len(e)) + e for e in encoded)
        return struct.pack(f"<{len(flat)}{_format(self.datatype)}", *flat)

    def as_json(self) -> list[Any]:
        if self.json_data is not None:
            return self.json_data
        raw = self.raw or b""
        if self.datatype == "BYTES":
            values, offset = [], 0
            while offset < len(raw):
                (size,) = struct.unpack_from("<I", raw, offset)
                values.append(raw[offset + 4 : offset + 4 + size].decode("utf-8", "replace"))
                offset += 4 + size
            return values
        if self.datatype == "BF16":
            halves = [raw[i : i + 2] for i in range(0, len(raw), 2)]
            return [struct.unpack("<f", b"\0\0" + half)[0] for half in halves]
        fmt = _format(self.datatype)
        return list(struct.unpack(f"<{len(raw) // struct.calcsize(fmt)}{fmt}", raw))


@dataclass(frozen=True, slots=True)
class InferRequest:
    id: str | None
    inputs: list[Tensor]
    outputs: list[tuple[str, bool]]
    """Requested output names with whether each wants binary data."""
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        shape = self.inputs[0].shape if self.inputs else []
        return max(1, shape[0]) if shape else 1


def parse_infer(body: bytes, header_length: int | None) -> InferRequest:
    json_part = body if header_length is None else body[:header_length]
    if header_length is not None and not 0 <= header_length <= len(body):
        raise TensorError("Inference-Header-Content-Length exceeds the body")
    try:
        header = json.loads(json_part)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise TensorError(f"the inference header is not valid JSON: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list) or not header["inputs"]:
        raise TensorError("the request needs a non-empty 'inputs' list")
    offset = header_length or 0
    inputs = []
    for item in header["inputs"]:
        tensor, offset = _parse_input(item, body, offset)
        inputs.append(tensor)
    default_binary = bool((header.get("parameters") or {}).get("binary_data_output", False))
    names = [f"OUTPUT{i}" for i in range(len(inputs))]
    outputs: list[tuple[str, bool]] = []
    for item in header.get("outputs") or [{"name": n} for n in names]:
        name = item.get("name") if isinstance(item, dict) else None
        if name not in names:
            raise TensorError(f"unknown output {name!r}; this model has {names}")
        outputs.append((name, bool((item.get("parameters") or {}).get("binary_data", default_binary))))
    parameters = header.get("parameters")
    return InferRequest(header.get("id"), inputs, outputs, parameters if isinstance(parameters, dict) else {})


def _parse_input(item: Any, body: bytes, offset: int) -> tuple[Tensor, int]:
    if not isinstance(item, dict):
        raise TensorError("each input must be an object")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str) or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        raise TensorError("each input needs a 'name' and an integer 'shape'")
    if datatype not in ("BYTES", "BF16") and datatype not in STRUCT_FORMAT:
        raise TensorError(f"input {name!r}: unsupported datatype {datatype!r}")
    size = (item.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or offset + size > len(body):
            raise TensorError(f"input {name!r}: binary_data_size runs past the body")
        return Tensor(name, datatype, shape, raw=body[offset : offset + size]), offset + size
    if not isinstance(item.get("data"), list):
        raise TensorError(f"input {name!r} has neither 'data' nor binary_data_size")
    return Tensor(name, datatype, shape, json_data=item["data"]), offset


def infer_response(model: str, version: str, request: InferRequest) -> tuple[bytes, int | None]:
    """The body and, when it carries binary outputs, its Inference-Header-Content-Length."""
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in request.outputs:
        source = request.inputs[int(name.removeprefix("OUTPUT"))]
        entry: dict[str, Any] = {"name": name, "datatype": source.datatype, "shape": source.shape}
        if binary:
            raw = source.as_raw()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = source.as_json()
        outputs.append(entry)
    header: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": outputs}
    if request.id is not None:
        header["id"] = request.id
    head = json.dumps(header).encode()
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)


def _format(datatype: str) -> str:
    return STRUCT_FORMAT[datatype]
