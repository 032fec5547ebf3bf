"""`inference-gateway simulate` end to end, in-process: Poisson and CSV workloads, the report, bad input."""

import argparse
import json

import pytest

from gateway.tools.simulate.command import add_parser

TRACE = """\
# two requests on one slot: the second waits for the first
at_s,class,tenant,cost,service_s
0.0,high,a,1,1.0
0.1,high,b,2,1.0
5.0,low,a,1,0.5
"""


def simulate(*argv: str) -> int:
    # gateway/programs/cli.py does not register the command yet: wire it the way it will.
    parser = argparse.ArgumentParser(prog="inference-gateway")
    add_parser(parser.add_subparsers(required=True))
    try:
        args = parser.parse_args(["simulate", *argv])
    except SystemExit as exit_:  # argparse refuses malformed arguments itself
        return int(exit_.code or 0)
    return int(args.command(args))


def report_json(capsys, *argv: str) -> dict:
    assert simulate(*argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


def flow(report: dict, class_name: str, tenant: str) -> dict:
    return next(f for f in report["flows"] if f["class"] == class_name and f["tenant"] == tenant)


def test_simulate_prints_a_table_of_waits_goodput_and_shares_for_a_poisson_workload(capsys):
    assert simulate("--rate", "8", "--service-ms", "100", "--requests", "2000", "--seed", "3") == 0
    out = capsys.readouterr().out
    assert "simulated 2000 requests on 1 slot(s)" in out
    header = next(line for line in out.splitlines() if line.startswith("class"))
    for column in ("mean ms", "p50 ms", "p95 ms", "p99 ms", "goodput/s", "work share", "weight share"):
        assert column in header
    row = next(line for line in out.splitlines() if line.startswith("default"))
    assert row.split()[3:5] == ["2000", "2000"]  # arrived, served


def test_simulate_replays_a_csv_trace_with_its_classes_tenants_costs_and_service_times(capsys, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    report = report_json(capsys, "--trace", str(trace), "--class", "high", "--class", "low")
    assert flow(report, "high", "a")["wait_s"]["mean"] == 0.0
    assert flow(report, "high", "b")["wait_s"]["mean"] == pytest.approx(0.9)
    assert flow(report, "high", "b")["handed_work"] == 2.0
    assert flow(report, "low", "a")["served"] == 1


def test_wait_percentiles_interpolate_between_the_served_requests_waits(capsys, tmp_path):
    # Five requests at once on one slot of 1 s: they wait 0, 1, 2, 3 and 4 s.
    trace = tmp_path / "trace.csv"
    trace.write_text("at_s,service_s\n" + "0,1\n" * 5)
    waits = flow(report_json(capsys, "--trace", str(trace)), "default", "default")["wait_s"]
    assert waits == pytest.approx({"mean": 2.0, "p50": 2.0, "p95": 3.8, "p99": 3.96})


def test_the_report_gives_each_tenants_share_of_its_bands_work_beside_its_weight_share(capsys, tmp_path):
    # a (weight 3) and b send 8 requests each at t = 0 to one slot of 1 s; by t = 3.5 s four are
    # handed over: a's first at once, then by fairness b, a, a.
    trace = tmp_path / "trace.csv"
    trace.write_text("at_s,tenant,service_s\n" + "0,a,1\n" * 8 + "0,b,1\n" * 8)
    report = report_json(capsys, "--trace", str(trace), "--tenant", "a,weight=3", "--until-s", "3.5")
    a, b = flow(report, "default", "a"), flow(report, "default", "b")
    assert (a["work_share"], b["work_share"]) == (0.75, 0.25)
    assert (a["weight_share"], b["weight_share"]) == (0.75, 0.25)
    assert report["left_queued"] == 12


def test_a_class_reserving_slots_keeps_them_from_less_urgent_classes(capsys, tmp_path):
    # Two slots, one reserved for high: three low requests at once run one after the other.
    trace = tmp_path / "trace.csv"
    trace.write_text("at_s,class,service_s\n" + "0,low,1\n" * 3)
    argv = ("--trace", str(trace), "--slots", "2", "--class", "high,reserved_slots=1", "--class", "low")
    assert flow(report_json(capsys, *argv), "low", "default")["wait_s"]["mean"] == pytest.approx(1.0)


def test_goodput_counts_only_requests_done_within_their_class_deadline(capsys, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    # b waits 0.9 s and is served for 1 s: done after 1.9 s, past a 1.5 s deadline; a is done in 1 s.
    report = report_json(capsys, "--trace", str(trace), "--class", "high,deadline_ms=1500", "--class", "low")
    assert (flow(report, "high", "a")["on_time"], flow(report, "high", "b")["on_time"]) == (1, 0)
    assert flow(report, "high", "b")["served"] == 1


def test_the_same_seed_gives_the_same_report_and_another_seed_another(capsys):
    argv = ("--rate", "30", "--slots", "4", "--service", "lognormal", "--cv", "2", "--requests", "3000")
    first = report_json(capsys, *argv, "--seed", "5")
    assert report_json(capsys, *argv, "--seed", "5") == first
    assert report_json(capsys, *argv, "--seed", "6") != first


def test_a_class_max_wait_refuses_at_arrival_and_bounds_the_waits_of_the_admitted(capsys):
    # Twice the pool's capacity: without admission the queue would grow for the whole run.
    argv = ("--rate", "20", "--service-ms", "100", "--requests", "4000", "--class", "only,max_wait_ms=500")
    only = flow(report_json(capsys, *argv), "only", "default")
    assert only["refused"] > 1000
    assert only["served"] + only["refused"] + only["expired"] == only["arrived"]
    assert only["wait_s"]["p99"] <= 0.5


def test_progress_is_reported_on_stderr_every_tenth_of_the_requests(capsys):
    assert simulate("--rate", "8", "--service-ms", "100", "--requests", "1000", "--progress") == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"simulate: {p}% ({p * 10}/1000 requests)" for p in range(10, 101, 10)]


def test_a_short_run_reports_no_progress(capsys):
    assert simulate("--rate", "8", "--service-ms", "100", "--requests", "1000") == 0
    assert capsys.readouterr().err == ""


MALFORMED = {
    "not_a_number": ("at_s,service_s\n0.0,1\nsoon,1\n", "data row 2: at_s must be a number, got 'soon'"),
    "no_at_s_column": ("arrival,service_s\n0.0,1\n", "the header lacks the column at_s"),
    "undeclared_class": ("at_s,class\n0.0,gold\n", "data row 1: class 'gold' is not declared"),
    "cost_not_positive": ("at_s,cost\n0.0,0\n", "data row 1: cost must be > 0"),
    "negative_service": ("at_s,service_s\n0.0,-1\n", "data row 1: service_s must be >= 0"),
    "extra_cell": ("at_s,service_s\n0.0,1,2\n", "data row 1: more cells than the header names"),
    "no_rows": ("at_s,service_s\n# nothing\n", "has no requests"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_a_malformed_trace_exits_2_with_a_message_naming_the_problem(capsys, tmp_path, case):
    text, message = MALFORMED[case]
    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    assert simulate("--trace", str(trace)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"inference-gateway simulate: trace {trace}: ")
    assert message in captured.err


def test_a_missing_trace_file_exits_2(capsys, tmp_path):
    assert simulate("--trace", str(tmp_path / "absent.csv")) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_arrivals_need_a_rate_or_a_trace(capsys):
    assert simulate("--requests", "10") == 2
    assert "give --rate" in capsys.readouterr().err


def test_a_malformed_class_spec_is_refused_by_the_parser(capsys):
    assert simulate("--rate", "1", "--class", "high,max_wait=5") == 2
    assert "unknown key 'max_wait'" in capsys.readouterr().err


def test_tenant_quotas_that_lend_keep_the_pool_busy_where_hard_ones_leave_it_half_idle(capsys):
    # Two teams own half of 8 slots each; team-a offers 1.5 times the pool, team-b nothing.
    argv = ("--slots", "8", "--rate", "120", "--service-ms", "100", "--requests", "6000", "--until-s", "50")
    quiet = ("--tenant", "b,share=0,quota=4")
    hard = report_json(capsys, *argv, "--tenant", "a,quota=4,borrowing_limit=0", *quiet)
    lent = report_json(capsys, *argv, "--tenant", "a,quota=4", *quiet)
    assert 0.45 < hard["utilization"] < 0.55
    assert lent["utilization"] > 0.97


def test_borrowing_and_lending_limits_need_a_quota(capsys):
    assert simulate("--rate", "1", "--tenant", "a,borrowing_limit=2") == 2
    assert "borrowing and lending limits need a quota" in capsys.readouterr().err
