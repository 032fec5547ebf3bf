"""A continuous-batching engine (issue 16): `max_concurrency: auto` against fixed limits that are too
low, right and too high, and against HAProxy with `maxconn` tuned by hand.

    python -m loadtests.continuous                 # 1x and 2x capacity, every target (~10 min)
    python -m loadtests.continuous --quick         # a smoke run, about two minutes
    python -m loadtests.continuous --deadline-ms 3500 --loads 1.5   # clients with deadlines

The engine is the simulator's continuous mode: 64 sequences at most, a 10 ms step alone that
doubles with 64 running, 10 ms of prefill per 1,000 prompt tokens, a KV cache of 80,000 tokens.
Chat requests (streamed) have prompts of 50-2,000 tokens and ask for 10-500 output tokens
(`ignore_eos`, so they make exactly that many); the open-loop Poisson arrivals (seeded) are the
same for every target, each in front of a fresh engine, at `--loads` x its capacity (`capacity_rps`).

The objective is a first token within TTFT_OBJECTIVE_MS of arrival. A request is good when its
stream starts within it and ends complete; goodput counts good requests and their tokens per second
of arrivals. Every gateway target prices requests in tokens (`cost: tokens`) and lets a request wait
for the engine at most MAX_WAIT_MS; HAProxy queues as long (`timeout queue`).

With `--deadline-ms`, each request carries that budget (`X-Request-Timeout-Ms`) and is good when
its stream ends complete within it; `auto` then takes its default objectives, as a user who
configures none would (issue 37: it has to find the engine's knee from what the clients ask).

Targets:
- auto: `max_concurrency: auto` (TTFT objective 1 s inside the engine, scraped every 250 ms, from
  4 to 256; with `--deadline-ms`, `max_concurrency: auto` and nothing else, every default);
- fixed-16, fixed-64, fixed-256: a hand-set max_concurrency (too low, the engine's own, too high);
- haproxy: maxconn 64 (the engine's max-num-seqs), a queue timeout of MAX_WAIT_MS.

Per target: goodput (requests and tokens), TTFT p50 and p99 of the answered, refusals and late
answers, the share of long (>= 250 output tokens) and short requests refused, and of the costliest
and cheapest quarters in tokens as the gateway prices them (0.5 x prompt + output), the engine's peak
sequences (running + waiting) and preemptions, and the gateway's final limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.tools.loadtest import client
from gateway.tools.loadtest.requests import Prepared
from gateway.tools.loadtest.workload import Arrival as KitArrival
from loadtests.bench import HAProxy
from loadtests.matrix import chosen_targets, result_table, results_path, run_matrix
from loadtests.openloop import percentile, run_fast
from tests.integration.servers import Gateway, Sim, gateway_config

MAX_NUM_SEQS = 64
ENGINE_ARGS = (
    "--engine", "continuous", "--max-num-seqs", str(MAX_NUM_SEQS), "--step-ms", "10",
    "--step-growth", "1", "--prefill-ms-per-1k", "10", "--kv-tokens", "80000",
)  # fmt: skip
OUTPUT_TOKENS = (10, 500)
"""Each request's output tokens, drawn uniformly (`--output-tokens`)."""


def capacity_rps(output_tokens: tuple[int, int]) -> float:
    """About what the engine serves: 64 x (1 / 20 ms steps) = 3,200 tokens/s over the mean output
    (255 tokens a request by default: 12.5/s), less a fifth for the prefills."""
    mean_output = sum(output_tokens) / 2
    return round(0.8 * MAX_NUM_SEQS / (0.020 * mean_output), 1)


TTFT_OBJECTIVE_MS = 2000
MAX_WAIT_MS = 1500
LONG_TOKENS = 250
TARGETS = ("auto", "fixed-16", "fixed-64", "fixed-256", "haproxy")


@dataclass(frozen=True, slots=True)
class Chat:
    at_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True)
class Result:
    chat: Chat
    status: int | None
    ttft_s: float | None = None
    complete: bool = False
    end_s: float | None = None
    """When the stream ended complete, from its scheduled send."""


def schedule(
    rate_rps: float, duration_s: float, seed: int, output_tokens: tuple[int, int] = OUTPUT_TOKENS
) -> list[Chat]:
    rng = random.Random(seed)
    chats, now = [], 0.0
    while (now := now + rng.expovariate(rate_rps)) < duration_s:
        chats.append(Chat(now, rng.randint(50, 2000), rng.randint(*output_tokens)))
    return chats


def token_cost(chat: Chat) -> float:
    """What the request costs as the gateway prices it (`token_pricing`'s defaults), exactly."""
    return 0.5 * chat.prompt_tokens + chat.output_tokens


def body_of(chat: Chat) -> bytes:
    # Four-letter words are one token each to the simulator's tokenizer.
    prompt = " ".join(["abcd"] * chat.prompt_tokens)
    request = {
        "model": "sim",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": chat.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    return json.dumps(request).encode()


async def send_all(url: str, chats: list[Chat], deadline_ms: float | None = None) -> list[Result]:
    """Every chat streamed at its time by the kit's client (gateway/tools/loadtest/client.py); a
    stream gives up after 60 s. The time to first token counts from the scheduled send."""
    headers = {"Content-Type": "application/json"}
    if deadline_ms is not None:
        headers["X-Request-Timeout-Ms"] = str(round(deadline_ms))
    path = "/v1/chat/completions"
    prepared = [Prepared(path, body_of(chat), headers, True, 59.0) for chat in chats]
    sends = [KitArrival(chat.at_s, index) for index, chat in enumerate(chats)]
    records, _ = await client.run(url, sends, prepared, timeout_factor=1.0)
    return [_result(chats[record.arrival.traffic], record) for record in records]


def _result(chat: Chat, record: client.RequestRecord) -> Result:
    answer = record.final
    result = Result(chat, answer.status, complete=record.served)
    if answer.first_token_s is not None:
        result.ttft_s = answer.first_token_s - chat.at_s
    if record.served:
        result.end_s = answer.ended_s - chat.at_s
    return result


def start_target(
    target: str,
    log_dir: Path,
    sim: Sim,
    python: str,
    defaults: bool = False,
    output_tokens: tuple[int, int] = OUTPUT_TOKENS,
) -> tuple[str, Any]:
    if target == "haproxy":
        proxy = HAProxy(log_dir, sim.url, slots=MAX_NUM_SEQS, queue_timeout_ms=MAX_WAIT_MS)
        return proxy.url, proxy
    classes = [{"name": "standard", "max_wait_ms": MAX_WAIT_MS}]
    config = gateway_config([(sim.url, 1)], priorities=classes, default_priority="standard")
    model = config["models"][0]
    # What a user would set: the mean output at the engine's full-load step (20 ms a token).
    # (A new user, `defaults`, leaves it unset.)
    expected_service_ms = round(20 * sum(output_tokens) / 2, -2)
    model.update({"cost": "tokens", "expected_service_ms": expected_service_ms})
    if defaults:
        del model["expected_service_ms"]
    backend = model["backends"][0]
    backend.update({"kind": "vllm", "metrics_url": sim.metrics_url})
    if target == "auto" and defaults:
        backend["max_concurrency"] = "auto"  # and nothing else, as a new user writes it
    elif target == "auto":
        backend.update({"max_concurrency": "auto", "min_concurrency": 4, "max_concurrency_cap": 256})
        backend["ttft_objective_ms"] = 1000
        config["signals"] = {"scrape_interval_ms": 250}
    else:
        backend["max_concurrency"] = int(target.removeprefix("fixed-"))
    config["health"] = {"interval_ms": 1000}
    gateway = Gateway(log_dir, config, python=python)
    gateway.wait_ready()
    return gateway.url, gateway


def run_one(
    target: str,
    load: float,
    duration_s: float,
    seed: int,
    log_dir: Path,
    python: str,
    deadline_ms: float | None = None,
    output_tokens: tuple[int, int] = OUTPUT_TOKENS,
) -> dict[str, Any]:
    sim = Sim(log_dir, extra_args=ENGINE_ARGS)
    server: Any = None
    try:
        url, server = start_target(
            target, log_dir, sim, python, defaults=deadline_ms is not None, output_tokens=output_tokens
        )
        chats = schedule(load * capacity_rps(output_tokens), duration_s, seed, output_tokens)
        peak = {"sequences": 0}

        async def watched() -> list[Result]:
            async def watch() -> None:
                while True:
                    engine = (await asyncio.to_thread(sim.stats))["continuous"]
                    peak["sequences"] = max(peak["sequences"], engine["running"] + engine["waiting"])
                    await asyncio.sleep(0.5)

            watcher = asyncio.ensure_future(watch())
            try:
                return await send_all(url, chats, deadline_ms)
            finally:
                watcher.cancel()

        results = run_fast(watched())
        engine = sim.stats()["continuous"]
        limit = None
        if isinstance(server, Gateway):
            limit = server.metric("gateway_backend_slots", model="sim", backend=sim.url)
    finally:
        if server is not None:
            server.stop()
        sim.stop()
    return summary(
        target, load, duration_s, results, peak["sequences"], engine["preemptions"], limit, deadline_ms
    )


def summary(
    target: str,
    load: float,
    duration_s: float,
    results: list[Result],
    peak_sequences: int,
    preemptions: int,
    limit: float | None,
    deadline_ms: float | None = None,
) -> dict[str, Any]:
    objective_s = TTFT_OBJECTIVE_MS / 1000
    if deadline_ms is None:
        good = [r for r in results if r.complete and r.ttft_s is not None and r.ttft_s <= objective_s]
    else:
        good = [r for r in results if r.end_s is not None and r.end_s <= deadline_ms / 1000]
    answered = [r.ttft_s * 1000 for r in results if r.ttft_s is not None]
    refused = [r for r in results if r.status is not None and r.status != 200]
    long = [r for r in results if r.chat.output_tokens >= LONG_TOKENS]
    short = [r for r in results if r.chat.output_tokens < LONG_TOKENS]
    by_cost = sorted(results, key=lambda r: token_cost(r.chat))
    quarter = len(by_cost) // 4

    def refused_share(group: list[Result]) -> float:
        return round(sum(r in refused for r in group) / max(1, len(group)), 3)

    return {
        "target": target,
        "load": load,
        "offered_rps": round(len(results) / duration_s, 1),
        "good_rps": round(len(good) / duration_s, 2),
        "good_of_offered": round(len(good) / max(1, len(results)), 3),
        "good_tokens_per_s": round(sum(r.chat.output_tokens for r in good) / duration_s),
        "ttft_p50_ms": _rounded(percentile(answered, 0.5)),
        "ttft_p99_ms": _rounded(percentile(answered, 0.99)),
        "refused": len(refused),
        "late": sum(r.ttft_s is not None and r.ttft_s > objective_s for r in results),
        "failed": sum(r.status is None or (r.status == 200 and not r.complete) for r in results),
        "refused_long": refused_share(long),
        "refused_short": refused_share(short),
        "refused_costliest_q": refused_share(by_cost[len(by_cost) - quarter :]),
        "refused_cheapest_q": refused_share(by_cost[:quarter]),
        "peak_sequences": peak_sequences,
        "preemptions": preemptions,
        "final_limit": limit,
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value)


COLUMNS = (
    "target", "load", "offered_rps", "good_rps", "good_of_offered", "good_tokens_per_s", "ttft_p50_ms",
    "ttft_p99_ms", "refused", "late", "failed", "refused_long", "refused_short", "refused_costliest_q",
    "refused_cheapest_q", "peak_sequences",
    "preemptions", "final_limit",
)  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    return result_table(results, COLUMNS, lambda r, c: r[c])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help=", ".join(TARGETS))
    parser.add_argument("--loads", default="1,2", help="x the engine's capacity, comma-separated")
    parser.add_argument(
        "--output-tokens", default="10-500", help="each request's output tokens, drawn from LOW-HIGH"
    )
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="10 s per run: a smoke run")
    parser.add_argument(
        "--deadline-ms", type=float, help="clients' budget; good = complete within it, auto on its defaults"
    )
    parser.add_argument(
        "--gateway-python", default=sys.executable, help="the interpreter that runs the gateway"
    )
    args = parser.parse_args()
    fixed = tuple(t for t in args.targets.split(",") if t.removeprefix("fixed-").isdigit())  # any fixed-N
    targets = chosen_targets(parser, args.targets, (*TARGETS, *fixed))
    duration_s = 10.0 if args.quick else args.duration
    low, high = (int(x) for x in args.output_tokens.split("-"))
    output_tokens = (low, high)
    log_dir = Path(tempfile.mkdtemp(prefix="continuous-"))
    out = results_path("continuous")
    report: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores",
        "seed": args.seed,
        "duration_s": duration_s,
        "capacity_rps": capacity_rps(output_tokens),
        "output_tokens": output_tokens,
        "ttft_objective_ms": TTFT_OBJECTIVE_MS,
        "deadline_ms": args.deadline_ms,
        "results": [],
    }

    def one(target: str, load: float) -> dict[str, Any]:
        return run_one(
            target, load, duration_s, args.seed, log_dir, args.gateway_python, args.deadline_ms, output_tokens
        )

    run_matrix(report, out, [float(x) for x in args.loads.split(",")], targets, one, table)
    print(f"saved {out} (server logs in {log_dir})")


if __name__ == "__main__":
    main()
