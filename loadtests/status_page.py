"""What the status page costs with a deep queue: the page and its JSON with 10,000 requests queued
across 1,000 tenants, in-process on the memory store, timed over repeats.

    python -m loadtests.status_page [--queued 10000] [--tenants 1000] [--repeat 20]

The requests are queued through admission itself (AdmissionController.acquire), in the most urgent
class, behind a backend whose one slot is held, and entered in the lookup table as admitted calls
enter them; then the document (gateway.flow.status) and the HTML (gateway.http.status) are built
`--repeat` times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from gateway.flow.queued_requests import QueuedRequest
from gateway.http.status import render_body
from gateway.programs.app import build_runtime, status_board
from gateway.queues.base import Flow
from gateway.settings import parse_settings


async def main(queued: int, tenants: int, repeat: int) -> None:
    settings = parse_settings(
        {
            "priorities": [
                {"name": "high", "max_wait_ms": 3_600_000},
                {"name": "low", "max_wait_ms": 3_600_000},
            ],
            "default_priority": "low",
            "tenants": [{"name": f"t{i}"} for i in range(tenants)],
            "models": [
                {
                    "name": "sim",
                    "expected_service_ms": 40,
                    "backends": [{"url": "http://127.0.0.1:9", "max_concurrency": 1}],
                }
            ],
        },
        "status page benchmark",
    )
    rt = build_runtime(settings)
    pool = rt.pools["sim"]
    pool.backends[0].ready = True
    await rt.store.start()
    never = asyncio.get_running_loop().create_future()
    held = await rt.controller.acquire(Flow("sim", 1, "t0"), 1.0, None, lambda: never)
    waits = []
    for i in range(queued):
        flow = Flow("sim", 0, f"t{i % tenants}")
        waits.append(asyncio.ensure_future(rt.controller.acquire(flow, 1.0, None, lambda: never)))
        rt.admission.queued.add(
            QueuedRequest(f"r{i}", "sim", flow.band, "high", flow.tenant, 1.0, rt.clock(), None)
        )
        if i % 500 == 0:
            await asyncio.sleep(0)
    await asyncio.sleep(0.1)
    board = status_board(settings, rt)
    depth = [c["queued"] for c in board.document()["models"][0]["classes"]]
    timings: dict[str, list[float]] = {"document": [], "json": [], "html": []}
    for _ in range(repeat):
        started = time.perf_counter()
        document = board.document()
        built = time.perf_counter()
        json.dumps(document)
        dumped = time.perf_counter()
        render_body(document)
        rendered = time.perf_counter()
        timings["document"].append(built - started)
        timings["json"].append(built - started + dumped - built)
        timings["html"].append(built - started + rendered - dumped)
    print(f"{sum(depth)} queued ({depth} by class) across {tenants} tenants, {repeat} repeats:")
    for name, values in timings.items():
        print(f"- {name}: median {statistics.median(values) * 1000:.1f} ms, max {max(values) * 1000:.1f} ms")
    for wait in waits:
        wait.cancel()
    del held
    await rt.store.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.queued, args.tenants, args.repeat))
