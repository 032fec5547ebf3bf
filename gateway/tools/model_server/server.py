"""Serve the simulator: the API port and a separate metrics port, as Triton does (8000 and 8002)."""

from __future__ import annotations

import asyncio
import random
import socket
from dataclasses import dataclass

import uvicorn

from gateway.server.serving import QuietServer, StoppingServer, bind, url_of, uvicorn_config
from gateway.tools.model_server.app import SimApp
from gateway.tools.model_server.continuous import ContinuousEngine, ContinuousSpec
from gateway.tools.model_server.engine import ServiceDistribution, ServiceModel, SimEngine


@dataclass(frozen=True, slots=True)
class SimOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = 8002
    slots: int = 8
    base_ms: float = 40.0
    per_item_ms: float = 0.0
    token_ms: float = 0.0
    default_tokens: int = 16
    stop_on_disconnect: bool = False
    service_dist: ServiceDistribution = "fixed"
    seed: int | None = None
    continuous: ContinuousSpec | None = None
    """OpenAI generation on a continuous-batching engine (vLLM's kind) instead of the slots."""
    served_model_name: str = "sim"
    """The `model_name` label of the continuous engine's vLLM metrics."""


@dataclass(slots=True)
class SimServers:
    app: SimApp
    servers: list[uvicorn.Server]
    sockets: list[socket.socket]

    @property
    def url(self) -> str:
        return url_of(self.sockets[0])

    @property
    def metrics_url(self) -> str | None:
        return url_of(self.sockets[1]) + "/metrics" if len(self.sockets) > 1 else None

    async def serve(self) -> None:
        """Serve until the first server stops (on a signal, or `stop()`), then stop the rest."""
        tasks = [
            asyncio.ensure_future(server.serve([sock]))
            for server, sock in zip(self.servers, self.sockets, strict=True)
        ]
        try:
            await tasks[0]
        finally:
            self.stop()
            await asyncio.gather(*tasks)

    def stop(self) -> None:
        for server in self.servers:
            server.should_exit = True


def build_sim(options: SimOptions, *, quiet: bool = False) -> SimServers:
    """Bind the sim's sockets now (so port 0 resolves) and prepare its servers."""
    service = ServiceModel(
        options.base_ms,
        options.per_item_ms,
        options.token_ms,
        options.service_dist,
        random.Random(options.seed),
    )
    engine = SimEngine(options.slots, service)
    continuous = None if options.continuous is None else ContinuousEngine(options.continuous, engine.stats)
    app = SimApp(
        engine,
        default_tokens=options.default_tokens,
        stop_on_disconnect=options.stop_on_disconnect,
        continuous=continuous,
        served_model_name=options.served_model_name,
    )
    sockets = [bind(options.host, options.port)]
    if options.metrics_port is not None:
        sockets.append(bind(options.host, options.metrics_port))
    servers: list[uvicorn.Server] = []
    for index in range(len(sockets)):
        config = uvicorn_config(app, lifespan="off")
        # Only the first server of a standalone sim handles signals; the others follow it.
        servers.append(StoppingServer(config) if index == 0 and not quiet else QuietServer(config))
    if isinstance(leader := servers[0], StoppingServer):
        leader.followers = servers[1:]
    return SimServers(app, servers, sockets)
