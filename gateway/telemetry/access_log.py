"""The access log: one line per request on the admitted routes (KServe infer, OpenAI) and the model
passthrough (a model's metadata, `/ready` and `/config`: routes `model.metadata`, `model.ready`,
`model.config`), as text or JSON, on the `gateway.access` logger at info.

A line says who asked for what and how it ended: its request id (the client's `X-Request-Id`, or
one made here; the answer carries it back as `x-request-id`, so a client or a load test can find
its line), method and
route, model, class, tenant (the configured name, never a key), cost, status, outcome and the rule
that refused it, the wait for a slot and the time upstream (the answer's `Server-Timing`), the
Retry-After told, and the request's time in the gateway. Never a header but the id, never a body.

Lines are rate-limited (`access_log.max_lines_per_s`, a bucket as deep as one second of them): a
refusal storm of thousands a second must not fill the disk nor take the event loop's time. The
lines dropped are counted, and said in the next line written (`suppressed=N`).

The operator routes (health, readiness, metrics, the status page) write none: probes would bury
the clients' lines.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import Message, Scope, Send

log = logging.getLogger("gateway.access")

_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")
"""An id as a client may send it: 1-128 visible ASCII characters (no space, no control)."""
_TIMING = re.compile(rb"(queue|upstream);dur=([0-9.]+)")


@dataclass(slots=True)
class AccessRecord:
    """One request's line, filled in as the request goes."""

    request_id: str
    method: str
    route: str
    started: float
    model: str = ""
    priority: str = ""
    tenant: str = ""
    cost: float | None = None
    status: int = 0
    outcome: str = ""
    rule: str = ""
    queue_ms: float | None = None
    upstream_ms: float | None = None
    retry_after_s: float | None = None

    def asks(self, model: str, priority: str, tenant: str = "", cost: float | None = None) -> None:
        """What the request asks for, once it is read (model "" where it names none configured)."""
        self.model, self.priority, self.tenant, self.cost = model, priority, tenant, cost

    def fields(self, now: float) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "method": self.method,
            "route": self.route,
            "model": self.model,
            "class": self.priority,
            "tenant": self.tenant,
            "cost": self.cost,
            "status": self.status,
            "outcome": self.outcome,
            "rule": self.rule,
            "queue_ms": self.queue_ms,
            "upstream_ms": self.upstream_ms,
            "retry_after_s": self.retry_after_s,
            "ms": round((now - self.started) * 1000, 3),
        }


class AccessLog:
    """Starts each request's record, watches its answer go out, and writes its line."""

    def __init__(
        self,
        style: Literal["text", "json"],
        max_lines_per_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        """Whether requests get a record and a line (`access_log.enabled`, live on a reload)."""
        self._style = style
        self._rate = max_lines_per_s
        self._tokens = max_lines_per_s
        self._filled_at = clock()
        self._clock = clock
        self.suppressed = 0
        """Lines dropped since the process started."""
        self._untold = 0
        """Lines dropped since the last one written, which it tells."""

    def reconfigure(self, enabled: bool, style: Literal["text", "json"], max_lines_per_s: float) -> None:
        """A reloaded config's `access_log`, from the next request on."""
        self.enabled, self._style = enabled, style
        if max_lines_per_s != self._rate:
            self._rate = self._tokens = max_lines_per_s

    def start(self, scope: Scope, route: str) -> AccessRecord:
        """The record of a request: its id the client's `X-Request-Id` where it is one a log can
        keep (1-128 visible ASCII characters), else a new one, which the backend is sent too
        where the client sent none."""
        headers = scope["headers"]
        sent = next((value for name, value in headers if name == b"x-request-id"), None)
        record = self.begin(sent, scope["method"], route)
        if sent is None:  # the backend gets it too, so that its own log names the same id
            headers.append((b"x-request-id", record.request_id.encode("ascii")))
        return record

    def begin(self, sent_id: bytes | None, method: str, route: str) -> AccessRecord:
        """The record of a request whose client sent `sent_id` as its id (see `start`)."""
        if sent_id is not None and _REQUEST_ID.fullmatch(sent_id):
            request_id = sent_id.decode("ascii")
        else:
            request_id = os.urandom(8).hex()
        return AccessRecord(request_id, method, route, self._clock())

    def watch(self, record: AccessRecord, send: Send) -> Send:
        """`send`, noting the status, the waits and the advice of the answer as it starts, which
        carries the request's id back (`x-request-id`)."""

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [
                    (name, value) for name, value in message.get("headers", ()) if name != b"x-request-id"
                ]
                message["headers"] = [*headers, (b"x-request-id", record.request_id.encode("ascii"))]
                for name, value in headers:
                    if name == b"server-timing":
                        for part, ms in _TIMING.findall(value):
                            setattr(record, f"{part.decode()}_ms", float(ms))
                    elif name == b"retry-after-ms" and value.isdigit():
                        record.retry_after_s = int(value) / 1000
            await send(message)

        return watched

    def write(self, record: AccessRecord) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._filled_at) * self._rate)
        self._filled_at = now
        if self._tokens < 1.0:
            self.suppressed += 1
            self._untold += 1
            return
        self._tokens -= 1.0
        fields = record.fields(now)
        if self._untold:
            fields["suppressed"], self._untold = self._untold, 0
        if self._style == "json":
            log.info(json.dumps(fields, separators=(",", ":")))
        else:
            log.info(" ".join(f"{key}={_text(value)}" for key, value in fields.items()))


def _text(value: object) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
