"""The replica beacon's verdicts, on real sockets of 127.0.0.1: what proves a replica dead and what
does not (gateway/queues/redis/peers.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.queues.redis import peers
from gateway.queues.redis.peers import Beacon, BeaconAt, Verdict, probe, reachable_host

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def started(replica: str) -> Beacon:
    beacon = Beacon(replica)
    await beacon.start(BeaconAt("127.0.0.1", 0))
    assert beacon.address is not None and beacon.address.startswith("127.0.0.1:")
    assert beacon.address.endswith("@" + socket.gethostname())  # loopback: this machine's only
    return beacon


async def test_the_replica_itself_answering_is_here_and_another_replica_there_is_proof_it_is_gone():
    beacon = await started("replica-a")
    try:
        assert await probe(beacon.address, "replica-a") is Verdict.HERE
        # A restarted pod on the same address answers with its new id: the old process is dead.
        assert await probe(beacon.address, "replica-b") is Verdict.GONE
    finally:
        await beacon.close()


async def test_a_closed_beacon_refuses_and_is_gone():
    beacon = await started("replica-a")
    address = beacon.address
    await beacon.close()
    assert await probe(address, "replica-a") is Verdict.GONE


async def test_a_process_that_accepts_and_says_nothing_is_unknown_not_gone():
    # A stopped (SIGSTOP) or wedged process: the kernel still accepts on its listening socket.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        port = listening.getsockname()[1]
        assert await probe(f"127.0.0.1:{port}", "replica-a", timeout_s=0.2) is Verdict.UNKNOWN


async def test_something_else_on_the_port_is_unknown():
    async def other(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(other, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await probe(f"127.0.0.1:{port}", "replica-a") is Verdict.UNKNOWN
    finally:
        server.close()
        await server.wait_closed()


async def test_a_malformed_address_is_unknown():
    assert await probe("nowhere", "replica-a") is Verdict.UNKNOWN


def test_a_wildcard_bind_is_advertised_by_this_hosts_address_never_a_loopback_one(monkeypatch):
    assert reachable_host("10.1.2.3") == "10.1.2.3"
    monkeypatch.setattr(peers.socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts
    assert reachable_host("0.0.0.0") is None
    monkeypatch.setattr(peers.socket, "gethostbyname", lambda name: "10.244.0.7")  # a pod's IP
    assert reachable_host("0.0.0.0") == "10.244.0.7"
    assert reachable_host("::") == "10.244.0.7"


async def test_a_loopback_beacon_is_probed_only_from_its_own_machine():
    # From another machine 127.0.0.1 is the prober's own: a refusal there would prove nothing.
    beacon = await started("replica-a")
    address = beacon.address.partition("@")[0]
    await beacon.close()
    assert await probe(address + "@another-machine", "replica-a") is Verdict.UNKNOWN
    assert await probe(address + "@" + socket.gethostname(), "replica-a") is Verdict.GONE
