"""Where does a slot hand-over spend its time inside the gateway? A diagnostic, not a benchmark.

Put this directory on PYTHONPATH with HANDOVER_PROBE=1 and run the saturation benchmark:

    HANDOVER_PROBE=1 PYTHONPATH=loadtests/probes/handover \\
        python -m loadtests.bench --scenarios saturate --targets gateway

Python imports `sitecustomize` at start, so every gateway process the benchmark starts wraps two
functions: the release inside the callback that completes an upstream answer (the slot is handed
to a waiter there), and the upstream client's write of a request. At exit each gateway writes, to
$HANDOVER_PROBE_DIR (default: the temp dir), how many hand-overs had the waiter's request written
inside the releasing callback (the grant hook found an idle connection) and how many later, and
the distribution of answer complete -> next request written. A later write is paired with the most
recent hand-over, which is exact unless two slots free in the same event-loop turn.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("HANDOVER_PROBE") and "serve" in sys.argv:
    import atexit
    import tempfile
    import time
    from pathlib import Path
    from typing import Any

    from gateway.flow.controller import AdmissionController
    from gateway.upstream import http1

    _state: dict[str, Any] = {"handover_at": None, "releasing": False, "inside": 0, "outside": 0}
    _samples: list[float] = []

    release_soon = AdmissionController.release_soon

    def timed_release_soon(self: Any, *args: Any, **kwargs: Any) -> bool:
        started = time.perf_counter()
        inside_before = _state["inside"]
        _state["releasing"] = True
        try:
            handed_over = release_soon(self, *args, **kwargs)
        finally:
            _state["releasing"] = False
        if handed_over and _state["inside"] == inside_before:
            _state["handover_at"] = started  # the waiter's request goes out later
        return handed_over

    send = http1._Connection.send

    def timed_send(self: Any, reply: Any, request: bytes) -> None:
        if _state["releasing"]:
            _state["inside"] += 1
            _samples.append(0.0)
        elif _state["handover_at"] is not None:
            _state["outside"] += 1
            _samples.append(time.perf_counter() - _state["handover_at"])
            _state["handover_at"] = None
        send(self, reply, request)

    AdmissionController.release_soon = timed_release_soon  # type: ignore[method-assign]
    http1._Connection.send = timed_send  # type: ignore[method-assign]

    def report() -> None:
        ordered = sorted(_samples) or [float("nan")]
        p50, p90, p99 = (ordered[int(q * (len(ordered) - 1))] * 1000 for q in (0.5, 0.9, 0.99))
        lines = [
            f"answer complete -> next request written: n={len(_samples)} "
            f"p50={p50:.3f} ms p90={p90:.3f} ms p99={p99:.3f} ms",
            f"written inside the releasing callback: {_state['inside']}, later: {_state['outside']}",
        ]
        out_dir = Path(os.environ.get("HANDOVER_PROBE_DIR", tempfile.gettempdir()))
        out = out_dir / f"handover-{os.getpid()}.txt"
        out.write_text("\n".join(lines) + "\n")
        print(f"handover probe: {out}", file=sys.stderr)

    atexit.register(report)
