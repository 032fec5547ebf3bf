"""The load generator's client: sends each arrival at its scheduled time, follows Retry-After as the
SDKs do where asked, and records every attempt.

Times are seconds from the run's start on the monotonic clock. A request's latency counts from its
scheduled send, not its actual one, so neither a lagging generator nor a slow target can hide a
queue (no coordinated omission); the generator's own lag is recorded beside it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from gateway.tools.loadtest.requests import Prepared
from gateway.tools.loadtest.scrape import Scrape, scrape_until
from gateway.tools.loadtest.workload import Arrival

if TYPE_CHECKING:
    from gateway.tools.loadtest.grpc_calls import Channels

T = TypeVar("T")
RETRIED_STATUSES = frozenset({429, 503})
"""Answers a client following Retry-After tries again, when they carry the advice."""
NO_SERVER = b"No server is available to handle this request"
"""HAProxy's 503 when its queue timed out (or no server is up), as the benchmarks compare against it."""
MAX_ADVICE_S = 60.0
"""Advice beyond this is not followed (the openai SDK's own bound): the request ends refused."""


@dataclass(slots=True)
class Attempt:
    sent_s: float
    status: int | None = None
    """None: no answer (a connection error or the client's timeout, named by `reason`)."""
    reason: str = ""
    """`ok`, the gateway's refusal reason (KServe `reason`, OpenAI `error.code`), or `http_<status>`."""
    ended_s: float = 0.0
    advised_s: float | None = None
    """Retry-After (retry-after-ms where sent), in seconds."""
    retryable: bool = True
    """False where the answer says `x-should-retry: false`."""
    queue_ms: float | None = None
    upstream_ms: float | None = None
    first_token_s: float | None = None
    """Streams: when the first event with output arrived."""
    token_gaps_s: list[float] = field(default_factory=list)
    """Streams: the gaps between later output events (inter-token latency)."""
    complete: bool = True
    """False for a stream that ended without `[DONE]` (its reason then `stream_cut_short`)."""


@dataclass(slots=True)
class RequestRecord:
    arrival: Arrival
    attempts: list[Attempt]
    abandoned: bool = False
    """Refused, and its retry would have come past the run's horizon."""

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def served(self) -> bool:
        """Answered 200, and whole: a stream that ended without `[DONE]` was not served."""
        return self.final.status == 200 and self.final.complete

    @property
    def latency_s(self) -> float:
        """From its scheduled send to the end of its last answer."""
        return self.final.ended_s - self.arrival.at_s

    @property
    def lag_s(self) -> float:
        """How late the generator sent it."""
        return self.attempts[0].sent_s - self.arrival.at_s


@dataclass(slots=True)
class Progress:
    scheduled: int
    sent: int = 0
    done: int = 0
    served: int = 0


Route = Callable[[int, int], str]
"""(the arrival's index, the attempt's) -> the URL to send it to."""


@dataclass(frozen=True, slots=True)
class Retrying:
    """How clients retry a refused request (429 or 503, not `x-should-retry: false`)."""

    times: int = 0
    """At most this many retries."""
    backoff_s: float | None = None
    """The wait where the refusal carries no advice; None: such a request is not retried."""
    horizon_s: float | None = None
    """A retry due later than this from the start is not made (the request is `abandoned`)."""


async def run(
    url: str | Sequence[str] | Route,
    schedule: Sequence[Arrival],
    prepared: Sequence[Prepared],
    *,
    retrying: Retrying = Retrying(),
    timeout_factor: float = 3.0,
    progress: Callable[[Progress, float], None] | None = None,
    metrics: Mapping[str, str] | None = None,
) -> tuple[list[RequestRecord], list[Scrape]]:
    """Send `schedule` to `url`, arrival `a` as `prepared[a.traffic]`; to several URLs (gateway
    replicas) in turn, as a round-robin balancer would, a retry to the next; an attempt gives up
    after `timeout_factor` x its deadline + 1 s. A refused request is sent again after the wait it
    was advised (Retry-After), as `retrying` says; a retry carries `X-Retry-Attempt`.
    `metrics`: name -> /metrics URL of what to scrape every second during the run."""
    records: list[RequestRecord] = []
    scrapes: list[Scrape] = []
    stop_scraping = asyncio.Event()
    state = Progress(len(schedule))
    route = _route(url)
    channels = _grpc_channels() if any(p.rpc is not None for p in prepared) else None
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()

        def clock() -> float:
            return time.monotonic() - started

        async def one(arrival: Arrival, index: int) -> None:
            request = prepared[arrival.traffic]
            timeout_s = request.deadline_s * timeout_factor + 1
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            record = RequestRecord(arrival, [])
            while True:
                sent = request if not record.attempts else request.retry(len(record.attempts))
                target = route(index, len(record.attempts))
                if sent.rpc is not None and channels is not None:
                    attempt = await channels.call(target, sent.rpc, sent.metadata, timeout_s, clock)
                else:
                    attempt = await _attempt(session, target + sent.path, sent, timeout, clock)
                record.attempts.append(attempt)
                wait_s = _wait_before_retry(attempt, len(record.attempts), retrying)
                if wait_s is None:
                    break
                if retrying.horizon_s is not None and clock() + wait_s > retrying.horizon_s:
                    record.abandoned = True
                    break
                await asyncio.sleep(wait_s)
            records.append(record)
            state.done += 1
            state.served += record.served

        ticker = asyncio.ensure_future(_tick(progress, state, clock)) if progress else None
        scraper = (
            asyncio.ensure_future(scrape_until(metrics, started, stop_scraping, scrapes)) if metrics else None
        )
        tasks = []
        try:
            for index, arrival in enumerate(schedule):
                delay = arrival.at_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(arrival, index)))
                state.sent += 1
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            stop_scraping.set()
            if scraper is not None:
                await scraper
            if channels is not None:
                await channels.close()
            if ticker is not None:
                ticker.cancel()
                progress(state, clock())  # type: ignore[misc]
    records.sort(key=lambda r: r.arrival.at_s)
    return records, scrapes


def run_fast(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop where installed, so that the generator costs as little CPU as it can."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _grpc_channels() -> Channels:
    from gateway.tools.loadtest.grpc_calls import Channels  # grpcio only where it is used

    return Channels()


def _route(url: str | Sequence[str] | Route) -> Route:
    if callable(url):
        return url
    urls = [url] if isinstance(url, str) else list(url)
    return lambda index, attempt: urls[(index + attempt) % len(urls)]


def _wait_before_retry(attempt: Attempt, attempts: int, retrying: Retrying) -> float | None:
    """How long before the next attempt, or None when there is none."""
    if attempts > retrying.times or attempt.status not in RETRIED_STATUSES or not attempt.retryable:
        return None
    if attempt.advised_s is None:
        return retrying.backoff_s
    return attempt.advised_s if attempt.advised_s <= MAX_ADVICE_S else None


async def _tick(
    progress: Callable[[Progress, float], None], state: Progress, clock: Callable[[], float]
) -> None:
    while True:
        progress(state, clock())
        await asyncio.sleep(0.5)


async def _attempt(
    session: aiohttp.ClientSession,
    url: str,
    request: Prepared,
    limit: aiohttp.ClientTimeout,
    clock: Callable[[], float],
) -> Attempt:
    attempt = Attempt(sent_s=clock())
    try:
        async with session.post(url, data=request.body, headers=request.headers, timeout=limit) as reply:
            attempt.status = reply.status
            attempt.queue_ms, attempt.upstream_ms = server_timing(reply.headers.get("Server-Timing", ""))
            if reply.status == 200:
                attempt.reason = "ok"
                if request.stream:
                    attempt.complete = await _read_events(reply, attempt, clock)
                    if not attempt.complete:
                        attempt.reason = "stream_cut_short"
                else:
                    await reply.read()
            else:
                attempt.reason = refusal_reason(reply.status, await reply.read())
                attempt.advised_s = advised_wait_s(reply.headers)
                attempt.retryable = reply.headers.get("x-should-retry", "").lower() != "false"
    except (aiohttp.ClientError, TimeoutError) as error:
        attempt.status = None
        attempt.reason = "timeout" if isinstance(error, TimeoutError) else type(error).__name__
    attempt.ended_s = clock()
    return attempt


async def _read_events(reply: aiohttp.ClientResponse, attempt: Attempt, clock: Callable[[], float]) -> bool:
    """Server-sent events: the first with output is the first token; the gaps after, the ITL.
    True when the stream ended with `[DONE]`."""
    last: float | None = None
    async for line in reply.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        if not has_output(data):
            continue
        now = clock()
        if last is None:
            attempt.first_token_s = now
        else:
            attempt.token_gaps_s.append(now - last)
        last = now
    return False


def has_output(data: bytes) -> bool:
    """Whether an OpenAI stream event carries generated text (not only usage or a role)."""
    try:
        event = json.loads(data)
    except ValueError:
        return False
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return bool(text)


def server_timing(value: str) -> tuple[float | None, float | None]:
    """The `queue` and `upstream` durations (ms) of a Server-Timing header."""
    durations: dict[str, float] = {}
    for metric in value.split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, number = param.strip().partition("=")
            if key == "dur":
                try:
                    durations[name] = float(number)
                except ValueError:
                    pass
    return durations.get("queue"), durations.get("upstream")


def advised_wait_s(headers: Mapping[str, str]) -> float | None:
    """The advice to wait, in seconds: retry-after-ms where sent (as the openai SDK reads it), else
    Retry-After in seconds (an HTTP date is not followed). `headers` looked up case-insensitively."""
    for name, scale in (("retry-after-ms", 0.001), ("Retry-After", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if seconds >= 0:
            return seconds
    return None


def refusal_reason(status: int, body: bytes) -> str:
    """The reason a refusal names: KServe's `reason`, OpenAI's `error.code`, else `http_<status>`."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        payload = None
    if status == 503 and NO_SERVER in body:
        return "no_server_available"
    if isinstance(payload, dict):
        if isinstance(payload.get("reason"), str):
            return str(payload["reason"])
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            return str(error["code"])
    return f"http_{status}"
