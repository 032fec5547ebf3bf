"""A TCP proxy that delays every chunk by a fixed time each way: a Redis in another zone, for the
benchmarks' `redisN-delayM` targets (loadtests.bench).

    python -m loadtests.delay_proxy --listen-port P --upstream-port R --delay-ms 5

Each direction keeps its order: a chunk read at t is written at t + delay, never before the
chunk read ahead of it.
"""

from __future__ import annotations

import argparse
import asyncio


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            at, chunk = await due.get()
            if not chunk:
                break
            if (wait := at - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()
        writer.close()

    delivering = asyncio.ensure_future(deliver())
    try:
        while chunk := await reader.read(65536):
            due.put_nowait((loop.time() + delay_s, chunk))
    except ConnectionError:
        pass
    finally:
        due.put_nowait((0.0, b""))
        await delivering


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True, help="added each way")
    args = parser.parse_args()
    delay_s = args.delay_ms / 1000

    async def serve() -> None:
        async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", args.upstream_port)
            except OSError:
                client_writer.close()
                return
            await asyncio.gather(
                _pipe(client_reader, up_writer, delay_s),
                _pipe(up_reader, client_writer, delay_s),
                return_exceptions=True,
            )

        server = await asyncio.start_server(handle, "127.0.0.1", args.listen_port)
        print(
            f"delay proxy listening on http://127.0.0.1:{args.listen_port} ({args.delay_ms:g} ms each way)",
            flush=True,
        )
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
