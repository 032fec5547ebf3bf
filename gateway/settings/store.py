"""Settings of the store the replicas share their queues and slots through: in memory (one
replica), or Redis (one server, behind Sentinel, or a Cluster)."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from gateway.settings.base import Frozen, Name, PositiveMs


class RedisSentinel(Frozen):
    """Redis behind Sentinel: the replicas ask the sentinels where the master is, and follow it when
    a replica is promoted."""

    master: Name
    """The name the sentinels monitor the master by (`sentinel monitor <master> ...`)."""
    nodes: list[Annotated[str, Field(pattern=r"^[^\s:]+:[0-9]{1,5}$")]] = Field(min_length=1)
    """The sentinels, host:port each."""

    def addresses(self) -> list[tuple[str, int]]:
        return [(host, int(port)) for host, _, port in (node.rpartition(":") for node in self.nodes)]


class Store(Frozen):
    kind: Literal["memory", "redis"] = "memory"
    url: str | None = None
    """redis://host:port/db (or rediss://, unix://), required for kind: redis unless `sentinel` is
    set; beside `sentinel` it gives only the password, the db and the scheme, its host unused."""
    sentinel: RedisSentinel | None = None
    cluster: bool = False
    """Redis Cluster: `url` names one node, the client finds the rest. Each model's keys share one
    hash slot, so its scripts run on one master; models spread over the masters by their names."""
    key_prefix: str = Field("gw", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    lease_ttl_ms: PositiveMs = 5000.0
    """A replica that stops renewing its slots loses them after this long."""
    pool_size: int = Field(64, ge=2, le=10_000)
    """Connections the replica's commands take turns on; more in flight wait for one."""
    timeout_ms: PositiveMs = 1000.0
    """A Redis command slower than this counts as Redis being unreachable (a wait for a pooled
    connection does not)."""
    on_store_failure: Literal["local", "reject"] = "local"
    """local: fall back to in-memory queues with a share of the slots; reject: answer 503."""
    replicas: int = Field(1, ge=1, le=10_000)
    """How many gateway replicas share the backends: the local fallback gets slots / replicas."""
    fallback_max_ms: PositiveMs = 30_000.0
    """local: a replica cut off from Redis serves from its fallback at most this long after its last
    heartbeat, then answers 503; the others keep its slots reserved that long + upstream_timeout_ms."""
    peer_port: int | None = Field(0, ge=0, le=65535)
    """The replica's beacon (0: a free port; null: none): when a replica's heartbeat lapses, the others
    connect to its beacon, and a refusal there or another replica's answer proves it dead, so its
    slots come back in seconds instead of at their full bounds (gateway/queues/redis/peers.py)."""
    peer_address: str | None = None
    """The host other replicas reach the beacon at (a pod's IP); by default the client listener's
    host, or when that is a wildcard, this host's name resolved (not a loopback address)."""

    @property
    def mode(self) -> str:
        """memory, or how the replicas reach Redis: one server, behind Sentinel, or a Cluster."""
        if self.kind == "memory":
            return "memory"
        return "cluster" if self.cluster else "sentinel" if self.sentinel is not None else "single"

    @model_validator(mode="after")
    def _redis_needs_url(self) -> Store:
        if self.kind == "redis":
            if self.cluster and self.sentinel is not None:
                raise ValueError("store.cluster and store.sentinel exclude each other (a cluster fails over)")
            if self.cluster and not self.url:
                raise ValueError("store.cluster needs store.url, naming one of its nodes")
            if not self.url and self.sentinel is None:
                raise ValueError("store.url (or store.sentinel) is required for kind: redis")
            if self.url and urlsplit(self.url).scheme not in ("redis", "rediss", "unix"):
                raise ValueError("store.url must be a redis://, rediss:// or unix:// URL")
        elif self.sentinel is not None or self.cluster:
            raise ValueError("store.sentinel and store.cluster are for kind: redis")
        return self
