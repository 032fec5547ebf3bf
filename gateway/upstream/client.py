"""The header rules of RFC 9110 for a proxy, and the aiohttp session for the gateway's own calls.

Proxied requests go through gateway.upstream.http1; health checks and metric scrapes use the
aiohttp session (Triton discovery uses tritonclient). Bodies pass byte for byte: no automatic
decompression, no default headers the client did not send, no cookie jar shared between clients.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from gateway.settings import Settings
from policies.retry_after import RetryAfterConfig, header_values, upstream_advice_s

RawHeaders = list[tuple[bytes, bytes]]

# RFC 9110 section 7.6.1: connection-specific fields a proxy must not forward.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Set again for the upstream hop.
_REQUEST_REWRITTEN = frozenset({b"host", b"content-length", b"expect"})
# Set again by the gateway's server for the downstream hop (it may re-frame the body, and it
# stamps its own Date).
_RESPONSE_REWRITTEN = frozenset({b"content-length", b"date"})


def _connection_tokens(headers: RawHeaders) -> frozenset[bytes]:
    """Fields named by Connection, which are hop-by-hop too."""
    tokens: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    return frozenset(tokens)


@dataclass(frozen=True, slots=True)
class HeaderRules:
    """What the gateway takes out of a client's request headers, and what it adds."""

    strip: frozenset[bytes] = frozenset()
    """Names (lower case) the backend does not get: the gateway's control headers, its keys."""
    forwarded_for: bool = False
    """Append the client's address to X-Forwarded-For."""

    @classmethod
    def from_settings(cls, settings: Settings) -> HeaderRules:
        strip = {name.lower().encode("latin-1") for name in settings.forwarding.strip_request_headers}
        if settings.api_key_digests():  # the key is the gateway's then, not the backend's
            strip.add(b"authorization")
        return cls(frozenset(strip), settings.forwarding.forwarded_for)


def upstream_request_headers(
    headers: RawHeaders, rules: HeaderRules = HeaderRules(), client_address: str | None = None
) -> RawHeaders:
    """The client's headers (names lower-cased, as ASGI gives them) as the backend should see them."""
    drop = HOP_BY_HOP | _REQUEST_REWRITTEN | _connection_tokens(headers) | rules.strip
    if rules.forwarded_for:
        drop |= {b"x-forwarded-for"}
    kept = [(k, v) for k, v in headers if k not in drop]
    if rules.forwarded_for and client_address is not None:
        chain = [v for k, v in headers if k == b"x-forwarded-for"] + [client_address.encode("latin-1")]
        kept.append((b"x-forwarded-for", b", ".join(chain)))
    return kept


_ADVICE = frozenset({b"retry-after", b"retry-after-ms"})
UPSTREAM_ADVICE_MAX_S = RetryAfterConfig().max_s
"""The longest advice of a backend the gateway passes on (its own default ceiling)."""


def downstream_response_headers(raw: Sequence[tuple[bytes, bytes]]) -> RawHeaders:
    """The backend's response headers as the client should see them (names lower-cased). Its own
    Retry-After passes only where a client should follow it (policies.retry_after.upstream_advice_s),
    written as the gateway writes its own: `Retry-After` and `retry-after-ms` naming one moment."""
    headers = [(k.lower(), v) for k, v in raw]
    drop = HOP_BY_HOP | _RESPONSE_REWRITTEN | _connection_tokens(headers) | _ADVICE
    kept = [(k, v) for k, v in headers if k not in drop]
    if any(k in _ADVICE for k, _ in headers):
        advice = upstream_advice_s(headers, time.time(), UPSTREAM_ADVICE_MAX_S)
        if advice is not None:
            seconds, millis = header_values(advice)
            kept += [(b"retry-after", seconds.encode()), (b"retry-after-ms", millis.encode())]
    return kept


def create_session() -> aiohttp.ClientSession:
    """A session for the gateway's own calls: pooled keep-alive connections, nothing added or decoded."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
    )
