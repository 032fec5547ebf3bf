"""Pricing KServe v2 requests by batch items (gateway.http.pricing)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as triton

from gateway.http.pricing import batch_items
from gateway.tensors.batch import HEADER_LENGTH


def json_body(*shapes: list[int]) -> bytes:
    inputs = [
        {"name": f"IN{i}", "shape": shape, "datatype": "FP32", "data": [0]} for i, shape in enumerate(shapes)
    ]
    return json.dumps({"inputs": inputs}).encode()


def test_a_json_request_costs_its_first_inputs_batch():
    assert batch_items(json_body([16, 4], [16, 2]), []) == 16.0
    assert batch_items(json_body([1, 4]), []) == 1.0


def test_a_binary_request_is_priced_from_its_json_header_alone():
    tensor = triton.InferInput("INPUT0", [8, 3], "FP32")
    tensor.set_data_from_numpy(np.ones((8, 3), dtype=np.float32), binary_data=True)
    body, header_length = triton.InferenceServerClient.generate_request_body([tensor])
    assert header_length is not None and len(body) > header_length
    assert batch_items(body, [(HEADER_LENGTH, str(header_length).encode())]) == 8.0


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b"not json", []),
        (b'{"inputs": []}', []),
        (b'{"inputs": [{"name": "x"}]}', []),
        (json_body([]), []),
        (json_body([0, 4]), []),
        (b'{"inputs": [{"shape": [true, 4]}]}', []),
        (b'{"inputs": [{"shape": ["8", 4]}]}', []),
        (b'{"inputs": [{"shape": [2.5, 4]}]}', []),
        (json_body([4, 4]), [(HEADER_LENGTH, b"abc")]),
        (json_body([4, 4]), [(HEADER_LENGTH, b"99999")]),
        (b"[1, 2]", []),
    ],
)
def test_a_body_whose_batch_cannot_be_read_costs_one(body, headers):
    assert batch_items(body, headers) == 1.0


def test_a_body_or_a_header_length_pricing_cannot_read_costs_one():
    deep = b'{"inputs": [{"shape": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    assert batch_items(deep, []) == 1.0
    assert batch_items(json_body([8, 2]), [(HEADER_LENGTH, b"9" * 5000)]) == 1.0  # past int()'s digits
    assert batch_items(json_body([8, 2]), [(HEADER_LENGTH, b"-1")]) == 1.0
