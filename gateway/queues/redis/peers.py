"""Telling a dead replica from a cut-off one, so that a crash costs seconds of slots, not minutes.

Redis sees only that a replica's heartbeat lapsed. A replica cut off from Redis may still be serving
(its requests, and its fallback's on their capacity), so Redis keeps what it held reserved
(presence.py). But a killed process leaves a trace another replica can check: the port it listened
on refuses connections, or another process (a restarted pod, with a new replica id) answers there.
Each replica therefore keeps a beacon, a TCP port that answers its replica id to whoever connects,
open for the whole life of the process (not closed while it drains, as the client listener is), and
publishes its address with each beat. When a replica turns absent, the others probe its beacon:

- refused, or another replica's id: gone. Its connections to the backends closed with it, so a
  backend that stops on a closed connection (`on_abandon: abort`) runs none of its work now, and
  one that computes on (`drain`) runs each request at most its measured bound more
  (policies.service_times.surely_ended_s); nothing of a fallback can run. lua/gone.lua frees the
  slots on those terms.
- its own id: alive, cut off from Redis only; everything stays reserved.
- anything else (a timeout, an unreachable host, a process that accepts and says nothing because it
  is stopped, a loopback beacon seen from another machine): unknown, and everything stays
  reserved, as without a beacon.

A firewall that rejects connections between replicas (rather than dropping them) would look like a
death: set `store.peer_port: null` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.queues.redis.grants import ModelState
from gateway.telemetry.store_calls import StoreCalls
from gateway.upstream.origin import OnAbandon

log = logging.getLogger("gateway.redis")

GREETING = b"inference-gateway replica "
PROBE_TIMEOUT_S = 1.0
REPROBE_S = 1.0
"""A replica found alive, or not answering, is probed again at most this often (per model)."""
FORGET_PROBES_S = 60.0


class Verdict(enum.Enum):
    GONE = "gone"
    HERE = "here"
    UNKNOWN = "unknown"


class Beacon:
    """Answers its replica id on a port of its own until the process ends."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.address: str | None = None
        """host:port where others reach it, once started with an address to publish."""
        self._server: asyncio.Server | None = None

    async def start(self, at: BeaconAt) -> None:
        bind_host, port, advertised_host = at.bind_host, at.port, at.advertised_host
        answer = GREETING + self.replica.encode() + b"\n"

        async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(answer)
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(greet, bind_host, port)
        bound_port = self._server.sockets[0].getsockname()[1]
        host = advertised_host or reachable_host(bind_host)
        if host is None:
            log.warning(
                "the replica beacon listens on %s:%d but this host's name resolves to a loopback "
                "address: set store.peer_address for the other replicas to reach it (until then a "
                "killed replica's slots stay reserved for their full bounds)",
                bind_host,
                bound_port,
            )
            return
        address = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
        if _is_loopback(host):  # reachable from this machine only: probed only from it
            address += "@" + socket.gethostname()
        self.address = address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


def reachable_host(bind_host: str) -> str | None:
    """The address others reach a server bound to `bind_host` at: the host itself unless it is a
    wildcard, else this host's name resolved (a pod's IP in Kubernetes); None when that is a
    loopback address while the bind is a wildcard (Debian maps the host name to 127.0.1.1), since
    a replica on another host probing it would reach its own machine and see a refusal."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ipaddress.ip_address(resolved).is_loopback else resolved


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def probe(address: str, replica: str, timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """Whether `replica`'s process is still the one at `address` (see the module's rules). A
    loopback address carries its machine's name (`host:port@machine`): from another machine it
    would reach the prober's own loopback, where a refusal proves nothing, so it is unknown."""
    address, _, machine = address.partition("@")
    if machine and machine != socket.gethostname():
        return Verdict.UNKNOWN
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            try:
                line = await reader.readline()
            finally:
                writer.close()
    except ConnectionRefusedError:
        return Verdict.GONE
    except (OSError, TimeoutError, ValueError):
        return Verdict.UNKNOWN
    if not line.startswith(GREETING) or not line.endswith(b"\n"):
        return Verdict.UNKNOWN
    return Verdict.HERE if line[len(GREETING) : -1].decode(errors="replace") == replica else Verdict.GONE


class Peers:
    """This replica's beacon, and the probes, off the heartbeat's path, of the beacons of the
    replicas Redis holds as absent, freeing what a gone one held (lua/gone.lua)."""

    def __init__(
        self,
        replica: str,
        beacon_at: BeaconAt | None,
        run: Callable[[str, ModelState, dict[str, Any]], Awaitable[Any]],
        spawn: Callable[[Awaitable[Any]], object],
        calls: StoreCalls | None = None,
    ) -> None:
        self._beacon, self._beacon_at = Beacon(replica), beacon_at
        self._calls = calls if calls is not None else StoreCalls()
        self._run = run
        self._spawn = spawn
        self._probing: set[tuple[str, str]] = set()
        """(model's tag, replica) whose probe is under way: one at a time each."""
        self._probed_at: dict[tuple[str, str], float] = {}
        """When each was last probed (monotonic): at most every REPROBE_S."""
        self._heads: dict[tuple[str, str], str] = {}
        """The head of each live replica's grant list at the last look, where it had one."""
        self._live: dict[str, dict[str, str]] = {}
        """Per model's tag, the replicas live at the last look -> the hash of their configs."""

    async def open(self) -> str | None:
        """Start this replica's beacon, where configured; returns the address to publish."""
        if self._beacon_at is not None:
            await self._beacon.start(self._beacon_at)
        return self._beacon.address

    async def close(self) -> None:
        await self._beacon.close()

    def look(self, state: ModelState) -> None:
        """Probe, in the background, the replicas of `state`'s model that may be gone: the absent
        ones, and the live ones whose grant list kept the same head since the last look. A replica
        without a beacon of its own (`store.peer_port: null`) probes none; either way it learns
        which replicas are live, and the config each runs."""
        self._spawn(self._look(state))

    def live(self) -> dict[str, str]:
        """The replicas live on any model at the last looks -> the hash of the config each runs."""
        return {replica: config for seen in self._live.values() for replica, config in seen.items()}

    async def _look(self, state: ModelState) -> None:
        reply = await self._run("peers", state, {"replica": self._beacon.replica})
        now, tag = time.monotonic(), state.tag
        self._live[tag] = {r: config for r, config in reply["live"].items() if r != "~"}
        if self._beacon_at is None:
            return
        self._probed_at = {key: at for key, at in self._probed_at.items() if now - at < FORGET_PROBES_S}
        suspects = {r: (address, False) for r, address in reply["absent"].items() if r != "~"}
        heads = {r: entry for r, entry in reply["heads"].items() if r != "~"}
        for replica, entry in heads.items():
            if self._heads.get((tag, replica)) == entry["h"]:
                suspects[replica] = (entry["a"], True)
        self._heads = {key: head for key, head in self._heads.items() if key[0] != tag}
        self._heads.update({(tag, replica): entry["h"] for replica, entry in heads.items()})
        for replica, (address, stuck) in suspects.items():
            key = (tag, replica)
            if key in self._probing or now - self._probed_at.get(key, -math.inf) < REPROBE_S:
                continue
            self._probing.add(key)
            self._probed_at[key] = now
            self._spawn(self._probe(state, replica, address, stuck))

    async def _probe(self, state: ModelState, replica: str, address: str, stuck: bool) -> None:
        try:
            verdict = await probe(address, replica)
            self._calls.probed(verdict.value)
            if verdict is not Verdict.GONE:
                return
            stops = [b.url for b in state.pool.backends if b.on_abandon is OnAbandon.ABORT]
            reply = await self._run("gone", state, {"replica": replica, "abort": stops, "stuck": stuck})
            log.warning(
                "model %s: replica %s is gone (its beacon at %s%s): freed %d of its slots, granted %d",
                state.pool.name,
                replica,
                address,
                ", its grants untaken" if stuck else "",
                reply["freed"],
                reply["granted"],
            )
        finally:
            self._probing.discard((state.tag, replica))


@dataclass(frozen=True, slots=True)
class BeaconAt:
    """Where a replica's beacon listens, and the host it tells the others (None: found here)."""

    bind_host: str
    port: int
    advertised_host: str | None = None
