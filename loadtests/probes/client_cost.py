"""What does an upstream client cost per proxied request? A diagnostic, not a benchmark.

    python -m loadtests.probes.client_cost

Sends sequential requests, shaped like a KServe infer call, to a minimal HTTP server in the same
process on 127.0.0.1. It measures two clients, in turn, twice each:
- aiohttp's `session.request(...)` followed by `read()`, with the settings the gateway used;
- the gateway's own client (gateway.upstream.http1), as the proxy uses it.

Both share the server's cost and the event loop (uvloop when installed), so the difference per
request is the client's own. On the hand-over path the gateway pays that cost when it completes
one answer and when it sends the next request.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import aiohttp
import httptools

from gateway.server.serving import run
from gateway.upstream.http1 import UpstreamClient, serialize_request
from gateway.upstream.origin import Origin
from gateway.upstream.reply import Reply

BODY = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
ANSWER = b'{"model_name":"sim","outputs":[{"name":"OUTPUT0","shape":[1,4],"datatype":"FP32","data":[1,2]}]}'
RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(ANSWER),
    ANSWER,
)
HEADERS = [("content-type", "application/json"), ("x-priority", "low")]
REQUESTS = 4000


class _Server(asyncio.Protocol):
    """Answers every request on the connection with the same response."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        self._transport.write(RESPONSE)


async def _aiohttp_round(url: str) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    ) as session:
        for _ in range(REQUESTS):
            timeout = aiohttp.ClientTimeout(total=5)
            async with session.request("POST", url, headers=HEADERS, data=BODY, timeout=timeout) as reply:
                await reply.read()


async def _http1_round(port: int) -> None:
    loop = asyncio.get_running_loop()
    client = UpstreamClient()
    origin = Origin("127.0.0.1", port, tls=False)
    headers = [(name.encode(), value.encode()) for name, value in HEADERS]
    for _ in range(REQUESTS):
        request = serialize_request("POST", "/v2/models/sim/infer", origin, headers, BODY)
        reply = Reply(loop, 5.0, whole_up_to_bytes=1 << 20)
        await client.send(origin, request, reply)
        await reply.head()
        await reply.read()
    await client.close()


async def main() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v2/models/sim/infer"
    for label in ("aiohttp", "http1", "aiohttp", "http1"):
        wall, cpu = time.perf_counter(), time.process_time()
        await (_aiohttp_round(url) if label == "aiohttp" else _http1_round(port))
        wall_us = (time.perf_counter() - wall) / REQUESTS * 1e6
        cpu_us = (time.process_time() - cpu) / REQUESTS * 1e6
        print(f"{label:8s} {wall_us:6.1f} us per request, {cpu_us:6.1f} us CPU (client and server)")
    server.close()


if __name__ == "__main__":
    run(main)
