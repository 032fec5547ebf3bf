"""The HTTP side of gateway-side micro-batching (gateway.flow.batch_calls): which requests may share
a slot (`batch_part`: those sent with the same query and headers, trace ids aside, as the merged
call goes up with its first member's), and a member's answer to its client (`BatchRelay`)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace

from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorStyle
from gateway.flow.batch_calls import PER_REQUEST, BatchMember, Failed
from gateway.flow.drain import DRAINING_RETRY_S, Drain
from gateway.flow.verdicts import Lease
from gateway.http.asgi_io import send_response, until_disconnect
from gateway.http.relay import Relay, send_error, server_timing
from gateway.tensors.batch import Part, header_length_of, part_of
from gateway.upstream.client import HeaderRules, upstream_request_headers
from policies.batching import BatchLimits
from policies.outcomes import Outcome, answered


def batch_part(scope: Scope, body: bytes, limits: BatchLimits, rules: HeaderRules) -> Part | None:
    """The request's part in a batch, or None when it passes alone."""
    headers = scope["headers"]
    if any(name == b"content-encoding" for name, _ in headers):
        return None  # a compressed body is the backend's to read
    part = part_of(scope["path"], body, header_length_of(headers))
    if part is None or part.rows > limits.max_batch_size:
        return None
    return replace(part, key=_sent_alike_key(part.key, scope, rules))


def _sent_alike_key(key: str, scope: Scope, rules: HeaderRules) -> str:
    """`key`, narrowed to requests the backend would get with the same query and headers.

    The merged call goes up with its first member's: another client's credentials or options
    must not ride on it.
    """
    digest = hashlib.blake2b(key.encode(), digest_size=12)
    digest.update(b"%d:%s" % (len(scope["query_string"]), scope["query_string"]))
    sent = sorted(
        (k, v) for k, v in upstream_request_headers(scope["headers"], rules) if k not in PER_REQUEST
    )
    for name, value in sent:
        digest.update(b"%d:%s%d:%s" % (len(name), name, len(value), value))
    return digest.hexdigest()


class BatchRelay(Relay):
    """The client's side of a mergeable request: alone, the plain relay; in a batch, its rows."""

    __slots__ = ("_member",)

    def __init__(
        self,
        receive: Receive,
        send: Send,
        style: ErrorStyle,
        member: BatchMember,
        drain: Drain,
        no_backend_retry_s: float,
    ) -> None:
        super().__init__(receive, send, style, member.exchange, drain, no_backend_retry_s)
        self._member = member

    async def answer(self, lease: Lease) -> Outcome:
        member = self._member
        if member.solo or member.result is None or member.round is None:
            return await super().answer(lease)
        result, batch = member.result, member.round
        left = asyncio.ensure_future(until_disconnect(self._receive))
        clock = member.clock
        timeout = None if member.budget_at is None else max(0.0, member.budget_at - clock())
        try:
            await asyncio.wait((result, left), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if not self._drain.absorb_cut():
                raise
            await self._fail(Failed(Outcome.DRAINING, retry_after_s=DRAINING_RETRY_S))
            return Outcome.DRAINING
        finally:
            left.cancel()
        if not result.done():
            if left.done() and not left.cancelled():
                return Outcome.CLIENT_DISCONNECTED
            return await self._fail(Failed(Outcome.UPSTREAM_TIMEOUT))  # its budget ran out
        answer = result.result()
        if isinstance(answer, Failed):
            return await self._fail(answer)
        batch_wait_s = (lease.batch_wait_s or 0.0) + batch.started_at - member.joined_at
        headers = [
            *answer.headers,
            (b"content-length", str(len(answer.body)).encode()),
            server_timing(lease.queue_wait_s, batch.upstream_s(), batch_wait_s),
        ]
        await send_response(self._send, answer.status, headers, answer.body)
        return answered(answer.status)

    async def _fail(self, failed: Failed) -> Outcome:
        await send_error(
            self._send,
            self._style,
            failed.outcome,
            self._drain,
            detail=failed.detail,
            retry_after_s=failed.retry_after_s,
        )
        return failed.outcome
