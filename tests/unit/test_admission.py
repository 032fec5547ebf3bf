from dataclasses import replace
from statistics import NormalDist

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.admission import (
    AdmissionConfig,
    AdmissionRequest,
    Reject,
    allowed_wait_s,
    arriving_work,
    budget_hopeless,
    cautious_wait_s,
    max_work,
    min_budget_s,
    offered_limit,
    refuse,
    service_allowance_s,
    work_limit,
)
from policies.outcomes import Outcome
from policies.retry_after import RetryAfterConfig
from policies.service_times import ServiceTimes
from policies.wait import QueueStats, Throughput, urgent_rate_over, work_before_grant, work_to_drain

RETRY = RetryAfterConfig(min_s=0.01, max_s=60.0, jitter=0.0)
EXACT = AdmissionConfig(safety_sigmas=0.0, retry=RETRY)  # no margin: the plain mean prediction
CAUTIOUS = AdmissionConfig(safety_sigmas=2.0, retry=RETRY)
# 8 slots x 40 ms: the pool drains 200 requests per second.
FLOW = Throughput(
    service_time_s=0.04,
    drain_rate_per_s=200.0,
    admitted_rate_by_band=(0.0, 0.0),
    offered_rate_by_band=(0.0, 0.0),
)
# The same pool whose every call takes 40 ms: it hands over like a clock. (FLOW's service times
# are not known yet, so they count as exponential: it hands over like a Poisson stream.)
STEADY_FLOW = replace(FLOW, service_cv=0.0)
HIGH = AdmissionRequest(band=0, max_queue_wait_s=0.25)
LOW = AdmissionRequest(band=1, max_queue_wait_s=1.0)


def decide(request, stats, flow, jitter_u, config) -> Reject | None:
    """Admission as the gateway composes it: admitted (None) where the work the store counts ahead
    of the request is within the limit the controller offers with (`offered_limit` of `work_limit`,
    at the config's margin), else the refusal with its Retry-After."""
    confidence = NormalDist().cdf(config.safety_sigmas)
    limit = offered_limit(work_limit(request, stats, flow, 0.0, confidence, config), request, flow, 0.0)
    arriving = arriving_work(request, stats, flow)
    if (
        work_to_drain(stats, request.band, flow.handover_cost, request.tenant, request.cost, arriving)
        <= limit
    ):
        return None
    return refuse(request, stats, flow, jitter_u, config)


def admit(request, queued, free=0, flow=FLOW, config=EXACT):
    return decide(request, QueueStats(queued, free), flow, jitter_u=0.5, config=config)


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
    assert (admit(request_, queued, free) is None) is admitted


@pytest.mark.parametrize(
    ("queued", "admitted"),
    [
        ((0, 172), True),  # 173 positions: 173 + 2 * sqrt(173) = 199.3, within 1 s x 200/s
        ((0, 173), False),  # 174 positions: 174 + 2 * sqrt(174) = 200.4
        ((0, 0), True),
    ],
)
def test_safety_margin_shortens_the_admitted_queue(queued, admitted):
    assert int(max_work(LOW, FLOW, CAUTIOUS)) == 173
    assert (admit(LOW, queued, config=CAUTIOUS) is None) is admitted


def test_cautious_wait_adds_sigmas_of_a_poisson_count_for_exponential_service():
    assert cautious_wait_s(100, FLOW, 0, 2.0) == pytest.approx((100 + 20) / 200)
    assert cautious_wait_s(0, FLOW, 0, 2.0) == 0.0


def test_steady_service_times_leave_only_the_urgent_arrivals_to_doubt():
    # Every call takes 40 ms: 100 hand-overs take 0.5 s, give or take nothing.
    assert cautious_wait_s(100, STEADY_FLOW, 0, 2.0) == pytest.approx(100 / 200)
    # High arrivals (Poisson, 100/s) take half the hand-overs: 100 for low take about 1 s, over
    # which high's count wavers by sqrt(100) = 10 hand-overs.
    urgent = replace(STEADY_FLOW, admitted_rate_by_band=(100.0, 0.0))
    assert cautious_wait_s(100, urgent, 1, 2.0) == pytest.approx((100 + 2 * 10) / 100)


def test_the_margin_grows_with_the_variation_of_service_times():
    limits = [max_work(LOW, replace(FLOW, service_cv=cv), CAUTIOUS) for cv in (0.0, 0.25, 1.0, 2.5)]
    assert limits == sorted(limits, reverse=True)
    assert limits[0] == pytest.approx(200)  # steady service and no urgent traffic: the plain mean
    assert int(limits[2]) == 173


def test_cautious_wait_of_a_band_counts_the_pool_hand_overs_it_must_sit_through():
    # High takes 150 of 200 hand-overs per second: 100 for low take about 2 s, over which the
    # pool's count wavers with variance 200/s (exponential service) and high's with 150/s.
    busy = replace(FLOW, admitted_rate_by_band=(150.0, 0.0), offered_rate_by_band=(150.0, 0.0))
    assert cautious_wait_s(100, busy, 1, 2.0) == pytest.approx((100 + 2 * (2 * 350) ** 0.5) / 50)


def test_admission_rejects_queue_full_with_reason():
    decision = admit(LOW, (0, 500))
    assert isinstance(decision, Reject)
    assert decision.reason is Outcome.QUEUE_FULL
    assert decision.predicted_wait_s == pytest.approx(501 / 200)


def test_admission_rejects_when_budget_minus_service_is_shorter_than_the_wait():
    tight = AdmissionRequest(band=1, max_queue_wait_s=1.0, budget_s=0.14)  # 0.1 s may go to the queue
    assert admit(tight, (0, 19)) is None  # 20 positions: 0.1 s
    decision = admit(tight, (0, 20))
    assert isinstance(decision, Reject)
    assert decision.reason is Outcome.DEADLINE_UNMEETABLE


def test_admission_rejects_a_budget_below_the_service_time_even_when_idle():
    hopeless = AdmissionRequest(band=0, max_queue_wait_s=1.0, budget_s=0.01)
    decision = admit(hopeless, (0, 0), free=8)
    assert isinstance(decision, Reject)
    assert decision.reason is Outcome.DEADLINE_UNMEETABLE


def test_the_service_allowance_is_the_mean_however_the_service_times_spread():
    """Three means for exponential service times (mean + 2 deviations) refused work a plain queue
    served in time; the queue's margin protects the deadline of work already admitted."""
    spread = Throughput(0.04, 200.0, (0.0, 0.0), (0.0, 0.0), service_spread_s=0.04)
    assert service_allowance_s(spread) == pytest.approx(0.04)
    assert allowed_wait_s(AdmissionRequest(0, 1.0, budget_s=0.2), spread) == pytest.approx(0.16)


def test_allowed_wait_is_the_tighter_of_class_limit_and_budget_less_service():
    assert allowed_wait_s(AdmissionRequest(0, 0.25, budget_s=10.0), FLOW) == pytest.approx(0.25)
    assert allowed_wait_s(AdmissionRequest(0, 0.25, budget_s=0.1), FLOW) == pytest.approx(0.06)
    assert allowed_wait_s(AdmissionRequest(0, 0.25), FLOW) == pytest.approx(0.25)


def test_urgent_traffic_shrinks_what_low_may_queue():
    busy = Throughput(0.04, 200.0, admitted_rate_by_band=(120.0, 0.0), offered_rate_by_band=(120.0, 0.0))
    assert max_work(LOW, FLOW, EXACT) == pytest.approx(200)
    assert max_work(LOW, busy, EXACT) == pytest.approx(80)  # only 80 slots per second reach low


def test_refusal_of_an_expired_request_keeps_its_reason():
    reject = refuse(LOW, QueueStats((0, 10), 0), FLOW, 0.5, EXACT, reason=Outcome.DEADLINE_EXPIRED_IN_QUEUE)
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
    service_spread_s=st.floats(0, 1),
    service_cv=st.floats(0, 5),
)
queue_stats = st.builds(
    QueueStats,
    queued_by_band=st.tuples(st.integers(0, 5000), st.integers(0, 5000)),
    free_slots=st.integers(0, 8),
)
configs = st.builds(AdmissionConfig, safety_sigmas=st.floats(0, 4), retry=st.just(RETRY))


@given(requests, queue_stats, flows, configs)
def test_admitted_requests_fit_their_allowance_with_margin(request, stats, flow, config):
    decision = decide(request, stats, flow, 0.5, config)
    if decision is None:
        work = work_to_drain(stats, request.band, flow.handover_cost)
        cautious = cautious_wait_s(work, flow, request.band, config.safety_sigmas)
        assert cautious <= allowed_wait_s(request, flow) * (1 + 1e-9) + 1e-12
    else:
        assert decision.retry_after_s > 0


@given(requests, flows, configs)
def test_work_limit_is_the_most_work_that_fits(request, flow, config):
    """The atomic store check (work <= limit) must agree with the cautious wait check."""
    limit = max_work(request, flow, config)
    allowed = allowed_wait_s(request, flow)
    if allowed < 0:
        assert limit == -1
        return
    assert cautious_wait_s(limit, flow, request.band, config.safety_sigmas) <= allowed * (1 + 1e-9) + 1e-12
    more = limit * (1 + 1e-6) + 1e-6
    assert cautious_wait_s(more, flow, request.band, config.safety_sigmas) > allowed


@given(requests, flows)
def test_a_margin_never_admits_more(request, flow):
    exact = max_work(request, flow, EXACT)
    assert max_work(request, flow, CAUTIOUS) <= exact + 1e-12 * abs(exact)


def test_a_budget_below_the_service_allowance_is_hopeless_and_one_above_is_not():
    spread = replace(FLOW, service_spread_s=0.01)  # allowance: the mean, 40 ms
    assert budget_hopeless(replace(HIGH, budget_s=0.039), spread)
    assert not budget_hopeless(replace(HIGH, budget_s=0.041), spread)
    assert not budget_hopeless(HIGH, spread)  # no budget, nothing to be hopeless about


@given(st.integers(0, 200), st.integers(0, 200), st.floats(0.0, 3.0))
def test_the_smallest_budget_accepted_now_grows_with_the_work_ahead_and_is_accepted(ahead, more, sigmas):
    def need(queued: int) -> float:
        return min_budget_s(QueueStats(queued_by_band=(queued, 0), free_slots=0), FLOW, 0, sigmas)

    assert need(ahead) <= need(ahead + more)
    assert need(ahead) >= service_allowance_s(FLOW)
    budget = need(ahead) * (1 + 1e-9)
    request = AdmissionRequest(band=0, max_queue_wait_s=1e9, budget_s=budget)
    config = AdmissionConfig(safety_sigmas=sigmas, retry=RETRY)
    assert decide(request, QueueStats(queued_by_band=(ahead, 0), free_slots=0), FLOW, 0.0, config) is None


def test_a_cluster_of_urgent_arrivals_weighs_on_the_next_moment_not_on_a_long_allowance():
    # 4 slots x 0.8 s, learned; urgent work at 0.9/s sustained, but two urgent arrivals a moment
    # ago read 4/s on the fast estimate. A low request allowed 18.8 s takes the slow level for all
    # but the fast estimate's half second.
    times = ServiceTimes(0.8)
    for _ in range(500):
        times.record(0.8)
    spike = Throughput(
        0.8,
        5.0,
        admitted_rate_by_band=(4.0, 0.0),
        offered_rate_by_band=(4.0, 0.0),
        service_times=times,
        sustained_rate_by_band=(0.9, 0.0),
        fast_memory_s=0.5,
    )
    assert urgent_rate_over(spike, 1, 0.25) == pytest.approx(4.0)
    assert urgent_rate_over(spike, 1, 18.8) == pytest.approx((4.0 * 0.5 + 0.9 * 18.3) / 18.8)
    low = AdmissionRequest(band=1, max_queue_wait_s=18.8)
    stats = QueueStats((0, 0), 0, (0.0, 0.0), started_at=(0.0, -0.2, -0.4, -0.6))
    believed_all_along = replace(spike, sustained_rate_by_band=None)
    config = AdmissionConfig()
    sustained = work_limit(low, stats, spike, 0.0, 0.977, config)
    assert sustained > work_limit(low, stats, believed_all_along, 0.0, 0.977, config) + 20
    # Believed for the whole allowance, it would be as if urgent work took 4/s of the 5/s.
    assert sustained >= 0.6 * (5.0 - 0.9) * 18.8


@pytest.mark.parametrize(
    ("limit", "external", "offered"),
    [
        (10.0, 0.0, 10.0),
        (10.0, 2.0, 8.0),  # the backends' own queue is ahead of every band, and comes off
        (10.0, 12.0, -2.0),  # and may refuse it with a slot free
        (-1.0, 5.0, -1.0),  # never stays never
    ],
)
def test_the_offers_limit_takes_off_what_the_backends_hold_for_others(limit, external, offered):
    request = AdmissionRequest(band=0, max_queue_wait_s=1.0)
    assert offered_limit(limit, request, FLOW, external) == offered


@pytest.mark.parametrize(
    ("queued_ahead", "free", "arriving", "checked"),
    [
        (0.0, 1, 25.0, 0.0),  # a free slot with nothing queued ahead starts it now, before any arrives
        (0.0, 0, 3.0, 4.0),  # no slot free: a hand-over, and what arrives in turn ahead meanwhile
        (5.0, 1, 3.0, 10.0),  # queued work ahead: it, the arrivals, and its own cost of 2 behind them
    ],
)
def test_the_stores_check_counts_arrivals_ahead_of_its_turn_only_where_the_request_waits(
    queued_ahead, free, arriving, checked
):
    assert work_before_grant(queued_ahead, free, 1.0, 2.0, arriving) == checked
