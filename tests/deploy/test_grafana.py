"""The Grafana dashboard parses, and every query asks for metrics the gateway (or Kubernetes) exports."""

import json
import re

import pytest

from policies.outcomes import SHED_OUTCOMES
from tests.deploy.manifests import ROOT

DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "inference-gateway.json").read_text())
METRICS_SOURCE = "".join(path.read_text() for path in (ROOT / "gateway" / "telemetry").glob("*.py"))
EXPORTED = set(re.findall(r'"((?:gateway|gpu)_[a-z_]+)"', METRICS_SOURCE))
KUBE_STATE_METRICS = {"kube_deployment_status_replicas"}
SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")  # name{...}
PREFIXED = re.compile(r"\b((?:gateway|gpu|kube)_[a-zA-Z0-9_:]*)")  # also bare names


def exprs() -> list[tuple[str, str]]:
    return [(panel["title"], t["expr"]) for panel in DASHBOARD["panels"] for t in panel["targets"]]


def metric_family(name: str) -> str:
    """The name the exporter defines: counters get _total, histograms _bucket, _sum and _count."""
    return re.sub(r"_(total|bucket|sum|count)$", "", name)


def test_panels_have_unique_ids_and_a_query_each():
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert all(panel["targets"] for panel in DASHBOARD["panels"])


@pytest.mark.parametrize(("title", "expr"), exprs())
def test_every_query_selects_only_known_metrics(title, expr):
    names = set(SELECTOR.findall(expr)) | set(PREFIXED.findall(expr))
    assert names, f"{title}: no metric in {expr}"
    unknown = {n for n in names if metric_family(n) not in EXPORTED and n not in KUBE_STATE_METRICS}
    assert not unknown, f"{title}: {sorted(unknown)}"


@pytest.mark.parametrize(
    "needle",
    [
        "gateway_queue_depth{",
        "histogram_quantile(0.95, sum by (le, priority) (rate(gateway_queue_wait_seconds_bucket{",
        "gateway_requests_total{",
        "gateway_desired_replicas{",
        "kube_deployment_status_replicas{",
        "gateway_backend_saturation{",
    ],
)
def test_the_dashboard_shows_queue_wait_refusals_replicas_and_saturation(needle):
    assert any(needle in expr for _, expr in exprs())


def test_the_429_panel_counts_exactly_the_load_shedding_outcomes():
    [expr] = [e for _, e in exprs() if "gateway_requests_total" in e]
    outcomes = re.search(r'outcome=~"([^"]+)"', expr)
    assert outcomes is not None
    assert set(outcomes.group(1).split("|")) == {o.value for o in SHED_OUTCOMES}
