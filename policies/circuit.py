"""Should a backend get requests, judged by how its requests end? Passive health: a circuit breaker.

What the data path sees decides, not the health checks: a backend can pass its probes and still
answer no inference (HAProxy's `observe layer7`). The rules:
- closed: requests go. `failures_to_open` failures in a row, or a stall, open it.
- open: no request goes (`admits` False, `slot_limit` 0). Outcomes that arrive now were sent
  before it opened and change nothing. It half-opens once `cooldown_s` has passed and the backend
  holds no slot of ours any more (its last requests ended), so that a trial is never sent beside
  work it may still be doing.
- half-open: one trial request goes (`slot_limit` 1). Its success closes the circuit; its failure,
  or a stall, opens it again for another cool-down.
- a failure is an answer the backend could not give: the hard timeout, an answer cut off or
  malformed, 502/503/504. Any other complete answer, 4xx and 500 included, is a success (the
  backend is serving; a 4xx is the client's fault). A request whose reader left before the end,
  or whose connection was refused (readiness handles that), is no evidence either way.
- a stall: requests in flight and no byte of any of their answers for the stall timeout. It is
  measured per backend, across all its requests: a backend streaming some answers is not stalled
  while others compute; one computing silently for longer than the timeout is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum, StrEnum

FAILING_STATUSES = frozenset({502, 503, 504})


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Cause(StrEnum):
    """Why a circuit opened."""

    FAILURES = "failures"
    STALL = "stall"


class Ending(Enum):
    """How an exchange with a backend ended, as the shell sees it."""

    ANSWERED = "answered"
    """The whole answer arrived (its status says more)."""
    TIMED_OUT = "timed_out"
    """The hard upstream timeout cut it."""
    CUT_OFF = "cut_off"
    """The connection broke, or the answer was malformed, before the answer was complete."""
    ABANDONED = "abandoned"
    """Its reader left and the exchange ended without a whole answer (closed as on_abandon says)."""
    UNREACHABLE = "unreachable"
    """No connection could be opened."""


class Verdict(Enum):
    SUCCESS = "success"
    FAILURE = "failure"


@dataclass(frozen=True, slots=True)
class CircuitRules:
    failures_to_open: int = 5
    cooldown_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Circuit:
    state: CircuitState = CircuitState.CLOSED
    failures: int = 0
    """Failures in a row while closed."""
    opened_at: float | None = None
    cause: Cause | None = None
    """Why it last opened (kept after it closes, for the log)."""


CLOSED = Circuit()


def verdict_of(ending: Ending, status: int = 0) -> Verdict | None:
    """What an exchange's end says about its backend; None when it says nothing."""
    if ending is Ending.ANSWERED:
        return Verdict.FAILURE if status in FAILING_STATUSES else Verdict.SUCCESS
    if ending in (Ending.TIMED_OUT, Ending.CUT_OFF):
        return Verdict.FAILURE
    return None


def after_verdict(circuit: Circuit, verdict: Verdict, rules: CircuitRules, now: float) -> Circuit:
    """The circuit once an exchange ended with `verdict` at `now`."""
    if circuit.state is CircuitState.OPEN:
        return circuit  # sent before it opened: the cool-down decides, not stragglers
    if verdict is Verdict.SUCCESS:
        if circuit.state is CircuitState.CLOSED and circuit.failures == 0:
            return circuit  # the usual case, on every answer: nothing to build
        return replace(circuit, state=CircuitState.CLOSED, failures=0)
    if circuit.state is CircuitState.HALF_OPEN:
        return _opened(circuit, Cause.FAILURES, now)
    failures = circuit.failures + 1
    if failures >= rules.failures_to_open:
        return _opened(circuit, Cause.FAILURES, now)
    return replace(circuit, failures=failures)


def after_stall(circuit: Circuit, now: float) -> Circuit:
    """The circuit once its backend was found stalled at `now`."""
    if circuit.state is CircuitState.OPEN:
        return circuit
    return _opened(circuit, Cause.STALL, now)


def after_wait(circuit: Circuit, rules: CircuitRules, now: float, slots_held: int) -> Circuit:
    """The circuit at `now`, while its backend holds `slots_held` of our slots: an open one
    half-opens after its cool-down, once no slot is held."""
    if circuit.state is not CircuitState.OPEN or slots_held > 0:
        return circuit
    assert circuit.opened_at is not None, "an open circuit knows when it opened"
    if now - circuit.opened_at < rules.cooldown_s:
        return circuit
    return replace(circuit, state=CircuitState.HALF_OPEN)


def cooldown_left_s(circuit: Circuit, rules: CircuitRules, now: float) -> float | None:
    """Seconds until an open circuit's cool-down ends (0 once it has: it half-opens when the
    backend's slots are free); None when it is not open."""
    if circuit.state is not CircuitState.OPEN:
        return None
    assert circuit.opened_at is not None, "an open circuit knows when it opened"
    return max(0.0, circuit.opened_at + rules.cooldown_s - now)


def admits(circuit: Circuit) -> bool:
    """May the backend get new requests at all (closed, or half-open for its trial)?"""
    return circuit.state is not CircuitState.OPEN


def slot_limit(circuit: Circuit, slots: int) -> int:
    """How many of the backend's `slots` may be filled: all of them while closed, one while
    half-open, none while open (also where readiness is shared and another replica's says yes)."""
    if circuit.state is CircuitState.OPEN:
        return 0
    return min(slots, 1) if circuit.state is CircuitState.HALF_OPEN else slots


@dataclass(frozen=True, slots=True)
class Quiet:
    """What the stall watch last saw of one backend."""

    since: float | None = None
    """Since when it has had requests in flight and sent no answer byte; None: nothing in flight."""
    answer_events: int = 0
    """Its count of answer events (heads, body chunks, ends) when last looked at."""


def watch_quiet(
    quiet: Quiet,
    answer_events: int,
    busy_since: float | None,
    now: float,
    *,
    owed_nothing: bool = False,
) -> Quiet:
    """The watch after looking at `now`: the backend has sent `answer_events` so far and has had
    requests in flight without a break since `busy_since` (None: none in flight).

    `owed_nothing`: every answer in flight waits on its client (the gateway stopped reading it
    because the client stopped taking it), so no byte is due from the backend and its silence is
    not a stall; the watch starts over from `now`. Else one client that stops reading would open
    the circuit of a healthy backend for every other client.

    The count is only compared between looks, so a byte is dated to the look that first sees it:
    a stall is found late by at most one look's interval, never early.
    """
    if busy_since is None:
        return Quiet(None, answer_events)
    if owed_nothing or answer_events != quiet.answer_events:
        return Quiet(now, answer_events)
    since = busy_since if quiet.since is None else max(quiet.since, busy_since)
    return Quiet(since, answer_events)


def stalled(quiet: Quiet, now: float, stall_s: float) -> bool:
    """Has the backend had requests in flight and sent no byte of any answer for `stall_s`?"""
    return quiet.since is not None and now - quiet.since >= stall_s


def _opened(circuit: Circuit, cause: Cause, now: float) -> Circuit:
    return Circuit(CircuitState.OPEN, 0, now, cause)
