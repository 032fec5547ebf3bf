"""gRPC inference messages to and from the KServe v2 binary extension, and the gRPC status table."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.grpc.service import InferenceService
from gateway.grpc.status import CODES, outcome_error
from gateway.grpc.tensors import TensorError, infer_response, packed, request_body
from gateway.tools.model_server.tensors import parse_infer
from policies.outcomes import Outcome

# Datatype -> (numpy dtype, typed contents field, a strategy of its values).
TYPED = {
    "BOOL": (np.bool_, "bool_contents", st.booleans()),
    "INT8": (np.int8, "int_contents", st.integers(-(2**7), 2**7 - 1)),
    "INT16": (np.int16, "int_contents", st.integers(-(2**15), 2**15 - 1)),
    "INT32": (np.int32, "int_contents", st.integers(-(2**31), 2**31 - 1)),
    "INT64": (np.int64, "int64_contents", st.integers(-(2**63), 2**63 - 1)),
    "UINT8": (np.uint8, "uint_contents", st.integers(0, 2**8 - 1)),
    "UINT16": (np.uint16, "uint_contents", st.integers(0, 2**16 - 1)),
    "UINT32": (np.uint32, "uint_contents", st.integers(0, 2**32 - 1)),
    "UINT64": (np.uint64, "uint64_contents", st.integers(0, 2**64 - 1)),
    "FP32": (np.float32, "fp32_contents", st.floats(width=32, allow_nan=False)),
    "FP64": (np.float64, "fp64_contents", st.floats(allow_nan=False)),
}


@st.composite
def typed_tensors(draw):
    datatype = draw(st.sampled_from(sorted(TYPED)))
    dtype, field, values = TYPED[datatype]
    data = draw(st.lists(values, max_size=12))
    return datatype, dtype, field, data


@given(st.lists(typed_tensors(), min_size=1, max_size=4), st.booleans())
def test_typed_and_raw_contents_go_up_as_the_bytes_numpy_holds(tensors, raw):
    request = service_pb2.ModelInferRequest(model_name="m", id="x")
    expected = []
    for i, (datatype, dtype, field, data) in enumerate(tensors):
        tensor = request.inputs.add(name=f"IN{i}", datatype=datatype, shape=[len(data)])
        array = np.array(data, dtype=dtype)
        expected.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
        if raw:
            request.raw_input_contents.append(expected[-1])
        else:
            getattr(tensor.contents, field).extend(data)
    body, header_length = request_body(request)
    parsed = parse_infer(body, header_length)
    assert parsed.id == "x"
    assert [t.raw for t in parsed.inputs] == expected
    assert [t.shape for t in parsed.inputs] == [[len(d)] for _, _, _, d in tensors]
    header = json.loads(body[:header_length])
    assert header["parameters"] == {"binary_data_output": True}  # every output comes back binary


def test_bytes_are_length_prefixed_in_both_protocols():
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="S", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(
        [b"", b"ab", b"\xff"]
    )
    body, header_length = request_body(request)
    assert body[header_length:] == b"\0\0\0\0" + b"\2\0\0\0ab" + b"\1\0\0\0\xff"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.inputs[0].shape.__setitem__(0, 3), "8 bytes for shape [3] of FP32"),
        (lambda r: setattr(r.inputs[0], "datatype", "FP8"), "unknown datatype 'FP8'"),
        (lambda r: r.raw_input_contents.append(b"\0" * 8), "raw_input_contents has 2 entries for 1 inputs"),
        (lambda r: r.inputs[0].contents.int_contents.append(1), "belongs in contents.fp32_contents"),
        (lambda r: r.inputs.add(name="B", datatype="INT8", shape=[1]), "input 'B' has no data"),
        (lambda r: r.inputs[0].shape.__setitem__(0, -2), "no negative dimension"),
    ],
    ids=["short", "unknown datatype", "raw and typed", "wrong kind", "no data", "negative shape"],
)
def test_tensors_that_cannot_be_sent_are_the_clients_fault(change, message):
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="A", datatype="FP32", shape=[2]).contents.fp32_contents.extend([1, 2])
    if "raw_input_contents" in message:
        request.raw_input_contents.append(b"\0" * 8)
        request.inputs[0].ClearField("contents")
    change(request)
    with pytest.raises(TensorError, match=message.replace("[", r"\[").replace("]", r"\]")):
        request_body(request)


def test_an_answer_in_json_is_packed_as_triton_would_send_it_raw():
    header = {
        "model_name": "m",
        "model_version": "1",
        "id": "q",
        "parameters": {"sequence_id": 7, "note": "x", "ok": True, "ratio": 0.5},
        "outputs": [
            {"name": "F", "datatype": "FP16", "shape": [2, 1], "data": [[1.5], [-2]]},
            {"name": "S", "datatype": "BYTES", "shape": [2], "data": ["é", "b"]},
            {"name": "R", "datatype": "INT16", "shape": [1], "parameters": {"binary_data_size": 2}},
        ],
    }
    head = json.dumps(header).encode()
    response = infer_response(head + b"\x07\x00", len(head))
    assert response.raw_output_contents[0] == np.array([1.5, -2], dtype="<f2").tobytes()
    assert response.raw_output_contents[1] == b"\2\0\0\0" + "é".encode() + b"\1\0\0\0b"
    assert response.raw_output_contents[2] == b"\x07\x00"
    assert [list(o.shape) for o in response.outputs] == [[2, 1], [2], [1]]
    assert response.parameters["sequence_id"].int64_param == 7
    assert response.parameters["ok"].bool_param is True
    assert response.parameters["ratio"].double_param == 0.5
    assert "binary_data_size" not in response.outputs[2].parameters


def test_bf16_is_a_float32s_upper_half_rounded_to_nearest_even():
    assert packed("BF16", [1.0, -2.0]) == b"\x80\x3f\x00\xc0"
    # 1 + 2^-8 is halfway between two bfloat16s: it rounds to the even one (1.0).
    assert packed("BF16", [1 + 2**-8]) == b"\x80\x3f"
    assert packed("BF16", [1 + 3 * 2**-8]) == b"\x82\x3f"


def test_every_outcome_but_ok_has_a_grpc_status():
    assert set(CODES) == set(Outcome) - {Outcome.OK}


def test_a_refusal_carries_its_pushback_and_details_and_a_hopeless_one_none():
    error = outcome_error(Outcome.QUEUE_FULL, retry_after_s=1.2346, rule="low.max_wait_ms")
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_ms == 1235
    trailers = dict(error.trailers)
    assert trailers["grpc-retry-pushback-ms"] == "1235"
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    retry, info = error_details_pb2.RetryInfo(), error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(retry) and retry.retry_delay.ToMilliseconds() == 1235
    assert status.details[1].Unpack(info) and info.reason == "QUEUE_FULL"
    assert info.metadata["rule"] == "low.max_wait_ms"
    hopeless = outcome_error(Outcome.BUDGET_TOO_SMALL, retry_after_s=3.0)
    assert hopeless.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "grpc-retry-pushback-ms" not in dict(hopeless.trailers) and hopeless.retry_after_ms is None


def test_every_method_of_the_service_is_served_or_says_why_not():
    base = service_pb2_grpc.GRPCInferenceServiceServicer
    methods = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
    for method in methods:
        assert getattr(InferenceService, method.name) is not getattr(base, method.name), method.name
