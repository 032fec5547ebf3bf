"""A request is a retry when its client says so: the openai SDK's x-stainless-retry-count, or any
client's X-Retry-Attempt, above 0."""

import pytest

from gateway.flow.request_meta import RequestClassifier
from gateway.settings import parse_settings

SETTINGS = parse_settings(
    {
        "priorities": [{"name": "low", "max_wait_ms": 1000}],
        "default_priority": "low",
        "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9", "max_concurrency": 1}]}],
    }
)


@pytest.mark.parametrize(
    ("headers", "retry"),
    [
        ([], False),
        ([(b"x-stainless-retry-count", b"0")], False),  # the SDK's first attempt
        ([(b"x-stainless-retry-count", b"1")], True),
        ([(b"x-retry-attempt", b" 3 ")], True),
        ([(b"x-retry-attempt", b"yes")], False),
        ([(b"x-retry-attempt", b"-1")], False),
        ([(b"x-retry-attempt", b"9" * 40)], False),
        ([(b"x-stainless-retry-count", b"0"), (b"x-retry-attempt", b"2")], True),
    ],
)
def test_a_retry_is_what_the_client_counts_above_zero(headers, retry):
    assert RequestClassifier(SETTINGS).classify(headers).retry is retry
