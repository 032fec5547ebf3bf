"""A refusal's body names the rule that caused it, in the style of its route (gateway/errors.py)."""

import json

from gateway.errors import ErrorStyle, error_response
from policies.outcomes import Outcome


def test_a_kserve_refusal_names_its_rule_beside_its_reason():
    status, _, body = error_response(
        Outcome.QUEUE_FULL, ErrorStyle.KSERVE, retry_after_s=0.5, rule="priorities[low].max_wait_ms"
    )
    assert status == 429
    assert json.loads(body) == {
        "error": "the queue for this priority class is full",
        "reason": "queue_full",
        "rule": "priorities[low].max_wait_ms",
    }


def test_an_openai_refusal_names_its_rule_as_the_errors_param():
    _, _, body = error_response(Outcome.OUTSIDE_WINDOW, ErrorStyle.OPENAI, rule="windows[nightly]")
    error = json.loads(body)["error"]
    assert (error["code"], error["param"]) == ("outside_window", "windows[nightly]")


def test_without_a_rule_the_body_has_none():
    _, _, body = error_response(Outcome.NO_BACKEND, ErrorStyle.KSERVE)
    assert "rule" not in json.loads(body)
