"""The gRPC side of an admitted call: the backend's answer as a `ModelInferResponse`, or its error.

A gRPC handler answers by returning (or aborting), after the admitted call has run, so the answer
is kept here rather than written: `GrpcAnswer.result` holds the response or the `GrpcError`. The
slot does not wait for that write: it frees when the backend's answer has been read whole, as an
HTTP answer with a Content-Length does. A client that leaves cancels the handler's task, which the
admitted call treats as any client that left.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from gateway.flow.batch_calls import BatchMember, Failed
from gateway.flow.drain import DRAINING_RETRY_S, Drain
from gateway.flow.verdicts import Lease, Refusal
from gateway.grpc.status import Code, GrpcError, backend_code, outcome_error
from gateway.grpc.tensors import infer_response
from gateway.telemetry.server_timing import server_timing_value
from gateway.tensors.batch import header_length_of
from gateway.upstream.exchange import UpstreamExchange
from gateway.upstream.reply import ConnectFailed, UpstreamError
from policies.outcomes import Outcome, answered

log = logging.getLogger("gateway.grpc")


class GrpcAnswer:
    """The client's side of one admitted gRPC inference (a gateway.flow.admitted.Ingress)."""

    __slots__ = ("_drain", "_no_backend_retry_s", "_work", "result", "timing")

    def __init__(self, work: UpstreamExchange, drain: Drain, no_backend_retry_s: float) -> None:
        self._work = work
        self._drain = drain
        self._no_backend_retry_s = no_backend_retry_s
        self.result: Any = None
        """The `ModelInferResponse`, or the `GrpcError` the call ended with."""
        self.timing: tuple[str, str] | None = None
        """`server-timing` for the trailing metadata, once the backend answered."""

    def until_disconnect(self) -> asyncio.Future[None]:
        # A gRPC client that leaves cancels the handler's task: nothing to watch for.
        return asyncio.get_running_loop().create_future()

    async def refuse(self, refusal: Refusal) -> None:
        self.result = outcome_error(
            refusal.outcome, detail=refusal.detail, retry_after_s=refusal.retry_after_s, rule=refusal.rule
        )

    async def answer(self, lease: Lease) -> Outcome:
        work = self._work
        retry_after_s: float | None = None
        try:
            reply = work.reply or await work.start()
            await reply.head()
            body = await reply.read()
        except asyncio.CancelledError:
            if not self._drain.absorb_cut():
                raise
            outcome, retry_after_s = Outcome.DRAINING, DRAINING_RETRY_S
        except ConnectFailed:  # the backend was marked unreachable before its slot went back
            outcome, retry_after_s = Outcome.NO_BACKEND, self._no_backend_retry_s
        except TimeoutError:
            outcome = Outcome.UPSTREAM_TIMEOUT
        except UpstreamError as error:
            log.warning("backend %s failed: %s", lease.slot.backend.url, error)
            outcome = Outcome.UPSTREAM_ERROR
        else:
            timing = server_timing_value(lease.queue_wait_s, work.elapsed_s or 0.0, lease.batch_wait_s)
            self.timing = ("server-timing", timing)
            return self._answered(reply.status, reply.headers, body)
        self.result = outcome_error(outcome, retry_after_s=retry_after_s)
        return outcome

    def _answered(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> Outcome:
        if status >= 400:
            self.result = GrpcError(
                backend_code(status), backend_message(body), reason=answered(status).value
            )
            return answered(status)
        try:
            # The backend's field names as it wrote them: Triton's is `Inference-Header-Content-Length`.
            self.result = infer_response(body, header_length_of((k.lower(), v) for k, v in headers))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            log.warning("a backend's answer is not a KServe v2 inference answer: %s", error)
            message = f"the backend's answer is not a KServe v2 inference answer: {error}"
            self.result = GrpcError(Code.INTERNAL, message, reason=Outcome.UPSTREAM_ERROR.value)
            return Outcome.UPSTREAM_ERROR
        return answered(status)


class GrpcBatchAnswer(GrpcAnswer):
    """A mergeable request's side (gateway.flow.batch_calls): alone on its slot, `GrpcAnswer`; in a
    batch, its rows of the merged answer."""

    __slots__ = ("_member",)

    def __init__(self, member: BatchMember, drain: Drain, no_backend_retry_s: float) -> None:
        super().__init__(member.exchange, drain, no_backend_retry_s)
        self._member = member

    async def answer(self, lease: Lease) -> Outcome:
        member = self._member
        if member.solo or member.result is None or member.round is None:
            return await super().answer(lease)
        batch = member.round
        timeout_s = None if member.budget_at is None else max(0.0, member.budget_at - member.clock())
        try:
            async with asyncio.timeout(timeout_s):
                result = await member.result
        except TimeoutError:  # its budget ran out; the batch goes on for the others
            self.result = outcome_error(Outcome.UPSTREAM_TIMEOUT)
            return Outcome.UPSTREAM_TIMEOUT
        except asyncio.CancelledError:
            if not self._drain.absorb_cut():
                raise
            self.result = outcome_error(Outcome.DRAINING, retry_after_s=DRAINING_RETRY_S)
            return Outcome.DRAINING
        if isinstance(result, Failed):
            self.result = outcome_error(
                result.outcome, detail=result.detail, retry_after_s=result.retry_after_s
            )
            return result.outcome
        batch_wait_s = (lease.batch_wait_s or 0.0) + batch.started_at - member.joined_at
        self.timing = (
            "server-timing",
            server_timing_value(lease.queue_wait_s, batch.upstream_s(), batch_wait_s),
        )
        return self._answered(result.status, result.headers, result.body)


def backend_message(body: bytes) -> str:
    """A backend's error message: KServe's `{"error": "..."}`, or its body's first 200 characters."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        error = None
    if isinstance(error, str):
        return error
    return body[:200].decode("utf-8", "replace") or "the backend failed the request"
