"""A request joins its tenant's flow only when that tenant is configured (an API key named it);
otherwise the one default flow, whatever X-Tenant says: flows stay a closed, configured set."""

from gateway.http.request_meta import RequestClassifier
from gateway.settings import parse_settings

BASE = {
    "priorities": [{"name": "high", "max_wait_ms": 250}, {"name": "low", "max_wait_ms": 1000}],
    "default_priority": "low",
    "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9", "max_concurrency": 1}]}],
}


def test_a_configured_tenant_has_a_flow_of_its_own():
    settings = parse_settings({**BASE, "tenants": [{"name": "team-a", "api_keys": ["key-of-team-a"]}]})
    meta = RequestClassifier(settings).classify([(b"authorization", b"Bearer key-of-team-a")])
    assert (meta.tenant, meta.flow_tenant) == ("team-a", "team-a")


def test_x_tenant_without_configured_tenants_joins_the_default_flow():
    meta = RequestClassifier(parse_settings(BASE)).classify([(b"x-tenant", b"anything-a-client-says")])
    assert (meta.tenant, meta.flow_tenant) == ("anything-a-client-says", "")
