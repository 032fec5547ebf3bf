"""Where does the gateway's event loop stall, and what does the cycle collector cost? A diagnostic,
not a benchmark.

Put this directory on PYTHONPATH with STALL_PROBE=1 and run a benchmark:

    STALL_PROBE=1 PYTHONPATH=loadtests/probes/stalls \\
        python -m loadtests.bench --scenarios overload --targets gateway

Python imports `sitecustomize` at start, so every gateway process the benchmark starts runs a
heartbeat on its event loop (every 0.5 ms) and a watchdog thread that, while the heartbeat is
more than STALL_MS (default 3) late, samples the main thread's stack. It also times every cycle
collection by generation. At exit each gateway writes, to $STALL_PROBE_DIR (default: the temp
dir), the collections' pause times, the number and length of the stalls, and the stacks sampled
in them, the most frequent first. The watchdog costs CPU (it takes the GIL every 0.5 ms): read
where the stalls are, not the benchmark's numbers.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("STALL_PROBE") and "serve" in sys.argv:
    import asyncio
    import atexit
    import gc
    import tempfile
    import threading
    import time
    import traceback
    from collections import Counter, defaultdict
    from pathlib import Path
    from typing import Any

    import uvicorn

    _late_s = float(os.environ.get("STALL_MS", "3")) / 1000
    _beat = {"at": time.perf_counter()}
    _sampled: list[str] = []  # the stacks of the stall under way
    _stalls: list[tuple[float, list[str]]] = []
    _pauses: defaultdict[int, list[float]] = defaultdict(list)
    _full_at: list[float] = []  # when each full collection began, from the serving's start
    _collecting = {"since": 0.0, "serving_since": 0.0}
    _main = threading.main_thread().ident

    def _collector(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            _collecting["since"] = time.perf_counter()
        else:
            _pauses[info["generation"]].append(time.perf_counter() - _collecting["since"])
            if info["generation"] == 2:
                _full_at.append(_collecting["since"] - _collecting["serving_since"])

    def _heartbeat() -> None:
        now = time.perf_counter()
        if _sampled:
            _stalls.append((now - _beat["at"], list(_sampled)))
            _sampled.clear()
        _beat["at"] = now
        asyncio.get_running_loop().call_later(0.0005, _heartbeat)

    def _watch() -> None:
        while True:
            time.sleep(0.0005)
            if time.perf_counter() - _beat["at"] > _late_s:
                frame = sys._current_frames().get(_main)
                if frame is not None:
                    _sampled.append("".join(traceback.format_stack(frame, limit=16)))

    serve = uvicorn.Server.serve

    async def watched_serve(self: uvicorn.Server, *args: Any, **kwargs: Any) -> None:
        if not _collecting.get("watching"):
            _collecting["watching"] = True
            sys.setswitchinterval(0.0005)  # or the watchdog waits up to 5 ms for the GIL
            _beat["at"] = _collecting["serving_since"] = time.perf_counter()
            asyncio.get_running_loop().call_later(0.0005, _heartbeat)
            threading.Thread(target=_watch, daemon=True).start()
        await serve(self, *args, **kwargs)

    def _ms(seconds: float) -> str:
        return f"{seconds * 1000:.2f} ms"

    def _report() -> None:
        lines = []
        for generation, pauses in sorted(_pauses.items()):
            ordered = sorted(pauses)
            lines.append(
                f"gc gen{generation}: n={len(ordered)} p50={_ms(ordered[len(ordered) // 2])} "
                f"p99={_ms(ordered[int(0.99 * (len(ordered) - 1))])} max={_ms(ordered[-1])} "
                f"total={_ms(sum(ordered))} (startup included)"
            )
        lines.append("full collections at " + ", ".join(f"{at:+.1f} s" for at in _full_at) + " from serving")
        lengths = sorted(length for length, _ in _stalls)
        longest = _ms(lengths[-1]) if lengths else "-"
        lines.append(f"stalls over {_ms(_late_s)}: n={len(lengths)} total={_ms(sum(lengths))} max={longest}")
        stacks = Counter(stack for _, sampled in _stalls for stack in sampled)
        lines += [f"---- {count} samples\n{stack}" for stack, count in stacks.most_common(25)]
        out = Path(os.environ.get("STALL_PROBE_DIR", tempfile.gettempdir())) / f"stalls-{os.getpid()}.txt"
        out.write_text("\n".join(lines) + "\n")
        print(f"stall probe: {out}", file=sys.stderr)

    gc.callbacks.append(_collector)
    uvicorn.Server.serve = watched_serve  # type: ignore[method-assign]
    atexit.register(_report)
