"""`inference-gateway loadtest` as a user runs it: a real process against a real gateway in front of the
simulator, its report read back, its HTML rendered in a real headless browser (Debian's chromium)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from llmd_benchmark_report import import_benchmark_report

from tests.integration.servers import gateway_config
from tests.redis_server import free_port

IN_CI = bool(os.environ.get("CI"))
CHROMIUM = shutil.which("chromium")
LOCUSTFILE = Path(__file__).parents[2] / "loadtests" / "locustfile.py"


def loadtest(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "loadtest", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def read_report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_clients_following_retry_after_at_1_5x_are_reported_served_in_the_end_and_on_first_retry(
    start_sim, start_gateway, tmp_path
):
    sim = start_sim(slots=8, base_ms=40)
    gateway = start_gateway(gateway_config([(sim.url, 8)]))
    out = tmp_path / "run"
    ran = loadtest(
        "--target", gateway.url, "--model", "sim", "--rate", "300", "--duration", "4",
        "--retry-after", "3", "--out", str(out),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    document = read_report(out)
    (run,) = document["runs"]
    overall = run["overall"]
    assert 1000 <= overall["sent"] <= 1400  # 300/s for 4 s, Poisson
    refused_first = sum(overall["first_attempt_refused_by_reason"].values())
    assert refused_first > 0.1, overall  # 1.5x the pool's 200/s: a third is refused at first
    assert overall["retried"] > 0 and overall["first_retry_admitted"] > 0.5, overall
    assert overall["served_eventually"] > 1 - refused_first + 0.05, overall  # the retries were served
    assert overall["attempts_per_served"] > 1
    assert overall["refusal_ms"]["p50"] < 50  # refused at once
    assert overall["queue_ms"]["p99"] is not None and overall["upstream_ms"]["p50"] >= 40
    assert run["jain_index"] == 1.0
    queued = [s["values"].get("gateway_queue_depth{priority=low}") for s in run["scrapes"] if s["ok"]]
    assert queued and max(queued) > 0, run["scrapes"]
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == overall["sent"]
    assert json.loads(lines[0])["attempts"][0]["status"] in (200, 429)
    (exported,) = out.glob("benchmark_report_v0.2,_*.yaml")
    assert (
        import_benchmark_report(str(exported)).results.request_performance.aggregate.requests.total
        == (overall["sent"])
    )
    assert "served in the end" in ran.stdout and "report.html" in ran.stdout
    render_in_a_browser(out / "report.html")


def render_in_a_browser(page: Path) -> None:
    if CHROMIUM is None:
        reason = "needs Debian's chromium (apt-get install chromium; .ci/run installs it)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    shown = subprocess.run(
        [
            CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    dom = shown.stdout
    assert "<h1>Load test of sim" in dom, shown.stderr[-2000:]
    assert dom.count("<svg") >= 3 and "<polyline" in dom  # outcomes, advice, queued
    assert "Retry-After advised and actual" in dom
    assert "Uncaught" not in shown.stderr


def test_streams_report_time_to_first_token_and_inter_token_latency(start_sim, start_gateway, tmp_path):
    sim = start_sim(slots=4, base_ms=5, token_ms=20)
    gateway = start_gateway(gateway_config([(sim.url, 4)]))
    out = tmp_path / "stream"
    ran = loadtest(
        "--target", gateway.url, "--model", "sim", "--kind", "chat", "--stream", "--size", "6",
        "--rate", "20", "--duration", "2", "--deadline-ms", "2000", "--out", str(out),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    overall = read_report(out)["runs"][0]["overall"]
    assert overall["served"] == overall["sent"] > 20
    assert 5 <= overall["ttft_ms"]["p50"] < 200, overall
    assert 15 <= overall["itl_ms"]["p50"] <= 40, overall  # 20 ms a token
    assert overall["latency_ms"]["p50"] >= 6 * 20 - 20


def test_a_scenario_mixes_classes_and_tenants_and_reports_each(start_sim, start_gateway, tmp_path):
    sim = start_sim(slots=8, base_ms=40)
    config = gateway_config([(sim.url, 8)], tenants=[{"name": "acme"}, {"name": "beta"}])
    gateway = start_gateway(config)
    scenario = tmp_path / "mix.yaml"
    scenario.write_text(
        yaml.safe_dump(
            {
                "traffic": [
                    {"name": "urgent", "priority": "high", "tenant": "acme", "share": 1, "deadline_ms": 250},
                    {"name": "bulk-a", "priority": "low", "tenant": "acme", "share": 2},
                    {"name": "bulk-b", "priority": "low", "tenant": "beta", "share": 2},
                ]
            }
        )
    )
    out = tmp_path / "mix"
    ran = loadtest(
        "--target", gateway.url, "--model", "sim", "--scenario", str(scenario), "--rate", "300",
        "--duration", "3", "--out", str(out),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    run = read_report(out)["runs"][0]
    assert set(run["by_class"]) == {"high", "low"} and set(run["by_tenant"]) == {"acme", "beta"}
    assert set(run["by_traffic"]) == {"urgent", "bulk-a", "bulk-b"}
    high, low = run["by_class"]["high"], run["by_class"]["low"]
    assert high["goodput_share"] > low["goodput_share"], (high, low)  # urgent work first
    assert run["jain_index"] is not None and 0 < run["jain_index"] <= 1


def test_bad_arguments_and_an_absent_target_are_told_plainly(tmp_path):
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("traffic:\n  - colour: red\n")
    ran = loadtest(
        "--target", "http://127.0.0.1:1", "--model", "m", "--scenario", str(scenario), "--rate", "1"
    )
    assert ran.returncode == 2 and "colour" in ran.stderr
    ran = loadtest("--target", "http://127.0.0.1:1", "--model", "m")
    assert ran.returncode == 2 and "--rate" in ran.stderr
    out = tmp_path / "absent"
    ran = loadtest(
        "--target", f"http://127.0.0.1:{free_port()}", "--model", "m", "--rate", "20", "--duration", "0.5",
        "--out", str(out),
    )  # fmt: skip
    assert ran.returncode == 1 and "no answer" in ran.stderr
    overall = read_report(out)["runs"][0]["overall"]
    assert overall["answered"] == 0 and overall["refused_by_reason"], overall


@pytest.mark.slow
def test_the_locustfiles_users_follow_the_advice_and_its_summary_says_how_it_held(
    start_sim, start_gateway, tmp_path
):
    sim = start_sim(slots=2, base_ms=40)
    gateway = start_gateway(gateway_config([(sim.url, 2)]))
    ran = subprocess.run(
        [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
            "--host", gateway.url, "--headless", "-u", "40", "-r", "40", "-t", "4s", "--only-summary",
        ],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    output = ran.stdout + ran.stderr
    summary = re.search(r"retries: (\d+) over ([\d.]+) s, refused again (\d+)%", output)
    assert summary is not None, output[-3000:]
    assert int(summary[1]) > 0 and 3.5 <= float(summary[2]) < 30
    thirds = re.findall(r"^\s+([\d.]+)-\s*([\d.]+) s: ", output, re.MULTILINE)
    assert len(thirds) == 3 and float(thirds[-1][1]) == float(summary[2]), output[-3000:]


@pytest.mark.slow
def test_a_recommendation_from_a_sweep_holds_when_the_run_is_repeated_with_it(launcher, tmp_path):
    """Sweep one backend of 8 slots x 40 ms (200 requests/s: the sweep's knee is within 20% of it),
    ask for 300 requests/s, run the recommended pool at 300 requests/s, and find what was predicted."""
    sim = launcher.sim(slots=8, base_ms=40)
    gateway = launcher.gateway(gateway_config([(sim.url, 8)]))
    advised = tmp_path / "advised"
    ran = loadtest(
        "--target", gateway.url, "--model", "sim", "--priority", "low", "--sweep", "--rate", "80",
        "--duration", "3", "--recommend", "--target-rate", "300", "--out", str(advised), timeout_s=240,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    swept = read_report(advised)
    offered = [run["rate_rps"] for run in swept["runs"]]
    assert offered[-1] > 250, offered  # it went past saturation, and stopped there
    assert len(offered) < 12, offered
    assert 160 <= swept["sweep"]["max_sustainable_rps"] <= 240, swept["sweep"]
    assert len(list(advised.glob("benchmark_report_v0.2,_*_stage_*.yaml"))) == len(offered)
    recommended = json.loads((advised / "recommendation.json").read_text())
    assert recommended["measured"]["slots_per_backend"] == 8 and recommended["measured"]["backends"] == 1
    low = recommended["classes"]["low"]
    assert 900 <= low["max_wait_ms"] < 1000 and recommended["replicas"] in (2, 3), recommended
    assert f"max_wait_ms: {low['max_wait_ms']}" in ran.stdout

    sims = [launcher.sim(slots=8, base_ms=40) for _ in range(recommended["replicas"])]
    config = gateway_config([(s.url, 8) for s in sims])
    config["priorities"][1]["max_wait_ms"] = low["max_wait_ms"]
    repeated = launcher.gateway(config)
    checked = tmp_path / "checked"
    ran = loadtest(
        "--target", repeated.url, "--model", "sim", "--priority", "low", "--rate", "300", "--duration", "4",
        "--compare", str(advised / "recommendation.json"), "--out", str(checked),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    compared = read_report(checked)["compared"]["classes"]["low"]
    assert compared["measured_within_deadline"] >= compared["predicted_within_deadline"] - 0.02, compared
    assert "Predicted and measured" in (checked / "report.html").read_text()


def test_a_recommendation_without_the_pools_slots_says_what_to_give_and_the_run_is_still_reported(
    start_sim, start_gateway, tmp_path
):
    sim = start_sim(slots=4, base_ms=10)
    gateway = start_gateway(gateway_config([(sim.url, 4)]))
    out = tmp_path / "unfounded"
    ran = loadtest(
        "--target", gateway.url, "--model", "sim", "--rate", "40", "--duration", "1.5", "--recommend",
        "--gateway-metrics", "none", "--out", str(out),
    )  # fmt: skip
    assert ran.returncode == 2 and "--gateway-metrics" in ran.stderr and "--slots-per-backend" in ran.stderr
    assert read_report(out)["runs"][0]["overall"]["served"] > 20
    assert (out / "report.html").is_file() and not (out / "recommendation.json").exists()


def test_grpc_clients_following_the_pushback_at_1_5x_are_reported_as_http_ones(
    start_sim, start_gateway, tmp_path
):
    sim = start_sim(slots=8, base_ms=40)
    gateway = start_gateway(gateway_config([(sim.url, 8)], grpc_listen={"host": "127.0.0.1", "port": 0}))
    out = tmp_path / "grpc"
    ran = loadtest(
        "--target", f"grpc://{gateway.grpc_target}", "--model", "sim", "--kind", "grpc", "--rate", "300",
        "--duration", "3", "--retry-after", "3", "--gateway-metrics", gateway.url + "/metrics",
        "--out", str(out),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    run = read_report(out)["runs"][0]
    overall = run["overall"]
    refused_first = overall["first_attempt_refused_by_reason"]
    shedding = {"deadline_unmeetable", "queue_full", "deadline_expired_in_queue"}
    shed = sum(share for reason, share in refused_first.items() if reason in shedding)
    # Load shedding, by its reasons from the gateway's ErrorInfo; the rest (a budget run out
    # upstream, 504 upstream_timeout, happens under overload over HTTP too) stays rare.
    assert shed > 0.1 and sum(refused_first.values()) - shed < 0.02, refused_first
    assert overall["first_retry_admitted"] > 0.5 and overall["served_eventually"] > 0.95, overall
    assert overall["queue_ms"]["p99"] is not None and overall["upstream_ms"]["p50"] >= 40  # server-timing
    assert any(
        s["ok"] and s["values"].get("gateway_queue_depth{priority=low}", 0) > 0 for s in run["scrapes"]
    )
    assert gateway.metric("gateway_retries_total", model="sim", priority="low") >= overall["retried"] > 0
