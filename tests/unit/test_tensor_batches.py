"""Merging KServe v2 requests along dimension 0 and splitting the answer back (gateway.tensors.batch).

Requests are built by tritonclient's own encoder; the reference answers are the simulator's identity
model answering each request alone, so a split answer must equal the unbatched one: binary tensor
bytes byte for byte, JSON headers value for value.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import triton_to_np_dtype

from gateway.tensors.batch import SplitError, merged, part_of, split
from gateway.tensors.datatypes import FIXED_SIZE
from gateway.tools.model_server.tensors import infer_response, parse_infer

PATH = "/v2/models/sim/infer"
DTYPES = {"FP32": np.float32, "INT64": np.int64, "FP16": np.float16, "BOOL": np.bool_, "BYTES": np.object_}


def tensor(datatype: str, rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if datatype == "BYTES":
        words = [f"w{rng.integers(0, 10 ** int(rng.integers(1, 6)))}".encode() for _ in range(rows * width)]
        return np.array(words, dtype=np.object_).reshape(rows, width)
    if datatype == "BOOL":
        return rng.integers(0, 2, (rows, width)).astype(np.bool_)
    if datatype == "INT64":
        return rng.integers(-(2**40), 2**40, (rows, width), dtype=np.int64)
    return rng.standard_normal((rows, width)).astype(DTYPES[datatype])


def request(
    arrays: list[np.ndarray], datatypes: list[str], *, binary: bool, binary_out: bool, request_id: str = ""
) -> tuple[bytes, int | None]:
    inputs = []
    for index, (array, datatype) in enumerate(zip(arrays, datatypes, strict=True)):
        item = triton.InferInput(f"INPUT{index}", list(array.shape), datatype)
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    outputs = [triton.InferRequestedOutput(f"OUTPUT{i}", binary_data=binary_out) for i in range(len(arrays))]
    return triton.InferenceServerClient.generate_request_body(inputs, outputs, request_id=request_id)


def answer_alone(body: bytes, header_length: int | None) -> tuple[bytes, int | None]:
    """The simulator's identity model answering one request."""
    return infer_response("sim", "1", parse_infer(body, header_length))


def decoded(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    result = triton.InferResult.from_response_body(body, header_length=header_length)
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def header_of(body: bytes, header_length: int | None) -> dict:
    return json.loads(body if header_length is None else body[:header_length])


def blobs_of(body: bytes, header_length: int | None) -> bytes:
    return b"" if header_length is None else body[header_length:]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", list(DTYPES))
def test_a_split_answer_equals_each_members_unbatched_answer(datatype, binary):
    sizes = [1, 3, 2, 5]
    bodies = [
        request(
            [tensor(datatype, rows, 4, seed), tensor("INT64", rows, 2, seed + 100)],
            [datatype, "INT64"],
            binary=binary,
            binary_out=binary,
            request_id=f"req-{seed}",
        )
        for seed, rows in enumerate(sizes)
    ]
    parts = [part_of(PATH, body, length) for body, length in bodies]
    assert all(p is not None for p in parts)
    assert len({p.key for p in parts}) == 1
    assert [p.rows for p in parts] == sizes

    batch_body, batch_length = merged(parts)
    assert parse_infer(batch_body, batch_length).batch == sum(sizes)
    answers = split(*answer_alone(batch_body, batch_length), parts)

    for (body, length), (got, got_length) in zip(bodies, answers, strict=True):
        want, want_length = answer_alone(body, length)
        assert header_of(got, got_length) == header_of(want, want_length)
        assert blobs_of(got, got_length) == blobs_of(want, want_length)
        for name, array in decoded(want, want_length).items():
            np.testing.assert_array_equal(decoded(got, got_length)[name], array)


def test_mixed_output_encodings_split_per_output():
    arrays = [tensor("FP32", 2, 3, 1), tensor("BYTES", 2, 1, 2)]
    inputs = []
    for index, (array, datatype) in enumerate(zip(arrays, ["FP32", "BYTES"], strict=True)):
        item = triton.InferInput(f"INPUT{index}", list(array.shape), datatype)
        item.set_data_from_numpy(array, binary_data=index == 0)
        inputs.append(item)
    outputs = [
        triton.InferRequestedOutput("OUTPUT0", binary_data=False),
        triton.InferRequestedOutput("OUTPUT1"),
    ]
    first = triton.InferenceServerClient.generate_request_body(inputs, outputs)
    second = triton.InferenceServerClient.generate_request_body(inputs, outputs, request_id="b")
    parts = [part_of(PATH, *first), part_of(PATH, *second)]
    answers = split(*answer_alone(*merged(parts)), parts)
    for alone, got in zip([first, second], answers, strict=True):
        want = answer_alone(*alone)
        assert header_of(*got) == header_of(*want)
        assert blobs_of(*got) == blobs_of(*want)


def test_nested_json_data_merges_as_its_flat_rows():
    nested = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]}
    flat = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 2], "data": [5, 6]}]}
    parts = [part_of(PATH, json.dumps(nested).encode(), None), part_of(PATH, json.dumps(flat).encode(), None)]
    body, length = merged(parts)
    assert length is None
    want = {"name": "INPUT0", "datatype": "INT32", "shape": [3, 2], "data": [1, 2, 3, 4, 5, 6]}
    assert json.loads(body)["inputs"][0] == want


def key_of(document: dict, path: str = PATH) -> str | None:
    part = part_of(path, json.dumps(document).encode(), None)
    return None if part is None else part.key


BASE = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}


def varied(**changes: object) -> dict:
    document = json.loads(json.dumps(BASE))
    for field, value in changes.items():
        if field in ("datatype", "shape", "data", "name"):
            document["inputs"][0][field] = value
        else:
            document[field] = value
    return document


@pytest.mark.parametrize(
    "other",
    [
        varied(name="INPUT1"),
        varied(datatype="FP64"),
        varied(shape=[1, 1], data=[1.0]),
        varied(parameters={"binary_data_output": True}),
        varied(outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}]),
        varied(parameters={"priority": 2}),
    ],
    ids=["input name", "datatype", "inner shape", "binary_data_output", "output choice", "parameters"],
)
def test_requests_that_differ_in_what_a_batch_shares_get_different_keys(other):
    assert key_of(other) is not None
    assert key_of(other) != key_of(BASE)


def test_the_version_in_the_path_is_part_of_the_key():
    assert key_of(BASE, "/v2/models/sim/versions/2/infer") != key_of(BASE)


def test_batch_size_and_id_are_not_part_of_the_key():
    assert key_of(varied(shape=[2, 2], data=[1.0, 2.0, 3.0, 4.0], id="x")) == key_of(BASE)


@pytest.mark.parametrize(
    "document",
    [
        varied(parameters={"sequence_id": 7}),
        varied(parameters={"sequence_start": True}),
        {"inputs": [{**BASE["inputs"][0], "parameters": {"shared_memory_region": "r"}}]},
        varied(outputs=[{"name": "OUTPUT0", "parameters": {"shared_memory_region": "r"}}]),
        varied(shape=[1, 3]),  # data does not fill the shape
        varied(shape=[0, 2], data=[]),  # no batch
        varied(shape=[]),
        varied(datatype="FP8"),
        varied(extension={"x": 1}),
        {"inputs": [BASE["inputs"][0], {"name": "B", "datatype": "FP32", "shape": [2, 1], "data": [1, 2]}]},
        {"inputs": []},
        [1, 2],
    ],
    ids=[
        "sequence id", "sequence start", "shared memory in", "shared memory out", "short data", "empty batch",
        "scalar", "unknown datatype", "unknown field", "batch sizes differ", "no inputs", "not an object",
    ],
)  # fmt: skip
def test_requests_a_batch_would_change_pass_alone(document):
    assert part_of(PATH, json.dumps(document).encode(), None) is None


def test_malformed_bodies_pass_alone():
    body, length = request([tensor("FP32", 2, 2, 0)], ["FP32"], binary=True, binary_out=True)
    assert part_of(PATH, body, length) is not None
    assert part_of(PATH, body[:-1], length) is None  # the tensor is short
    assert part_of(PATH, body + b"x", length) is None  # bytes no input claims
    assert part_of(PATH, body, len(body) + 1) is None
    assert part_of(PATH, b"{not json", None) is None
    assert part_of(PATH, b"[" * 5000 + b"]" * 5000, None) is None


def test_an_answer_that_does_not_carry_the_batch_cannot_be_split():
    parts = [part_of(PATH, json.dumps(BASE).encode(), None) for _ in range(2)]
    one_row = {"outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}
    with pytest.raises(SplitError, match="rows"):
        split(json.dumps(one_row).encode(), None, parts)
    short = {"outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [2, 2], "data": [1.0]}]}
    with pytest.raises(SplitError, match="data"):
        split(json.dumps(short).encode(), None, parts)
    with pytest.raises(SplitError, match="outputs"):
        split(b'{"error": "boom"}', None, parts)
    sized = {"binary_data_size": 16}
    binary = {"outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [2, 2], "parameters": sized}]}
    head = json.dumps(binary).encode()
    with pytest.raises(SplitError, match="runs past"):
        split(head + b"\0" * 8, len(head), parts)
    with pytest.raises(SplitError, match="no output claims"):
        split(head + b"\0" * 20, len(head), parts)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    width=st.integers(1, 3),
    datatype=st.sampled_from(list(DTYPES)),
    binary=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_merge_then_split_of_the_identity_gives_back_each_members_tensors(
    sizes, width, datatype, binary, seed
):
    arrays = [tensor(datatype, rows, width, seed + i) for i, rows in enumerate(sizes)]
    bodies = [request([a], [datatype], binary=binary, binary_out=binary) for a in arrays]
    parts = [part_of(PATH, *body) for body in bodies]
    answers = split(*answer_alone(*merged(parts)), parts)
    for array, body, answer in zip(arrays, bodies, answers, strict=True):
        got = decoded(*answer)["OUTPUT0"]
        np.testing.assert_array_equal(got, decoded(*answer_alone(*body))["OUTPUT0"])
        assert got.shape == array.shape


def test_the_datatype_sizes_are_tritonclients():
    for name, size in FIXED_SIZE.items():
        assert np.dtype(triton_to_np_dtype(name)).itemsize == size, name
