"""`inference-gateway plan`: the table, the three answers, JSON, traces and refusals of bad input."""

import json
import math
import subprocess
import sys

import pytest

from gateway.programs.cli import main
from policies.capacity import Targets, mgc, replicas_for

SEED = ["--arrival-rate", "3.8", "--service-rate", "4", "--time-unit", "h"]


def plan(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def plan_json(capsys, *argv: str) -> dict:
    return json.loads(plan(capsys, *argv, "--json"))


def refusal(capsys, *argv: str) -> str:
    """Run a plan that must be refused: exit status 2 and the message on stderr."""
    try:
        status = main(["plan", *argv])
    except SystemExit as exit_:  # argparse refuses malformed arguments itself
        status = exit_.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_table_lists_replicas_with_utilization_p_wait_mean_and_p95_wait(capsys):
    out = plan(capsys, *SEED, "--cv", "0.4", "--target-wait", "0.5")
    assert "replicas  slots  utilization  P(wait)  mean wait (h)  p95 wait (h)" in out
    # One replica is the seed's M/G/1 (variance 0.01 h^2 is cv 0.4): Pollaczek-Khinchine's 2.755 h.
    one = next(line for line in out.splitlines() if line.split()[:2] == ["1", "1"])
    assert one.split()[2:5] == ["95.0%", "95.0%", "2.755"]


def test_table_marks_the_recommended_row_and_says_why(capsys):
    out = plan(capsys, *SEED, "--target-wait", "0.5")
    marked = [line for line in out.splitlines() if line.endswith("<- recommended")]
    assert len(marked) == 1 and marked[0].startswith(">") and marked[0].split()[1] == "2"
    assert "(a) Replicas for mean wait <= 0.5 h and utilization <= 80.0%: 2 (2 slots)" in out
    assert "1 replica would be 95.0% busy, over the ceiling." in " ".join(out.split())


def test_the_legend_names_the_model_formula_and_units(capsys):
    out = plan(capsys, *SEED, "--cv", "0.4", "--target-wait", "0.5")
    assert "M/G/c (Allen-Cunneen approximation over Erlang C)" in out
    assert "Erlang C / (servers x service rate - arrival rate) x (1 + cv^2)/2 = 0.58" in out
    assert "P(wait > t) = P(wait) x" in out and "in h" in out
    assert "M/M/c (Erlang C)" in plan(capsys, *SEED)


def test_recommendation_is_the_capacity_policys(capsys):
    data = plan_json(capsys, "--arrival-rate", "190", "--service-time", "0.04", "--cv", "1.5")
    expected = replicas_for(190, 25, Targets(), service_cv=1.5)
    assert data["recommendation"]["replicas"] == expected.replicas
    assert data["recommendation"]["bound_by"] == expected.bound_by
    assert data["recommendation"]["mean_wait"] == pytest.approx(expected.estimate.mean_wait)


def test_json_has_inputs_recommendation_table_and_the_three_answers(capsys):
    data = plan_json(capsys, *SEED, "--target-wait", "0.5", "--slots-per-replica", "2")
    assert set(data) == {"model", "units", "inputs", "recommendation", "table", "growth", "burst"}
    assert data["units"] == {"time": "h", "rate": "per h"}
    row_keys = {"replicas", "slots", "utilization", "p_wait", "mean_wait", "percentile_wait"}
    assert all(set(row) == row_keys | {"recommended"} for row in data["table"])
    assert [row["replicas"] for row in data["table"] if row["recommended"]] == [
        data["recommendation"]["replicas"]
    ]
    assert set(data["growth"]) == {"factor", "before", "after"}
    assert {"interpretation", "extra_arrival_rate", "during", "replicas_needed"} <= set(data["burst"])


def test_json_writes_an_unbounded_wait_as_null(capsys):
    data = plan_json(capsys, *SEED, "--replicas", "1", "--burst-replicas", "1")
    assert data["burst"]["during"]["utilization"] == pytest.approx((3.8 + 4) / 4)
    assert data["burst"]["during"]["mean_wait"] is None
    assert data["burst"]["during"]["percentile_wait"] is None


def test_json_stays_valid_when_the_load_overflows(capsys):
    data = plan_json(capsys, "--arrival-rate", "1e300", "--service-rate", "1e-300")
    assert data["recommendation"]["met"] is False
    assert data["recommendation"]["utilization"] is None
    assert all(row["utilization"] is None for row in data["table"])


def test_growth_answer_multiplies_the_current_replicas_and_rounds_up(capsys):
    data = plan_json(capsys, "--arrival-rate", "7", "--service-time", "1", "--replicas", "9")
    assert data["growth"]["before"]["replicas"] == 9
    assert data["growth"]["after"]["replicas"] == 14  # 13.5 rounded up
    assert data["growth"]["after"]["mean_wait"] == pytest.approx(mgc(7, 1, 14, 1.0).mean_wait)


def test_burst_adds_fifty_replicas_worth_of_arrivals_and_sizes_the_pool_for_it(capsys):
    data = plan_json(capsys, "--arrival-rate", "100", "--service-time", "0.5", "--slots-per-replica", "4")
    burst = data["burst"]
    assert burst["extra_arrival_rate"] == pytest.approx(50 * 4 * 2)  # 50 replicas x 4 slots x 2/s
    during, base = burst["during"], data["recommendation"]["replicas"]
    assert during["replicas"] == base and during["mean_wait"] is None
    assert burst["backlog_growth_rate"] == pytest.approx(100 + 400 - base * 4 * 2)
    assert burst["replicas_needed"] == replicas_for(500, 2, Targets(), servers_per_replica=4).replicas
    assert burst["with_added_replicas"]["replicas"] == base + 50


def test_trace_gives_arrival_rate_service_time_and_cv(capsys, tmp_path):
    trace = tmp_path / "trace.csv"
    # 9 arrivals 0.5 s apart, out of order, with a column the planner ignores.
    rows = [(4 - i * 0.5, 0.1 if i % 2 else 0.3) for i in range(9)]
    trace.write_text(
        "# exported from the access log\narrival_s,service_s,model\n"
        + "".join(f"{t},{s},sim\n" for t, s in rows)
    )
    data = plan_json(capsys, "--trace", str(trace))
    inputs = data["inputs"]
    services = [s for _, s in rows]
    mean = sum(services) / 9
    sample_sd = math.sqrt(sum((s - mean) ** 2 for s in services) / 8)
    assert inputs["arrival_rate"] == pytest.approx(2.0)
    assert inputs["service_time"] == pytest.approx(mean)
    assert inputs["service_cv"] == pytest.approx(sample_sd / mean)
    assert inputs["trace"]["requests"] == 9 and inputs["trace"]["arrival_cv"] == pytest.approx(0.0, abs=1e-9)


def test_trace_times_are_seconds_whatever_the_time_unit(capsys, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,service_s\n0,0.02\n0.1,0.02\n0.2,0.02\n")
    inputs = plan_json(capsys, "--trace", str(trace), "--time-unit", "ms")["inputs"]
    assert inputs["arrival_rate"] == pytest.approx(0.01)  # 10/s is 0.01/ms
    assert inputs["service_time"] == pytest.approx(20.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "give --arrival-rate"),
        (("--arrival-rate", "3"), "give --service-time or --service-rate"),
        (
            ("--arrival-rate", "-1", "--service-time", "1"),
            "argument --arrival-rate: must be a finite number >= 0",
        ),
        (
            ("--arrival-rate", "1", "--service-time", "0"),
            "argument --service-time: must be a finite number > 0",
        ),
        (("--arrival-rate", "1", "--service-time", "x"), "argument --service-time: not a number: 'x'"),
        (
            ("--arrival-rate", "1", "--service-time", "1", "--ceiling", "1.2"),
            "--ceiling: must be a finite number",
        ),
        (("--arrival-rate", "1", "--service-time", "1", "--cv", "nan"), "--cv: must be a finite number >= 0"),
        (("--arrival-rate", "1", "--service-time", "1", "--service-rate", "1"), "not allowed with argument"),
        (("--arrival-rate", "1", "--service-time", "1", "--target-p-wait", "0"), "--target-p-wait"),
        (("--arrival-rate", "1", "--service-time", "1", "--slots-per-replica", "0"), "--slots-per-replica"),
        (("--trace", "/nonexistent/trace.csv"), "cannot read it"),
    ],
)
def test_bad_arguments_exit_2_with_a_message_naming_the_problem(capsys, argv, message):
    assert message in refusal(capsys, *argv)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("arrival,service_s\n0,1\n1,1\n", "the header lacks column(s) arrival_s"),
        ("arrival_s,service_s\n0,1\nsoon,1\n", "data row 2: arrival_s and service_s must be numbers"),
        ("arrival_s,service_s\n0,1\n1,-1\n", "data row 2: needs finite times and service_s >= 0"),
        ("arrival_s,service_s\n0,1\n", "needs at least 2 requests, has 1"),
        ("arrival_s,service_s\n5,1\n5,1\n", "every request arrived at the same time"),
        ("arrival_s,service_s\n0,0\n1,0\n", "every service_s is 0"),
        ("", "the header lacks column(s) arrival_s, service_s"),
    ],
)
def test_bad_traces_exit_2_naming_the_file_and_row(capsys, tmp_path, text, message):
    trace = tmp_path / "bad.csv"
    trace.write_text(text)
    error = refusal(capsys, "--trace", str(trace))
    assert error.startswith(f"inference-gateway plan: trace {trace}: ")
    assert message in error


def test_trace_and_rates_together_are_refused(capsys, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,service_s\n0,1\n1,1\n")
    assert "--trace gives the workload; drop --arrival-rate" in refusal(
        capsys, "--trace", str(trace), "--arrival-rate", "2"
    )


def test_the_installed_command_exits_2_on_bad_input():
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "plan", "--arrival-rate", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "inference-gateway plan: give --service-time or --service-rate" in done.stderr
