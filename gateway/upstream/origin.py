"""Where a backend listens and how its connections behave: what a pooled connection is keyed by."""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from urllib.parse import urlsplit


class OnAbandon(StrEnum):
    """What an exchange does when its reader leaves (the client went away, or its budget ran out)
    before the answer ended. Either way the slot stays held until the backend has stopped."""

    ABORT = "abort"
    """Close the connection (a backend such as vLLM then stops generating), and hold the slot
    until the backend has closed its side too."""
    DRAIN = "drain"
    """Read and discard the rest of the answer (Triton and KServe servers compute on regardless),
    and hold the slot until it ends."""


@dataclass(frozen=True, slots=True)
class TlsOptions:
    ca_file: str | None = None
    """CAs to trust instead of the system's."""
    cert_file: str | None = None
    """A client certificate (PEM), for backends that ask for one; `key_file` holds its key."""
    key_file: str | None = None
    verify: bool = True
    """False accepts any certificate: for test rigs only."""

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


@functools.cache
def tls_context(options: TlsOptions) -> ssl.SSLContext:
    """`options` as a context, made once per process (it reads files), for every connection to a
    backend: requests, probes, model config reads. A context that fails is not kept: tried again."""
    return options.context()


@dataclass(frozen=True, slots=True)
class ConnectionOptions:
    keepalive_s: float = 1.5
    """A connection idle for longer is closed instead of reused. Below the idle timeouts of common
    servers (gunicorn 2 s, uvicorn and so vLLM 5 s), so that a request is not written onto a
    connection the backend is closing at that moment."""
    max_head_bytes: int = 16 * 1024
    """Bytes an answer's status line and headers may take (h11's default); more is a broken backend."""
    tls: TlsOptions = TlsOptions()


DEFAULT_OPTIONS = ConnectionOptions()


@dataclass(frozen=True, slots=True)
class Origin:
    host: str
    port: int
    tls: bool
    options: ConnectionOptions = DEFAULT_OPTIONS

    @property
    def host_header(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}".encode("latin-1")


@lru_cache(maxsize=1024)  # bounded: endpoint discovery brings new pod addresses over time
def origin_of(url: str, options: ConnectionOptions = DEFAULT_OPTIONS) -> Origin:
    """The origin of a backend's base URL (cached: looked up per request)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    return Origin(parts.hostname, parts.port or (443 if tls else 80), tls, options)
