"""policies.circuit: the passive-health circuit breaker and the stall watch, as tables and invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.circuit import (
    CLOSED,
    Cause,
    Circuit,
    CircuitRules,
    CircuitState,
    Ending,
    Quiet,
    Verdict,
    admits,
    after_stall,
    after_verdict,
    after_wait,
    cooldown_left_s,
    slot_limit,
    stalled,
    verdict_of,
    watch_quiet,
)

RULES = CircuitRules(failures_to_open=3, cooldown_s=5.0)
OPEN_AT_10 = Circuit(CircuitState.OPEN, 0, 10.0, Cause.FAILURES)
HALF_OPEN = Circuit(CircuitState.HALF_OPEN, 0, 10.0, Cause.FAILURES)


@pytest.mark.parametrize(
    ("ending", "status", "verdict"),
    [
        (Ending.ANSWERED, 200, Verdict.SUCCESS),
        (Ending.ANSWERED, 400, Verdict.SUCCESS),
        (Ending.ANSWERED, 404, Verdict.SUCCESS),
        (Ending.ANSWERED, 429, Verdict.SUCCESS),
        (Ending.ANSWERED, 500, Verdict.SUCCESS),
        (Ending.ANSWERED, 502, Verdict.FAILURE),
        (Ending.ANSWERED, 503, Verdict.FAILURE),
        (Ending.ANSWERED, 504, Verdict.FAILURE),
        (Ending.TIMED_OUT, 0, Verdict.FAILURE),
        (Ending.CUT_OFF, 200, Verdict.FAILURE),
        (Ending.ABANDONED, 0, None),
        (Ending.UNREACHABLE, 0, None),
    ],
)
def test_verdict_counts_only_what_the_backend_could_not_answer(ending, status, verdict):
    assert verdict_of(ending, status) is verdict


def test_circuit_opens_after_failures_in_a_row():
    circuit = CLOSED
    for _ in range(2):
        circuit = after_verdict(circuit, Verdict.FAILURE, RULES, 1.0)
        assert circuit.state is CircuitState.CLOSED
    circuit = after_verdict(circuit, Verdict.FAILURE, RULES, 2.0)
    assert circuit == Circuit(CircuitState.OPEN, 0, 2.0, Cause.FAILURES)


def test_a_success_between_failures_starts_the_count_again():
    circuit = CLOSED
    for verdict in (Verdict.FAILURE, Verdict.FAILURE, Verdict.SUCCESS, Verdict.FAILURE, Verdict.FAILURE):
        circuit = after_verdict(circuit, verdict, RULES, 1.0)
    assert (circuit.state, circuit.failures) == (CircuitState.CLOSED, 2)


def test_a_stall_opens_a_closed_circuit_at_once():
    assert after_stall(CLOSED, 7.0) == Circuit(CircuitState.OPEN, 0, 7.0, Cause.STALL)


@pytest.mark.parametrize("verdict", list(Verdict))
def test_outcomes_arriving_while_open_change_nothing(verdict):
    assert after_verdict(OPEN_AT_10, verdict, RULES, 11.0) is OPEN_AT_10
    assert after_stall(OPEN_AT_10, 11.0) is OPEN_AT_10


@pytest.mark.parametrize(
    ("now", "slots_held", "state"),
    [
        (14.9, 0, CircuitState.OPEN),  # cooling down
        (15.0, 0, CircuitState.HALF_OPEN),
        (99.0, 1, CircuitState.OPEN),  # its last request still holds a slot
        (99.0, 0, CircuitState.HALF_OPEN),
    ],
)
def test_open_circuit_half_opens_after_its_cooldown_once_no_slot_is_held(now, slots_held, state):
    assert after_wait(OPEN_AT_10, RULES, now, slots_held).state is state


def test_waiting_moves_only_an_open_circuit():
    assert after_wait(CLOSED, RULES, 99.0, 0) is CLOSED
    assert after_wait(HALF_OPEN, RULES, 99.0, 0) is HALF_OPEN


def test_trial_success_closes_the_circuit():
    circuit = after_verdict(HALF_OPEN, Verdict.SUCCESS, RULES, 16.0)
    assert (circuit.state, circuit.failures) == (CircuitState.CLOSED, 0)


def test_trial_failure_or_stall_opens_it_again_for_another_cooldown():
    assert after_verdict(HALF_OPEN, Verdict.FAILURE, RULES, 16.0) == Circuit(
        CircuitState.OPEN, 0, 16.0, Cause.FAILURES
    )
    assert after_stall(HALF_OPEN, 17.0) == Circuit(CircuitState.OPEN, 0, 17.0, Cause.STALL)


@pytest.mark.parametrize(
    ("circuit", "slots", "limit", "admitted"),
    [(CLOSED, 8, 8, True), (OPEN_AT_10, 8, 0, False), (HALF_OPEN, 8, 1, True), (HALF_OPEN, 0, 0, True)],
)
def test_open_circuit_refuses_and_offers_no_slot_half_open_offers_one(circuit, slots, limit, admitted):
    assert slot_limit(circuit, slots) == limit
    assert admits(circuit) is admitted


def test_quiet_is_measured_from_when_requests_went_in_flight():
    quiet = watch_quiet(Quiet(None, 4), 4, busy_since=3.0, now=5.0)
    assert quiet == Quiet(3.0, 4)
    assert not stalled(quiet, 5.9, 3.0)
    assert stalled(quiet, 6.0, 3.0)


def test_any_answer_byte_restarts_the_quiet_time():
    quiet = watch_quiet(Quiet(1.0, 4), 5, busy_since=1.0, now=8.0)
    assert quiet == Quiet(8.0, 5)
    assert not stalled(quiet, 10.0, 3.0)


def test_nothing_in_flight_is_never_stalled():
    quiet = watch_quiet(Quiet(1.0, 4), 4, busy_since=None, now=100.0)
    assert quiet == Quiet(None, 4)
    assert not stalled(quiet, 1000.0, 3.0)


def test_a_new_busy_spell_after_an_unseen_idle_one_counts_from_its_start():
    quiet = watch_quiet(Quiet(1.0, 4), 4, busy_since=6.0, now=7.0)
    assert quiet == Quiet(6.0, 4)


def test_answers_that_wait_on_their_clients_are_not_a_stall():
    # Silent for 10 s, but the gateway stopped reading because the client stopped taking the answer.
    quiet = watch_quiet(Quiet(1.0, 4), 4, busy_since=1.0, now=11.0, owed_nothing=True)
    assert quiet == Quiet(11.0, 4)
    assert not stalled(quiet, 11.0, 3.0)
    # Once a byte is owed again, the silence counts from the last look that owed nothing.
    assert stalled(watch_quiet(quiet, 4, busy_since=1.0, now=14.0), 14.0, 3.0)


# -- invariants over any sequence of events -------------------------------------------------------

_events = st.lists(
    st.tuples(
        st.sampled_from(["success", "failure", "stall", "wait"]),
        st.floats(min_value=0.0, max_value=4.0),  # time passing before the event
        st.integers(min_value=0, max_value=2),  # slots held, for "wait"
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    events=_events,
    failures_to_open=st.integers(min_value=1, max_value=5),
    cooldown_s=st.floats(min_value=0.0, max_value=6.0),
    slots=st.integers(min_value=0, max_value=8),
)
def test_circuit_invariants_hold_for_any_sequence(events, failures_to_open, cooldown_s, slots):
    rules = CircuitRules(failures_to_open, cooldown_s)
    circuit, now = CLOSED, 0.0
    failures_in_a_row = 0  # counted independently, as the rules state it
    for kind, elapsed_s, slots_held in events:
        now += elapsed_s
        before = circuit
        if kind == "wait":
            circuit = after_wait(circuit, rules, now, slots_held)
        elif kind == "stall":
            circuit = after_stall(circuit, now)
        else:
            circuit = after_verdict(circuit, Verdict(kind), rules, now)
        if before.state is CircuitState.CLOSED and kind != "wait":
            failures_in_a_row = failures_in_a_row + 1 if kind == "failure" else 0
        moved = (before.state, circuit.state)

        if circuit.state is CircuitState.OPEN and before.state is not CircuitState.OPEN:
            assert circuit.opened_at == now  # each opening starts its own cool-down
            if before.state is CircuitState.CLOSED and kind == "failure":
                assert failures_in_a_row >= failures_to_open
            assert kind in ("failure", "stall"), f"opened by {kind}"
        if moved == (CircuitState.OPEN, CircuitState.HALF_OPEN):
            assert kind == "wait" and slots_held == 0
            assert before.opened_at is not None and now - before.opened_at >= cooldown_s
        if before.state is CircuitState.OPEN and kind != "wait":
            assert circuit == before, "an open circuit only moves by waiting"
        if before.state is CircuitState.HALF_OPEN and kind != "wait":
            # The trial decides at once: a success closes, a failure or stall opens again.
            assert circuit.state is (CircuitState.CLOSED if kind == "success" else CircuitState.OPEN)
        if before.state is CircuitState.OPEN and kind == "wait":
            assert before.opened_at is not None
            due = slots_held == 0 and now - before.opened_at >= cooldown_s
            assert circuit.state is (CircuitState.HALF_OPEN if due else CircuitState.OPEN)
        if before.state is CircuitState.CLOSED:
            assert circuit.state is not CircuitState.HALF_OPEN
            if circuit.state is CircuitState.CLOSED:
                assert circuit.failures == failures_in_a_row < failures_to_open
        if circuit.state is not CircuitState.CLOSED:
            failures_in_a_row = 0

        assert admits(circuit) == (circuit.state is not CircuitState.OPEN)
        limit = slot_limit(circuit, slots)
        expected = {CircuitState.CLOSED: slots, CircuitState.HALF_OPEN: min(slots, 1), CircuitState.OPEN: 0}
        assert limit == expected[circuit.state]


@settings(max_examples=300, deadline=None)
@given(
    looks=st.lists(
        st.tuples(
            st.floats(min_value=0.01, max_value=2.0),  # time to the next look
            st.integers(min_value=0, max_value=2),  # answer events since the last look
            st.booleans(),  # requests in flight at this look
        ),
        max_size=40,
    ),
    stall_s=st.floats(min_value=0.1, max_value=5.0),
)
def test_stall_is_never_found_before_the_backend_was_silent_and_busy_that_long(looks, stall_s):
    quiet, now, events = Quiet(), 0.0, 0
    busy_since: float | None = None
    last_event_seen_at = 0.0  # the look at which the latest event was first counted
    for elapsed_s, new_events, busy in looks:
        now += elapsed_s
        busy_since = (busy_since if busy_since is not None else now - elapsed_s / 2) if busy else None
        events += new_events
        if new_events:
            last_event_seen_at = now
        quiet = watch_quiet(quiet, events, busy_since, now)
        if stalled(quiet, now, stall_s):
            assert busy_since is not None and now - busy_since >= stall_s
            assert now - last_event_seen_at >= stall_s
        if busy_since is not None and not new_events and now - max(busy_since, last_event_seen_at) >= stall_s:
            assert stalled(quiet, now, stall_s), "a silent busy backend must be found stalled"


def test_the_cooldown_left_counts_down_from_the_opening_and_only_for_an_open_circuit():
    rules = CircuitRules(failures_to_open=1, cooldown_s=5.0)
    opened = after_verdict(CLOSED, Verdict.FAILURE, rules, now=100.0)
    assert cooldown_left_s(opened, rules, 101.5) == pytest.approx(3.5)
    assert cooldown_left_s(opened, rules, 107.0) == 0.0  # over: it half-opens once its slots are free
    assert cooldown_left_s(CLOSED, rules, 101.5) is None
