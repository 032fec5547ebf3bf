"""How long does each stage of a refused request take inside the gateway? A diagnostic, not a
benchmark.

Put this directory on PYTHONPATH with SECTIONS_PROBE=1 and run a benchmark:

    SECTIONS_PROBE=1 PYTHONPATH=loadtests/probes/sections \\
        python -m loadtests.bench --scenarios overload --targets gateway

Python imports `sitecustomize` at start, so every gateway process the benchmark starts wraps the
stages of the request path below in a timer, once `gateway.programs.app` is imported. A stage's time is
wall time from its call to its return, with every stage it calls inside it, and with whatever
took the process off the CPU meanwhile (a write that wakes the client on the same core). The
controller's `acquire` and the relay's `refuse` count refused requests only; the rest count
every call. At exit each gateway writes, to $SECTIONS_PROBE_DIR (default: the temp dir), each
stage's count and percentiles, the costliest in all first. The timers cost about a microsecond a
stage: read the shares, not the benchmark's numbers.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("SECTIONS_PROBE") and "serve" in sys.argv:
    import atexit
    import builtins
    import functools
    import inspect
    import tempfile
    import time
    from collections import defaultdict
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any

    _times: defaultdict[str, list[int]] = defaultdict(list)
    _clock = time.perf_counter_ns

    def _refused(result: Any) -> bool:
        return type(result).__name__ == "Refusal"

    def _timed(owner: type, name: str, label: str, keep: Callable[[Any], bool] | None = None) -> None:
        """Time `owner.name` under `label`; with `keep`, only the calls whose result it accepts."""
        original = getattr(owner, name)
        if inspect.iscoroutinefunction(original):

            @functools.wraps(original)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = _clock()
                result = await original(*args, **kwargs)
                if keep is None or keep(result):
                    _times[label].append(_clock() - started)
                return result

            setattr(owner, name, timed_async)
        else:

            @functools.wraps(original)
            def timed(*args: Any, **kwargs: Any) -> Any:
                started = _clock()
                result = original(*args, **kwargs)
                if keep is None or keep(result):
                    _times[label].append(_clock() - started)
                return result

            setattr(owner, name, timed)

    def _install() -> None:
        from gateway.flow import controller, predictions, request_meta
        from gateway.http import intake
        from gateway.http.relay import Relay
        from gateway.queues import memory
        from gateway.telemetry import metrics

        admission = controller.AdmissionController
        _timed(intake.AdmittedEndpoint, "__call__", "request (every request, queue wait included)")
        _timed(admission, "acquire", "admission of a refused request", _refused)
        _timed(admission, "_advise", "  the refusal and its Retry-After")
        _timed(admission, "_book_return", "    the return's booking")
        _timed(admission, "_refusal", "  the refusal's metric")
        _timed(admission, "_rank", "  the cost's rank")
        _timed(predictions.Predictions, "work_limit", "  the work limit")
        _timed(memory.MemoryQueue, "offer_nowait", "  the store's offer")
        _timed(memory.MemoryQueue, "throughput", "  the store's rates")
        _timed(memory.MemoryQueue, "stats", "  the store's stats")
        _timed(Relay, "refuse", "the refusal written")
        _timed(request_meta.RequestClassifier, "classify", "classification")
        _timed(intake.AdmittedEndpoint, "admit", "the request's call made")
        _timed(metrics.GatewayMetrics, "count", "the outcome counted")
        _timed(metrics.GatewayMetrics, "observe_cost", "the cost observed")

    _import = builtins.__import__

    def _import_then_install(name: str, *args: Any, **kwargs: Any) -> Any:
        module = _import(name, *args, **kwargs)
        if name == "gateway.programs.app" and builtins.__import__ is _import_then_install:
            builtins.__import__ = _import
            _install()
        return module

    def _report() -> None:
        lines = []
        for label, spent in sorted(_times.items(), key=lambda item: -sum(item[1])):
            ordered = sorted(spent)
            n = len(ordered)
            shown = " ".join(f"p{q * 100:g}={ordered[int(q * (n - 1))] / 1000:.1f}" for q in (0.5, 0.9, 0.99))
            lines.append(f"{label:52} n={n:6} {shown} us")
        directory = Path(os.environ.get("SECTIONS_PROBE_DIR", tempfile.gettempdir()))
        out = directory / f"sections-{os.getpid()}.txt"
        out.write_text("\n".join(lines) + "\n")
        print(f"sections probe: {out}", file=sys.stderr)

    builtins.__import__ = _import_then_install
    atexit.register(_report)
