from pathlib import Path

import pytest

from gateway.settings import ConfigError, load_settings, parse_settings

ROOT = Path(__file__).parents[2]


def config(**overrides):
    base = {
        "priorities": [{"name": "high", "max_wait_ms": 250}, {"name": "low", "max_wait_ms": 1000}],
        "default_priority": "low",
        "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:8000", "max_concurrency": 4}]}],
    }
    base.update(overrides)
    return base


def problems(data) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_settings(data)
    return caught.value.problems


def test_the_documented_sample_config_loads():
    settings = load_settings(ROOT / "deploy" / "config" / "gateway.yaml")
    assert [p.name for p in settings.priorities] == ["high", "low"]


def test_sentinel_names_the_master_and_its_sentinels_and_the_url_may_go():
    store = {"kind": "redis", "sentinel": {"master": "queue", "nodes": ["s-0:26379", "10.0.0.7:26380"]}}
    settings = parse_settings(config(store=store))
    assert settings.store.url is None
    assert settings.store.sentinel is not None
    assert settings.store.sentinel.addresses() == [("s-0", 26379), ("10.0.0.7", 26380)]


def test_defaults_fill_the_rest():
    settings = parse_settings(config())
    assert settings.store.kind == "memory"
    assert settings.models[0].backends[0].readiness_path == "/v2/health/ready"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"store": {"kind": "redis"}}, "store.url (or store.sentinel) is required for kind: redis"),
        ({"store": {"sentinel": {"master": "q", "nodes": ["s:26379"]}}}, "are for kind: redis"),
        ({"store": {"cluster": True}}, "are for kind: redis"),
        ({"store": {"kind": "redis", "cluster": True}}, "store.cluster needs store.url"),
        ({"store": {"kind": "redis", "sentinel": {"master": "q", "nodes": []}}}, "store.sentinel.nodes"),
        (
            {"store": {"kind": "redis", "sentinel": {"master": "q", "nodes": ["s"]}}},
            "store.sentinel.nodes[0]",
        ),
        ({"store": {"kind": "redis", "url": "http://x"}}, "store.url must be a redis://"),
        ({"store": {"kind": "etcd"}}, "store.kind"),
        ({"default_priority": "urgent"}, "default_priority 'urgent' is not one of"),
        ({"priorities": [{"name": "a", "max_wait_ms": 1}, {"name": "a", "max_wait_ms": 2}]}, "appears twice"),
        (
            {"tenants": [{"name": "t", "api_keys": ["0123456789"], "max_priority": "gold"}]},
            "max_priority 'gold' is not one of",
        ),
        (
            {
                "tenants": [
                    {"name": "a", "api_keys": ["same-key-123"]},
                    {"name": "b", "api_keys": ["same-key-123"]},
                ]
            },
            "tenants 'a' and 'b': one api key is listed twice (api_keys[0] of 'b'",
        ),
        ({"tenants": [{"name": "t", "api_keys": ["short"]}]}, "tenants[0].api_keys[0]"),
        ({"ordering": "lifo"}, "ordering"),
        (
            {
                "models": [
                    {
                        "name": "m",
                        "backends": [
                            {
                                "url": "http://127.0.0.1:8000",
                                "max_concurrency": 4,
                                "forward_priority": {"values": {"gold": 0}},
                            }
                        ],
                    }
                ]
            },
            "forward_priority names no class ['gold']",
        ),
        ({"models": [{"name": "m", "cost": "words", "backends": []}]}, "models[0].cost"),
        (
            {
                "models": [
                    {
                        "name": "m",
                        "decoupled": True,
                        "backends": [{"url": "http://b:8000", "max_concurrency": 1}],
                    }
                ]
            },
            "decoupled: every backend needs grpc_port",
        ),
        (
            {
                "models": [
                    {
                        "name": "m",
                        "decoupled": True,
                        "backends": [{"url": "http://b:8000", "max_concurrency": 1, "grpc_port": 8001}],
                    }
                ]
            },
            "models ['m'] are decoupled: their requests come on gRPC, set grpc_listen",
        ),
        (
            {
                "models": [
                    {
                        "name": "m",
                        "decoupled": True,
                        "batching": {"max_batch_size": 4},
                        "backends": [{"url": "http://b:8000", "max_concurrency": 1, "grpc_port": 8001}],
                    }
                ]
            },
            "are not batched by the gateway",
        ),
        ({"admission": {"safety_sigmas": -1}}, "admission.safety_sigmas"),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    assert any(message in problem for problem in problems(config(**overrides)))


@pytest.mark.parametrize(
    "tenants",
    [
        [{"name": "a", "api_keys": ["same-key-123"]}, {"name": "b", "api_keys": ["same-key-123"]}],
        [{"name": "a", "api_keys": ["other-key-1", "same-key-123", "same-key-123"]}],
    ],
)
def test_a_key_listed_twice_is_an_error_that_never_shows_the_key(tenants):
    found = problems(config(tenants=tenants))
    assert any("one api key is listed twice" in problem for problem in found), found
    assert not any("same-key-123" in problem for problem in found)


def test_a_backend_needs_its_slots_unless_triton_discovers_them():
    plain = {"name": "m", "backends": [{"url": "http://127.0.0.1:8000"}]}
    assert any("max_concurrency is required" in p for p in problems(config(models=[plain])))
    triton = {"name": "m", "backends": [{"url": "http://127.0.0.1:8000", "kind": "triton"}]}
    backend = parse_settings(config(models=[triton])).models[0].backends[0]
    assert backend.max_concurrency is None
    assert backend.readiness_path == "/v2/models/{model}/ready"


def test_kueue_needs_an_http_url():
    kueue = {"url": "ftp://kueue", "cluster_queue": "q"}
    assert any(p.startswith("kueue.url") for p in problems(config(kueue=kueue)))


def test_the_admin_listener_needs_a_port_of_its_own():
    same = config(listen={"port": 8080}, admin_listen={"port": 8080})
    assert problems(same) == ["admin_listen must use another port than listen"]
    assert parse_settings(config(listen={"port": 0}, admin_listen={"port": 0})).admin_listen is not None


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_number_that_is_not_finite_is_refused_with_its_path(value):
    found = problems(config(priorities=[{"name": "low", "max_wait_ms": value}]))
    assert found == ["priorities[0].max_wait_ms: Input should be a finite number"]


def test_a_yaml_syntax_error_names_the_file_and_where_in_it(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("listen:\n  port: [1\nmodels: x\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(path)
    message = str(raised.value)
    assert str(path) in message
    assert "line 3, column 7: expected ',' or ']'" in message
    assert "begun at line 2, column 9" in message
    assert "<unicode string>" not in message
