"""The load test kit's pure parts: arrivals, scenarios, answer parsing, the report's sums, the llm-d
export (validated by the llm-d package itself) and the HTML charts."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmd_benchmark_report import BenchmarkReportV02, import_benchmark_report
from multidict import CIMultiDict

from gateway.tools.loadtest import llmd, report
from gateway.tools.loadtest.charts import Series, line_chart, nice_max
from gateway.tools.loadtest.client import (
    Attempt,
    Progress,
    RequestRecord,
    Retrying,
    _route,
    _wait_before_retry,
    advised_wait_s,
    has_output,
    refusal_reason,
    server_timing,
)
from gateway.tools.loadtest.command import _command_line, _ProgressBar
from gateway.tools.loadtest.grpc_calls import infer_request
from gateway.tools.loadtest.recommend import (
    Pool,
    RecommendError,
    compare,
    config_snippet,
    measured_pool,
    recommend,
)
from gateway.tools.loadtest.requests import prepare
from gateway.tools.loadtest.summary import fair_shares, group_stats, jain_index, knee, percentile, summarize
from gateway.tools.loadtest.workload import (
    Arrival,
    Scenario,
    ScenarioError,
    Traffic,
    arrivals,
    scenario_from,
)
from policies.capacity import mgc


def test_arrivals_keep_each_entrys_rate_and_share():
    scenario = Scenario((Traffic("a", share=3), Traffic("b", share=1), Traffic("c", rate=20)))
    sent = arrivals(scenario, rate=400, duration_s=20, seed=7)
    counts = [sum(a.traffic == i for a in sent) for i in range(3)]
    # 300/s, 100/s and 20/s for 20 s: Poisson counts within 4 standard deviations.
    for count, expected in zip(counts, (6000, 2000, 400), strict=True):
        assert abs(count - expected) < 4 * expected**0.5, counts
    assert [a.at_s for a in sent] == sorted(a.at_s for a in sent)
    assert arrivals(scenario, 400, 20, seed=7) == sent  # the same seed, the same load


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gaps_have_the_asked_burstiness(cv):
    sent = arrivals(Scenario((Traffic("a"),), burstiness=cv), rate=100, duration_s=200, seed=3)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(sent)]
    assert statistics.mean(gaps) == pytest.approx(0.01, rel=0.1)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.12)


@pytest.mark.parametrize(
    ("document", "names"),
    [
        ({}, "traffic"),
        ({"traffic": []}, "empty"),
        ({"traffic": [{"kind": "embed"}]}, "kind"),
        ({"traffic": [{"stream": True}]}, "stream needs kind chat"),
        ({"traffic": [{"colour": "red"}]}, "colour"),
        ({"traffic": [{"share": -1}]}, "share"),
        ({"traffic": [{"size": 0}]}, "size"),
        ({"traffic": [{"name": "x"}, {"name": "x"}]}, "repeat"),
        ({"traffic": [{"headers": {"a": 1}}]}, "headers"),
        ({"traffic": [{}], "burstiness": 0}, "burstiness"),
    ],
)
def test_a_bad_scenario_is_refused_naming_what_is_wrong(document, names):
    with pytest.raises(ScenarioError, match=names):
        scenario_from(document)


def test_a_scenario_reads_its_mix():
    scenario = scenario_from(
        {
            "burstiness": 1.5,
            "traffic": [
                {"name": "urgent", "priority": "high", "tenant": "acme", "share": 0.2, "deadline_ms": 250},
                {"name": "chat", "kind": "chat", "stream": True, "tenant": "beta", "weight": 2, "size": 32},
            ],
        }
    )
    assert scenario.burstiness == 1.5
    assert scenario.rates(100) == pytest.approx([100 * 0.2 / 1.2, 100 / 1.2])
    urgent, chat = (prepare(t, "m") for t in scenario.traffic)
    assert urgent.path == "/v2/models/m/infer" and urgent.headers["X-Priority"] == "high"
    assert urgent.headers["X-Tenant"] == "acme" and urgent.headers["X-Request-Timeout-Ms"] == "250"
    assert chat.path == "/v1/chat/completions" and chat.stream
    assert (
        b'"stream": true' in chat.body and b'"max_tokens": 32' in chat.body and b'"model": "m"' in chat.body
    )


def test_answers_are_read_as_the_gateway_and_the_sdks_write_them():
    assert server_timing("queue;dur=12.5, batch;dur=3, upstream;dur=40.25") == (12.5, 40.25)
    assert server_timing("") == (None, None)
    assert advised_wait_s(CIMultiDict({"Retry-After": "3", "retry-after-ms": "2412"})) == pytest.approx(2.412)
    assert advised_wait_s(CIMultiDict({"retry-after": "2"})) == 2.0
    assert advised_wait_s(CIMultiDict({"Retry-After": "Wed, 21 Oct 2099 07:28:00 GMT"})) is None
    assert refusal_reason(429, b'{"error": "full", "reason": "queue_full"}') == "queue_full"
    assert refusal_reason(429, b'{"error": {"message": "m", "code": "deadline_unmeetable"}}') == (
        "deadline_unmeetable"
    )
    assert refusal_reason(502, b"<html>bad gateway</html>") == "http_502"
    assert has_output(b'{"choices": [{"delta": {"content": "hi"}}]}')
    assert not has_output(b'{"choices": [{"delta": {"role": "assistant"}}]}')
    assert has_output(b'{"choices": [{"text": "hi"}]}')
    assert not has_output(b'{"choices": [], "usage": {"completion_tokens": 3}}')


def _record(at_s, *attempts, traffic=0):
    return RequestRecord(Arrival(at_s, traffic), [Attempt(**a) for a in attempts])


def _served(sent_s, ended_s):
    return {"sent_s": sent_s, "status": 200, "reason": "ok", "ended_s": ended_s}


def _refused(sent_s, advised_s, reason="deadline_unmeetable"):
    return {
        "sent_s": sent_s,
        "status": 429,
        "reason": reason,
        "ended_s": sent_s + 0.001,
        "advised_s": advised_s,
    }


def test_a_groups_sums_follow_retries_to_the_end():
    records = [
        _record(0.0, _served(0.0, 0.1)),  # within its 1 s deadline
        _record(0.1, _refused(0.1, 0.5), _served(0.601, 0.7)),  # served on its first retry, in time
        _record(0.2, _refused(0.2, 2.0), _served(2.201, 2.3)),  # served on its first retry, late
        _record(0.3, _refused(0.3, 0.5), _refused(0.801, 0.5), _served(1.302, 1.4)),  # second retry, late
        _record(0.4, _refused(0.4, 0.5), _refused(0.901, 0.5, "queue_full")),  # never served
        _record(0.5, {"sent_s": 0.5, "status": None, "reason": "timeout", "ended_s": 3.5}),
    ]
    stats = group_stats(records, lambda _: 1.0, duration_s=2.0)
    assert stats["sent"] == 6 and stats["served"] == 4 and stats["within_deadline"] == 2
    assert stats["goodput_rps"] == 1.0 and stats["served_eventually"] == pytest.approx(4 / 6, abs=1e-4)
    assert stats["retried"] == 4 and stats["first_retry_admitted"] == 0.5
    assert stats["attempts_per_served"] == pytest.approx(8 / 4)
    assert stats["refused_by_reason"] == {
        "queue_full": pytest.approx(1 / 6, abs=1e-4),
        "timeout": pytest.approx(1 / 6, abs=1e-4),
    }
    assert stats["first_attempt_refused_by_reason"]["deadline_unmeetable"] == pytest.approx(4 / 6, abs=1e-4)
    assert stats["advised_wait_ms"]["p50"] == 500.0
    # Waited until the served attempt left: 0.5, 2.0 and 1.0 s after the first refusal.
    assert stats["actual_wait_ms"]["p99"] == pytest.approx(2000, abs=1)
    assert stats["answered"] == 5


def test_water_filling_gives_what_is_asked_below_the_share_and_splits_the_rest_by_weight():
    shares = fair_shares({"a": 10, "b": 100, "c": 100}, {"a": 1, "b": 1, "c": 2}, total=130)
    assert shares == pytest.approx({"a": 10, "b": 40, "c": 80})
    assert fair_shares({"a": 5, "b": 5}, {}, total=10) == pytest.approx({"a": 5, "b": 5})


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 1000), min_size=1),
    st.floats(0, 5000),
)
def test_water_filling_never_gives_more_than_asked_nor_more_than_there_is(demand, total):
    shares = fair_shares(demand, {}, total)
    assert all(shares[t] <= demand[t] + 1e-6 for t in demand)
    assert sum(shares.values()) <= min(total, sum(demand.values())) + 1e-6


def test_jains_index_is_one_at_fair_shares_and_falls_as_one_tenant_starves():
    assert jain_index({"a": 10, "b": 40}, {"a": 10, "b": 40}) == 1.0
    assert jain_index({"a": 0, "b": 50}, {"a": 25, "b": 25}) == 0.5


def test_percentiles_are_nearest_rank():
    assert percentile([3, 1, 2, 4], 0.5) == 2 and percentile([1, 2, 3, 4], 0.99) == 4
    assert percentile([], 0.5) is None


def test_a_sweeps_knee_is_its_plateau_and_its_last_rate_served_in_time():
    steps = [
        {"overall": {"offered_rps": 100, "goodput_rps": 99, "goodput_share": 0.99}},
        {"overall": {"offered_rps": 150, "goodput_rps": 146, "goodput_share": 0.97}},
        {"overall": {"offered_rps": 225, "goodput_rps": 196, "goodput_share": 0.87}},
        {"overall": {"offered_rps": 337, "goodput_rps": 192, "goodput_share": 0.57}},
    ]
    assert knee(steps) == {"max_sustainable_rps": 196, "knee_offered_rps": 150}


def _document(tmp_path: Path) -> dict:
    scenario = Scenario((Traffic("a", tenant="acme"), Traffic("b", tenant="beta", kind="chat", stream=True)))
    first = Attempt(0.0, 200, "ok", 0.2, first_token_s=0.05, token_gaps_s=[0.01, 0.02])
    records = [
        RequestRecord(Arrival(0.0, 1), [first]),
        RequestRecord(Arrival(0.1, 0), [Attempt(0.1, 429, "queue_full", 0.101, advised_s=1.0)]),
        RequestRecord(Arrival(0.2, 0), [Attempt(0.2, 200, "ok", 0.25, queue_ms=1.0, upstream_ms=40.0)]),
    ]
    run = summarize(records, scenario, rate=3.0, duration_s=1.0)
    run |= {"started_at": "2026-12-07T12:00:00+00:00", "wall_s": 1.5}
    return {
        "target": "http://127.0.0.1:1",
        "model": "sim",
        "command": ["loadtest"],
        "started_at": "x",
        "runs": [run, run],
    }


def test_each_run_is_a_valid_llmd_benchmark_report(tmp_path):
    document = _document(tmp_path)
    paths = llmd.write_reports(document, tmp_path)
    assert [p.name for p in paths] == [
        f"benchmark_report_v0.2,_inference-gateway-loadtest_stage_{i}.yaml" for i in (0, 1)
    ]
    read = import_benchmark_report(str(paths[0]))
    assert isinstance(read, BenchmarkReportV02)
    aggregate = read.results.request_performance.aggregate
    assert aggregate.requests.total == 3 and aggregate.requests.failures == 1
    assert aggregate.latency.time_to_first_token.p50 == pytest.approx(0.05)
    assert aggregate.latency.inter_token_latency.units == "s/token"


def test_the_html_report_holds_its_tables_charts_and_data(tmp_path):
    document = _document(tmp_path)
    document["sweep"] = knee(document["runs"])
    page = report.render(document)
    assert page.count("<svg") == 2 + 2 * 2  # the sweep's two, and each run's two (no scrapes)
    assert "<td>acme</td>" in page and "<td>beta</td>" in page and "queue_full 33.3%" in page
    assert '<script type="application/json" id="report">' in page and "</script></body></html>" in page


def test_charts_draw_lines_broken_where_a_value_is_missing():
    svg = line_chart("t", "x", "y", [Series("s", [(0, 1), (1, None), (2, 3), (3, 4)])])
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1
    assert nice_max(0) == 1 and nice_max(180) == 200 and nice_max(201) == 250 and nice_max(3) == 5


POOL = Pool(backends=1, slots_per_backend=8, service_mean_s=0.040, service_cv=0.1, service_p99_s=0.045)
MIX = Scenario(
    (Traffic("urgent", priority="high", share=1, deadline_ms=250), Traffic("bulk", priority="low", share=4))
)


def test_the_recommendation_is_the_fewest_backends_meeting_every_class_and_the_ceiling():
    recommended = recommend(POOL, MIX, rate=100, target_rate=600, slo_share=0.99, ceiling=0.8)
    replicas = recommended["replicas"]
    high, low = recommended["classes"]["high"], recommended["classes"]["low"]
    assert (high["max_wait_ms"], low["max_wait_ms"]) == (205, 955)  # the deadline less the p99 service
    assert (high["rate_rps"], low["rate_rps"]) == (120, 480)
    # 600/s of 40 ms is 24 slots busy: 30 at the 80% ceiling, so 4 backends of 8; not 3.
    assert replicas == 4
    fewer = mgc(600, 25, (replicas - 1) * 8, 0.1)
    assert fewer.utilization > 0.8 or fewer.wait_exceeded(0.205) > 0.01
    assert high["predicted_within_deadline"] >= 0.99 * 0.99 and high["predicted_queue_p99_ms"] < 205
    # The urgent class alone: 120/s of 40 ms is 4.8 slots busy; its SLO needs a few more.
    assert 6 <= high["reserved_slots"] <= 9 and "reserved_slots" not in low
    assert mgc(120, 25, high["reserved_slots"] - 1, 0.1).wait_exceeded(0.205) > 0.01
    snippet = config_snippet(recommended, "sim")
    assert "  - name: high\n    max_wait_ms: 205\n    reserved_slots:" in snippet and "4 of them" in snippet


def test_a_deadline_below_the_service_time_is_refused_not_planned():
    tight = Scenario((Traffic("t", priority="high", deadline_ms=40),))
    with pytest.raises(RecommendError, match=r"high.*below the p99 service time"):
        recommend(POOL, tight, rate=10, target_rate=10, slo_share=0.99, ceiling=0.8)


def test_a_recommendation_needs_server_timing_and_the_pools_slots():
    served = [
        RequestRecord(Arrival(0, 0), [Attempt(0, 200, "ok", 0.05, upstream_ms=40 + i % 3)]) for i in range(30)
    ]
    with pytest.raises(RecommendError, match="gateway_backend_slots"):
        measured_pool(served, [], None)
    scrape = {
        "source": "gateway",
        "ok": True,
        "values": {"gateway_backend_slots{backend=a}": 8.0, "gateway_backend_slots{backend=b}": 8.0},
    }
    pool = measured_pool(served, [scrape], None)
    assert (pool.backends, pool.slots_per_backend) == (2, 8)
    assert pool.service_mean_s == pytest.approx(0.041, abs=0.001) and pool.service_p99_s == 0.042
    with pytest.raises(RecommendError, match="Server-Timing"):
        measured_pool(served[:5], [scrape], None)


def test_a_later_run_is_compared_with_the_prediction():
    recommended = recommend(POOL, MIX, rate=100, target_rate=600, slo_share=0.99, ceiling=0.8)
    run = {
        "rate_rps": 600,
        "by_class": {"high": {"goodput_share": 0.995, "queue_ms": {"p99": 3.0}}},
    }
    compared = compare(recommended, run)
    assert compared["classes"]["high"]["measured_within_deadline"] == 0.995
    assert "low" not in compared["classes"]  # the run sent none


def test_a_refused_request_waits_its_advice_or_the_backoff_and_stops_where_told():
    advised = Attempt(0.0, 429, "queue_full", 0.01, advised_s=1.5)
    bare = Attempt(0.0, 503, "http_503", 0.01)
    assert _wait_before_retry(advised, 1, Retrying(2)) == 1.5
    assert _wait_before_retry(advised, 3, Retrying(2)) is None  # the third attempt was its last
    assert _wait_before_retry(bare, 1, Retrying(2)) is None  # no advice, no backoff: not retried
    assert _wait_before_retry(bare, 1, Retrying(2, backoff_s=0.5)) == 0.5
    told = Attempt(0.0, 429, "budget_too_small", 0.01, advised_s=1.0, retryable=False)
    assert _wait_before_retry(told, 1, Retrying(2)) is None
    far = Attempt(0.0, 429, "queue_full", 0.01, advised_s=120.0)
    assert _wait_before_retry(far, 1, Retrying(2)) is None  # beyond what an SDK follows
    failed = Attempt(0.0, 502, "upstream_error", 0.01, advised_s=1.0)
    assert _wait_before_retry(failed, 1, Retrying(2)) is None


def test_replicas_are_taken_in_turn_and_a_retry_goes_to_the_next():
    route = _route(["a", "b", "c"])
    assert [route(i, 0) for i in range(4)] == ["a", "b", "c", "a"]
    assert route(1, 1) == "c"
    assert _route("x")(5, 2) == "x"


def test_a_stream_cut_short_is_not_served():
    cut = RequestRecord(Arrival(0, 0), [Attempt(0, 200, "stream_cut_short", 1.0, complete=False)])
    whole = RequestRecord(Arrival(0, 0), [Attempt(0, 200, "ok", 1.0)])
    assert not cut.served and whole.served
    stats = group_stats([cut, whole], lambda _: 5.0, duration_s=1.0)
    assert stats["served"] == 1 and stats["refused_by_reason"] == {"stream_cut_short": 0.5}


def test_a_retry_says_it_is_one():
    prepared = prepare(Traffic("a"), "m")
    assert "X-Retry-Attempt" not in prepared.headers
    assert prepared.retry(2).headers["X-Retry-Attempt"] == "2" and prepared.retry(2).body == prepared.body


def test_the_progress_bar_redraws_one_line_with_the_schedule_and_the_answers(capsys):
    bar = _ProgressBar(rate=50, duration_s=10)
    bar.show(Progress(scheduled=500, sent=250, done=240, served=200), 5.0)
    bar.show(Progress(scheduled=500, sent=500, done=500, served=450), 12.0)
    bar.close()
    lines = capsys.readouterr().err.split("\r")
    assert lines[1].startswith(
        "50 rps [" + "#" * 12 + "-" * 12 + "]   5.0/10 s sent 250 answered 240 served 200"
    )
    assert lines[2].startswith("50 rps [" + "#" * 24 + "]  10.0/10 s sent 500") and lines[2].endswith("\n")


def test_the_report_never_writes_an_api_key():
    argv = ["gateway", "loadtest", "--api-key", "sk-secret-123", "--model", "m", "--api-key=sk-other-456"]
    shown = _command_line(argv)
    assert "sk-secret-123" not in shown and "sk-other-456" not in " ".join(shown)
    assert shown[:4] == ["inference-gateway", "loadtest", "--api-key", "<key>"]


def test_a_kserve_body_becomes_a_model_infer_request_with_typed_contents():
    body = {
        "id": "r1",
        "inputs": [
            {"name": "A", "shape": [1, 2], "datatype": "FP32", "data": [[1.5, 2.5]]},
            {"name": "B", "shape": [2], "datatype": "INT64", "data": [3, 4]},
            {"name": "C", "shape": [1], "datatype": "BYTES", "data": ["hé"]},
            {"name": "D", "shape": [1], "datatype": "BOOL", "data": [True]},
        ],
        "outputs": [{"name": "OUT"}],
    }
    request = infer_request("m", body)
    assert request.model_name == "m" and request.id == "r1" and [o.name for o in request.outputs] == ["OUT"]
    a, b, c, d = request.inputs
    assert list(a.shape) == [1, 2] and list(a.contents.fp32_contents) == [1.5, 2.5]
    assert list(b.contents.int64_contents) == [3, 4] and list(c.contents.bytes_contents) == ["hé".encode()]
    assert list(d.contents.bool_contents) == [True]
    with pytest.raises(ScenarioError, match="FP16"):
        infer_request("m", {"inputs": [{"name": "H", "shape": [1], "datatype": "FP16", "data": [1]}]})
    with pytest.raises(ScenarioError, match="name, datatype, shape"):
        infer_request("m", {"inputs": [{"datatype": "FP32", "data": [1]}]})


def test_grpc_traffic_sends_its_headers_as_metadata():
    prepared = prepare(Traffic("g", kind="grpc", priority="high", tenant="acme", size=3), "m")
    assert prepared.rpc.model_name == "m" and list(prepared.rpc.inputs[0].shape) == [1, 3]
    assert dict(prepared.metadata) == {
        "x-request-timeout-ms": "1000",
        "x-priority": "high",
        "x-tenant": "acme",
    }
    assert dict(prepared.retry(1).metadata)["x-retry-attempt"] == "1"
