"""A TCP proxy on 127.0.0.1 that a test cuts and restores: a network partition between one client
and its server, without touching either.

While cut, nothing goes through in either direction and nothing is lost: what arrives waits (in
this proxy and in the sockets' buffers, so the sender's writes back up, as they do in a partition),
and new connections are accepted but not connected onward. `restore` lets it all through, as TCP
delivers what it retransmitted once the path heals. `reset` closes every connection at once.

It runs its own event loop on a thread, so that it forwards while the test's loop is blocked (in a
synchronous launcher, say); its methods may be called from any thread.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any


class CuttableProxy:
    def __init__(self, target_host: str, target_port: int, *, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the proxy's own server side, ending TLS in front of a plain server (as a TLS
        proxy does in front of a Triton, whose HTTP port has none)."""
        self._tls = tls
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.connections = 0
        """Connections accepted so far."""

    def start(self) -> CuttableProxy:
        """Listen on an ephemeral port of 127.0.0.1 (returns once it does)."""
        self._thread.start()

        async def listen() -> None:
            self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0, ssl=self._tls)

        self._call(listen).result(timeout=10)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "start it first"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def restore(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def reset(self) -> None:
        def abort() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        self._loop.call_soon_threadsafe(abort)

    def close(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for handler in list(self._handlers):
                handler.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()

        self._call(shut).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _call(self, work: Callable[[], Coroutine[Any, Any, None]]) -> Future[None]:
        return asyncio.run_coroutine_threadsafe(work(), self._loop)

    async def _accepted(self, client: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        self._writers.add(client_writer)
        server_writer: asyncio.StreamWriter | None = None
        pumps: set[asyncio.Task[bool]] = set()
        try:
            await self._open.wait()  # a partition lets no connection through either
            server_reader, server_writer = await asyncio.open_connection(*self._target)
            self._writers.add(server_writer)
            pumps = {
                asyncio.ensure_future(self._pump(client, server_writer)),
                asyncio.ensure_future(self._pump(server_reader, client_writer)),
            }
            # A side that closed cleanly lets the other finish; one that broke ends both.
            while pumps:
                done, pumps = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                if not all(task.result() for task in done):
                    break
        except (OSError, asyncio.CancelledError):
            pass  # a handler cancelled by `close` ends quietly (asyncio logs one that raises)
        finally:
            self._handlers.discard(handler)
            for pump in pumps:
                pump.cancel()
            for writer in (client_writer, server_writer):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Forward until the end of the stream (True) or a broken connection (False)."""
        try:
            while data := await reader.read(1 << 16):
                await self._open.wait()  # held while cut: the sender's writes back up behind it
                writer.write(data)
                await writer.drain()
            await self._open.wait()
            if writer.can_write_eof():
                writer.write_eof()
            return True
        except OSError:
            return False
