"""A gRPC `ModelInferRequest`'s way to its answer: classified, translated, admitted, answered.

The same steps as an HTTP inference (gateway.http.kserve): the key and class first, from the
call's metadata (`authorization`, `x-tenant`, `x-priority`, `x-request-timeout-ms`) read by the
HTTP path's classifier; the budget is the smaller of `x-request-timeout-ms` and the call's own
deadline (`grpc-timeout`); the model; the tensors, translated to a binary KServe v2 body
(gateway.grpc.tensors); then one admitted call (gateway.flow.admitted), which takes a slot of the
pool HTTP requests take slots of. Unary calls and each message of a stream come here alike.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

from gateway.flow.admitted import Admission, AdmittedCall, RequestMeta
from gateway.flow.batch_calls import Batches, BatchMember
from gateway.flow.drain import DRAINING_RETRY_S
from gateway.flow.request_meta import Problem, RequestClassifier
from gateway.grpc.answer import GrpcAnswer, GrpcBatchAnswer
from gateway.grpc.status import Code, GrpcError, outcome_error
from gateway.grpc.streamed import UNARY_TO_DECOUPLED, StreamedAnswer, Write
from gateway.grpc.tensors import TensorError, batch_size, parameter_values, request_body
from gateway.queues.base import Batching
from gateway.telemetry.access_log import AccessLog, AccessRecord
from gateway.telemetry.tracing import RequestTrace, Tracing
from gateway.tensors.batch import HEADER_LENGTH, part_of
from gateway.upstream.backends import ModelPool
from gateway.upstream.exchange import Forwarder, UpstreamExchange, UpstreamRequest
from gateway.upstream.streamed import GrpcChannels, StreamedExchange
from policies.outcomes import Outcome
from policies.request_kinds import request_kind
from policies.sequences import sequence_of

Headers = list[tuple[bytes, bytes]]

SERVICE = "inference.GRPCInferenceService"
ROUTE = "grpc.infer"
"""The access log's route of a gRPC inference."""


def metadata_headers(metadata: Iterable[Any] | None) -> Headers:
    """A call's invocation metadata as the header pairs the classifier reads (names lower case)."""
    headers: Headers = []
    for key, value in metadata or ():
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogateescape")
        headers.append((str(key).lower().encode("latin-1", "replace"), raw))
    return headers


@dataclass(frozen=True, slots=True)
class Answered:
    """How an inference ended: its response or error, and its trailing metadata."""

    result: Any
    """The `ModelInferResponse` (a decoupled request's last), or a `GrpcError`."""
    trailers: tuple[tuple[str, str], ...] = ()
    written: bool = False
    """Its responses were written to the client's stream already (a decoupled model's request)."""


class GrpcInference:
    """Runs gRPC inferences through admission; one per gateway, shared by its calls."""

    def __init__(
        self,
        pools: Mapping[str, ModelPool],
        classifier: RequestClassifier,
        admission: Admission,
        forwarder: Forwarder,
        batches: Batches,
        access: AccessLog | None = None,
        tracing: Tracing | None = None,
        channels: GrpcChannels | None = None,
    ) -> None:
        self._pools = pools
        self._channels = channels or GrpcChannels()
        """To the backends' gRPC ports, for decoupled models (gateway.upstream.streamed)."""
        self._classifier = classifier
        self._admission = admission
        self._forwarder = forwarder
        self._batches = batches
        self._access = access
        self._tracing = tracing

    async def infer(
        self, request: Any, headers: Headers, time_left_s: float | None, write: Write | None = None
    ) -> Answered:
        """Admit and run one inference, counted in the drain from here to its answer. `write`: the
        client's stream, where a decoupled model's responses go as they come (None: a unary call)."""
        drain = self._admission.drain
        drain.started()
        record = self._record(headers)
        trace = None
        if self._tracing is not None:
            attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": "ModelInfer"}
            trace = self._tracing.request(f"{SERVICE}/ModelInfer", headers, attributes)
        try:
            answered = await self._infer(request, headers, time_left_s, record, trace, write)
        except asyncio.CancelledError:
            if not drain.absorb_cut():
                raise
            # Cut before admission: nothing was counted yet (an admitted call answers its own cut).
            self._admission.metrics.count("", "", Outcome.DRAINING)
            if record is not None:
                record.outcome = Outcome.DRAINING.value
            answered = Answered(outcome_error(Outcome.DRAINING, retry_after_s=DRAINING_RETRY_S))
        finally:
            drain.finished()
        if record is not None and self._access is not None:
            _note(record, answered)
            self._access.write(record)
        if trace is not None:
            code = answered.result.code if isinstance(answered.result, GrpcError) else None
            trace.end({"rpc.grpc.status_code": 0 if code is None else code.value[0]})
        return answered

    def _record(self, headers: Headers) -> AccessRecord | None:
        if self._access is None or not self._access.enabled:
            return None
        sent = next((value for name, value in headers if name == b"x-request-id"), None)
        return self._access.begin(sent, "RPC", ROUTE)

    async def _infer(
        self,
        request: Any,
        headers: Headers,
        time_left_s: float | None,
        record: AccessRecord | None,
        trace: RequestTrace | None,
        write: Write | None,
    ) -> Answered:
        meta = self._classifier.classify(headers)
        if isinstance(meta, Problem):
            return self._fail(record, meta.outcome, detail=meta.detail)
        if self._classifier.reads_levels and not any(name == b"x-priority" for name, _ in headers):
            level = parameter_values(request.parameters).get("priority")  # tritonclient's priority=
            meta = self._classifier.at_level(meta, level)
            if isinstance(meta, Problem):
                return self._fail(record, meta.outcome, detail=meta.detail)
        if time_left_s is not None:  # the call's deadline bounds the budget as X-Request-Timeout-Ms does
            budget_s = min(math.inf if meta.budget_s is None else meta.budget_s, max(0.001, time_left_s))
            meta = replace(meta, budget_s=budget_s)
        model = request.model_name
        pool = self._pools.get(model)
        if pool is None:
            detail = repr(model) if model else "ModelInferRequest.model_name is empty"
            return self._fail(record, Outcome.UNKNOWN_MODEL, priority=meta.priority, detail=detail)
        if pool.pins_sequences and "sequence_id" in request.parameters:
            sequence = sequence_of(parameter_values(request.parameters))
            if isinstance(sequence, str):
                return self._fail(
                    record, Outcome.BAD_REQUEST, model=model, priority=meta.priority, detail=sequence
                )
            meta = replace(meta, sequence=sequence)
        if pool.decoupled:
            return await self._streamed(request, pool, meta, record, trace, write)
        try:
            body, header_length = request_body(request)
        except TensorError as error:
            return self._fail(
                record, Outcome.BAD_REQUEST, model=model, priority=meta.priority, detail=str(error)
            )
        limits, path = pool.batch_limits, _infer_path(model, request.model_version)
        part = None if limits is None else part_of(path, body, header_length)
        if part is not None and limits is not None and part.rows <= limits.max_batch_size:
            cost = float(part.rows)
        else:
            part = None
            cost = batch_size(request) if pool.priced_by_items else 1.0
        if record is not None:
            record.asks(model, meta.priority, meta.tenant or "", cost)
        self._admission.metrics.observe_cost(model, cost)
        upstream_headers = [
            (b"content-type", b"application/octet-stream"),
            (HEADER_LENGTH, str(header_length).encode()),
        ]
        if record is not None:  # the backend's log names the same id
            upstream_headers.append((b"x-request-id", record.request_id.encode("ascii")))
        upstream = UpstreamRequest(
            method="POST",
            path=path,
            query=b"",
            headers=upstream_headers,
            body=body,
            priority=meta.priority,
        )
        del body
        admission = self._admission
        kind = request_kind("infer", False, cost)
        work: UpstreamExchange | BatchMember
        batching = None
        if part is not None and limits is not None:
            # Its key apart from HTTP requests': a merged call goes up with its first member's fields.
            part = replace(part, key=hashlib.blake2b(f"grpc:{part.key}".encode(), digest_size=12).hexdigest())
            work = self._batches.member(pool, upstream, part, meta.budget_s)
            work.exchange.trace = trace  # its own call's, alone on its slot; a batch's links it
            answer: GrpcAnswer = GrpcBatchAnswer(work, admission.drain, admission.no_backend_retry_s)
            batching = Batching(part.key, limits.max_batch_size, limits.max_delay_s, limits.preferred_sizes)
        else:
            work = self._forwarder.exchange(pool, upstream, meta.budget_s)
            work.trace = trace
            answer = GrpcAnswer(work, admission.drain, admission.no_backend_retry_s)
        call = AdmittedCall(
            admission,
            pool,
            meta,
            work,
            answer,
            body_bytes=len(upstream.body),
            cost=cost,
            batching=batching,
            kind=kind,
            access=record,
            trace=trace,
        )
        await call.run()
        return Answered(answer.result, (answer.timing,) if answer.timing is not None else ())

    async def _streamed(
        self,
        request: Any,
        pool: ModelPool,
        meta: RequestMeta,
        record: AccessRecord | None,
        trace: RequestTrace | None,
        write: Write | None,
    ) -> Answered:
        """A decoupled model's request: over gRPC to its backend, each response to the stream."""
        if write is None:  # as Triton answers it
            refused = GrpcError(Code.UNIMPLEMENTED, UNARY_TO_DECOUPLED, reason=Outcome.BAD_REQUEST.value)
            return self._fail(
                record, Outcome.BAD_REQUEST, model=pool.name, priority=meta.priority, error=refused
            )
        cost = batch_size(request) if pool.priced_by_items else 1.0
        if record is not None:
            record.asks(pool.name, meta.priority, meta.tenant or "", cost)
        admission = self._admission
        admission.metrics.observe_cost(pool.name, cost)
        work = StreamedExchange(self._forwarder, self._channels, pool, request, meta.budget_s)
        work.trace = trace
        if record is not None:
            work.request_id = record.request_id
        clock = self._forwarder.clock
        answer = StreamedAnswer(request, work, write, admission.drain, admission.no_backend_retry_s, clock)
        call = AdmittedCall(
            admission,
            pool,
            meta,
            work,
            answer,
            body_bytes=request.ByteSize(),
            cost=cost,
            kind=request_kind("infer", True, cost),
            access=record,
            trace=trace,
        )
        await call.run()
        return Answered(answer.result, written=True)

    def _fail(
        self,
        record: AccessRecord | None,
        outcome: Outcome,
        *,
        model: str = "",
        priority: str = "",
        detail: str | None = None,
        error: GrpcError | None = None,
    ) -> Answered:
        """Count `outcome` for a request that never reached admission, and its error (`error`, or
        the outcome's own)."""
        self._admission.metrics.count(model, priority, outcome)
        if record is not None:
            record.asks(model, priority)
            record.outcome = outcome.value
        return Answered(error or outcome_error(outcome, detail=detail))


def _infer_path(model: str, version: str) -> str:
    path = "/v2/models/" + quote(model, safe="")
    if version:
        path += "/versions/" + quote(version, safe="")
    return path + "/infer"


def _note(record: AccessRecord, answered: Answered) -> None:
    """The access line's status (the gRPC code) and advice."""
    result = answered.result
    if isinstance(result, GrpcError):
        record.status = result.code.value[0]
        if result.retry_after_ms is not None:
            record.retry_after_s = result.retry_after_ms / 1000
    else:
        record.status = 0
    for _, value in answered.trailers:
        for part in value.split(", "):
            name, _, duration = part.partition(";dur=")
            if name in ("queue", "upstream"):
                setattr(record, f"{name}_ms", float(duration))
