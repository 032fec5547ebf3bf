"""Raw HTTP/1.1 clients for the limits on clients: heads written byte by byte, answers read by hand,
and a gateway started under a low open-file limit."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.integration.servers import Gateway

INFER_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
).encode()
INFER_PATH = "/v2/models/sim/infer"


def infer_request(*fields: tuple[str, str], path: str = INFER_PATH, body: bytes = INFER_BODY) -> bytes:
    """A POST as it goes on the wire: `Name: value` fields, Content-Length last."""
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", *(f"{n}: {v}" for n, v in fields)]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def head_size(request: bytes) -> int:
    return request.index(b"\r\n\r\n") + 4


async def connect(gateway: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(gateway.url)
    return await asyncio.open_connection(parts.hostname, parts.port)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader, within_s: float = 10.0) -> Answer:
    """One response with a Content-Length (every answer the gateway writes itself has one)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within_s)
    status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), within_s)
    return Answer(int(status_line.split()[1]), headers, body)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the gateway ends the connection (EOF or reset) within `seconds`, sending nothing."""
    try:
        data = await asyncio.wait_for(reader.read(1), seconds)
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    if data:
        raise AssertionError(f"the gateway answered {data!r}... instead of closing")
    return True


async def drip(
    data: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, every_s: float
) -> float:
    """Write `data` one byte every `every_s` (the slow client's pace is the wait for the gateway to
    close); returns seconds from the start until the gateway closed. Fails if `data` runs out first."""
    started = time.monotonic()
    for byte in data:
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            return time.monotonic() - started
        if await closed_within(reader, every_s):
            return time.monotonic() - started
    raise AssertionError(f"the gateway took all {len(data)} bytes dripped over {len(data) * every_s} s")


def python_with_open_file_limit(directory: Path, limit: int) -> str:
    """An executable that runs this Python with RLIMIT_NOFILE set to `limit` (soft and hard)."""
    path = directory / f"python-nofile-{limit}"
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
    )
    path.chmod(0o755)
    return str(path)


def open_file_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' in /proc limits")
