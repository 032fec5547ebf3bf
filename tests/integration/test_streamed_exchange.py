"""A decoupled request's call upstream (gateway.upstream.streamed.StreamedExchange) against a real
grpc.aio server in this process, whose handler holds each request until told: how the slot
follows the backend when the request is abandoned, at every moment."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.exchange import Forwarder
from gateway.upstream.origin import OnAbandon, TlsOptions
from gateway.upstream.streamed import GrpcChannels, StreamedExchange
from tests.eventually import eventually
from tests.redis_server import free_port

pytestmark = pytest.mark.anyio


class HeldBackend(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers each request once `release` is set; counts the requests it got and the calls that
    were cancelled while it held them."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0
        self.cancelled = 0

    async def ModelStreamInfer(self, requests, context):
        async for request in requests:
            self.received += 1
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            yield service_pb2.ModelStreamInferResponse(
                infer_response=service_pb2.ModelInferResponse(id=request.id)
            )


@pytest.fixture
async def held_backend():
    backend = HeldBackend()
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(backend, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield backend, port
    backend.release.set()
    await server.stop(None)


class OnBackend:
    def __init__(self, backend: BackendState) -> None:
        self.backend = backend


def exchange_to(
    port: int, on_abandon: OnAbandon, done: list, unreachable: list | None = None
) -> tuple[StreamedExchange, OnBackend, GrpcChannels]:
    """A request's exchange with the backend at `port`; `done` gets its slot's release, `unreachable`
    the backends it marked so."""
    unreachable = [] if unreachable is None else unreachable
    backend = BackendState(
        model="m",
        url="http://127.0.0.1:1",
        known_slots=1,
        health_path="/",
        on_abandon=on_abandon,
        grpc_port=port,
    )
    pool = ModelPool(name="m", backends=[backend], upstream_timeout_s=30.0)
    forwarder = Forwarder(
        None,  # type: ignore[arg-type]  # no HTTP here
        on_unreachable=lambda pool, backend: unreachable.append(backend.grpc_target),
        observe_upstream_s=lambda *_: None,
    )
    channels = GrpcChannels()
    request = service_pb2.ModelInferRequest(model_name="m", id="held")
    exchange = StreamedExchange(forwarder, channels, pool, request, budget_s=None)
    exchange.on_done = done.append
    return exchange, OnBackend(backend), channels


async def test_an_abort_backends_request_abandoned_at_its_grant_is_cancelled_and_its_slot_freed(held_backend):
    """Abandoned in the very callback that granted it, before its call was made: the call is
    cancelled as soon as it is made, and the slot comes back without the backend's answer."""
    backend, port = held_backend
    done: list = []
    exchange, slot, channels = exchange_to(port, OnAbandon.ABORT, done)
    try:
        exchange.start_at_grant(slot)
        assert exchange.close()  # at once: the call's task has not run yet
        await eventually(lambda: len(done) == 1, what="the slot back")
        assert done == [None]  # no service time learned from a cut call
        assert not backend.release.is_set()
    finally:
        await channels.close()


async def test_an_abort_backends_request_abandoned_while_it_runs_is_cancelled_at_the_backend(held_backend):
    backend, port = held_backend
    done: list = []
    exchange, slot, channels = exchange_to(port, OnAbandon.ABORT, done)
    try:
        exchange.start_at_grant(slot)
        await eventually(lambda: backend.received == 1, what="the request at the backend")
        exchange.close()
        await eventually(lambda: backend.cancelled == 1 and len(done) == 1, what="cancelled, the slot back")
    finally:
        await channels.close()


async def test_a_drain_backends_request_abandoned_keeps_its_slot_till_the_backend_answers(held_backend):
    backend, port = held_backend
    done: list = []
    exchange, slot, channels = exchange_to(port, OnAbandon.DRAIN, done)
    try:
        exchange.start_at_grant(slot)
        exchange.close()
        await eventually(lambda: backend.received == 1, what="the request at the backend")
        assert done == [] and backend.cancelled == 0
        backend.release.set()
        await eventually(lambda: len(done) == 1, what="the slot back once answered")
        assert done[0] is not None and done[0] > 0  # a whole answer: its service time is learned
    finally:
        await channels.close()


async def test_a_call_to_a_port_where_nothing_listens_marks_the_backend_and_frees_the_slot():
    done: list = []
    unreachable: list = []
    exchange, slot, channels = exchange_to(free_port(), OnAbandon.DRAIN, done, unreachable)
    try:
        exchange.start_at_grant(slot)
        end = await asyncio.wait_for(exchange.responses.get(), timeout=10)
        assert isinstance(end, grpc.aio.AioRpcError) and end.code() is grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: len(done) == 1, what="the slot back")
        assert done == [None] and unreachable == [slot.backend.grpc_target]
    finally:
        await channels.close()


async def test_a_call_that_cannot_be_made_fails_its_request_alone_and_frees_the_slot(tmp_path):
    """An https backend whose CA file is gone: no channel can be made, the request is told so, and
    its slot comes back."""
    done: list = []
    exchange, slot, channels = exchange_to(free_port(), OnAbandon.DRAIN, done)
    slot.backend.url = "https://127.0.0.1:1"
    slot.backend.connection = replace(
        slot.backend.connection, tls=TlsOptions(ca_file=str(tmp_path / "gone.pem"))
    )
    try:
        exchange.start_at_grant(slot)
        end = await asyncio.wait_for(exchange.responses.get(), timeout=10)
        assert isinstance(end, grpc.aio.AioRpcError) and end.code() is grpc.StatusCode.UNKNOWN
        assert "FileNotFoundError" in end.details()
        await eventually(lambda: len(done) == 1, what="the slot back")
        assert done == [None]
    finally:
        await channels.close()
