"""Finding the test Redis, and starting private redis-server processes for tests that stop Redis.

CI (`.ci/run`) starts a redis-server and passes REDIS_URL. Outside CI the machine's Redis at
127.0.0.1:6379 is used when one answers; without one, Redis tests skip, which they may only do
outside CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from urllib.parse import urlsplit

import pytest

from tests.eventually import eventually_blocking

IN_CI = bool(os.environ.get("CI"))


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 6379), timeout=0.5
        ) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_url_or_skip() -> str:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if _answers(url):
        return url
    if IN_CI:
        pytest.fail(f"CI must provide a Redis, and none answers at {url}")
    pytest.skip(f"no Redis answers at {url}; .ci/run starts one (or set REDIS_URL)")


def unique_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server on its own port, which a test may stop and start again."""

    def __init__(self, *extra_args: str) -> None:
        """`extra_args`: more of redis-server's options (`--replicaof host port`)."""
        self.extra_args = extra_args
        if shutil.which("redis-server") is None:
            if IN_CI:
                pytest.fail("CI must have redis-server installed (.ci/run installs it)")
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-")
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        eventually_blocking(lambda: _answers(self.url), what=f"redis-server to answer at {self.url}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


class RedisSentinel:
    """A private sentinel (redis-server --sentinel) monitoring `master_port` as `name`, quorum 1,
    quick to declare the master down and to fail over."""

    def __init__(self, name: str, master_port: int, down_after_ms: int = 1000) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="sentinel-")
        config = os.path.join(self.dir, "sentinel.conf")  # a sentinel rewrites its config file
        with open(config, "w") as file:
            file.write(
                f"bind 127.0.0.1\nport {self.port}\ndir {self.dir}\n"
                f"sentinel monitor {name} 127.0.0.1 {master_port} 1\n"
                f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
                f"sentinel failover-timeout {name} 10000\n"
            )
        self.process = subprocess.Popen(
            ["redis-server", config, "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        eventually_blocking(lambda: _answers(f"redis://127.0.0.1:{self.port}"), what="the sentinel to answer")

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above it, which must be a port too) is free too."""
    for _ in range(1000):
        port = free_port()
        if port + 10_000 > 65_535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port with a free cluster bus port")


CLUSTER_CREATE = ("--cluster-replicas", "0", "--cluster-yes")
CLUSTER_NODE = (
    *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"),
    *("--save", "", "--appendonly", "no"),
)


class RedisClusterServers:
    """A private Redis Cluster of `masters` masters (no replicas) on ports of their own, each node
    in a directory of its own that keeps its cluster config across a restart."""

    def __init__(self, masters: int = 3) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            if IN_CI:
                pytest.fail("CI must have redis-server and redis-cli installed (.ci/run installs them)")
            pytest.skip("redis-server is not installed")
        self.ports = [free_cluster_port() for _ in range(masters)]
        self.dirs = [tempfile.mkdtemp(prefix=f"redis-cluster-{port}-") for port in self.ports]
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        for port in self.ports:
            self.start(port)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), *CLUSTER_CREATE],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in self.ports:
            eventually_blocking(lambda port=port: self.ok(port), what=f"cluster node {port} ok")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def ok(self, port: int) -> bool:
        try:
            reply = subprocess.run(
                ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, timeout=5, check=False
            )
        except subprocess.TimeoutExpired:
            return False
        return b"cluster_state:ok" in reply.stdout

    def port_of(self, key: str) -> int:
        """The port of the master that holds `key`'s slot."""
        slot = int(
            subprocess.check_output(["redis-cli", "-p", str(self.ports[0]), "cluster", "keyslot", key])
        )
        nodes = subprocess.check_output(
            ["redis-cli", "-p", str(self.ports[0]), "cluster", "nodes"], text=True
        )
        for line in nodes.splitlines():
            fields = line.split()
            for span in fields[8:]:
                low, _, high = span.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return int(fields[1].split(":")[1].split("@")[0])
        raise AssertionError(f"no master holds slot {slot}")

    def start(self, port: int) -> None:
        index = self.ports.index(port)
        self.processes[port] = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                *CLUSTER_NODE,
                "--dir",
                self.dirs[index],
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        eventually_blocking(lambda: _answers(f"redis://127.0.0.1:{port}"), what=f"cluster node {port}")

    def kill(self, port: int) -> None:
        process = self.processes.pop(port)
        process.kill()
        process.wait(10)

    def stop(self) -> None:
        for port in list(self.processes):
            self.kill(port)
