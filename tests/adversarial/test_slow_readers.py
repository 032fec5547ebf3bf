"""A client that stops reading its answer cannot hold a slot, nor open a healthy backend's circuit.

Real processes: the simulator with one slot echoing a large tensor (an answer of several MiB, so
it is streamed through, not held whole), the gateway in front with a short send timeout and a
shorter stall timeout. The client reads the answer's head and then nothing more: the gateway's
buffers fill, it stops reading the backend, and the backend sends nothing more. That silence is
the client's doing, so the circuit must stay closed; after the send timeout the client is cut and
the slot goes back.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import numpy as np
import pytest

from tests.adversarial.slow_client_support import infer_request, read_answer
from tests.eventually import eventually
from tests.integration.servers import Gateway, gateway_config

pytestmark = pytest.mark.anyio

SEND_TIMEOUT_S = 3.0
STALL_TIMEOUT_S = 1.0  # well inside the send timeout: the circuit would open first if it could
SLACK_S = 3.0
BURST_BYTES = 2 << 20
# 8 MiB of binary tensor data, answered as much: far beyond what the sockets and the gateway buffer
# between the two. Binary, so that the simulator reads and writes it at once, without seconds of
# JSON that would read as a stall of its own.
ITEMS = 2 << 20
_HEADER = json.dumps(
    {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [1, ITEMS],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 4 * ITEMS},
            }
        ],
        "parameters": {"binary_data_output": True},
    }
).encode()
LARGE_INFER = _HEADER + np.full(ITEMS, 1.5, dtype=np.float32).tobytes()
LARGE_FIELDS = (
    ("Content-Type", "application/octet-stream"),
    ("Inference-Header-Content-Length", str(len(_HEADER))),
)


@pytest.fixture
def gateway(start_sim, start_gateway) -> Gateway:
    sim = start_sim(slots=1, base_ms=5)
    config = gateway_config(
        [(sim.url, 1)],
        expected_service_ms=5,
        limits={"send_timeout_ms": SEND_TIMEOUT_S * 1000},
        health={"interval_ms": 200, "timeout_ms": 500, "stall_timeout_ms": STALL_TIMEOUT_S * 1000},
    )
    config["models"][0]["upstream_timeout_ms"] = 120_000  # nothing here is freed by it
    gateway = start_gateway(config)
    gateway.wait_ready()
    return gateway


async def stop_reading_after_the_head(gateway: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send the large request on a socket with a small receive buffer and read only up to the
    end of the answer's head."""
    parts = urlsplit(gateway.url)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window
    raw.setblocking(False)
    await asyncio.get_running_loop().sock_connect(raw, (parts.hostname, parts.port))
    reader, writer = await asyncio.open_connection(sock=raw, limit=1 << 16)
    writer.write(infer_request(*LARGE_FIELDS, body=LARGE_INFER))
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    assert head.startswith(b"HTTP/1.1 200"), head
    return reader, writer


def circuit_open(gateway: Gateway) -> float:
    return gateway.metric("gateway_backend_circuit_state", state="open")


async def test_a_client_that_stops_reading_is_cut_its_slot_freed_and_the_circuit_stays_closed(gateway):
    _, writer = await stop_reading_after_the_head(gateway)
    try:
        started = time.monotonic()
        assert gateway.metric("gateway_inflight_requests", model="sim") == 1
        # The backend falls silent (the gateway stopped reading it) for longer than the stall
        # timeout before the cut.
        await eventually(
            lambda: gateway.assert_metric(
                "gateway_client_connections_closed_total", 1, reason="send_timeout"
            ),
            timeout_s=SEND_TIMEOUT_S + SLACK_S,
            what="the reader that stopped to be cut",
        )
        assert time.monotonic() - started >= SEND_TIMEOUT_S - 0.5, "cut before its send timeout"
        await eventually(
            lambda: gateway.assert_metric("gateway_inflight_requests", 0, model="sim"),
            timeout_s=10,
            what="the slot goes back once the cut reader's answer has drained from the backend",
        )
        assert circuit_open(gateway) == 0
        # Nor did it open at any moment before: an opening is logged.
        assert "circuit is open" not in gateway.log(), "a client that stopped reading opened the circuit"
        assert (
            gateway.metric_by("gateway_requests_total", "outcome", model="sim").get("client_disconnected")
            == 1
        )
    finally:
        writer.close()

    reader, other = await asyncio.open_connection(urlsplit(gateway.url).hostname, urlsplit(gateway.url).port)
    other.write(infer_request())
    assert (await read_answer(reader)).status == 200
    other.close()


async def take_in_bursts(reader: asyncio.StreamReader, pause_s: float) -> tuple[int, int]:
    """Read the rest of a chunked answer in bursts of at most BURST_BYTES with `pause_s` between
    them: the bytes taken and the pauses made."""
    received = pauses = 0
    tail = b""
    while not tail.endswith(b"0\r\n\r\n"):
        await asyncio.sleep(pause_s)  # the client's pace: the behaviour under test
        pauses += 1
        burst = 0
        while burst < BURST_BYTES and not tail.endswith(b"0\r\n\r\n"):
            try:
                chunk = await asyncio.wait_for(reader.read(1 << 16), 0.3)
            except TimeoutError:
                break
            if not chunk:
                raise AssertionError(f"the gateway closed the connection after {received} bytes")
            received += len(chunk)
            burst += len(chunk)
            tail = (tail + chunk)[-16:]
    return received, pauses


async def test_a_slow_reader_that_keeps_taking_its_answer_is_not_cut(gateway):
    reader, writer = await stop_reading_after_the_head(gateway)
    try:
        # Paused longer in all than the send timeout, never that long at once.
        received, pauses = await asyncio.wait_for(take_in_bursts(reader, SEND_TIMEOUT_S / 3), 60)
    finally:
        writer.close()
    assert pauses >= 3, "the answer was taken without pausing long enough to test anything"
    assert received > len(LARGE_INFER) * 0.9
    assert gateway.metric("gateway_client_connections_closed_total", reason="send_timeout") == 0
    assert gateway.metric_by("gateway_requests_total", "outcome", model="sim") == {"ok": 1.0}
