"""Running apps under uvicorn: the fastest loop and parser installed, pre-bound sockets, graceful drain.

SIGTERM/SIGINT starts a drain instead of an immediate stop: readiness turns 503, new requests get
503 + Retry-After, queued and in-flight ones finish (up to the drain timeout), then uvicorn stops.
A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal
import socket
from collections.abc import Callable, Coroutine, Generator
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import ASGIApp

if TYPE_CHECKING:
    from gateway.flow.drain import Drain
    from prometheus_client import CollectorRegistry


    from gateway.settings import Limits
log = logging.getLogger("gateway.serving")

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None
HAS_HTTPTOOLS = importlib.util.find_spec("httptools") is not None


class CannotListen(Exception):
    """A listening socket could not be opened (the port is taken, the address is not ours)."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {host}:{port}: {reason}")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, so that port 0 can be resolved before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise CannotListen(host, port, error.strerror or str(error)) from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_config(
    app: ASGIApp,
    *,
    lifespan: str = "on",
    log_level: str = "warning",
    limits: Limits | None = None,
    registry: CollectorRegistry | None = None,
) -> uvicorn.Config:
    """uvicorn's config for one listener. With `limits`, its clients are held to them, together with
    the process's other listeners (gateway.connections), and `registry` gets the connection counts;
    without (the sim, load tests), uvicorn's own protocol serves as it comes."""
    http: type[asyncio.Protocol] | str = "httptools" if HAS_HTTPTOOLS else "h11"
    if limits is not None:
        from gateway.connections import process_connections

        clients = process_connections(limits)
        http = clients.protocol
        if registry is not None:
            registry.register(clients)
    return uvicorn.Config(
        app,
        lifespan=lifespan,  # type: ignore[arg-type]
        log_level=log_level,
        access_log=False,
        proxy_headers=False,  # the gateway is the edge: X-Forwarded-* from clients is not trusted
        server_header=False,
        loop="uvloop" if HAS_UVLOOP else "asyncio",
        http=http,
        ws="none",  # nothing here speaks WebSocket: an upgrade is served as a plain request
        backlog=2048,
        timeout_keep_alive=30,
    )


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to another (several servers in one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class StoppingServer(uvicorn.Server):
    """A uvicorn server that stops on SIGTERM/SIGINT and exits 0 rather than re-raising the signal."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._requests = drain
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        log.warning("draining: refusing new requests, waiting for %d active", self._requests.active)
        if not await self._requests.drain(self._drain_timeout_s):
            log.warning("drain timed out with %d requests still active", self._requests.active)
        self.should_exit = True


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `main` on uvloop when installed."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if HAS_UVLOOP:
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
