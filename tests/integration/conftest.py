import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.servers import Gateway, ServerProcess, Sim
from tests.redis_server import RedisServer, unique_prefix


class Launcher:
    """Starts servers and stops every one of them at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[ServerProcess] = []

    def sim(self, **options: Any) -> Sim:
        sim = Sim(self.log_dir, **options)
        self.started.append(sim)
        return sim

    def gateway(
        self, config: dict[str, Any], *, wait_ready: bool = True, env: dict[str, str] | None = None
    ) -> Gateway:
        gateway = Gateway(self.log_dir, config, env=env)
        self.started.append(gateway)
        if wait_ready:
            gateway.wait_ready()
        return gateway

    def stop_all(self) -> None:
        # All at once: each stop takes a few tenths of a second, and the suite makes hundreds.
        for server in reversed(self.started):
            server.ask_to_stop()
        for server in reversed(self.started):
            server.stop()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launched = Launcher(tmp_path)
    yield launched
    launched.stop_all()


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launched = Launcher(tmp_path_factory.mktemp("servers"))
    yield launched
    launched.stop_all()


@pytest.fixture
def start_sim(launcher: Launcher) -> Callable[..., Sim]:
    return launcher.sim


@pytest.fixture
def start_gateway(launcher: Launcher) -> Callable[..., Gateway]:
    return launcher.gateway


@pytest.fixture
def store_section(store: str) -> Iterator[dict[str, Any] | None]:
    """The gateway config's `store:` for a test parametrized on `store`: None for "memory", a Redis
    of its own (started here, stopped after the test) under a key prefix of its own for "redis"."""
    if store != "redis":
        yield None
        return
    server = RedisServer()
    try:
        yield {"kind": "redis", "url": server.url, "key_prefix": unique_prefix()}
    finally:
        server.stop()


@pytest.fixture
def tls_cert(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
