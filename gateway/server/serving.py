"""Running apps under uvicorn: the fastest loop and parser installed, pre-bound sockets, graceful drain.

SIGTERM/SIGINT starts a drain instead of an immediate stop: readiness turns 503, new requests get
503 + Retry-After, queued and in-flight ones finish (up to the drain timeout); those still active
then are cut (503 `draining` where no response has started), and uvicorn stops. A second signal
cuts at once. Either way the process exits 0, within EXIT_GRACE_S of the cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal
import socket
import ssl
from collections.abc import Callable, Coroutine, Generator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import ASGIApp

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from gateway.flow.drain import Drain
    from gateway.settings import Limits, Tls

log = logging.getLogger("gateway.server.serving")

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


def url_of(sock: socket.socket, *, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def uvicorn_config(
    app: ASGIApp,
    *,
    lifespan: str = "on",
    log_level: str = "warning",
    limits: Limits | None = None,
    backend_files: int = 0,
    registry: CollectorRegistry | None = None,
    admin_port: int | None = None,
    tls: Tls | None = None,
) -> uvicorn.Config:
    """uvicorn's config for one listener. With `limits`, its clients are held to them, together with
    the process's other listeners (gateway.server.connections), leaving the open files `backend_files`
    names to backend and Redis connections, and `registry` gets the connection counts; the
    admin listener's connections (on `admin_port`, bound) are held apart from the clients';
    without (the sim, load tests), uvicorn's own protocol serves as it comes. With `tls`, its
    sockets serve TLS (and ask for a client certificate where a client CA is given)."""
    http: type[asyncio.Protocol] | str = "httptools" if HAS_HTTPTOOLS else "h11"
    if limits is not None:
        from gateway.server.client_connections import process_connections

        clients = process_connections(limits, backend_files)
        clients.admin_port = admin_port
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
        ssl_certfile=tls.cert_file if tls is not None else None,
        ssl_keyfile=tls.key_file if tls is not None else None,
        ssl_ca_certs=tls.client_ca_file if tls is not None else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls is not None and tls.client_ca_file else ssl.CERT_NONE,
    )


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to another (several servers in one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class StoppingServer(uvicorn.Server):
    """A uvicorn server that stops on SIGTERM/SIGINT and exits 0 rather than re-raising the signal;
    the servers in `followers` (of the same process) stop with it, not after it."""

    followers: Sequence[uvicorn.Server] = ()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        for server in self.followers:
            server.should_exit = True


EXIT_GRACE_S = 5.0
"""From the end of the drain to the exit: the cut requests' answers, the connections' close and the
lifespan's shutdown (the store's leave, the loops' stop) all fit in this."""
_CUT_SETTLE_S = 1.0  # for the cut requests to answer and withdraw (one store round trip each)
_CONNECTIONS_S = 1.0  # then for connections still open (no request counted in the drain) to close
_SHUTDOWN_S = EXIT_GRACE_S - _CUT_SETTLE_S  # uvicorn's shutdown: the connections, then the lifespan's


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains on SIGTERM/SIGINT (see the module docstring) and exits 0.

    The drain waits up to `drain_timeout_s`, then cuts what is left (gateway.flow.drain); a second
    signal cuts at once. uvicorn then stops within EXIT_GRACE_S: its wait for connections is
    bounded, and so is the lifespan's shutdown.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        super().__init__(config)
        # Unbounded by default: a request nobody counts (metadata, /metrics) could hold the exit.
        # uvicorn cancels what is still running after it.
        graceful = config.timeout_graceful_shutdown
        bounded = _CONNECTIONS_S if graceful is None else min(graceful, _CONNECTIONS_S)
        config.timeout_graceful_shutdown = bounded  # type: ignore[assignment]  # a float is fine
        self._requests = drain
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Never uvicorn's: it re-raises a signal it caught once it has stopped, which would end the
        # process by that signal rather than with status 0.
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        elif not self._requests.cut_short:
            log.warning("%s during the drain: cutting %d active requests now", name, self._requests.active)
            self._requests.cut()
        else:
            log.warning("%s: already stopping (within %.0f s)", name, EXIT_GRACE_S)

    async def _drain(self) -> None:
        requests = self._requests
        log.warning("draining: refusing new requests, waiting for %d active", requests.active)
        if not await requests.drain(self._drain_timeout_s):
            if cut := requests.cut():  # none when a second signal cut them already
                log.warning("drain timed out: cutting %d active requests", cut)
            if not await requests.settle(_CUT_SETTLE_S):
                log.warning("%d cut requests did not end in %.0f s", requests.active, _CUT_SETTLE_S)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (close the listeners and the connections, then the lifespan's),
        within what is left of EXIT_GRACE_S."""
        try:
            async with asyncio.timeout(_SHUTDOWN_S):
                await super().shutdown(sockets)
        except TimeoutError:
            log.warning("shutdown did not end in %.0f s: exiting without the rest", _SHUTDOWN_S)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `main` on uvloop when installed."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if HAS_UVLOOP:
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
