"""The gRPC listener (`grpc_listen`): a `grpc.aio` server on the HTTP listener's event loop.

It starts in the app's lifespan, once the gateway's loops run, and stops at its end: after the
HTTP server's drain (gateway.server.serving), which counts gRPC calls in the same drain, so a stop
waits for both kinds of request alike and `ServerReady` turns false with `/readyz`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tritonclient.grpc import service_pb2_grpc

import grpc
from gateway.grpc.service import InferenceService
from gateway.settings import Listen, Tls
from gateway.upstream.streamed import GrpcChannels

log = logging.getLogger("gateway.grpc")

STOP_GRACE_S = 1.0
"""For calls still open when the listener stops (the drain has waited for the counted ones)."""


def server_credentials(tls: Tls) -> grpc.ServerCredentials:
    """The listener's TLS, asking for a client certificate signed by the client CA where one is given."""
    ca = None if tls.client_ca_file is None else Path(tls.client_ca_file).read_bytes()
    pair = (Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class GrpcListenFailed(Exception):
    """The gRPC listener could not bind its address."""


class GrpcListener:
    def __init__(
        self,
        listen: Listen,
        service: InferenceService,
        *,
        max_message_bytes: int,
        channels: GrpcChannels | None = None,
    ) -> None:
        """`channels`: the calls' own to backends (decoupled models), closed once the server stops."""
        self._channels = channels
        self._listen = listen
        self._service = service
        self._max_message_bytes = max_message_bytes
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> None:
        options = [
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.max_send_message_length", -1),
            # Not SO_REUSEPORT: a second gateway on the same port must fail, not share it silently.
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self._service, server)
        host = self._listen.host
        address = f"[{host}]:{self._listen.port}" if ":" in host else f"{host}:{self._listen.port}"
        try:
            tls = self._listen.tls
            if tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, server_credentials(tls))
        except RuntimeError as error:
            raise GrpcListenFailed(f"cannot listen for gRPC on {address}: {error}") from None
        if port == 0:
            raise GrpcListenFailed(f"cannot listen for gRPC on {address}")
        await server.start()
        self._server, self.port = server, port
        log.info("grpc listening on %s:%d%s", host, port, " (TLS)" if self._listen.tls else "")

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
            self._server = None
        if self._channels is not None:
            await self._channels.close()
