"""How many requests per second the simulator serves with 0 ms service time (it must not be the
bottleneck of any benchmark).

    python -m loadtests.sim_throughput [--concurrency 8] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtests.openloop import INFER_BODY, INFER_PATH, run_fast
from tests.integration.servers import Sim


async def closed_loop(url: str, concurrency: int, seconds: float) -> int:
    done = 0
    stop_at = time.monotonic() + seconds
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                async with session.post(url + INFER_PATH, data=INFER_BODY, headers=headers) as reply:
                    await reply.read()
                done += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    sim = Sim(Path(tempfile.mkdtemp()), slots=64, base_ms=0)
    try:
        done = run_fast(closed_loop(sim.url, args.concurrency, args.seconds))
    finally:
        sim.stop()
    print(json.dumps({"requests": done, "per_second": round(done / args.seconds)}))


if __name__ == "__main__":
    main()
