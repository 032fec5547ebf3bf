"""A request joins its tenant's flow only when that tenant is configured (named by its API key, or
by X-Tenant where tenants have no keys); otherwise the one default flow, whatever X-Tenant says:
flows stay a closed, configured set."""

import pytest

from gateway.flow.request_meta import RequestClassifier
from gateway.settings import ConfigError, parse_settings

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


KEYLESS = {**BASE, "tenants": [{"name": "team-a", "weight": 3}, {"name": "team-b"}]}


def test_without_keys_x_tenant_names_a_configured_tenants_flow():
    classifier = RequestClassifier(parse_settings(KEYLESS))
    meta = classifier.classify([(b"x-tenant", b"team-a")])
    assert (meta.tenant, meta.flow_tenant) == ("team-a", "team-a")


def test_without_keys_an_unconfigured_x_tenant_joins_the_default_flow():
    meta = RequestClassifier(parse_settings(KEYLESS)).classify([(b"x-tenant", b"team-z")])
    assert (meta.tenant, meta.flow_tenant) == ("team-z", "")


def test_tenant_weights_come_from_the_config_and_default_to_one():
    assert parse_settings(KEYLESS).tenant_weights() == {"team-a": 3.0, "team-b": 1.0}


def test_tenants_have_keys_all_or_none():
    mixed = {**BASE, "tenants": [{"name": "team-a", "api_keys": ["key-of-team-a"]}, {"name": "team-b"}]}
    with pytest.raises(ConfigError, match="team-b"):
        parse_settings(mixed)


def test_a_weight_must_be_positive():
    with pytest.raises(ConfigError, match="weight"):
        parse_settings({**BASE, "tenants": [{"name": "team-a", "weight": 0}]})
