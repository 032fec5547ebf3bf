"""Where does a slot hand-over spend its time inside the gateway? A diagnostic, not a benchmark.

Put this directory on PYTHONPATH with HANDOVER_PROBE=1 and run the saturation benchmark:

    HANDOVER_PROBE=1 PYTHONPATH=loadtests/probes/handover \\
        python -m loadtests.bench --scenarios saturate --targets gateway

Python imports `sitecustomize` at start, so every gateway process the benchmark starts wraps
three functions: the callback that completes an upstream answer (the slot is handed to a waiter
there), the waiter's wake-up in the admission controller, and aiohttp's writes to the upstream
socket. At exit each gateway writes, to $HANDOVER_PROBE_DIR (default: the temp dir), the
distribution of: answer complete -> waiter running, waiter running -> its request handed to the
socket. A waiter is paired with the most recent hand-over, which is exact unless two slots free in
the same event-loop turn. It patches aiohttp internals (StreamWriter._write and _writelines, as
of aiohttp 3.14) and may need adjusting for other versions.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("HANDOVER_PROBE") and "serve" in sys.argv:
    import atexit
    import contextvars
    import tempfile
    import time
    from pathlib import Path
    from typing import Any

    import aiohttp.http_writer

    from gateway.flow import controller
    from gateway.http import proxy
    from gateway.queues.base import Slot

    _last_handover_at = [0.0]
    _woken_at: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("woken_at", default=None)
    _samples: dict[str, list[float]] = {
        "answer complete -> waiter running": [],
        "waiter running -> request written": [],
    }

    finished = proxy._UpstreamTimer.finished

    def timed_finished(self: Any) -> None:
        started = time.perf_counter()
        first = self.elapsed_s is None
        finished(self)
        if first and self.handed_over:
            _last_handover_at[0] = started

    wait = controller.AdmissionController._wait

    async def timed_wait(self: Any, *args: Any) -> Any:
        result = await wait(self, *args)
        if isinstance(result, Slot):
            now = time.perf_counter()
            _samples["answer complete -> waiter running"].append(now - _last_handover_at[0])
            _woken_at.set([now])
        return result

    def timed(write: Any) -> Any:
        def timed_write(self: Any, data: Any) -> None:
            if woken := _woken_at.get():  # the first write of a woken request only
                _samples["waiter running -> request written"].append(time.perf_counter() - woken.pop())
            write(self, data)

        return timed_write

    proxy._UpstreamTimer.finished = timed_finished  # type: ignore[method-assign]
    controller.AdmissionController._wait = timed_wait  # type: ignore[method-assign]
    writer = aiohttp.http_writer.StreamWriter
    # Headers and a small body go out together through _writelines; anything else through _write.
    writer._write = timed(writer._write)  # type: ignore[method-assign]
    writer._writelines = timed(writer._writelines)  # type: ignore[method-assign]

    def report() -> None:
        lines = []
        for name, values in _samples.items():
            ordered = sorted(values) or [float("nan")]
            p50, p90, p99 = (ordered[int(q * (len(ordered) - 1))] * 1000 for q in (0.5, 0.9, 0.99))
            lines.append(f"{name}: n={len(values)} p50={p50:.3f} ms p90={p90:.3f} ms p99={p99:.3f} ms")
        out_dir = Path(os.environ.get("HANDOVER_PROBE_DIR", tempfile.gettempdir()))
        out = out_dir / f"handover-{os.getpid()}.txt"
        out.write_text("\n".join(lines) + "\n")
        print(f"handover probe: {out}", file=sys.stderr)

    atexit.register(report)
