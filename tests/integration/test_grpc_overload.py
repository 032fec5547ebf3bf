"""HTTP and gRPC clients flooding one pool together, on both stores, at a default-sized budget: two
tenants weighted 3:1, the heavier over HTTP and the lighter over gRPC, each at 1.25x the backend's
capacity with a 3 s queue wait. The slots are one count whatever the ingress: the work is split by
weight, what admission lets in is served in time, and every gRPC refusal is RESOURCE_EXHAUSTED
with pushback."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.integration.servers import gateway_config
from tests.integration.test_overload_shares import (
    ALLOWED_MS,
    COUNTED_FROM_S,
    PER_TENANT_RATE,
    SEND_S,
    SERVICE_MS,
    SLOTS,
    busy_share,
    check_admitted_served_in_time,
    open_loop,
    schedule,
)

pytestmark = [pytest.mark.anyio, pytest.mark.flood]


def grpc_request():
    request = service_pb2.ModelInferRequest(model_name="sim")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1)
    return request


async def grpc_open_loop(target: str, tenant: str, seed: int, started: float, served: list, refused: list):
    """As test_overload_shares.open_loop, over gRPC: a served call's queue wait is its trailing
    `server-timing`; a refused one is recorded with its reason (as HTTP's body names it)."""
    request, metadata = grpc_request(), (("x-tenant", tenant),)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def send():
            call = stub.ModelInfer(request, metadata=metadata, timeout=10)
            try:
                await call
            except grpc.aio.AioRpcError as error:
                trailers = dict(error.trailing_metadata())
                assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error
                assert int(trailers["grpc-retry-pushback-ms"]) >= 1
                status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
                info = error_details_pb2.ErrorInfo()
                assert status.details[1].Unpack(info)
                refused.append((time.monotonic() - started, tenant, info.reason.lower().encode()))
                return
            timing = dict(await call.trailing_metadata())["server-timing"]
            queue_ms = float(timing.split(", ")[0].removeprefix("queue;dur="))
            served.append((time.monotonic() - started, tenant, queue_ms))

        sends = []
        for due in schedule(seed):
            await asyncio.sleep(max(0.0, started + due - time.monotonic()))
            sends.append(asyncio.ensure_future(send()))
        await asyncio.gather(*sends)


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_http_and_grpc_tenants_flooding_share_the_slots_by_weight_and_in_time(
    start_sim, start_gateway, store_section
):
    sim = start_sim(slots=SLOTS, base_ms=SERVICE_MS)
    config = gateway_config(
        [(sim.url, SLOTS)],
        priorities=[{"name": "low", "max_wait_ms": ALLOWED_MS}],
        expected_service_ms=SERVICE_MS,
        tenants=[{"name": "team-a", "weight": 3}, {"name": "team-b", "weight": 1}],
        **({} if store_section is None else {"store": store_section}),
    )
    config["grpc_listen"] = {"host": "127.0.0.1", "port": 0}
    gateway = start_gateway(config)
    served: list = []
    refused: list = []
    started = time.monotonic()
    await asyncio.gather(
        open_loop(gateway.url, "team-a", 1, started, served, refused),
        grpc_open_loop(gateway.grpc_target, "team-b", 2, started, served, refused),
    )
    assert sim.stats()["peak_inflight"] <= SLOTS
    counted = [tenant for at, tenant, _ in served if COUNTED_FROM_S <= at <= SEND_S]
    share_b = counted.count("team-b") / len(counted)
    assert share_b == pytest.approx(0.25, rel=0.12), (counted.count("team-a"), counted.count("team-b"))
    assert len(counted) >= busy_share(store_section) * SLOTS * 1000 / SERVICE_MS * (SEND_S - COUNTED_FROM_S)
    assert sum(who == "team-b" for _, who, _ in refused) > 0.5 * PER_TENANT_RATE * SEND_S  # overloaded
    check_admitted_served_in_time(served, refused)
