"""Admitted routes: a request that needs a backend slot, from its arrival to its admitted call.

An endpoint classifies the request (gateway.flow.request_meta), reads its body under the limit,
finds its model, and hands it to an admitted call (gateway.flow.admitted) with an upstream
exchange (gateway.upstream.exchange) and the HTTP relay (gateway.http.relay). What goes wrong
before that is answered here, and counted once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from urllib.parse import quote

from starlette.types import Message, Receive, Scope, Send

from gateway.errors import ErrorStyle
from gateway.flow.admitted import Admission, AdmittedCall, RequestMeta
from gateway.flow.batch_calls import Batches
from gateway.flow.drain import DRAINING_RETRY_S
from gateway.flow.request_meta import RequestClassifier
from gateway.http.batches import BatchRelay
from gateway.http.pricing import usage_in
from gateway.http.relay import Relay, StreamRewrite, send_error
from gateway.queues.base import Batching
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.tracing import RequestTrace, Tracing
from gateway.tensors.batch import Part
from gateway.upstream.backends import ModelPool
from gateway.upstream.client import HeaderRules, upstream_request_headers
from gateway.upstream.exchange import Forwarder, UpstreamRequest
from policies.batching import BatchLimits
from policies.outcomes import Outcome
from policies.request_kinds import request_kind

ACCESS_RECORD = "gateway.access"
"""The scope key of the request's access record (gateway.telemetry.access_log.AccessRecord)."""
TRACE = "gateway.trace"
"""The scope key of the request's trace (gateway.telemetry.tracing.RequestTrace)."""


@dataclass(frozen=True, slots=True)
class Intake:
    """What an admitted route needs, built once and shared by the routes."""

    pools: Mapping[str, ModelPool]
    classifier: RequestClassifier
    admission: Admission
    forwarder: Forwarder
    max_body_bytes: int
    header_rules: HeaderRules
    batches: Batches
    access: AccessLog | None = None
    """Writes each request's access line (None: off)."""
    tracing: Tracing | None = None
    """Starts each request's trace (None: off)."""


class AdmittedEndpoint:
    """An ASGI endpoint whose requests take backend slots, counted for the graceful drain."""

    style: ErrorStyle

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        drain = self.intake.admission.drain
        drain.started()
        access = self.intake.access
        record = None
        if access is not None and access.enabled:
            record = scope[ACCESS_RECORD] = access.start(scope, self.route(scope))
            send = access.watch(record, send)
        trace = None
        if (tracing := self.intake.tracing) is not None:
            trace = tracing.request(
                f"{scope['method']} {self.route(scope)}",
                scope["headers"],
                {"http.request.method": scope["method"], "url.path": scope["path"]},
            )
            if trace is not None:  # sampled
                scope[TRACE] = trace
                send = _noting_status(trace, send)
        try:
            await self.serve(scope, receive, send)
        except asyncio.CancelledError:
            if not drain.absorb_cut():
                raise
            # Cut before admission (reading its body): nothing was sent; an admitted call answers its own.
            self.intake.admission.metrics.count("", "", Outcome.DRAINING)
            if record is not None:
                record.outcome = Outcome.DRAINING.value
            await send_error(send, self.style, Outcome.DRAINING, drain, retry_after_s=DRAINING_RETRY_S)
        finally:
            drain.finished()
            if record is not None and access is not None:
                access.write(record)
            if trace is not None:
                trace.end({})

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError

    def route(self, scope: Scope) -> str:
        """The route's short name, in the kind of its requests (policies.request_kinds)."""
        raise NotImplementedError

    async def fail(
        self,
        scope: Scope,
        send: Send,
        outcome: Outcome,
        *,
        model: str = "",
        priority: str = "",
        detail: str | None = None,
    ) -> None:
        """Count `outcome` and answer with its error: the request never reached admission."""
        admission = self.intake.admission
        admission.metrics.count(model, priority, outcome)
        if (record := scope.get(ACCESS_RECORD)) is not None:
            record.asks(model, priority)
            record.outcome = outcome.value
        await send_error(send, self.style, outcome, admission.drain, detail=detail)

    def admit(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        pool: ModelPool,
        meta: RequestMeta,
        body: bytes,
        cost: float = 1.0,
        batching: tuple[Part, BatchLimits] | None = None,
        observe: Callable[[bytes], None] | None = None,
        rewrite_stream: StreamRewrite | None = None,
        stream: bool = False,
    ) -> Awaitable[None]:
        """The admitted call of a request that is read and checked and costs `cost` work units
        (returned to be awaited, so that the hot path has no extra frame); `batching`: its part
        in a batch and the model's batching, when it may share its slot; `observe`: shown its
        successful answer, and `rewrite_stream`: passes its event stream on (gateway.http.relay);
        `stream`: its answer streams (its kind of request, with its route and cost)."""
        intake = self.intake
        kind = request_kind(self.route(scope), stream, cost)
        if (record := scope.get(ACCESS_RECORD)) is not None:
            record.asks(pool.name, meta.priority, meta.tenant or "", cost)
        intake.admission.metrics.observe_cost(pool.name, cost)
        trace = scope.get(TRACE)
        in_body = self.style is ErrorStyle.OPENAI
        if in_body and trace is not None:  # the GenAI conventions' token counts
            observe = _noting_usage(trace, observe)
        request = partial(
            upstream_request, scope, body, intake.header_rules, model_in_body=in_body, priority=meta.priority
        )
        admission = intake.admission
        drain, retry_s = admission.drain, admission.no_backend_retry_s
        if batching is not None:
            part, limits = batching
            member = intake.batches.member(pool, request(), part, meta.budget_s)
            member.exchange.trace = trace  # its own call's, alone on its slot; a batch's links it
            batch_relay = BatchRelay(receive, send, self.style, member, drain, retry_s)
            shares = Batching(part.key, limits.max_batch_size, limits.max_delay_s, limits.preferred_sizes)
            call = AdmittedCall(
                admission,
                pool,
                meta,
                member,
                batch_relay,
                body_bytes=len(body),
                cost=cost,
                batching=shares,
                kind=kind,
                access=record,
                trace=trace,
            )
            return call.run()
        work = intake.forwarder.exchange(pool, request, meta.budget_s)
        work.trace = trace
        relay = Relay(receive, send, self.style, work, drain, retry_s, observe, rewrite_stream)
        return AdmittedCall(
            admission,
            pool,
            meta,
            work,
            relay,
            body_bytes=len(body),
            cost=cost,
            kind=kind,
            access=record,
            trace=trace,
        ).run()


def _noting_usage(trace: RequestTrace, observe: Callable[[bytes], None] | None) -> Callable[[bytes], None]:
    """`observe`, telling the trace the answer's `usage` too (an OpenAI answer, or its stream's tail)."""

    def noted(answer: bytes) -> None:
        if (usage := usage_in(answer)) is not None:
            trace.usage(*usage)
        if observe is not None:
            observe(answer)

    return noted


def _noting_status(trace: RequestTrace, send: Send) -> Send:
    """`send`, telling the trace the answer's status as it starts."""

    async def noted(message: Message) -> None:
        if message["type"] == "http.response.start":
            trace.status(message["status"])
        await send(message)

    return noted


# RFC 3986 path characters that need no escape (quote() keeps letters, digits and "_.-~" too).
_PATH_SAFE = "/:@!$&'()*+,;="


def upstream_request(
    scope: Scope, body: bytes, rules: HeaderRules, *, model_in_body: bool = False, priority: str = ""
) -> UpstreamRequest:
    """The client's request as its backend gets it (hop-by-hop fields dropped).

    The path goes up as the gateway routed it: decoded, then escaped again where it must be. The raw
    path could name another model once the backend decodes it (`/v2/models/%73im` is `sim`), past
    the gateway's own routing and its `served_model` rewrite.
    """
    return UpstreamRequest(
        method=scope["method"],
        path=quote(scope["path"], safe=_PATH_SAFE),
        query=scope["query_string"],
        headers=upstream_request_headers(scope["headers"], rules, _client_address(scope)),
        body=body,
        model_in_body=model_in_body,
        priority=priority,
    )


def _client_address(scope: Scope) -> str | None:
    client = scope.get("client")
    return client[0] if client else None
