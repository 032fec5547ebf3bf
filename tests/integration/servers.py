"""Real servers for integration tests: the simulator and the gateway as subprocesses on ephemeral ports."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.eventually import eventually_blocking

# The sim names its metrics listener, the gateway its admin listener (when configured).
_LISTENING = re.compile(r"listening on (https?://[0-9.:\[\]]+)(?: \((?:metrics|admin) (https?://[^\s)]+)\))?")


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to `url`'s origin; over https, trusting any certificate (the tests' own)."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout_s, context=ssl._create_unverified_context()
        )
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = _connection(url, timeout_s)
    try:
        connection.request("GET", parts.path or "/")
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def http_post(url: str, body: bytes = b"", timeout_s: float = 5.0) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = _connection(url, timeout_s)
    try:
        connection.request("POST", parts.path, body=body)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid`, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def _server_environment() -> dict[str, str]:
    """The servers' environment: unbuffered output (the tests read their logs), and bytecode
    written, so that the hundreds of servers a run starts compile the sources once (a sandbox
    may set PYTHONDONTWRITEBYTECODE: each start then compiled them again, 0.1-0.15 s)."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    return environment


class ServerProcess:
    """`python -m gateway <args>`, logging to a file; `url` once it listens and answers."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_dir: Path,
        ready_path: str,
        *,
        module: str = "gateway",
        extra: list[str] | None = None,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        command = [python, "-m", module, *(["--log-level", "info"] if module == "gateway" else [])]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*command, *args, *(extra or [])],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**_server_environment(), **(env or {})},
            )
        self.url, self.metrics_url = self._wait_listening()
        self._wait_answering(ready_path)

    def _wait_listening(self, timeout_s: float = 30.0) -> tuple[str, str | None]:
        found: list[re.Match[str]] = []

        def listening() -> bool:
            if (match := _LISTENING.search(self.log())) is not None:
                found.append(match)
                return True
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
            return False

        self._started_within(listening, timeout_s, "its 'listening on' line")
        return found[0].group(1), found[0].group(2)

    def _probed_url(self) -> str:
        """Where the start is probed: the server's own URL."""
        return self.url

    def _wait_answering(self, path: str, timeout_s: float = 30.0) -> None:
        def answering() -> bool:
            try:
                return http_get(self._probed_url() + path)[0] < 500
            except OSError:
                return False

        self._started_within(answering, timeout_s, f"an answer to {path}")

    def _started_within(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        try:
            eventually_blocking(check, timeout_s=timeout_s, what=f"{self.name}: {what}")
        except AssertionError as error:
            self.kill()
            raise RuntimeError(f"{error}\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.process.wait(timeout_s)

    def ask_to_stop(self) -> None:
        """SIGTERM, without waiting for the exit (`stop` waits)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.process.poll() is None:
            self.ask_to_stop()
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


class Sim(ServerProcess):
    def __init__(
        self,
        log_dir: Path,
        *,
        slots: int = 8,
        base_ms: float = 40,
        token_ms: float = 0,
        per_item_ms: float = 0,
        port: int = 0,
        on_disconnect: str = "finish",
        service_dist: str | None = None,
        seed: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        args = [
            "sim",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--slots",
            str(slots),
            "--base-ms",
            str(base_ms),
            "--token-ms",
            str(token_ms),
            "--per-item-ms",
            str(per_item_ms),
            "--on-disconnect",
            on_disconnect,
            *([] if service_dist is None else ["--service-dist", service_dist]),
            *([] if seed is None else ["--seed", str(seed)]),
            *extra_args,
        ]
        super().__init__("sim", args, log_dir, "/v2/health/ready")

    def stats(self) -> dict[str, Any]:
        return json.loads(http_get(self.url + "/sim/stats")[1])

    def reset(self) -> dict[str, Any]:
        return json.loads(http_post(self.url + "/sim/reset")[1])


def gateway_config(backends: list[tuple[str, int]], **overrides: Any) -> dict[str, Any]:
    """A config for one model `sim` over `backends` [(url, max_concurrency)]."""
    model: dict[str, Any] = {
        "name": "sim",
        "expected_service_ms": overrides.pop("expected_service_ms", 40),
        "backends": [{"url": url, "max_concurrency": slots} for url, slots in backends],
    }
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "priorities": [{"name": "high", "max_wait_ms": 250}, {"name": "low", "max_wait_ms": 1000}],
        "default_priority": "low",
        "models": [model],
        "health": {"interval_ms": 200, "timeout_ms": 500},
        "shutdown": {"drain_timeout_ms": 10_000},
    }
    config.update(overrides)
    return config


class Gateway(ServerProcess):
    def __init__(
        self,
        log_dir: Path,
        config: dict[str, Any],
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config_path = log_dir / f"gateway-{time.monotonic_ns()}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        args = ["serve", "--config", str(self.config_path)]
        super().__init__("gateway", args, log_dir, "/healthz", python=python, env=env)

    def _probed_url(self) -> str:
        # The admin listener where there is one: the client one may want a client certificate.
        return self.admin_url

    @property
    def grpc_target(self) -> str:
        """host:port of the gRPC listener (`grpc_listen`), from its 'grpc listening on' line."""
        match = re.search(r"grpc listening on ([^\s(]+)", self.log())
        if match is None:
            raise AssertionError(f"the gateway logged no gRPC listener:\n{self.log()}")
        return match.group(1)

    @property
    def admin_url(self) -> str:
        """Where /metrics, /healthz and /readyz are served: the admin listener, if configured."""
        return self.metrics_url or self.url

    def metrics(self) -> str:
        return http_get(self.admin_url + "/metrics")[1].decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of the one sample from /metrics named `name` with (at least) these labels.

        A sample that is not there fails the test (AssertionError), naming what is there instead:
        a renamed metric or a mistyped label must not read as 0.
        """
        exposition = _Exposition(self.metrics())
        matches = exposition.matching(name, labels)
        if not matches:
            raise AssertionError(exposition.absent(name, labels))
        return matches[0][1]

    def assert_metric(self, name: str, expected: float, **labels: str) -> None:
        """Fail unless the sample `name{labels}` is `expected`; as a check, `eventually` shows the value."""
        value = self.metric(name, **labels)
        if value != expected:
            raise AssertionError(f"{name}{_braces(labels)} is {value}, expected {expected}")

    def metric_by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """The samples named `name` with these labels, by the value of `label`: {} when none.

        For an exact assertion on a labelled counter, whose label sets appear only once counted:
        `metric_by("gateway_requests_total", "priority", outcome="ok") == {"low": 1.0}`. The metric
        itself must be declared in /metrics, even if it has no sample yet.
        """
        exposition = _Exposition(self.metrics())
        if not exposition.declares(name):
            raise AssertionError(exposition.absent(name, labels))
        values: dict[str, float] = {}
        for sample_labels, value in exposition.matching(name, labels):
            key = sample_labels.get(label)
            if key is None or key in values:
                where = f"{name}{_braces(labels)}"
                raise AssertionError(f"{where}: label {label!r} does not tell its samples apart")
            values[key] = value
        return values

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        try:
            eventually_blocking(
                lambda: http_get(self.admin_url + "/readyz")[0] == 200,
                timeout_s=timeout_s,
                what="/readyz 200",
            )
        except AssertionError as error:
            raise AssertionError(f"gateway not ready: {error}\n{self.log()}") from None


_SAMPLE_SUFFIXES = ("", "_total", "_created", "_bucket", "_count", "_sum", "_gcount", "_gsum", "_info")


def _braces(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class _Exposition:
    """/metrics text parsed by prometheus-client, for looking samples up and saying what is missing."""

    def __init__(self, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.families = list(text_string_to_metric_families(text))
        self.samples = [(s.name, s.labels, float(s.value)) for f in self.families for s in f.samples]

    def matching(self, name: str, labels: dict[str, str]) -> list[tuple[dict[str, str], float]]:
        return [
            (sample_labels, value)
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
        ]

    def declares(self, name: str) -> bool:
        return any(name == family.name + suffix for family in self.families for suffix in _SAMPLE_SUFFIXES)

    def absent(self, name: str, labels: dict[str, str]) -> str:
        """Why there is no `name{labels}`: the label sets it has, else the names alike that exist."""
        message = f"no sample {name}{_braces(labels)} in /metrics"
        present = [sample_labels for sample_name, sample_labels, _ in self.samples if sample_name == name]
        if present:
            return f"{message}; {name} has only {', '.join(_braces(p) for p in present)}"
        names = sorted({sample_name for sample_name, _, _ in self.samples})
        words = name.split("_")
        for size in range(len(words) - 1, 0, -1):
            prefix = "_".join(words[:size]) + "_"
            alike = [n for n in names if n.startswith(prefix)]
            if alike:
                return f"{message}; metrics named {prefix}*: {', '.join(alike)}"
        return f"{message}; it has {', '.join(names) or 'no samples at all'}"
