"""`inference-gateway loadtest`: open-loop load against a gateway (or any KServe v2 or OpenAI endpoint),
at a fixed rate or swept past saturation, with clients that follow Retry-After where asked; it writes
report.json, report.html, requests.jsonl and llm-d Benchmark Reports into --out."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gateway.programs.arguments import count, number
from gateway.tools.loadtest import llmd, recommend, report, summary
from gateway.tools.loadtest.requests import prepare
from gateway.tools.loadtest.workload import (
    KINDS,
    Scenario,
    ScenarioError,
    arrivals,
    load_scenario,
    one_traffic,
    read_body,
    total_rate,
)

if TYPE_CHECKING:  # imported by a run (_run_step): aiohttp is 0.2 s of every CLI start, `serve` included
    from gateway.tools.loadtest import client

PAST_SATURATION = 0.8
"""A sweep stops after two steps in a row serve less than this share within deadline."""


def register(commands: Any) -> None:
    """Add `loadtest` to the CLI's subcommands."""
    load = commands.add_parser(
        "loadtest", help="open-loop load at a rate or a sweep, with a report", description=__doc__
    )
    load.add_argument(
        "--target", required=True, help="base URL, e.g. http://127.0.0.1:8080 (--kind grpc: grpc://HOST:PORT)"
    )
    load.add_argument("--model", required=True, help="the model to ask (path for KServe, body for OpenAI)")
    what = load.add_argument_group("what one request is (or --scenario)")
    what.add_argument("--kind", choices=KINDS, default="infer")
    what.add_argument("--stream", action="store_true", help="chat and completion: stream the answer (SSE)")
    what.add_argument("--priority", help="X-Priority to send")
    what.add_argument("--tenant", help="X-Tenant to send")
    what.add_argument("--api-key", help="sent as Authorization: Bearer")
    what.add_argument(
        "--deadline-ms", type=number(1.0), default=1000.0, help="X-Request-Timeout-Ms, and goodput's"
    )
    what.add_argument(
        "--size", type=count(1, 10**7), help="infer: FP32 elements; chat, completion: max_tokens"
    )
    what.add_argument("--body", type=Path, help="a JSON file: the request body as it is")
    what.add_argument("--scenario", type=Path, help="a YAML mix of traffic (class x tenant x kind x size)")
    how = load.add_argument_group("how much")
    how.add_argument(
        "--rate", type=number(0.0, strict=True), help="requests per second (a sweep's first step)"
    )
    how.add_argument(
        "--duration", type=number(0.0, strict=True), default=30.0, help="seconds (per sweep step)"
    )
    how.add_argument("--sweep", action="store_true", help="step the rate up until past saturation")
    how.add_argument("--rates", help="a sweep's rates, comma-separated, instead of stepping")
    how.add_argument(
        "--sweep-factor", type=number(1.0, strict=True), default=1.5, help="each step's rate x this"
    )
    how.add_argument("--sweep-steps", type=count(1, 100), default=12, help="at most this many steps")
    how.add_argument("--burstiness", type=number(0.05), help="gaps' coefficient of variation (1: Poisson)")
    how.add_argument("--seed", type=int, default=1)
    how.add_argument(
        "--retry-after", type=count(0, 100), default=0, metavar="N", help="follow Retry-After up to N times"
    )
    how.add_argument(
        "--timeout-factor", type=number(1.0), default=3.0, help="an attempt gives up at this x deadline"
    )
    advice = load.add_argument_group("config for a target SLO (recommend.py)")
    advice.add_argument("--recommend", action="store_true", help="from this run, values for --target-rate")
    advice.add_argument("--target-rate", type=number(0.0, strict=True), help="requests/s to plan for")
    advice.add_argument(
        "--slo-share", type=number(0.0, 1.0, strict=True), default=0.99, help="share in deadline"
    )
    advice.add_argument(
        "--ceiling", type=number(0.0, 1.0, strict=True), default=0.8, help="utilization ceiling"
    )
    advice.add_argument(
        "--slots-per-backend", type=count(1, 10**6), help="where the gateway's /metrics is not read"
    )
    advice.add_argument("--compare", type=Path, help="a recommendation.json: its prediction beside this run")
    out = load.add_argument_group("what is read and written")
    out.add_argument("--out", type=Path, help="directory for the report (default: loadtest-<time>)")
    out.add_argument("--gateway-metrics", help="the gateway's /metrics URL (default: TARGET/metrics; 'none')")
    out.add_argument("--engine-metrics", help="an engine's /metrics URL to scrape during the run")
    out.add_argument("--no-llmd", action="store_true", help="do not write llm-d Benchmark Reports")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal")
    load.set_defaults(command=main)


def main(args: argparse.Namespace) -> int:
    try:
        scenario = _scenario(args)
        for traffic in scenario.traffic:
            prepare(traffic, args.model)  # a body the transport cannot send is told before any load
        rates = _fixed_rates(args)
        predicted = _read_json(args.compare) if args.compare is not None else None
    except ScenarioError as error:
        print(f"loadtest: {error}", file=sys.stderr)
        return 2
    out: Path = args.out or Path(f"loadtest-{datetime.now(UTC):%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "version": 1,
        "target": args.target,
        "model": args.model,
        "started_at": llmd.now_iso(),
        "command": _command_line(sys.argv),
        "retry_after": args.retry_after,
        "scenario": [asdict(t) | {"api_key": None} for t in scenario.traffic],
        "runs": [],
    }
    records_out = (out / "requests.jsonl").open("w")
    every_record: list[client.RequestRecord] = []
    try:
        for step, rate in enumerate(_rates(args, rates)):
            run, records = _run_step(args, scenario, rate, step)
            document["runs"].append(run)
            every_record += records
            _write_records(records_out, step, records)
            _print_step(run)
            if rates is None and args.sweep and _past_saturation(document["runs"]):
                break
    finally:
        records_out.close()
    if len(document["runs"]) > 1:
        document["sweep"] = summary.knee(document["runs"])
        print(f"sweep: {json.dumps(document['sweep'])}")
    if predicted is not None:
        document["compared"] = recommend.compare(predicted, document["runs"][-1])
        print(f"predicted and measured: {json.dumps(document['compared']['classes'])}")
    unfounded = None
    if args.recommend:
        try:
            document["recommendation"] = _recommend(args, scenario, document, every_record)
        except recommend.RecommendError as error:
            unfounded = error  # the runs are reported all the same
        else:
            (out / "recommendation.json").write_text(json.dumps(document["recommendation"], indent=1))
            print(recommend.config_snippet(document["recommendation"], args.model))
    (out / "report.json").write_text(json.dumps(document, indent=1))
    (out / "report.html").write_text(report.render(document))
    if not args.no_llmd:
        llmd.write_reports(document, out)
    print(f"report: {out / 'report.html'}")
    if not any(run["overall"]["answered"] for run in document["runs"]):
        print(f"loadtest: no answer from {args.target}", file=sys.stderr)
        return 1
    if unfounded is not None:
        print(f"loadtest: --recommend {unfounded}", file=sys.stderr)
        return 2
    return 0


def _command_line(argv: Sequence[str]) -> list[str]:
    """The command as run, for the report: an API key in it is never written down."""
    shown = ["inference-gateway", "loadtest", *argv[2:]] if argv[1:2] == ["loadtest"] else list(argv)
    for index, word in enumerate(shown):
        if word.startswith("--api-key="):
            shown[index] = "--api-key=<key>"
        elif word == "--api-key" and index + 1 < len(shown):
            shown[index + 1] = "<key>"
    return shown


def _recommend(
    args: argparse.Namespace,
    scenario: Scenario,
    document: dict[str, Any],
    records: list[client.RequestRecord],
) -> dict[str, Any]:
    runs = document["runs"]
    scrapes = [scrape for run in runs for scrape in run["scrapes"]]
    pool = recommend.measured_pool(records, scrapes, args.slots_per_backend)
    target = args.target_rate if args.target_rate is not None else runs[-1]["rate_rps"]
    first_rate = args.rate if args.rate is not None else 10.0
    return recommend.recommend(pool, scenario, first_rate, target, args.slo_share, args.ceiling)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ScenarioError(f"{path}: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("classes"), dict):
        raise ScenarioError(f"{path}: not a recommendation.json")
    return document


def _scenario(args: argparse.Namespace) -> Scenario:
    if args.scenario is not None:
        scenario = load_scenario(args.scenario)
    else:
        body = read_body(args.body) if args.body is not None else None
        scenario = one_traffic(
            name="load",
            kind=args.kind,
            stream=args.stream or None,
            priority=args.priority,
            tenant=args.tenant,
            api_key=args.api_key,
            deadline_ms=args.deadline_ms,
            size=args.size,
            body=body,
        )
    if args.burstiness is not None:
        scenario = Scenario(scenario.traffic, args.burstiness)
    if args.rate is None and not args.sweep and any(t.rate is None for t in scenario.traffic):
        raise ScenarioError("--rate is needed where the traffic has shares, not rates of its own")
    return scenario


def _fixed_rates(args: argparse.Namespace) -> list[float] | None:
    if args.rates is None:
        return None
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        raise ScenarioError(f"--rates: not numbers: {args.rates}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ScenarioError("--rates: positive numbers, comma-separated")
    return rates


def _rates(args: argparse.Namespace, rates: list[float] | None) -> Sequence[float]:
    if rates is not None:
        return rates
    first = args.rate if args.rate is not None else 10.0
    if not args.sweep:
        return [first]
    return [first * args.sweep_factor**step for step in range(args.sweep_steps)]


def _past_saturation(runs: Sequence[dict[str, Any]]) -> bool:
    shares = [run["overall"]["goodput_share"] or 0.0 for run in runs[-2:]]
    return len(shares) == 2 and all(share < PAST_SATURATION for share in shares)


def _run_step(
    args: argparse.Namespace, scenario: Scenario, rate: float, step: int
) -> tuple[dict[str, Any], list[client.RequestRecord]]:
    from gateway.tools.loadtest import client

    schedule = arrivals(scenario, rate, args.duration, seed=args.seed + step)
    prepared = [prepare(traffic, args.model) for traffic in scenario.traffic]
    metrics = {}
    if args.gateway_metrics is not None and args.gateway_metrics != "none":
        metrics["gateway"] = args.gateway_metrics
    elif args.gateway_metrics is None and args.target.startswith(("http://", "https://")):
        metrics["gateway"] = args.target.rstrip("/") + "/metrics"
    if args.engine_metrics:
        metrics["engine"] = args.engine_metrics
    offered = total_rate(scenario, rate)
    bar = None if args.no_progress or not sys.stderr.isatty() else _ProgressBar(offered, args.duration)
    started_at = llmd.now_iso()
    began = time.monotonic()
    records, scrapes = client.run_fast(
        client.run(
            args.target.rstrip("/"),
            schedule,
            prepared,
            retrying=client.Retrying(args.retry_after),
            timeout_factor=args.timeout_factor,
            progress=bar.show if bar else None,
            metrics=metrics,
        )
    )
    if bar:
        bar.close()
    run = summary.summarize(records, scenario, offered, args.duration, scrapes)
    return run | {"started_at": started_at, "wall_s": round(time.monotonic() - began, 3)}, records


def _write_records(out: TextIO, step: int, records: Sequence[client.RequestRecord]) -> None:
    for record in records:
        line = {
            "step": step,
            "at_s": round(record.arrival.at_s, 6),
            "traffic": record.arrival.traffic,
            "attempts": [asdict(attempt) for attempt in record.attempts],
        }
        out.write(json.dumps(line) + "\n")


def _print_step(run: dict[str, Any]) -> None:
    overall = run["overall"]
    print(
        f"{run['rate_rps']:g} rps offered: goodput {overall['goodput_rps']:g}/s "
        f"({100 * (overall['goodput_share'] or 0):.1f}% within deadline), "
        f"served in the end {100 * (overall['served_eventually'] or 0):.1f}%, "
        f"p99 {overall['latency_ms']['p99']} ms"
    )


class _ProgressBar:
    """One line on stderr, redrawn in place: how far the schedule is, and what was answered."""

    def __init__(self, rate: float, duration_s: float) -> None:
        self.rate, self.duration_s = rate, duration_s

    def show(self, state: client.Progress, t_s: float) -> None:
        done = min(1.0, t_s / self.duration_s)
        bar = "#" * round(24 * done) + "-" * (24 - round(24 * done))
        sys.stderr.write(
            f"\r{self.rate:g} rps [{bar}] {min(t_s, self.duration_s):5.1f}/{self.duration_s:g} s "
            f"sent {state.sent} answered {state.done} served {state.served}  "
        )
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
