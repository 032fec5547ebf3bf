"""The core benchmark pins a server under test to its own core (loadtests.bench.Cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.bench import Cores

# A process with a second thread, which says so once the thread runs, and lives until killed.
TWO_THREADS = """
import sys, threading
threading.Thread(target=threading.Event().wait, daemon=True).start()
print("started", flush=True)
sys.stdin.read()
"""


def test_pinning_a_server_moves_every_thread_it_already_runs() -> None:
    cores = Cores.layout(["gateway"], share=False)
    if cores is None:
        pytest.skip("this machine has one core: the benchmark shares it, nothing is pinned")
    command = [sys.executable, "-c", TWO_THREADS]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"started\n"
            cores.pin_under_test(child.pid)
            threads = [int(task.name) for task in Path(f"/proc/{child.pid}/task").iterdir()]
            assert len(threads) == 2
            pinned = {tid: os.sched_getaffinity(tid) for tid in threads}
            assert pinned == dict.fromkeys(threads, cores.under_test)
        finally:
            child.kill()
