"""Where does a request's time inside the gateway go, and how does the refusal tail follow the CPU
each request costs? A diagnostic, not a benchmark.

Put this directory on PYTHONPATH with RESIDENCE_PROBE=1 and run a benchmark or a probe:

    RESIDENCE_PROBE=1 PYTHONPATH=loadtests/probes/residence python -m loadtests.probes.refusal_path

Python imports `sitecustomize` at start, so every gateway process started times each answered
request in phases, from the first bytes of it read to its answer complete:
- waiting: read -> the app starts on it (its task runs after whatever the loop had ready first);
- app: the app's work -> the first write of its answer (the head with the body, for a short one);
- write: that write (the system call; a client woken on the same core may run before it returns);
- rest: the write -> the answer complete (a streamed or long body's other writes);
- write CPU: the gateway's own CPU time in that write (thread time), the rest of its wall time
  being spent off the core.
At exit each gateway writes the phases' percentiles to $RESIDENCE_PROBE_DIR (default: the temp
dir), for each answer status apart (a refusal's path is not an answer's). The first quarter of
each status's requests is left out as warm-up. Requests are told apart by their client's port;
an answer whose head leaves alone (a stream's) is not timed.

RESIDENCE_EXTRA_US=N makes every request that reaches the inference routes spin N microseconds
of CPU first: run the same load with a few values to read how many milliseconds of tail a
microsecond of CPU per request costs on this machine.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("RESIDENCE_PROBE") and "serve" in sys.argv:
    import atexit
    import tempfile
    import time
    from pathlib import Path
    from typing import Any

    from gateway.http.hot_routes import InferenceRoutes
    from gateway.server.connections import LimitedHttpToolsProtocol
    from gateway.server.head_with_body import HeadWithBody

    _clock = time.perf_counter
    _extra_s = float(os.environ.get("RESIDENCE_EXTRA_US", "0")) / 1e6
    _PHASES = ("waiting", "app", "write", "rest", "total", "write CPU")
    # Per answer status (a refusal's path is not an answer's): each phase's times.
    _phases: dict[bytes, dict[str, list[float]]] = {}
    # A request under way, by its client's port: [read, app, write begun, write done] times and
    # the write's CPU time.
    _marks: dict[int, list[float]] = {}
    _statuses: dict[int, bytes] = {}

    def _port(address: Any) -> int | None:
        return address[1] if address else None

    data_received = LimitedHttpToolsProtocol.data_received
    on_response_complete = LimitedHttpToolsProtocol.on_response_complete
    routes_call = InferenceRoutes.__call__
    write = HeadWithBody.write

    def timed_data_received(self: LimitedHttpToolsProtocol, data: bytes) -> None:
        port = _port(self.client)
        if port is not None and port not in _marks:
            _marks[port] = [_clock(), 0.0, 0.0, 0.0, 0.0]
        data_received(self, data)

    def timed_response_complete(self: LimitedHttpToolsProtocol) -> None:
        port = _port(self.client) or -1
        marks, status = _marks.pop(port, None), _statuses.pop(port, b"")
        if marks is not None and all(marks[:4]):
            phases = _phases.setdefault(status, {name: [] for name in _PHASES})
            read, app, write_begun, written, write_cpu = marks
            done = _clock()
            spans = (
                app - read,
                write_begun - app,
                written - write_begun,
                done - written,
                done - read,
                write_cpu,
            )
            for name, seconds in zip(_PHASES, spans, strict=True):
                phases[name].append(seconds)
        on_response_complete(self)

    async def timed_routes(self: InferenceRoutes, scope: Any, receive: Any, send: Any) -> None:
        marks = _marks.get(_port(scope.get("client")) or -1)
        if marks is not None:
            marks[1] = _clock()
        if _extra_s:
            until = _clock() + _extra_s
            while _clock() < until:
                pass
        await routes_call(self, scope, receive, send)

    def timed_write(self: HeadWithBody, data: bytes) -> None:
        port = _port(self._transport.get_extra_info("peername")) or -1
        marks = _marks.get(port)
        if marks is None or marks[2] or self._head is None:
            write(self, data)
            return
        _statuses[port] = self._head[9:12]
        marks[2], cpu = _clock(), time.thread_time()
        write(self, data)
        marks[3], marks[4] = _clock(), time.thread_time() - cpu

    def _report() -> None:
        # Here, not above: sitecustomize runs before the working directory is on the import path.
        from loadtests.openloop import percentile

        lines = []
        for status, phases in sorted(_phases.items()):
            lines.append(f"status {status.decode()}:")
            for name, seconds in phases.items():
                kept = seconds[len(seconds) // 4 :]
                shown = " ".join(
                    f"p{q * 100:g}={(percentile(kept, q) or 0.0) * 1000:.3f}" for q in (0.5, 0.9, 0.99, 0.999)
                )
                lines.append(f"  {name:8} n={len(kept)} {shown} ms")
        directory = Path(os.environ.get("RESIDENCE_PROBE_DIR", tempfile.gettempdir()))
        out = directory / f"residence-{os.getpid()}.txt"
        out.write_text("\n".join(lines) + "\n")
        print(f"residence probe: {out}", file=sys.stderr)

    LimitedHttpToolsProtocol.data_received = timed_data_received  # type: ignore[method-assign]
    LimitedHttpToolsProtocol.on_response_complete = timed_response_complete  # type: ignore[method-assign]
    InferenceRoutes.__call__ = timed_routes  # type: ignore[method-assign]
    HeadWithBody.write = timed_write  # type: ignore[method-assign]
    atexit.register(_report)
