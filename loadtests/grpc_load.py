"""Open-loop load over gRPC (KServe v2 `ModelInfer`), for the benchmarks' gRPC targets.

The same arrivals and the same accounting as loadtests.openloop: latency from each request's
scheduled time, the class and budget sent as metadata (`x-priority`, `x-request-timeout-ms`), and
each answer mapped to the HTTP status the HTTP path would have given (OK 200, RESOURCE_EXHAUSTED
429, UNAVAILABLE 503), so that one summary reads both.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Sequence

import grpc
from google.rpc import error_details_pb2, status_pb2
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtests.openloop import Arrival, Outcome

_STATUS = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def small_request(model: str = "sim", input_name: str = "INPUT0") -> service_pb2.ModelInferRequest:
    """The benchmarks' small tensor: four FP32 values, as loadtests.openloop.INFER_BODY."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=input_name, datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(struct.pack("<4f", 1, 2, 3, 4))
    return request


def _expired_in_queue(error: grpc.aio.AioRpcError) -> bool:
    details = dict(error.trailing_metadata() or ()).get("grpc-status-details-bin")
    if not isinstance(details, bytes):
        return False
    info = error_details_pb2.ErrorInfo()
    status = status_pb2.Status.FromString(details)
    return any(d.Unpack(info) and info.reason == "DEADLINE_EXPIRED_IN_QUEUE" for d in status.details)


async def run_grpc(
    targets: Sequence[str],
    schedule: Sequence[Arrival],
    *,
    request: service_pb2.ModelInferRequest | None = None,
    timeout_factor: float = 3.0,
    send_class: bool = True,
) -> list[Outcome]:
    """Send `schedule` to the gRPC `targets` (host:port) in turn, one channel each; a call gives up
    after `timeout_factor` x its deadline + 1 s. `send_class`: send the class and budget as
    metadata (off for a server that knows neither, such as Triton itself)."""
    message = request if request is not None else small_request()
    channels = [grpc.aio.insecure_channel(target) for target in targets]
    stubs = [service_pb2_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
    outcomes: list[Outcome] = []
    started = time.monotonic()

    async def one(arrival: Arrival, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
        metadata = (
            (("x-priority", arrival.priority), ("x-request-timeout-ms", str(arrival.deadline_ms)))
            if send_class
            else ()
        )
        scheduled = started + arrival.at_s
        try:
            await stub.ModelInfer(
                message, metadata=metadata, timeout=arrival.deadline_ms / 1000 * timeout_factor + 1
            )
        except grpc.aio.AioRpcError as error:
            latency = time.monotonic() - scheduled
            status = _STATUS.get(error.code(), 500)
            if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED and error.details() == "Deadline Exceeded":
                outcomes.append(Outcome(arrival, None, latency, error="TimeoutError"))
                return
            pushback = "grpc-retry-pushback-ms" in dict(error.trailing_metadata() or ())
            outcomes.append(
                Outcome(arrival, status, latency, pushback, expired_in_queue=_expired_in_queue(error))
            )
            return
        outcomes.append(Outcome(arrival, 200, time.monotonic() - scheduled))

    try:
        tasks = []
        for index, arrival in enumerate(schedule):
            delay = started + arrival.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(arrival, stubs[index % len(stubs)])))
        await asyncio.gather(*tasks)
    finally:
        for channel in channels:
            await channel.close()
    return outcomes
