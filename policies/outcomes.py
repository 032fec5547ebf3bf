"""What can happen to a request? The closed set of outcomes, used as metric labels and error reasons."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"
    # The backend answered with an error, passed through to the client as it came.
    BACKEND_CLIENT_ERROR = "backend_client_error"
    BACKEND_SERVER_ERROR = "backend_server_error"
    # Load shedding: always 429 with Retry-After.
    QUEUE_FULL = "queue_full"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    DEADLINE_EXPIRED_IN_QUEUE = "deadline_expired_in_queue"
    CLUSTER_BACKLOGGED = "cluster_backlogged"
    OUTSIDE_WINDOW = "outside_window"
    """The class or tenant is served only within a time window, which is closed now."""
    DISPLACED = "displaced"
    """It waited in a queue at its cap, and a more urgent request took its place."""
    # The pool cannot serve at all: 503 with Retry-After.
    NO_BACKEND = "no_backend"
    DRAINING = "draining"
    STORE_UNAVAILABLE = "store_unavailable"
    # The backend failed once the request was sent.
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    # The client's fault.
    BAD_REQUEST = "bad_request"
    UNKNOWN_PRIORITY = "unknown_priority"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_MODEL = "unknown_model"
    BODY_TOO_LARGE = "body_too_large"
    BUDGET_TOO_SMALL = "budget_too_small"
    """The client's budget is below what even an idle pool needs: no retry can help."""
    COST_ABOVE_QUOTA = "cost_above_quota"
    """The request costs more work than its tenant's capped quota ever lets run: no retry can help."""
    CLIENT_DISCONNECTED = "client_disconnected"


SHED_OUTCOMES = frozenset(
    {
        Outcome.QUEUE_FULL,
        Outcome.DEADLINE_UNMEETABLE,
        Outcome.DEADLINE_EXPIRED_IN_QUEUE,
        Outcome.CLUSTER_BACKLOGGED,
        Outcome.OUTSIDE_WINDOW,
        Outcome.DISPLACED,
    }
)


def answered(status: int) -> Outcome:
    """The outcome of a request the backend answered with `status` (passed to the client as is)."""
    if status >= 500:
        return Outcome.BACKEND_SERVER_ERROR
    if status >= 400:
        return Outcome.BACKEND_CLIENT_ERROR
    return Outcome.OK
