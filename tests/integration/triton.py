"""Starting a real tritonserver for tests, or saying exactly why it cannot start here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.eventually import eventually_blocking
from tests.integration.servers import http_get
from tests.redis_server import IN_CI, free_port

COUNT_UP_RESPONSES = 3
"""How many responses the decoupled model `count_up` sends to each request (tests/triton_model.py)."""
COUNT_UP_INSTANCES = 2
"""How many of its requests the server runs at once."""
MODELS = ("sleep_ms", "typed_echo", "count_up")
"""What tests/triton_model.py serves: the server is ready once all are."""
HANDSHAKE_RACE = "get_config_from_handshake_server"


class TritonServer:
    def __init__(
        self,
        log_dir: Path,
        *,
        sleep_ms: float = 100.0,
        max_batch_size: int = 4,
        dynamic_batching: bool = True,
    ) -> None:
        if importlib.util.find_spec("pytriton") is None:
            reason = "nvidia-pytriton is not installed (pip install -e '.[test]' installs it on Linux x86_64)"
            if IN_CI:
                pytest.fail(reason)
            pytest.skip(reason)
        for attempt in range(2):
            self._launch(log_dir, sleep_ms, max_batch_size, dynamic_batching)
            try:
                self._wait_ready()
                return
            except RuntimeError as error:
                # pytriton's race: a model's later instances connect to its first one's handshake
                # socket once the file exists, which is before it listens; on a busy machine one
                # is refused and the server exits. Started again once, on new ports.
                if attempt or HANDSHAKE_RACE not in str(error):
                    raise

    def _launch(self, log_dir: Path, sleep_ms: float, max_batch_size: int, dynamic_batching: bool) -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        env = dict(os.environ)
        # The Python backend's stub loads libpython from the library path: it must find this
        # interpreter's, not another one on the system.
        env["LD_LIBRARY_PATH"] = ":".join(
            filter(None, [sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH")])
        )
        self.log_path = log_dir / f"triton-{self.http_port}.log"
        self.hold_path = log_dir / f"triton-{self.http_port}.hold"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.triton_model",
                    "--http-port",
                    str(self.http_port),
                    "--grpc-port",
                    str(self.grpc_port),
                    "--metrics-port",
                    str(self.metrics_port),
                    "--sleep-ms",
                    str(sleep_ms),
                    "--max-batch-size",
                    str(max_batch_size),
                    "--dynamic-batching" if dynamic_batching else "--no-dynamic-batching",
                    "--hold-file",
                    str(self.hold_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def hold(self) -> None:
        """From now on every inference waits before its work, until `let_go`."""
        self.hold_path.touch()

    def let_go(self) -> None:
        self.hold_path.unlink(missing_ok=True)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited:\n{self.log_path.read_text(errors='replace')}")
            try:
                return all(http_get(f"{self.url}/v2/models/{model}/ready")[0] == 200 for model in MODELS)
            except OSError:
                return False

        try:
            eventually_blocking(ready, timeout_s=timeout_s, interval_s=0.2, what="tritonserver to be ready")
        except AssertionError as error:
            self.stop()
            raise RuntimeError(f"{error}:\n{self.log_path.read_text(errors='replace')}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(10)
