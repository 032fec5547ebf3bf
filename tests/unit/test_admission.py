import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.admission import AdmissionRequest, Admit, Reject, allowed_wait_s, decide, max_positions, refuse
from policies.outcomes import Outcome
from policies.retry_after import RetryAfterConfig
from policies.wait import QueueStats, Throughput, predicted_wait_s

RETRY = RetryAfterConfig(min_s=0.01, max_s=60.0, jitter=0.0)
# 8 slots x 40 ms: the pool drains 200 requests per second.
FLOW = Throughput(
    service_time_s=0.04,
    drain_rate_per_s=200.0,
    admitted_rate_by_band=(0.0, 0.0),
    offered_rate_by_band=(0.0, 0.0),
)
HIGH = AdmissionRequest(band=0, max_queue_wait_s=0.25)
LOW = AdmissionRequest(band=1, max_queue_wait_s=1.0)


def admit(request, queued, free=0, flow=FLOW):
    return decide(request, QueueStats(queued, free), flow, jitter_u=0.5, retry=RETRY)


@pytest.mark.parametrize(
    ("request_", "queued", "free", "admitted"),
    [
        (LOW, (0, 0), 1, True),  # a free slot
        (LOW, (0, 199), 0, True),  # 200 positions / 200 per s = 1.0 s, exactly the limit
        (LOW, (0, 200), 0, False),  # 201 positions: 1.005 s
        (HIGH, (0, 5000), 0, True),  # low work never delays high
        (HIGH, (49, 0), 0, True),  # 50 positions: 0.25 s
        (HIGH, (50, 0), 0, False),
        (LOW, (150, 49), 0, True),  # high work counts against low
        (LOW, (150, 50), 0, False),
    ],
)
def test_admission_against_class_limit(request_, queued, free, admitted):
    assert isinstance(admit(request_, queued, free), Admit) is admitted


def test_admission_rejects_queue_full_with_reason():
    decision = admit(LOW, (0, 500))
    assert isinstance(decision, Reject)
    assert decision.reason is Outcome.QUEUE_FULL
    assert decision.predicted_wait_s == pytest.approx(501 / 200)


def test_admission_rejects_when_budget_minus_service_is_shorter_than_the_wait():
    tight = AdmissionRequest(band=1, max_queue_wait_s=1.0, budget_s=0.14)  # 0.1 s may go to the queue
    assert isinstance(admit(tight, (0, 19)), Admit)  # 20 positions: 0.1 s
    decision = admit(tight, (0, 20))
    assert isinstance(decision, Reject)
    assert decision.reason is Outcome.DEADLINE_UNMEETABLE


def test_admission_rejects_a_budget_below_the_service_time_even_when_idle():
    hopeless = AdmissionRequest(band=0, max_queue_wait_s=1.0, budget_s=0.01)
    decision = admit(hopeless, (0, 0), free=8)
    assert isinstance(decision, Reject)
    assert decision.reason is Outcome.DEADLINE_UNMEETABLE


def test_allowed_wait_is_the_tighter_of_class_limit_and_budget_less_service():
    assert allowed_wait_s(AdmissionRequest(0, 0.25, budget_s=10.0), 0.04) == pytest.approx(0.25)
    assert allowed_wait_s(AdmissionRequest(0, 0.25, budget_s=0.1), 0.04) == pytest.approx(0.06)
    assert allowed_wait_s(AdmissionRequest(0, 0.25), 0.04) == pytest.approx(0.25)


def test_urgent_traffic_shrinks_what_low_may_queue():
    busy = Throughput(0.04, 200.0, admitted_rate_by_band=(120.0, 0.0), offered_rate_by_band=(120.0, 0.0))
    assert max_positions(LOW, FLOW) == 200
    assert max_positions(LOW, busy) == 80  # only 80 slots per second reach low


def test_refusal_of_an_expired_request_keeps_its_reason():
    reject = refuse(LOW, QueueStats((0, 10), 0), FLOW, 0.5, RETRY, reason=Outcome.DEADLINE_EXPIRED_IN_QUEUE)
    assert reject.reason is Outcome.DEADLINE_EXPIRED_IN_QUEUE
    assert reject.retry_after_s >= 1 / 200


requests = st.builds(
    AdmissionRequest,
    band=st.integers(0, 1),
    max_queue_wait_s=st.floats(0.001, 30),
    budget_s=st.none() | st.floats(0.001, 60),
)
flows = st.builds(
    Throughput,
    service_time_s=st.floats(0.001, 5),
    drain_rate_per_s=st.floats(0.5, 5000),
    admitted_rate_by_band=st.tuples(st.floats(0, 5000), st.floats(0, 5000)),
    offered_rate_by_band=st.tuples(st.floats(0, 5000), st.floats(0, 5000)),
)
queue_stats = st.builds(
    QueueStats,
    queued_by_band=st.tuples(st.integers(0, 5000), st.integers(0, 5000)),
    free_slots=st.integers(0, 8),
)


@given(requests, queue_stats, flows)
def test_admitted_requests_are_predicted_to_fit_their_allowance(request, stats, flow):
    decision = decide(request, stats, flow, 0.5, RETRY)
    if isinstance(decision, Admit):
        assert decision.predicted_wait_s <= allowed_wait_s(request, flow.service_time_s) + 1e-9
    else:
        assert decision.retry_after_s > 0


@given(requests, queue_stats, flows)
def test_position_limit_agrees_with_the_wait_check(request, stats, flow):
    """The atomic store check (positions <= limit) and the wait check must decide alike."""
    decision = decide(request, stats, flow, 0.5, RETRY)
    wait = predicted_wait_s(stats, flow, request.band)
    fits = wait <= allowed_wait_s(request, flow.service_time_s)
    # Floating point may put a wait within a hair of the limit on either side.
    if abs(wait - allowed_wait_s(request, flow.service_time_s)) > 1e-9:
        assert isinstance(decision, Admit) is fits
