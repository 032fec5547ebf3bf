"""Open-loop load over gRPC (KServe v2 `ModelInfer`), for the benchmarks' gRPC targets.

The same arrivals, generator and accounting as loadtests.openloop (the kit's client and its gRPC
transport, gateway/tools/loadtest/grpc_calls.py): latency from each request's scheduled time, the
class and budget sent as metadata (`x-priority`, `x-request-timeout-ms`), and each answer mapped to
the HTTP status the HTTP path would have given (OK 200, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503),
so that one summary reads both.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from tritonclient.grpc import service_pb2

from gateway.tools.loadtest import client
from gateway.tools.loadtest.requests import Prepared
from gateway.tools.loadtest.workload import Arrival as KitArrival
from loadtests.openloop import Arrival, Outcome, outcome_of


def small_request(model: str = "sim", input_name: str = "INPUT0") -> service_pb2.ModelInferRequest:
    """The benchmarks' small tensor: four FP32 values, as loadtests.openloop.INFER_BODY."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=input_name, datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(struct.pack("<4f", 1, 2, 3, 4))
    return request


async def run_grpc(
    targets: Sequence[str],
    schedule: Sequence[Arrival],
    *,
    request: service_pb2.ModelInferRequest | None = None,
    timeout_factor: float = 3.0,
    send_class: bool = True,
) -> list[Outcome]:
    """Send `schedule` to the gRPC `targets` (host:port) in turn by the kit's client, one channel
    each; a call gives up after `timeout_factor` x its deadline + 1 s. `send_class`: send the class
    and budget as metadata (off for a server that knows neither, such as Triton itself)."""
    message = request if request is not None else small_request()
    prepared = []
    for arrival in schedule:
        headers = (
            {"x-priority": arrival.priority, "x-request-timeout-ms": str(arrival.deadline_ms)}
            if send_class
            else {}
        )
        prepared.append(Prepared("", b"", headers, False, arrival.deadline_ms / 1000, message))
    sends = [KitArrival(arrival.at_s, index) for index, arrival in enumerate(schedule)]
    records, _ = await client.run(list(targets), sends, prepared, timeout_factor=timeout_factor)
    return [outcome_of(schedule[record.arrival.traffic], record) for record in records]
