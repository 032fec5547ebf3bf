"""The core benchmark's layout: the servers under test on a core of their own (loadtests.bench)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.bench import Cores

# A process with a second thread, which says so once the thread runs.
TWO_THREADS = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print("started", flush=True)
time.sleep(30)
"""


def test_the_first_core_is_for_the_servers_under_test_and_the_others_for_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 2, 7})
    assert Cores.split() == Cores({2}, {5, 7})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert Cores.split() is None  # one core: everything shares it


def test_pinning_a_server_moves_every_thread_it_already_runs() -> None:
    cores = Cores.split()
    if cores is None:
        pytest.skip("this machine has one core: the benchmark shares it, nothing is pinned")
    with subprocess.Popen([sys.executable, "-c", TWO_THREADS], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"started\n"
            cores.pin_under_test(child.pid)
            threads = [int(task.name) for task in Path(f"/proc/{child.pid}/task").iterdir()]
            assert len(threads) == 2
            pinned = {tid: os.sched_getaffinity(tid) for tid in threads}
            assert pinned == dict.fromkeys(threads, cores.under_test)
        finally:
            child.kill()
