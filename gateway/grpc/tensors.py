"""gRPC inference messages to and from the KServe v2 HTTP binary tensor extension, byte for byte.

A `ModelInferRequest` goes up as one binary body: its JSON header (ids, parameters, shapes) and
every input's bytes after it, `raw_input_contents` as they came and typed contents (`fp32_contents`
and the rest) packed little-endian as Triton packs them, so that the backend sees the bytes a gRPC
backend would. Outputs are asked for as binary, so that they come back as the backend wrote them and
pass into `raw_output_contents` untouched; an output a backend answers as JSON `data` anyway is
packed the same way. BYTES elements are length-prefixed (4 bytes, little-endian) in both protocols.

What cannot be sent is refused here (`TensorError`, INVALID_ARGUMENT): an unknown datatype, a
fixed-size tensor whose bytes do not match its shape, typed contents of the wrong kind, raw contents
not one per input.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tritonclient.grpc import service_pb2

from gateway.tensors.datatypes import FIXED_SIZE, STRUCT_FORMAT, flattened

CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""Where each datatype's typed contents live (FP16 and BF16 travel raw only)."""

_LENGTH = struct.Struct("<I")


class TensorError(ValueError):
    """The request's tensors cannot be sent as they are: the client's fault."""


def datatype_size(datatype: str) -> int | None:
    """Bytes per element of a fixed-size datatype; None for BYTES; TensorError for an unknown one."""
    if datatype == "BYTES":
        return None
    size = FIXED_SIZE.get(datatype)
    if size is None:
        raise TensorError(f"unknown datatype {datatype!r}")
    return size


def request_body(request: Any) -> tuple[bytes, int]:
    """A `ModelInferRequest` as a binary KServe v2 body, and its JSON header's length."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise TensorError(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    header: dict[str, Any] = {}
    if request.id:
        header["id"] = request.id
    parameters = parameter_values(request.parameters)
    inputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for index, tensor in enumerate(request.inputs):
        shape = list(tensor.shape)
        if any(d < 0 for d in shape):
            raise TensorError(f"input {tensor.name!r}: a shape has no negative dimension ({shape})")
        entry: dict[str, Any] = {"name": tensor.name, "shape": shape, "datatype": tensor.datatype}
        size = datatype_size(tensor.datatype)
        tensor_parameters = parameter_values(tensor.parameters)
        data: bytes | None = None
        if raw:
            data = raw[index]
        elif tensor.HasField("contents"):
            data = _packed_contents(tensor.name, tensor.datatype, tensor.contents)
        elif "shared_memory_region" not in tensor_parameters:
            raise TensorError(f"input {tensor.name!r} has no data (no contents, no shared memory)")
        if data is not None:
            if size is not None and len(data) != size * math.prod(shape):
                raise TensorError(
                    f"input {tensor.name!r}: {len(data)} bytes for shape {shape} of {tensor.datatype}"
                )
            tensor_parameters["binary_data_size"] = len(data)
            blobs.append(data)
        if tensor_parameters:
            entry["parameters"] = tensor_parameters
        inputs.append(entry)
    header["inputs"] = inputs
    if request.outputs:
        outputs = []
        for output in request.outputs:
            wanted = parameter_values(output.parameters)
            if "shared_memory_region" not in wanted:
                wanted["binary_data"] = True
            outputs.append({"name": output.name, "parameters": wanted})
        header["outputs"] = outputs
    else:
        parameters["binary_data_output"] = True
    if parameters:
        header["parameters"] = parameters
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((head, *blobs)), len(head)


def infer_response(body: bytes, header_length: int | None) -> Any:
    """A KServe v2 answer (JSON, or binary with its header's length) as a `ModelInferResponse`.

    ValueError when it is not one (the backend's fault: the caller answers INTERNAL).
    """
    if header_length is not None and not 0 <= header_length <= len(body):
        raise ValueError("Inference-Header-Content-Length runs past the answer")
    header = json.loads(body if header_length is None else body[:header_length])
    if not isinstance(header, dict):
        raise ValueError("the answer is not a JSON object")
    response = service_pb2.ModelInferResponse(
        model_name=str(header.get("model_name", "")),
        model_version=str(header.get("model_version", "")),
        id=str(header.get("id", "")),
    )
    set_parameters(response.parameters, header.get("parameters"))
    offset = header_length or 0
    for output in header.get("outputs") or []:
        parameters = dict(output.get("parameters") or {})
        size = parameters.pop("binary_data_size", None)
        datatype = str(output.get("datatype", ""))
        tensor = response.outputs.add(name=str(output.get("name", "")), datatype=datatype)
        tensor.shape.extend(int(d) for d in output.get("shape", []))
        set_parameters(tensor.parameters, parameters)
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(body):
                raise ValueError(f"output {tensor.name!r}: binary_data_size runs past the answer")
            data = body[offset : offset + size]
            offset += size
        elif "data" in output:
            data = packed(datatype, flattened(output["data"]))
        else:
            data = b""  # in shared memory: its place in raw_output_contents is kept, as Triton keeps it
        response.raw_output_contents.append(data)
    return response


def packed(datatype: str, values: Sequence[Any]) -> bytes:
    """Elements of `datatype` as the binary extension and raw contents hold them."""
    if datatype == "BYTES":
        parts: list[bytes] = []
        for value in values:
            item = value.encode() if isinstance(value, str) else bytes(value)
            parts += (_LENGTH.pack(len(item)), item)
        return b"".join(parts)
    if datatype == "BF16":
        return b"".join(_bf16(float(v)) for v in values)
    fmt = STRUCT_FORMAT.get(datatype)
    if fmt is None:
        raise TensorError(f"unknown datatype {datatype!r}")
    try:
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except struct.error as error:
        raise TensorError(f"{datatype} values do not fit: {error}") from None


def _bf16(value: float) -> bytes:
    """A bfloat16: a float32's upper half, rounded to nearest even (NaN stays NaN)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    if math.isnan(value):
        return struct.pack("<H", (bits >> 16) | 0x40)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return struct.pack("<H", (bits >> 16) & 0xFFFF)


def _packed_contents(name: str, datatype: str, contents: Any) -> bytes:
    field = CONTENTS.get(datatype)
    if field is None:
        raise TensorError(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
    sent = [f.name for f, _ in contents.ListFields()]
    if sent and sent != [field]:
        raise TensorError(f"input {name!r}: {datatype} data belongs in contents.{field}, not {sent}")
    return packed(datatype, list(getattr(contents, field)))


def parameter_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """gRPC `InferParameter`s as the JSON values KServe HTTP carries."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        if which is not None:
            values[key] = getattr(parameter, which)
    return values


def set_parameters(target: Any, values: object) -> None:
    """JSON parameter values into a gRPC parameter map (values of other kinds are left out)."""
    if not isinstance(values, dict):
        return
    for key, value in values.items():
        parameter = target[str(key)]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            if value >= 1 << 63:
                parameter.uint64_param = value
            else:
                parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            del target[str(key)]


def batch_size(request: Any) -> float:
    """Dimension 0 of the first input's shape (what a model priced by items charges), or 1."""
    inputs: Iterable[Any] = request.inputs
    for tensor in inputs:
        return float(tensor.shape[0]) if len(tensor.shape) and tensor.shape[0] >= 1 else 1.0
    return 1.0
