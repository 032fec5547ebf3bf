"""Hand-overs that reach a band: the issue's examples, invariants, and a seeded Monte-Carlo of the pool."""

import math
import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from policies.handover_counts import Tails
from policies.handovers import LONGEST_WAIT_S, PoolState, handovers_within, handovers_within_steps, wait_for
from policies.service_times import BINS_PER_OCTAVE, ServiceTimes
from policies.steps import Steps

BIN_RATIO = 2 ** (1 / BINS_PER_OCTAVE)


def learned(draw, samples: int = 2000, memory: float = 200.0, prior_mean_s: float = 1.0) -> ServiceTimes:
    service = ServiceTimes(prior_mean_s=prior_mean_s, memory=memory)
    for _ in range(samples):
        service.record(draw())
    return service


def fixed(value_s: float) -> ServiceTimes:
    return learned(lambda: value_s)


def exponential(mean_s: float, seed: int = 0, samples: int = 2000, memory: float = 200.0) -> ServiceTimes:
    rng = random.Random(seed)
    return learned(lambda: rng.expovariate(1 / mean_s), samples, memory)


# -- the examples ------------------------------------------------------------------------------


def test_two_slots_finishing_in_150_ms_hand_over_to_a_request_allowed_250_ms():
    state = PoolState(ages_s=(0.0, 0.0), free_slots=0)
    assert handovers_within(state, fixed(0.15), 0.25, 0.977) >= 1


def test_a_slot_of_fixed_service_hands_over_when_its_request_ends_and_not_before():
    state = PoolState(ages_s=(0.1, 0.5), free_slots=0)  # of 0.8 s: they end in 0.7 s and 0.3 s
    service = fixed(0.8)
    assert handovers_within(state, service, 0.35, 0.977) >= 1
    assert handovers_within(state, service, 0.25, 0.977) == 0


# -- edges ---------------------------------------------------------------------------------------------


def test_free_slots_hand_over_at_once_whatever_the_urgent_work():
    state = PoolState(ages_s=(0.1,), free_slots=3, urgent_rate_per_s=1e4)
    assert handovers_within(state, fixed(0.8), 0.0, 0.999) == 3
    assert handovers_within(state, fixed(0.8), 2.0, 0.999) == 3  # urgent work takes all the rest
    assert wait_for(state, fixed(0.8), 3, 0.999) == 0.0


def test_wait_for_no_hand_over_is_no_wait():
    assert wait_for(PoolState((0.1,), 0), fixed(0.8), 0, 0.9) == 0.0


def test_a_fractional_count_rounds_up():
    state, service = PoolState((0.1, 0.5), 0), fixed(0.8)
    assert wait_for(state, service, 1.2, 0.9) == wait_for(state, service, 2, 0.9)
    assert wait_for(state, service, 1.2, 0.9) > wait_for(state, service, 1, 0.9)


@pytest.mark.parametrize("handovers", [1e6, 1e12, math.inf])
def test_wait_for_a_huge_count_is_finite(handovers):
    assert 0 < wait_for(PoolState((0.1,) * 8, 0), exponential(0.1), handovers, 0.9) <= LONGEST_WAIT_S


def test_wait_for_a_band_starved_by_urgent_work_is_finite():
    state = PoolState((0.1, 0.2), 0, urgent_rate_per_s=1000.0)  # 2 slots of 0.8 s hand over 2.5 a second
    assert wait_for(state, fixed(0.8), 1, 0.9) == LONGEST_WAIT_S


def test_a_pool_without_slots_never_hands_over():
    assert handovers_within(PoolState((), 0), fixed(0.8), 100.0, 0.5) == 0
    assert wait_for(PoolState((), 0), fixed(0.8), 1, 0.5) == LONGEST_WAIT_S


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5])
def test_a_confidence_outside_zero_one_is_refused(confidence):
    with pytest.raises(ValueError):
        handovers_within(PoolState((0.1,), 0), fixed(0.8), 1.0, confidence)


def test_many_hand_overs_are_counted_as_a_normal_that_still_grows_with_time():
    state, service = PoolState(tuple(0.01 * i for i in range(64)), 2), exponential(0.8)
    counts = [handovers_within(state, service, 0.8 * k, 0.977) for k in range(1, 40)]
    assert counts == sorted(counts)
    expected = 66 + 64 * 39  # about one hand-over per slot per mean service time
    assert 0.9 * expected < counts[-1] <= expected


def test_the_first_hand_over_is_the_soonest_slots_even_when_many_follow_it():
    # A heavy tail (cv 18): within a second thousands of hand-overs are expected, counted as a normal.
    service = learned(lambda: 0.001, samples=100, memory=50, prior_mean_s=0.8)
    state = PoolState(ages_s=(0.002,), free_slots=0)
    for confidence in (0.5, 0.9, 0.96):
        assert wait_for(state, service, 1, confidence) == pytest.approx(
            soonest_end_s(state, service, confidence), rel=2e-3
        )


def test_slots_that_end_together_never_make_more_hand_overs_come_sooner():
    # Fixed slots that end at (nearly) the same moments: their hand-overs come (nearly) together.
    state, service = PoolState(ages_s=(0.3, 0.3, 0.3), free_slots=2), fixed(0.8)
    waits = [wait_for(state, service, n, 0.9) for n in range(1, 16)]
    assert waits == sorted(waits)
    assert waits[4] - waits[2] < 0.8 * (BIN_RATIO - 1)


# -- invariants ----------------------------------------------------------------------------------------


@st.composite
def services(draw) -> ServiceTimes:
    """Learned fixed or exponential services, and services from a few arbitrary samples."""
    kind = draw(st.sampled_from(["fixed", "exponential", "few"]))
    mean = draw(st.sampled_from([0.05, 0.3, 0.8]))
    if kind == "fixed":
        return fixed(mean)
    if kind == "exponential":
        return exponential(mean, seed=draw(st.integers(0, 3)), samples=300)
    values = draw(st.lists(st.floats(0.001, 3.0), min_size=1, max_size=12))
    return learned(iter(values * 100).__next__, samples=len(values) * 100, memory=50, prior_mean_s=mean)


@st.composite
def pools(draw, urgent: bool = True) -> tuple[PoolState, ServiceTimes]:
    service = draw(services())
    ages = draw(st.lists(st.floats(0.0, 3.0), max_size=8))
    scale = service.mean_s
    rate = draw(st.floats(0.0, 3.0)) / scale if urgent and draw(st.booleans()) else 0.0
    return PoolState(tuple(age * scale for age in ages), draw(st.integers(0, 3)), rate), service


windows = st.floats(0.0, 4.0)
confidences = st.floats(0.5, 0.999)


def steps_and_value(steps: Steps[int]) -> tuple[int, int]:
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return count, end.value
        count += 1


@settings(max_examples=100, deadline=None)
@given(pools(), windows, confidences)
def test_read_a_step_at_a_time_the_count_is_the_same_in_two_steps_per_slot_at_most(pool, window, confidence):
    state, service = pool
    within = window * service.mean_s
    steps, value = steps_and_value(handovers_within_steps(state, service, within, confidence))
    assert value == handovers_within(state, service, within, confidence)
    assert steps <= 2 * (len(state.ages_s) + state.free_slots)


def test_a_clock_like_pool_is_read_a_slot_per_step_as_it_was_when_the_reading_began():
    """Each busy slot's count a step, then each slot's part of their sum a step."""
    state = PoolState(ages_s=(0.1, 0.3, 0.5, 0.7), free_slots=0)
    service = fixed(0.8)
    before = handovers_within(state, service, 0.85, 0.977)
    steps = handovers_within_steps(state, service, 0.85, 0.977)
    for _ in range(2000):  # the service times change while the steps run: they read what was
        service.record(8.0)
    assert handovers_within(state, service, 0.85, 0.977) != before
    assert steps_and_value(steps) == (8, before)


def test_a_spread_out_pool_is_read_a_group_of_slots_per_step():
    """The busy slots' count and the free slots' are summed a step each."""
    state = PoolState(ages_s=(0.1, 0.2), free_slots=1)
    service = exponential(0.8)
    steps = handovers_within_steps(state, service, 1.0, 0.977)
    assert steps_and_value(steps) == (2, handovers_within(state, service, 1.0, 0.977))


@settings(max_examples=100, deadline=None)
@given(pools(urgent=False), windows, windows, confidences)
def test_more_time_never_means_fewer_hand_overs(pool, first, second, confidence):
    state, service = pool
    shorter, longer = sorted((first * service.mean_s, second * service.mean_s))
    assert handovers_within(state, service, shorter, confidence) <= handovers_within(
        state, service, longer, confidence
    )


@settings(max_examples=100, deadline=None)
@given(pools(), windows, confidences, st.integers(1, 3))
def test_a_free_slot_never_means_fewer_hand_overs(pool, window, confidence, more):
    state, service = pool
    freer = PoolState(state.ages_s, state.free_slots + more, state.urgent_rate_per_s)
    within = window * service.mean_s
    assert handovers_within(state, service, within, confidence) <= handovers_within(
        freer, service, within, confidence
    )


@settings(max_examples=100, deadline=None)
@given(pools(), windows, confidences, confidences)
def test_more_confidence_never_means_more_hand_overs(pool, window, first, second):
    state, service = pool
    lower, higher = sorted((first, second))
    within = window * service.mean_s
    assert handovers_within(state, service, within, higher) <= handovers_within(state, service, within, lower)


@settings(max_examples=100, deadline=None)
@given(pools(), windows, confidences, st.floats(0.0, 3.0))
def test_more_urgent_work_never_means_more_hand_overs(pool, window, confidence, more):
    state, service = pool
    busier = PoolState(state.ages_s, state.free_slots, state.urgent_rate_per_s + more / service.mean_s)
    within = window * service.mean_s
    assert handovers_within(busier, service, within, confidence) <= handovers_within(
        state, service, within, confidence
    )


@settings(max_examples=100, deadline=None)
@given(pools(), st.integers(1, 30), st.integers(1, 30), confidences)
def test_wait_for_more_hand_overs_is_never_shorter(pool, first, second, confidence):
    state, service = pool
    fewer, more = sorted((first, second))
    assert wait_for(state, service, fewer, confidence) <= wait_for(state, service, more, confidence)


@settings(max_examples=120, deadline=None)
@given(
    services(), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=2), st.integers(0, 2), st.floats(0.5, 3.0)
)
def test_wait_for_more_hand_overs_is_never_shorter_while_urgent_work_takes_most(service, ages, free, load):
    # Urgent work at up to 3 times what the slots hand over: the chance to reach a count can fall in
    # time, and a search that tried other times for a larger count could find an earlier one.
    slots = len(ages) + free
    state = PoolState(tuple(a * service.mean_s for a in ages), free, load * slots / service.mean_s)
    waits = [wait_for(state, service, n, 0.5) for n in range(free + 1, free + 6)]
    assert waits == sorted(waits)


@settings(max_examples=100, deadline=None)
@given(pools(urgent=False), st.integers(1, 30), confidences)
def test_handovers_within_and_wait_for_agree(pool, handovers, confidence):
    state, service = pool
    waited = wait_for(state, service, handovers, confidence)
    assume(waited < LONGEST_WAIT_S)
    assert handovers_within(state, service, waited, confidence) >= handovers
    if waited > 0:
        assert handovers_within(state, service, waited * (1 - 1e-3), confidence) < handovers


def soonest_end_s(state: PoolState, service: ServiceTimes, confidence: float) -> float:
    """The t with P(min R_i <= t) = confidence, found here by bisection on the residuals alone."""

    def ended(t: float) -> float:
        return 1 - math.prod(1 - service.residual_cdf(age, t) for age in state.ages_s)

    low, high = 0.0, service.mean_s
    while ended(high) < confidence:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if ended(middle) >= confidence else (middle, high)
    return high


@settings(max_examples=100, deadline=None)
@given(pools(), confidences)
def test_the_first_hand_over_comes_with_the_soonest_finishing_slot_and_never_before(pool, confidence):
    state, service = pool
    assume(state.ages_s)
    alone = PoolState(state.ages_s, 0)
    soonest = soonest_end_s(alone, service, confidence)
    assert wait_for(alone, service, 1, confidence) == pytest.approx(soonest, rel=2e-3)
    assert wait_for(
        PoolState(state.ages_s, 0, state.urgent_rate_per_s), service, 1, confidence
    ) >= soonest * (1 - 2e-3)


# -- against a simulated pool --------------------------------------------------------------------------


def simulated_counts(
    kind: str, mean: float, state: PoolState, times: tuple[float, ...], runs: int, rng: random.Random
) -> list[list[int]]:
    """What reaches the band by each of `times` in `runs` simulated pools (urgent arrivals take
    hand-overs first), one list of counts per time."""

    def service() -> float:
        if kind == "uniform":
            return rng.uniform(0, 2 * mean)
        return rng.expovariate(1 / mean) if kind == "exponential" else mean

    def first_end(age: float) -> float:
        if kind == "uniform":  # what is left of a uniform service time that has run `age`
            return rng.uniform(0, 2 * mean - age)
        return rng.expovariate(1 / mean) if kind == "exponential" else mean - age

    horizon = max(times)
    counts: list[list[int]] = [[] for _ in times]
    for _ in range(runs):
        first_ends = [first_end(age) for age in state.ages_s] + [service() for _ in range(state.free_slots)]
        handovers = []
        for end in first_ends:
            while end <= horizon:
                handovers.append(end)
                end += service()
        arrivals = []
        if state.urgent_rate_per_s > 0:
            arrival = rng.expovariate(state.urgent_rate_per_s)
            while arrival <= horizon:
                arrivals.append(arrival)
                arrival += rng.expovariate(state.urgent_rate_per_s)
        band, waiting_urgent, arrived, reached = state.free_slots, 0, 0, []
        for handover in sorted(handovers):
            while arrived < len(arrivals) and arrivals[arrived] <= handover:
                waiting_urgent, arrived = waiting_urgent + 1, arrived + 1
            if waiting_urgent:
                waiting_urgent -= 1
            else:
                band += 1
                reached.append(handover)
        for count, time in zip(counts, times, strict=True):
            count.append(state.free_slots + sum(1 for handover in reached if handover <= time))
    return counts


def reached_count(counts: list[int], confidence: float) -> int:
    """The largest n that at least `confidence` of the runs reached."""
    return sorted(counts)[math.floor((1 - confidence) * len(counts))]


CASES = [(kind, seed) for kind in ("exponential", "fixed", "uniform") for seed in range(12)]


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_predicted_counts_never_overstate_a_simulated_pool(kind, seed):
    rng = random.Random(seed)
    mean = rng.choice([0.05, 0.3, 0.8])
    # Learned from many samples, so that what is tested is the count, not the learning.
    if kind == "fixed":
        service = fixed(mean)
    elif kind == "uniform":
        draws = random.Random(seed)
        service = learned(lambda: draws.uniform(0, 2 * mean), samples=40000, memory=1e5)
    else:
        service = exponential(mean, seed, samples=40000, memory=1e5)
    slots = rng.randint(2, 16)
    busy = rng.randint(1, slots)
    free = slots - busy if rng.random() < 0.3 else 0
    ages = tuple(
        rng.uniform(0, mean * {"fixed": 0.999, "uniform": 1.999, "exponential": 3.0}[kind])
        for _ in range(busy)
    )
    urgent = rng.choice([0.0, 0.0, 0.3 * slots / mean])
    state = PoolState(ages, free, urgent)
    # Not exactly at a multiple of the mean, where a fixed service's slots all hand over at once.
    within = mean * rng.choice([0.1, 0.3, 0.6, 1.0, 1.5, 2.5, 4.0]) * rng.uniform(0.93, 1.07)
    # The histogram spreads a fixed service time over its bin: a pool one bin slower is as good a reading.
    simulated, slower = simulated_counts(kind, mean, state, (within, within / BIN_RATIO), 2000, rng)
    for confidence in (0.9, 0.977) if kind == "fixed" else (0.5, 0.9, 0.977):
        predicted = handovers_within(state, service, within, confidence)
        margin = 3.5 * math.sqrt(confidence * (1 - confidence) / len(simulated))  # the simulation's error
        assert predicted <= reached_count(simulated, confidence - margin)
        if urgent == 0:  # urgent work that comes after a hand-over cannot take it; the model says it can
            at_least = reached_count(slower, confidence + margin)
            assert predicted >= at_least - max(1, math.ceil(0.1 * at_least))


@given(
    st.integers(-5, 20),
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12),
    st.integers(-30, 40),
    st.integers(0, 40),
)
def test_a_run_of_tails_is_each_count_s_tail(offset, weights, first, n):
    total = sum(weights)
    assume(total > 0)
    tails = Tails((offset, [w / total for w in weights]))
    assert tails.run_at_least(first, n) == [tails.at_least(first + i) for i in range(n)]
