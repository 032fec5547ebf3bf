"""gateway.upstream.priority: a request's class in the body, in the backend's own terms."""

from __future__ import annotations

import json

import pytest

from gateway.settings import ForwardPriority
from gateway.tensors.batch import HEADER_LENGTH
from gateway.upstream.priority import with_priority

VLLM = ForwardPriority(field="priority", values={"high": 0, "low": 10})
TRITON = ForwardPriority(field="priority", values={"high": 1, "low": 5})


def test_an_openai_body_gets_the_field_in_place_of_the_clients_own():
    body = json.dumps({"model": "m", "messages": [], "priority": -100}).encode()
    headers, written = with_priority(
        VLLM, "low", [(b"content-type", b"application/json")], body, model_in_body=True
    )
    assert json.loads(written) == {"model": "m", "messages": [], "priority": 10}
    assert headers == [(b"content-type", b"application/json")]


def test_a_class_without_a_value_takes_the_clients_field_away():
    body = json.dumps({"model": "m", "priority": -100}).encode()
    rule = ForwardPriority(values={"high": 0})
    _, written = with_priority(rule, "low", [], body, model_in_body=True)
    assert json.loads(written) == {"model": "m"}
    kserve = json.dumps({"inputs": [], "parameters": {"priority": 1}}).encode()
    _, written = with_priority(rule, "low", [], kserve, model_in_body=False)
    assert json.loads(written) == {"inputs": []}


def test_a_kserve_json_body_gets_it_among_its_parameters():
    body = json.dumps({"id": "a", "inputs": [{"name": "x"}], "parameters": {"sequence_id": 3}}).encode()
    _, written = with_priority(TRITON, "high", [], body, model_in_body=False)
    assert json.loads(written) == {
        "id": "a",
        "inputs": [{"name": "x"}],
        "parameters": {"sequence_id": 3, "priority": 1},
    }


def test_a_binary_body_gets_it_in_its_json_header_whose_length_is_set_anew():
    header = json.dumps({"inputs": [{"name": "x", "parameters": {"binary_data_size": 4}}]}).encode()
    tensor = b"\x00\x01\x02\x03"
    headers = [(b"content-type", b"application/octet-stream"), (HEADER_LENGTH, str(len(header)).encode())]
    new_headers, written = with_priority(TRITON, "low", headers, header + tensor, model_in_body=False)
    length = int(dict(new_headers)[HEADER_LENGTH])
    assert json.loads(written[:length])["parameters"] == {"priority": 5}
    assert written[length:] == tensor
    assert new_headers[0] == (b"content-type", b"application/octet-stream")


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_passes_as_it_is(body):
    assert with_priority(VLLM, "high", [], body, model_in_body=True) == ([], body)
    assert with_priority(TRITON, "high", [], body, model_in_body=False) == ([], body)
