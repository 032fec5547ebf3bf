"""Which requests' deadlines tell `max_concurrency: auto` how the backend keeps them
(gateway.upstream.exchange.count_deadline)."""

from types import SimpleNamespace

from gateway.upstream.backends import BackendState
from gateway.upstream.exchange import count_deadline


def answered(status=200):
    return SimpleNamespace(complete=True, status=status, given_up=None)


def backend():
    return BackendState("m", "http://127.0.0.1:9", 8, "/", ready=True)


def test_answers_in_time_and_late_are_counted_failures_are_not():
    b = backend()
    count_deadline(b, answered(), True, 0.0)
    count_deadline(b, answered(), False, 0.0)
    count_deadline(b, answered(503), False, 0.0)
    assert (b.deadlines_kept, b.deadlines_missed) == (1, 1)


def test_a_request_sent_before_the_limit_moved_tells_nothing_of_the_new_limit():
    b = backend()
    b.limit_moved_at = 10.0
    count_deadline(b, answered(), False, 9.9)  # late at the old limit
    assert (b.deadlines_kept, b.deadlines_missed) == (0, 0)
    count_deadline(b, answered(), False, 10.0)
    assert (b.deadlines_kept, b.deadlines_missed) == (0, 1)
