"""When should a refused client come back? The bounds of Retry-After, and its headers.

On its own, the advice is the time the queue needs to drain far enough for a request like this one
to fit (`excess_wait_s`), never less than one slot turnover of its band, jittered and clamped. The
gateway books each refusal's return in its band's schedule (policies.return_schedule), which
counts the refused clients told to come back before it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime


@dataclass(frozen=True, slots=True)
class RetryAfterConfig:
    min_s: float = 0.01
    max_s: float = 60.0
    jitter: float = 0.1
    """Relative spread of the drain-only advice (a factor in [1 - jitter, 1 + jitter]), and the
    share of the ceiling over which advice at the ceiling is spread."""


def retry_after_s(
    excess_wait_s: float,
    band_drain_rate_per_s: float,
    jitter_u: float,
    config: RetryAfterConfig,
) -> float:
    """Seconds a refused client should wait before trying again.

    `excess_wait_s`: how much longer than allowed the request would have waited.
    `band_drain_rate_per_s`: the rate at which slots reach its band.
    `jitter_u`: a uniform sample in [0, 1), drawn by the caller.
    """
    turnover_s = 1.0 / band_drain_rate_per_s if band_drain_rate_per_s > 0 else config.max_s
    base_s = max(excess_wait_s, turnover_s)
    jittered = base_s * (1.0 + config.jitter * (2.0 * jitter_u - 1.0))
    return min(config.max_s, max(config.min_s, jittered))


def header_values(advice_s: float) -> tuple[str, str]:
    """`retry-after-ms` (to the millisecond, at least 1) and `Retry-After`, its whole seconds
    rounded up: the two name the same moment, never a second apart for a fraction of a
    millisecond."""
    millis = max(1, round(advice_s * 1000))
    return str(-(-millis // 1000)), str(millis)


def upstream_advice_s(
    headers: Iterable[tuple[bytes, bytes]], now_epoch_s: float, max_s: float
) -> float | None:
    """A backend's own advice in its answer's `headers` (names lower case), as the gateway passes it
    on: `retry-after-ms`, else `Retry-After` (delta-seconds, or an HTTP-date read against
    `now_epoch_s`); None where it gives none that a client should follow: not a number, negative,
    a date past, or beyond `max_s` (a backend's `-5`, or a date in 2099, would park an SDK that
    obeys it)."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in (b"retry-after", b"retry-after-ms"):
            found.setdefault(name, value.strip())
    advice = None
    if (millis := found.get(b"retry-after-ms")) is not None:
        advice = _number(millis, 1000.0)
    if advice is None and (raw := found.get(b"retry-after")) is not None:
        advice = _number(raw, 1.0) if raw.isdigit() else _until_date(raw, now_epoch_s)
    return advice if advice is not None and 0.0 <= advice <= max_s else None


def _number(raw: bytes, per_second: float) -> float | None:
    try:
        value = float(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return value / per_second if value == value else None  # NaN is not advice


def _until_date(raw: bytes, now_epoch_s: float) -> float | None:
    try:
        when = parsedate_to_datetime(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError, TypeError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110's IMF-fixdate is GMT
        return None
    return when.timestamp() - now_epoch_s
