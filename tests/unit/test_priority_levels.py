"""Triton's `priority` request parameter as a class (`priority_levels`): for clients that send it
(tritonclient's `priority=`, perf_analyzer) rather than X-Priority."""

import pytest

from gateway.flow.request_meta import Problem, RequestClassifier
from gateway.http.pricing import request_parameter
from gateway.settings import ConfigError, parse_settings
from policies.outcomes import Outcome

BASE = {
    "priorities": [{"name": "high", "max_wait_ms": 250}, {"name": "low", "max_wait_ms": 1000}],
    "default_priority": "low",
    "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9", "max_concurrency": 1}]}],
    "priority_levels": {1: "high", 2: "low"},
}


def classifier(**overrides) -> RequestClassifier:
    return RequestClassifier(parse_settings({**BASE, **overrides}))


def test_a_level_picks_its_class_and_0_is_the_default():
    levels = classifier()
    meta = levels.classify([])
    assert levels.reads_levels
    assert levels.at_level(meta, 1).priority == "high"
    assert levels.at_level(meta, 2).priority == "low"
    assert levels.at_level(meta, 0).priority == "low"
    assert levels.at_level(meta, None) is meta  # none sent


@pytest.mark.parametrize("level", [3, -1, "1", 1.0, True])
def test_a_level_not_mapped_or_not_an_integer_is_refused_naming_the_map(level):
    refused = classifier().at_level(classifier().classify([]), level)
    assert isinstance(refused, Problem) and refused.outcome is Outcome.UNKNOWN_PRIORITY
    if level == 3:
        assert "priority 3 is not mapped (priority_levels: 1: high, 2: low)" in refused.detail


def test_a_tenants_max_priority_caps_the_level_as_it_caps_x_priority():
    capped = classifier(tenants=[{"name": "t", "api_keys": ["key-of-tenant-t"], "max_priority": "low"}])
    meta = capped.classify([(b"authorization", b"Bearer key-of-tenant-t")])
    assert capped.at_level(meta, 1).priority == "low"


def test_without_levels_nothing_is_read_and_a_class_that_does_not_exist_is_a_config_error():
    assert not RequestClassifier(parse_settings({**BASE, "priority_levels": {}})).reads_levels
    with pytest.raises(ConfigError, match="priority_levels"):
        parse_settings({**BASE, "priority_levels": {1: "gold"}})
    with pytest.raises(ConfigError, match="priority_levels"):
        parse_settings({**BASE, "priority_levels": {0: "high"}})  # 0 is Triton's default


def test_the_parameter_is_read_from_json_and_from_a_binary_bodys_json_header():
    body = b'{"parameters": {"priority": 1}, "inputs": []}'
    assert request_parameter(body, [], "priority") == 1
    binary = body + b"\x00\x01\x02\x03"
    headers = [(b"inference-header-content-length", str(len(body)).encode())]
    assert request_parameter(binary, headers, "priority") == 1
    assert request_parameter(b'{"inputs": []}', [], "priority") is None
    assert request_parameter(b"not json", [], "priority") is None
    assert request_parameter(b'{"parameters": [1]}', [], "priority") is None
