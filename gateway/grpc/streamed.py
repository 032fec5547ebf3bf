"""The client's side of a decoupled model's request on a `ModelStreamInfer` stream: each response
written to the stream as the backend sends it (gateway.upstream.streamed), and a refusal or a
failure written in-band, as every message of a stream is answered (gateway.grpc.service).

The backend is asked for a request's end as a response of its own (an empty final response); the
client gets it only when it asked for it too (tritonclient's `enable_empty_final_response`), as
Triton's own stream would answer it. The wait for the next response ends at the client's budget:
the client is told DEADLINE_EXCEEDED in-band, and the backend's call ends as its `on_abandon` says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tritonclient.grpc import service_pb2

import grpc
from gateway.flow.drain import DRAINING_RETRY_S, Drain
from gateway.flow.verdicts import Lease, Refusal
from gateway.grpc.status import Code, GrpcError, outcome_error
from gateway.grpc.tensors import parameter_values, set_parameters
from gateway.upstream.streamed import EMPTY_FINAL, FINAL, StreamedExchange
from policies.outcomes import Outcome

log = logging.getLogger("gateway.grpc")

Write = Callable[[Any], Awaitable[None]]
"""Writes one `ModelStreamInferResponse` to the client's stream."""

UNARY_TO_DECOUPLED = "ModelInfer RPC doesn't support models with decoupled transaction policy"
"""Triton's own answer (UNIMPLEMENTED) to a unary call for a decoupled model."""

_FAILED_CALLS = {
    Code.UNAVAILABLE: Outcome.NO_BACKEND,
    Code.DEADLINE_EXCEEDED: Outcome.UPSTREAM_TIMEOUT,
    Code.CANCELLED: Outcome.UPSTREAM_ERROR,
    Code.UNKNOWN: Outcome.UPSTREAM_ERROR,  # a backend's unhandled failure, or no call could be made
}


class StreamedAnswer:
    """One admitted decoupled request's side of the client's stream (a gateway.flow.admitted.Ingress)."""

    __slots__ = ("_clock", "_drain", "_no_backend_retry_s", "_request", "_work", "_write", "result")

    def __init__(
        self,
        request: Any,
        work: StreamedExchange,
        write: Write,
        drain: Drain,
        no_backend_retry_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._request = request
        self._work = work
        self._write = write
        self._drain = drain
        self._no_backend_retry_s = no_backend_retry_s
        self._clock = clock
        self.result: Any = None
        """The last response written, or the `GrpcError` the request ended with."""

    def until_disconnect(self) -> asyncio.Future[None]:
        # A gRPC client that leaves cancels the stream's tasks: nothing to watch for.
        return asyncio.get_running_loop().create_future()

    async def refuse(self, refusal: Refusal) -> None:
        await self._fail(
            outcome_error(
                refusal.outcome, detail=refusal.detail, retry_after_s=refusal.retry_after_s, rule=refusal.rule
            )
        )

    async def answer(self, lease: Lease) -> Outcome:
        work, request = self._work, self._request
        asked_for_end = bool(parameter_values(request.parameters).get(EMPTY_FINAL))
        outcome = Outcome.OK
        try:
            while True:
                timeout_s = None if work.budget_at is None else max(0.0, work.budget_at - self._clock())
                async with asyncio.timeout(timeout_s):
                    item = await work.responses.get()
                if item is None:  # the backend ended the call: the request is done
                    return outcome
                if isinstance(item, grpc.aio.AioRpcError):
                    return await self._call_failed(item)
                if item.error_message:
                    outcome = Outcome.BACKEND_SERVER_ERROR  # passed on in-band as it came
                elif _empty_final(item.infer_response) and not asked_for_end:
                    continue
                self.result = item.infer_response
                await self._write(item)
        except TimeoutError:  # the budget ran out: the call ends as the backend's on_abandon says
            await self._fail(outcome_error(Outcome.UPSTREAM_TIMEOUT))
            return Outcome.UPSTREAM_TIMEOUT
        except asyncio.CancelledError:
            if not self._drain.absorb_cut():
                raise
            await self._fail(outcome_error(Outcome.DRAINING, retry_after_s=DRAINING_RETRY_S))
            return Outcome.DRAINING

    async def _call_failed(self, error: grpc.aio.AioRpcError) -> Outcome:
        code = error.code()
        outcome = _FAILED_CALLS.get(code)
        if outcome is Outcome.NO_BACKEND:
            await self._fail(outcome_error(outcome, retry_after_s=self._no_backend_retry_s))
        elif outcome is not None:
            log.warning("a decoupled request's call ended %s: %s", code.name, error.details())
            await self._fail(outcome_error(outcome))
        else:  # the backend's own answer, passed on as it came
            outcome = Outcome.BACKEND_SERVER_ERROR if code is Code.INTERNAL else Outcome.BACKEND_CLIENT_ERROR
            await self._fail(GrpcError(code, error.details() or code.name, reason=outcome.value))
        return outcome

    async def _fail(self, error: GrpcError) -> None:
        self.result = error
        await self._write(in_band(self._request, error))


def in_band(request: Any, error: GrpcError) -> Any:
    """A stream's answer to `request` that failed: its error in-band (the stream stays open), with
    its code, reason and pushback among the response's parameters."""
    response = service_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    parameters: dict[str, Any] = {"grpc_code": error.code.name}
    if error.reason:
        parameters["reason"] = error.reason
    if error.retry_after_ms is not None:
        parameters["retry_after_ms"] = error.retry_after_ms
    set_parameters(response.parameters, parameters)
    return service_pb2.ModelStreamInferResponse(error_message=error.message, infer_response=response)


def _empty_final(response: Any) -> bool:
    """Whether `response` only says its request is done (no outputs)."""
    return not response.outputs and bool(parameter_values(response.parameters).get(FINAL))
