"""The floor of the gateway's HTTP stack: a bare pass-through proxy on uvicorn + aiohttp.

No admission, no queue, no metrics: only what any Python proxy on this stack must do. The benchmark
runs it beside the gateway, so that the gateway's own cost is the difference between the two.

    python -m loadtests.passthrough --upstream http://127.0.0.1:8000 --port 8090
"""

from __future__ import annotations

import argparse
import logging

import aiohttp
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.server.serving import bind, run, url_of, uvicorn_config


class PassThrough:
    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
                )
                await send({"type": "lifespan.startup.complete"})
            assert self._session is not None
            await self._session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        assert self._session is not None
        headers = {"content-type": "application/json"}
        async with self._session.post(
            self._upstream + scope["path"], data=b"".join(chunks), headers=headers
        ) as reply:
            body = await reply.read()
        response_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": reply.status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level="INFO")
    sock = bind("127.0.0.1", args.port)
    server = uvicorn.Server(uvicorn_config(PassThrough(args.upstream)))
    logging.getLogger("passthrough").info("passthrough listening on %s", url_of(sock))

    async def serve() -> None:
        await server.serve([sock])

    run(serve)


if __name__ == "__main__":
    main()
