"""The kit's gRPC transport: KServe v2 / Triton `ModelInfer` calls, answered as the HTTP path would be.

A request's KServe JSON body becomes a `ModelInferRequest` with typed contents; its headers become
metadata (`x-priority`, `x-tenant`, `authorization`, `x-request-timeout-ms`, lower-cased as gRPC
wants). An answer is mapped to the status the HTTP path would have given (OK 200,
RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, ...), its reason read from the `google.rpc.ErrorInfo` the
gateway sends, its advice from `grpc-retry-pushback-ms`, its timings from `server-timing`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.grpc.tensors import CONTENTS
from gateway.tensors.datatypes import flattened
from gateway.tools.loadtest.client import Attempt, server_timing
from gateway.tools.loadtest.workload import ScenarioError

STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""gRPC status -> the HTTP status the same answer has over HTTP (others: 500)."""


class BodyError(ScenarioError):
    """A KServe JSON body that has no gRPC form here; the message says why."""


def infer_request(model: str, body: Mapping[str, Any]) -> service_pb2.ModelInferRequest:
    """The `ModelInferRequest` of a KServe v2 JSON request body."""
    try:
        return _infer_request(model, body)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        if isinstance(error, BodyError):
            raise
        raise BodyError(
            f"not a KServe v2 request body with inputs of name, datatype, shape, data: {error!r}"
        ) from None


def _infer_request(model: str, body: Mapping[str, Any]) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=str(body.get("id", "")))
    for tensor in body.get("inputs", []):
        datatype = tensor.get("datatype", "")
        field = CONTENTS.get(datatype)
        if field is None:
            raise BodyError(f"input {tensor.get('name')!r}: datatype {datatype!r} has no typed gRPC contents")
        sent = request.inputs.add(name=tensor["name"], datatype=datatype, shape=tensor["shape"])
        values = flattened(tensor.get("data", []))
        if datatype == "BYTES":
            values = [v.encode() if isinstance(v, str) else bytes(v) for v in values]
        getattr(sent.contents, field).extend(values)
    for output in body.get("outputs", []):
        request.outputs.add(name=output["name"])
    return request


class Channels:
    """One channel per target (host:port), opened on first use."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[grpc.aio.Channel, service_pb2_grpc.GRPCInferenceServiceStub]] = {}

    def stub(self, target: str) -> service_pb2_grpc.GRPCInferenceServiceStub:
        target = target.split("://", 1)[-1].rstrip("/")  # grpc://host:port, or host:port
        if target not in self._open:
            channel = grpc.aio.insecure_channel(target)
            self._open[target] = (channel, service_pb2_grpc.GRPCInferenceServiceStub(channel))
        return self._open[target][1]

    async def close(self) -> None:
        for channel, _ in self._open.values():
            await channel.close()

    async def call(
        self,
        target: str,
        request: service_pb2.ModelInferRequest,
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        clock: Callable[[], float],
    ) -> Attempt:
        """One `ModelInfer` to `target`, answered as an Attempt of the HTTP path."""
        return await _call(self.stub(target), request, metadata, timeout_s, clock)


async def _call(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    request: service_pb2.ModelInferRequest,
    metadata: tuple[tuple[str, str], ...],
    timeout_s: float,
    clock: Callable[[], float],
) -> Attempt:
    attempt = Attempt(sent_s=clock())
    rpc = stub.ModelInfer(request, metadata=metadata, timeout=timeout_s)
    try:
        await rpc
        code, trailers = grpc.StatusCode.OK, await rpc.trailing_metadata()
    except grpc.aio.AioRpcError as error:
        code, trailers = error.code(), error.trailing_metadata()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and error.details() == "Deadline Exceeded":
            attempt.reason, attempt.ended_s = "timeout", clock()  # the client's own deadline
            return attempt
    found = dict(trailers or ())
    attempt.status = STATUS.get(code, 500)
    attempt.queue_ms, attempt.upstream_ms = server_timing(str(found.get("server-timing", "")))
    if code is grpc.StatusCode.OK:
        attempt.reason = "ok"
    else:
        attempt.reason = _reason(found.get("grpc-status-details-bin")) or code.name.lower()
        pushback = found.get("grpc-retry-pushback-ms")
        attempt.advised_s = int(pushback) / 1000 if isinstance(pushback, str) and pushback.isdigit() else None
        attempt.retryable = code is not grpc.StatusCode.FAILED_PRECONDITION
    attempt.ended_s = clock()
    return attempt


def _reason(details: object) -> str | None:
    """The gateway's reason (its outcome, in ErrorInfo as capitals), lower-cased as HTTP names it."""
    if not isinstance(details, bytes):
        return None
    info = error_details_pb2.ErrorInfo()
    for detail in status_pb2.Status.FromString(details).details:
        if detail.Unpack(info):
            return str(info.reason).lower()
    return None
