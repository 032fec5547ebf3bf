"""Outcome -> gRPC status, and the trailers a refusal carries, in one table (HTTP's is gateway.errors).

Load shedding is `RESOURCE_EXHAUSTED` and a pool that cannot serve `UNAVAILABLE`, both with the
computed advice as gRFC A6 server pushback (`grpc-retry-pushback-ms`, which grpc's own retry policy
waits out) and as a `google.rpc.RetryInfo` in `grpc-status-details-bin`, beside an `ErrorInfo`
naming the reason and the rule. A refusal no retry can help (`budget_too_small`,
`cost_above_quota`) is `FAILED_PRECONDITION`, with no pushback: a retrying client stops. The
backend's own HTTP error statuses map as Triton's gRPC endpoint answers the same errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

import grpc
from gateway.errors import ERRORS, echoed
from policies.outcomes import Outcome
from policies.retry_after import header_values

DOMAIN = "inference-gateway"
"""The `ErrorInfo.domain` of the gateway's refusals."""

Code = grpc.StatusCode

CODES: dict[Outcome, Code] = {
    Outcome.QUEUE_FULL: Code.RESOURCE_EXHAUSTED,
    Outcome.DEADLINE_UNMEETABLE: Code.RESOURCE_EXHAUSTED,
    Outcome.DEADLINE_EXPIRED_IN_QUEUE: Code.RESOURCE_EXHAUSTED,
    Outcome.CLUSTER_BACKLOGGED: Code.RESOURCE_EXHAUSTED,
    Outcome.DISPLACED: Code.RESOURCE_EXHAUSTED,
    Outcome.OUTSIDE_WINDOW: Code.RESOURCE_EXHAUSTED,
    Outcome.NO_BACKEND: Code.UNAVAILABLE,
    Outcome.DRAINING: Code.UNAVAILABLE,
    Outcome.STORE_UNAVAILABLE: Code.UNAVAILABLE,
    Outcome.UPSTREAM_ERROR: Code.INTERNAL,
    Outcome.UPSTREAM_TIMEOUT: Code.DEADLINE_EXCEEDED,
    Outcome.BAD_REQUEST: Code.INVALID_ARGUMENT,
    Outcome.UNKNOWN_PRIORITY: Code.INVALID_ARGUMENT,
    Outcome.UNAUTHORIZED: Code.UNAUTHENTICATED,
    Outcome.UNKNOWN_MODEL: Code.NOT_FOUND,
    Outcome.BODY_TOO_LARGE: Code.RESOURCE_EXHAUSTED,
    Outcome.BUDGET_TOO_SMALL: Code.FAILED_PRECONDITION,
    Outcome.COST_ABOVE_QUOTA: Code.FAILED_PRECONDITION,
    # The backend's own errors, mapped from their HTTP status (see `backend_code`).
    Outcome.BACKEND_CLIENT_ERROR: Code.INVALID_ARGUMENT,
    Outcome.BACKEND_SERVER_ERROR: Code.INTERNAL,
    Outcome.CLIENT_DISCONNECTED: Code.CANCELLED,
}

_BACKEND_CODES = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.ALREADY_EXISTS,
    429: Code.RESOURCE_EXHAUSTED,
    499: Code.CANCELLED,
    501: Code.UNIMPLEMENTED,
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
}

Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True, slots=True)
class GrpcError:
    """What a call ends with when it ends in error: its status, message and trailing metadata."""

    code: Code
    message: str
    trailers: Metadata = ()
    reason: str = ""
    """The outcome's value (a stream's in-band error carries it as a parameter)."""
    retry_after_ms: int | None = None


def backend_code(status: int) -> Code:
    """The gRPC status of a backend's HTTP error status."""
    return _BACKEND_CODES.get(status, Code.INTERNAL if status >= 500 else Code.INVALID_ARGUMENT)


def outcome_error(
    outcome: Outcome,
    *,
    detail: str | None = None,
    retry_after_s: float | None = None,
    rule: str | None = None,
) -> GrpcError:
    """The gRPC error of a request that ends with `outcome` (see the module docstring)."""
    code = CODES[outcome]
    message = ERRORS[outcome].message
    if detail:
        message = f"{message}: {echoed(detail)}"
    if code is Code.FAILED_PRECONDITION:
        retry_after_s = None  # no retry can help: no pushback, so that a retry policy stops
    info = error_details_pb2.ErrorInfo(reason=outcome.value.upper(), domain=DOMAIN)
    if rule is not None:
        info.metadata["rule"] = rule
    details = [_packed(info)]
    trailers: list[tuple[str, str | bytes]] = []
    retry_after_ms: int | None = None
    if retry_after_s is not None:
        retry_after_ms = int(header_values(retry_after_s)[1])  # HTTP's retry-after-ms, to the ms
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(retry_after_ms)
        details.insert(0, _packed(error_details_pb2.RetryInfo(retry_delay=delay)))
        trailers.append(("grpc-retry-pushback-ms", str(retry_after_ms)))
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    trailers.append(("grpc-status-details-bin", status.SerializeToString()))
    return GrpcError(code, message, tuple(trailers), outcome.value, retry_after_ms)


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
