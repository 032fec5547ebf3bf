"""KServe v2 inference requests merged along dimension 0 into one request, and the answer split back.

A request is mergeable (`part_of`) when it is a plain batched inference: every input has the same
batch size in dimension 0 and its data inline (JSON `data`) or in the binary extension, and it asks
nothing a batch would change (no sequence, no shared memory, no field this module does not know).
Requests merge only with requests of the same `key`: the same path (model and version), input
names, datatypes, non-batch dimensions and encodings, the same `outputs` and `parameters` (so the
same `binary_data_output` choices). A merged input is its members' data one after the other: row-
major order puts dimension 0 outermost, so JSON data lists and raw tensor bytes concatenate as they
are. The answer's outputs must carry the merged batch in dimension 0; each member gets its rows of
every output, in the encoding the backend chose, under its own `id`. Binary tensor bytes are passed
through as sliced, never decoded; the JSON header is written anew (its values as parsed).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway.fields import decimal
from gateway.tensors.datatypes import FIXED_SIZE

HEADER_LENGTH = b"inference-header-content-length"

_REQUEST_FIELDS = {"id", "inputs", "outputs", "parameters"}
_SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")
_LENGTH = struct.Struct("<I")


class SplitError(ValueError):
    """The batched answer cannot be split back into its members' answers."""


@dataclass(frozen=True, slots=True)
class Part:
    """One request's share of a batch: its rows of every input, and what its answer needs."""

    key: str
    """Requests merge only with requests of the same key."""
    rows: int
    """Its batch size: dimension 0 of every input."""
    inputs: tuple[list[Any] | bytes, ...]
    """Per input: its flat JSON data, or its raw tensor bytes."""
    header: dict[str, Any]
    """Its JSON header as sent (the template of a merged request)."""

    @property
    def has_id(self) -> bool:
        return "id" in self.header


def header_length_of(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The binary extension's JSON header length, or None for a JSON body (or an invalid value)."""
    for name, value in headers:
        if name == HEADER_LENGTH:
            length = decimal(value)
            return -1 if length is None else length
    return None


def part_of(path: str, body: bytes, header_length: int | None) -> Part | None:
    """The request's part in a batch, or None when it must pass alone."""
    if header_length is not None and not 0 <= header_length <= len(body):
        return None
    try:
        header = json.loads(body if header_length is None else body[:header_length])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(header, dict) or not set(header) <= _REQUEST_FIELDS:
        return None
    parameters = header.get("parameters", {})
    if not isinstance(parameters, dict) or any(parameters.get(p) for p in _SEQUENCE_PARAMETERS):
        return None
    outputs = header.get("outputs", [])
    if not isinstance(outputs, list) or not all(_plain_output(o) for o in outputs):
        return None
    items = header.get("inputs")
    if not isinstance(items, list) or not items:
        return None
    offset = header_length or 0
    rows: int | None = None
    inputs: list[list[Any] | bytes] = []
    signature: list[Any] = []
    for item in items:
        try:
            read = _input(item, body, offset)
        except RecursionError:  # data nested as deep as the JSON parser allows
            return None
        if read is None or (rows is not None and read[0] != rows):
            return None
        rows, data, offset, form = read
        inputs.append(data)
        signature.append(form)
    if offset != (len(body) if header_length is not None else 0) or rows is None:
        return None  # bytes no input claims (or a binary input without a binary body)
    canonical = json.dumps([path, signature, outputs, parameters], sort_keys=True, separators=(",", ":"))
    key = hashlib.blake2b(canonical.encode(), digest_size=12).hexdigest()
    return Part(key, rows, tuple(inputs), header)


def merged(parts: list[Part]) -> tuple[bytes, int | None]:
    """One request carrying every part's rows, in order: its body and, when it has binary
    tensors, its JSON header's length."""
    head = parts[0].header
    rows = sum(p.rows for p in parts)
    inputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for index, template in enumerate(head["inputs"]):
        entry = {k: v for k, v in template.items() if k != "data"}
        entry["shape"] = [rows, *template["shape"][1:]]
        if isinstance(parts[0].inputs[index], bytes):
            blob = b"".join(p.inputs[index] for p in parts)  # type: ignore[misc]
            entry["parameters"] = {**template["parameters"], "binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = [value for p in parts for value in p.inputs[index]]
        inputs.append(entry)
    request = {k: v for k, v in head.items() if k not in ("id", "inputs")}
    request["inputs"] = inputs
    document = json.dumps(request, separators=(",", ":")).encode()
    if not blobs:
        return document, None
    return document + b"".join(blobs), len(document)


def split(body: bytes, header_length: int | None, parts: list[Part]) -> list[tuple[bytes, int | None]]:
    """Each part's answer (body, JSON header length or None) from the merged request's answer."""
    if header_length is not None and not 0 <= header_length <= len(body):
        raise SplitError("Inference-Header-Content-Length exceeds the answer")
    try:
        header = json.loads(body if header_length is None else body[:header_length])
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise SplitError(f"the answer's header is not JSON: {error}") from None
    outputs = header.get("outputs") if isinstance(header, dict) else None
    if not isinstance(outputs, list):
        raise SplitError("the answer has no 'outputs' list")
    rows = [p.rows for p in parts]
    offset = header_length or 0
    per_output: list[tuple[dict[str, Any], list[list[Any]] | list[bytes]]] = []
    for output in outputs:
        try:
            sliced, offset = _split_output(output, body, offset, rows)
        except RecursionError:
            raise SplitError("an output's data is nested too deep") from None
        per_output.append((output, sliced))
    if offset != (len(body) if header_length is not None else 0):
        raise SplitError("the answer has binary data no output claims")
    common = {k: v for k, v in header.items() if k not in ("id", "outputs")}
    answers: list[tuple[bytes, int | None]] = []
    for index, part in enumerate(parts):
        answer = dict(common)
        if part.has_id:
            answer["id"] = part.header["id"]
        entries: list[dict[str, Any]] = []
        blobs: list[bytes] = []
        for output, sliced in per_output:
            entry = {k: v for k, v in output.items() if k != "data"}
            entry["shape"] = [part.rows, *output["shape"][1:]]
            piece = sliced[index]
            if isinstance(piece, bytes):
                entry["parameters"] = {**output["parameters"], "binary_data_size": len(piece)}
                blobs.append(piece)
            else:
                entry["data"] = piece
            entries.append(entry)
        answer["outputs"] = entries
        document = json.dumps(answer, separators=(",", ":")).encode()
        answers.append((document + b"".join(blobs), len(document)) if blobs else (document, None))
    return answers


def _plain_output(output: Any) -> bool:
    if not isinstance(output, dict) or not isinstance(output.get("name"), str):
        return False
    parameters = output.get("parameters", {})
    return isinstance(parameters, dict) and "shared_memory_region" not in parameters


def _input(item: Any, body: bytes, offset: int) -> tuple[int, list[Any] | bytes, int, list[Any]] | None:
    """An input's batch size, data, the offset after its bytes and its part of the key; None when
    it cannot be merged."""
    if not isinstance(item, dict) or not set(item) <= {"name", "datatype", "shape", "parameters", "data"}:
        return None
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    parameters = item.get("parameters", {})
    if not isinstance(name, str) or not isinstance(parameters, dict) or "shared_memory_region" in parameters:
        return None
    if datatype != "BYTES" and datatype not in FIXED_SIZE:
        return None
    if not isinstance(shape, list) or not shape or not all(_dimension(d) for d in shape) or shape[0] < 1:
        return None
    elements = math.prod(shape)
    size = parameters.get("binary_data_size")
    rest = {k: v for k, v in parameters.items() if k != "binary_data_size"}
    form = [name, datatype, shape[1:], rest, size is not None]
    if size is not None:
        if not _dimension(size) or offset + size > len(body) or "data" in item:
            return None
        raw = body[offset : offset + size]
        if _elements(datatype, raw) != elements:
            return None
        return shape[0], raw, offset + size, form
    data = item.get("data")
    if not isinstance(data, list):
        return None
    flat = _flatten(data)
    if flat is None or len(flat) != elements:
        return None
    return shape[0], flat, offset, form


def _split_output(
    output: Any, body: bytes, offset: int, rows: list[int]
) -> tuple[list[list[Any]] | list[bytes], int]:
    """An output's rows for each member, and the offset after its binary data."""
    if not isinstance(output, dict):
        raise SplitError("an output is not an object")
    name, datatype, shape = output.get("name"), output.get("datatype"), output.get("shape")
    if not isinstance(shape, list) or not shape or not all(_dimension(d) for d in shape):
        raise SplitError(f"output {name!r} has no valid shape")
    if shape[0] != sum(rows):
        raise SplitError(f"output {name!r} has {shape[0]} rows in dimension 0, the batch {sum(rows)}")
    per_row = math.prod(shape[1:])
    parameters = output.get("parameters", {})
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if not _dimension(size) or offset + size > len(body):
            raise SplitError(f"output {name!r}: binary_data_size runs past the answer")
        raw = body[offset : offset + size]
        cuts = _cuts(datatype, raw, per_row, rows)
        if cuts is None:
            raise SplitError(f"output {name!r}: its {size} bytes do not hold shape {shape} of {datatype}")
        return [raw[a:b] for a, b in itertools.pairwise(cuts)], offset + size
    data = output.get("data")
    flat = _flatten(data) if isinstance(data, list) else None
    if flat is None or len(flat) != per_row * sum(rows):
        raise SplitError(f"output {name!r}: its data does not hold shape {shape}")
    pieces, start = [], 0
    for count in rows:
        pieces.append(flat[start : start + count * per_row])
        start += count * per_row
    return pieces, offset


def _cuts(datatype: Any, raw: bytes, per_row: int, rows: list[int]) -> list[int] | None:
    """Byte offsets where each member's rows of a binary tensor start (and where the last ends)."""
    if datatype in FIXED_SIZE:
        row_bytes = per_row * FIXED_SIZE[datatype]
        if len(raw) != row_bytes * sum(rows):
            return None
        cuts = [0]
        for count in rows:
            cuts.append(cuts[-1] + count * row_bytes)
        return cuts
    if datatype != "BYTES":
        return None
    starts = _element_starts(raw)
    if starts is None or len(starts) != per_row * sum(rows):
        return None
    starts.append(len(raw))
    cuts, element = [0], 0
    for count in rows:
        element += count * per_row
        cuts.append(starts[element])
    return cuts


def _elements(datatype: str, raw: bytes) -> int | None:
    """How many elements a binary tensor of `datatype` holds; None when its bytes are malformed."""
    if datatype == "BYTES":
        starts = _element_starts(raw)
        return None if starts is None else len(starts)
    itemsize = FIXED_SIZE[datatype]
    return None if len(raw) % itemsize else len(raw) // itemsize


def _element_starts(raw: bytes) -> list[int] | None:
    """Where each element of a serialized BYTES tensor (4-byte little-endian length, then the
    bytes) starts; None when the lengths do not add up to the buffer."""
    starts, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            return None
        starts.append(offset)
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4 + length
    return starts if offset == len(raw) else None


def _dimension(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _flatten(data: list[Any]) -> list[Any] | None:
    """Row-major flat values of possibly nested lists; None when nesting is ragged."""
    if not any(isinstance(v, list) for v in data):
        return data
    if not all(isinstance(v, list) for v in data):
        return None
    flat: list[Any] = []
    for inner in data:
        values = _flatten(inner)
        if values is None:
            return None
        flat.extend(values)
    return flat
