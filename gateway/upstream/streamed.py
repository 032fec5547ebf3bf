"""A decoupled model's request upstream: one `ModelStreamInfer` call to the backend's gRPC port,
started at the grant, whose responses (several, or none) are read into a queue for the client.

A decoupled model (Triton's transaction policy; its vLLM and TensorRT-LLM backends stream tokens
so) answers over gRPC streams only, and may send the end of a request apart from its last response
(the final flag alone). So each request goes up on a call of its own that asks for that empty final
response (`triton_enable_empty_final_response`) and half-closes at once: the backend ends the call
when it is done with the request, which is when the slot goes back. The rules are the exchange's
(gateway.upstream.exchange):
- the call starts inside the grant; `on_done` runs once, when the backend is done (its call ended,
  or was cut: by the upstream timeout, or by `close` on an `abort` backend), with the service time
  to learn from;
- a backend that cannot be reached is marked so before its slot goes back; how the call ended is
  judged for passive health (policies.circuit);
- `close` leaves the call to end as the backend's `on_abandon` says: `abort` cancels it (Triton
  cancels the request), `drain` reads it to its end and frees the slot then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.exchange import Forwarder, OnBackend, UpstreamTrace
from gateway.upstream.origin import OnAbandon, TlsOptions
from policies.circuit import Ending, verdict_of

EMPTY_FINAL = "triton_enable_empty_final_response"
"""The request parameter that has Triton send a request's end as a response of its own."""
FINAL = "triton_final_response"
"""The response parameter that says the request is done."""

_ENDINGS = {
    grpc.StatusCode.UNAVAILABLE: Ending.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Ending.TIMED_OUT,
    grpc.StatusCode.CANCELLED: Ending.ABANDONED,
}
_STATUSES = {grpc.StatusCode.OK: 200, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500}
"""A call's code as the HTTP status passive health judges (any other is the client's: 400)."""
_NONE = grpc.aio.Metadata()

log = logging.getLogger("gateway.grpc")


class GrpcChannels:
    """One channel per backend gRPC target, opened on first use; `close` at the gateway's exit."""

    def __init__(self) -> None:
        self._stubs: dict[str, Any] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, backend: BackendState) -> Any:
        target = backend.grpc_target
        stub = self._stubs.get(target)
        if stub is None:
            options = [("grpc.max_receive_message_length", -1)]
            if backend.url.startswith("https://"):  # the backend's TLS settings, as its HTTP port's
                channel = grpc.aio.secure_channel(target, credentials(backend.connection.tls), options)
            else:
                channel = grpc.aio.insecure_channel(target, options)
            self._channels.append(channel)
            stub = self._stubs[target] = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return stub

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], {}
        for channel in channels:
            await channel.close(grace=None)


def credentials(tls: TlsOptions) -> grpc.ChannelCredentials:
    """A backend's TLS for its gRPC port: its CAs (else the system's) and client certificate."""

    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(
        read(tls.ca_file), read(tls.key_file or tls.cert_file), read(tls.cert_file)
    )


class StreamedExchange:
    """One decoupled request's call to the backend its slot is on; see the module docstring.

    `responses` gets each `ModelStreamInferResponse` as it comes, then the call's end: None when it
    ended OK, else its `grpc.aio.AioRpcError`."""

    __slots__ = (
        "_backend",
        "_call",
        "_cancelled",
        "_channels",
        "_forwarder",
        "_pool",
        "_request",
        "_task",
        "budget_at",
        "elapsed_s",
        "on_done",
        "request_id",
        "responses",
        "started_at",
        "trace",
    )

    def __init__(
        self,
        forwarder: Forwarder,
        channels: GrpcChannels,
        pool: ModelPool,
        request: Any,
        budget_s: float | None,
    ) -> None:
        self._forwarder = forwarder
        self._channels = channels
        self._pool = pool
        self._request = request
        self.budget_at = None if budget_s is None else forwarder.clock() + budget_s
        """When the client's budget runs out (the forwarder's clock): its reader stops waiting then."""
        self._backend: BackendState | None = None
        self._call: Any = None
        self._cancelled = False
        """Abandoned on an `abort` backend before its call was made: cancelled as soon as it is."""
        self._task: asyncio.Task[None] | None = None
        self.on_done: Callable[[float | None], None] | None = None
        self.trace: UpstreamTrace | None = None
        self.request_id = ""
        """The request's id, sent to the backend as `x-request-id` ("": none)."""
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.started_at = 0.0
        self.elapsed_s: float | None = None

    def prepare(self) -> None:
        """Nothing to build: the request is the client's message."""

    def start_at_grant(self, slot: OnBackend) -> None:
        self._backend = slot.backend
        self.started_at = self._forwarder.clock()
        self._task = asyncio.get_running_loop().create_task(self._run(slot.backend))

    def close(self) -> bool:
        """Done with it: a call still running ends as its backend's `on_abandon` says (and then
        calls `on_done`); False when none was started, so no `on_done` will come."""
        if self._task is None:
            return False
        if self._backend is not None and self._backend.on_abandon is OnAbandon.ABORT:
            # Not the task: one cancelled before its first step never runs its `finally`.
            self._cancelled = True
            if self._call is not None:
                self._call.cancel()
        return True

    async def _run(self, backend: BackendState) -> None:
        request = service_pb2.ModelInferRequest()
        request.CopyFrom(self._request)
        request.model_name = backend.served_model or backend.model
        request.parameters[EMPTY_FINAL].bool_param = True
        # The backend's log names the request as the gateway's does.
        metadata = [("x-request-id", self.request_id)] if self.request_id else []
        if self.trace is not None:
            attributes: dict[str, object] = {"rpc.system": "grpc", "server.address": backend.grpc_target}
            metadata.append(("traceparent", self.trace.upstream_started(attributes)))
        code = grpc.StatusCode.OK
        try:
            # The hard upstream timeout only: a budget that runs out ends the client's wait, and the
            # call then ends as the backend's on_abandon says (`close`), as an HTTP exchange does.
            call = self._call = self._channels.stub(backend).ModelStreamInfer(
                timeout=self._pool.upstream_timeout_s, metadata=metadata
            )
            if self._cancelled:
                call.cancel()
            await call.write(request)  # written here: a request iterator would cost a task of its own
            await call.done_writing()
            while (response := await call.read()) is not grpc.aio.EOF:
                self.responses.put_nowait(response)
        except grpc.aio.AioRpcError as error:
            code = error.code()
            self.responses.put_nowait(error)
        except asyncio.CancelledError:  # cancelled by `close` (abort), or the gateway exits
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as error:  # no call could be made (a TLS file gone): the gateway's failure
            log.exception("a decoupled request's call to %s could not be made", backend.grpc_target)
            code = grpc.StatusCode.UNKNOWN
            details = f"the gateway could not call the backend: {type(error).__name__}"
            self.responses.put_nowait(grpc.aio.AioRpcError(code, _NONE, _NONE, details))
        finally:
            if code is grpc.StatusCode.OK:
                self.responses.put_nowait(None)
            elif code is grpc.StatusCode.CANCELLED:
                self.responses.put_nowait(grpc.aio.AioRpcError(code, _NONE, _NONE))
            self._finished(backend, code)

    def _finished(self, backend: BackendState, code: grpc.StatusCode) -> None:
        """The backend is done with the request: judge and record it, then let the slot go."""
        forwarder = self._forwarder
        self.elapsed_s = elapsed_s = forwarder.clock() - self.started_at
        ending = _ENDINGS.get(code, Ending.ANSWERED)
        status = _STATUSES.get(code, 400)
        service_s: float | None = None
        try:
            if ending is Ending.UNREACHABLE:
                forwarder.on_unreachable(self._pool, backend)
            if forwarder.on_verdict is not None:
                verdict = verdict_of(ending, status)
                if verdict is not None:
                    forwarder.on_verdict(self._pool, backend, verdict)
            if code is grpc.StatusCode.OK:
                exemplar = self.trace.exemplar if self.trace is not None else None
                forwarder.observe_upstream_s(self._pool.name, elapsed_s, exemplar)
                service_s = elapsed_s
            elif ending is Ending.TIMED_OUT:
                service_s = elapsed_s  # cut short: the service took at least this long
            if self.trace is not None:
                answered = ending is Ending.ANSWERED
                self.trace.upstream_ended(status if answered else None, None if answered else code.name)
        finally:  # whatever the bookkeeping raised, the backend is done: its slot goes back
            on_done, self.on_done = self.on_done, None
            if on_done is not None:
                on_done(service_s)
