"""Gateway replicas on one Redis, for the tests that cut or kill one of them."""

from __future__ import annotations

from typing import Any

from tests.integration.servers import gateway_config


def replica_config(
    sim_url: str,
    redis_url: str,
    prefix: str,
    *,
    slots: int,
    service_s: float,
    lease_ttl_s: float,
    upstream_timeout_s: float,
    **store: Any,
) -> dict[str, Any]:
    """One of two replicas (store.replicas 2) sharing `slots` of the sim through `redis_url`, one
    class with room to queue, requests of `service_s`, bounded by `upstream_timeout_s`."""
    config = gateway_config(
        [(sim_url, slots)],
        priorities=[{"name": "low", "max_wait_ms": 30_000}],
        default_priority="low",
        expected_service_ms=service_s * 1000,
        store={
            "kind": "redis",
            "url": redis_url,
            "key_prefix": prefix,
            "lease_ttl_ms": lease_ttl_s * 1000,
            "replicas": 2,
            **store,
        },
    )
    config["models"][0]["upstream_timeout_ms"] = upstream_timeout_s * 1000
    return config
