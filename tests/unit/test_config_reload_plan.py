"""What a reloaded config changes now and what only a restart would (gateway.settings.reload)."""

from __future__ import annotations

import pytest

from gateway.settings import ConfigError, parse_settings
from gateway.settings.reload import plan_reload


def config(*tenants, max_wait_ms=1000, port=8080):
    return parse_settings(
        {
            "listen": {"host": "127.0.0.1", "port": port},
            "priorities": [{"name": "high", "max_wait_ms": 250}, {"name": "low", "max_wait_ms": max_wait_ms}],
            "default_priority": "low",
            "tenants": list(tenants),
            "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9", "max_concurrency": 2}]}],
        }
    )


def test_keys_names_caps_weights_and_allowances_apply_the_rest_is_reported_and_kept():
    old = config(
        {"name": "a", "api_keys": ["key-a-0001"], "quota": 2}, {"name": "b", "api_keys": ["key-b-0001"]}
    )
    new = config(
        {"name": "a", "api_keys": ["key-a-0002"], "quota": 5, "weight": 2, "max_priority": "low"},
        {"name": "c", "api_keys": ["key-c-0001"], "borrowing_limit": 0, "quota": 1},
        max_wait_ms=2000,
        port=9090,
    )
    plan = plan_reload(old, new)
    assert plan.live == [
        "tenants[a]: api_keys, max_priority, weight",
        "tenants[c] added",
        "tenants[b] removed",
        "priorities[low]: max_wait_ms",
    ]
    assert plan.restart_only == ["listen", "tenants[a]: quota", "tenants[c]: borrowing_limit, quota"]
    applied = {t.name: t for t in plan.applied.tenants}
    assert set(applied) == {"a", "c"}
    assert (applied["a"].api_keys, applied["a"].weight, applied["a"].quota) == (["key-a-0002"], 2, 2)
    assert applied["c"].quota is None and applied["c"].borrowing_limit is None
    assert plan.applied.listen.port == 8080 and plan.applied.priorities[1].max_wait_ms == 2000


def test_the_running_settings_are_the_base_and_a_restart_only_change_is_told_again():
    started = config({"name": "a", "api_keys": ["key-a-0001"]})
    running = started.model_copy(update={"listen": started.listen.model_copy(update={"port": 41234})})
    edited = config({"name": "a", "api_keys": ["key-a-0001"]}, port=9090)
    first = plan_reload(started, edited, running)
    second = plan_reload(started, edited, first.applied)
    assert first.restart_only == second.restart_only == ["listen"]  # the file's port, not the bound one
    assert second.applied.listen.port == 41234 and second.live == []


def test_classes_renamed_reordered_or_otherwise_changed_take_a_restart():
    started = config()
    renamed = started.model_copy(
        update={
            "priorities": [started.priorities[0], started.priorities[1].model_copy(update={"name": "bulk"})]
        }
    )
    assert plan_reload(started, renamed).restart_only == ["priorities"]
    reserved = started.model_copy(
        update={
            "priorities": [
                started.priorities[0].model_copy(update={"reserved_slots": 1}),
                started.priorities[1],
            ]
        }
    )
    plan = plan_reload(started, reserved)
    assert plan.restart_only == ["priorities[high]: reserved_slots"] and plan.live == []
    assert plan.applied.priorities[0].reserved_slots == 0


def test_tenants_that_break_a_rule_of_the_whole_config_are_refused():
    old = config({"name": "a", "api_keys": ["key-a-0001"]})
    new = config({"name": "a", "api_keys": ["key-a-0001"]})
    keyless = new.model_copy(
        update={"tenants": [*new.tenants, new.tenants[0].model_copy(update={"name": "k", "api_keys": []})]}
    )
    with pytest.raises(ConfigError, match="api_keys"):
        plan_reload(old, keyless)


def test_the_access_log_is_live_on_a_reload():
    old = config()
    new = parse_settings(old.model_dump() | {"access_log": {"enabled": False, "format": "json"}})
    plan = plan_reload(old, new)
    assert plan.live == ["access_log"] and plan.restart_only == []
    assert (plan.applied.access_log.enabled, plan.applied.access_log.format) == (False, "json")
