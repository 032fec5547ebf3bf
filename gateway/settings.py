"""Load and validate the YAML config into frozen settings, with errors that name the field."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policies.admission import AdmissionConfig
from policies.ordering import Ordering
from policies.queued_bytes import ByteLimits
from policies.retry_after import RetryAfterConfig

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")]
PositiveMs = Annotated[float, Field(gt=0)]


class ConfigError(Exception):
    """The config cannot be used; `problems` lists one line per field."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.source = source
        self.problems = problems


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    return value.rstrip("/")


class Listen(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class Store(_Frozen):
    kind: Literal["memory", "redis"] = "memory"
    url: str | None = None  # redis://host:port/db, required for kind: redis
    key_prefix: str = Field("gw", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    lease_ttl_ms: PositiveMs = 5000.0
    """A replica that stops renewing its slots loses them after this long."""
    pool_size: int = Field(64, ge=2, le=10_000)
    timeout_ms: PositiveMs = 1000.0
    """A Redis command slower than this counts as Redis being unreachable."""
    on_store_failure: Literal["local", "reject"] = "local"
    """local: fall back to in-memory queues with a share of the slots; reject: answer 503."""
    replicas: int = Field(1, ge=1, le=10_000)
    """How many gateway replicas share the backends: the local fallback gets slots / replicas."""
    fallback_max_ms: PositiveMs = 30_000.0
    """local: a replica cut off from Redis serves from its fallback at most this long after its last
    heartbeat, then answers 503; the others keep its slots reserved that long + upstream_timeout_ms."""

    @model_validator(mode="after")
    def _redis_needs_url(self) -> Store:
        if self.kind == "redis":
            if not self.url:
                raise ValueError("store.url is required for kind: redis")
            if urlsplit(self.url).scheme not in ("redis", "rediss", "unix"):
                raise ValueError("store.url must be a redis://, rediss:// or unix:// URL")
        return self


class PriorityClass(_Frozen):
    name: Name
    max_wait_ms: PositiveMs


_HEALTH_PATHS = {"kserve": "/v2/health/ready", "triton": "/v2/models/{model}/ready", "vllm": "/health"}
# vLLM stops generating when its client goes away; Triton and KServe servers compute on.
_ON_ABANDON = {"kserve": "drain", "triton": "drain", "vllm": "abort"}


class BackendTls(_Frozen):
    ca_file: str | None = None
    """CAs to trust instead of the system's."""
    cert_file: str | None = None
    """A client certificate (PEM) for backends that ask for one; key_file holds its key."""
    key_file: str | None = None
    verify: bool = True
    """false accepts any certificate (test rigs only)."""

    @model_validator(mode="after")
    def _key_with_cert(self) -> BackendTls:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file")
        return self


class Backend(_Frozen):
    url: str
    kind: Literal["kserve", "triton", "vllm"] = "kserve"
    """triton: readiness and capacity are discovered with tritonclient (model config)."""
    max_concurrency: int | None = Field(None, ge=1, le=100_000)
    """Slots; for kind triton it defaults to instances x max_batch_size (with dynamic batching)."""
    metrics_url: str | None = None
    """Triton's or vLLM's /metrics: its queue counts into admission and dispatch."""
    served_model: str | None = None
    """The model's name on this backend, when it differs from the name clients use."""
    discover: Literal["none", "dns"] = "none"
    """dns: one backend per address the URL's host resolves to (a headless Service's pods)."""
    health_path: str | None = None
    """Defaults by kind: /v2/health/ready, /v2/models/{model}/ready, /health ({model}: served name)."""
    on_abandon: Literal["abort", "drain"] | None = None
    """A request whose client left: abort closes the connection (for backends that stop on it, vllm's
    default), drain reads the answer to its end (kserve, triton); the slot is held till then."""
    keepalive_ms: PositiveMs = 1500.0
    """Idle pooled connections older than this are not reused: keep it below the backend's own
    idle timeout (gunicorn 2 s, uvicorn 5 s)."""
    max_answer_head_bytes: int = Field(16 * 1024, ge=1024, le=1 << 20)
    """An answer's status line and headers may take this much; more is a broken backend (502)."""
    tls: BackendTls = BackendTls()
    """For https:// backends."""

    @model_validator(mode="after")
    def _slots_known(self) -> Backend:
        if self.max_concurrency is None and self.kind != "triton":
            raise ValueError("max_concurrency is required unless kind is triton (discovered)")
        return self

    @property
    def readiness_path(self) -> str:
        return self.health_path or _HEALTH_PATHS[self.kind]

    @property
    def abandon_mode(self) -> Literal["abort", "drain"]:
        return self.on_abandon or _ON_ABANDON[self.kind]  # type: ignore[return-value]

    _check_url = field_validator("url")(_http_url)

    @field_validator("metrics_url")
    @classmethod
    def _check_metrics_url(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value)

    @field_validator("health_path")
    @classmethod
    def _check_health_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("must start with /")
        return value


class Model(_Frozen):
    name: Name
    backends: list[Backend] = Field(min_length=1)
    expected_service_ms: PositiveMs = 100.0
    """The service time assumed until one is measured."""
    upstream_timeout_ms: PositiveMs = 300_000.0
    max_queued_bytes: int | None = Field(None, ge=1)
    """The most request-body bytes one replica holds queued for this model (limits.max_queued_bytes
    bounds all models together)."""


class Tenant(_Frozen):
    name: Name
    api_keys: list[Annotated[str, Field(min_length=8, max_length=512)]] = Field(min_length=1)
    max_priority: str | None = None
    """The most urgent class this tenant may ask for; None allows every class."""


class Limits(_Frozen):
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1)
    max_priority_header_bytes: int = Field(64, ge=1)
    max_header_bytes: int = Field(32 * 1024, ge=1024, le=1 << 24)
    """A request's line and headers together; more is answered 431."""
    max_headers: int = Field(100, ge=8, le=10_000)
    """Header fields per request; more is answered 431."""
    header_timeout_ms: PositiveMs = 10_000.0
    """A request's head must arrive within this long of its first byte (of a new connection's start)."""
    body_timeout_ms: PositiveMs = 60_000.0
    """A request's body must arrive within this long of its headers."""
    max_connections: int | None = Field(None, ge=16)
    """Client connections at once, both listeners together (default: from the open-file limit); at
    it, the one waiting longest without a request in progress is closed for a new one."""
    max_queued_bytes: int = Field(512 * 1024 * 1024, ge=1)
    """The most request-body bytes one replica holds queued, all models together; a request that
    would go beyond is refused 429 queue_full with Retry-After."""


class RetryAfter(_Frozen):
    min_ms: PositiveMs = 10.0
    max_ms: PositiveMs = 60_000.0
    jitter: float = Field(0.1, ge=0.0, lt=1.0)
    adapt_s: float = Field(5.0, gt=0)
    """How fast the advice stretches while refused clients keep coming back too soon."""

    @model_validator(mode="after")
    def _min_below_max(self) -> RetryAfter:
        if self.min_ms > self.max_ms:
            raise ValueError("min_ms must not exceed max_ms")
        return self

    def policy(self) -> RetryAfterConfig:
        return RetryAfterConfig(
            min_s=self.min_ms / 1000, max_s=self.max_ms / 1000, jitter=self.jitter, adapt_tau_s=self.adapt_s
        )


class Admission(_Frozen):
    safety_sigmas: float = Field(2.0, ge=0.0, le=10.0)
    """Standard deviations of margin on the predicted queue wait and on the service time."""


class Signals(_Frozen):
    scrape_interval_ms: PositiveMs = 1000.0
    scrape_timeout_ms: PositiveMs = 800.0
    stale_after_failures: int = Field(3, ge=1)
    """A source that fails this many scrapes in a row is stale: decisions stop using it."""
    discovery_interval_ms: PositiveMs = 10_000.0
    """How often Triton backends' model config is read again."""
    endpoints_interval_ms: PositiveMs = 5_000.0
    """How often `discover: dns` backends' names are resolved again."""


class Kueue(_Frozen):
    url: str
    """The Kueue controller's metrics endpoint, usually https://...:8443/metrics."""
    cluster_queue: str
    """The ClusterQueue the serving fleet is admitted through."""
    bearer_token_file: str | None = None
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    backlog_pending_workloads: float = Field(10.0, gt=0)
    """The queue counts as backlogged above this many pending (active) workloads ..."""
    backlog_admission_wait_p95_s: float = Field(120.0, gt=0)
    """... or when the admission wait's p95 over the last scrape interval exceeds this."""

    _check_url = field_validator("url")(_http_url)


class Health(_Frozen):
    interval_ms: PositiveMs = 1000.0
    timeout_ms: PositiveMs = 1000.0
    failures_to_down: int = Field(2, ge=1)
    """Failed probes in a row before a backend counts as down (a refused connection counts at once)."""
    passive_failures_to_open: int = Field(5, ge=1)
    """Data-path failures in a row (timeouts, stalled or cut-off answers, 502/503/504) that open a
    backend's circuit: it gets no new requests though its health checks pass."""
    stall_timeout_ms: PositiveMs = 30_000.0
    """A backend with requests in flight that sends no byte of any answer for this long is failing."""
    cooldown_ms: PositiveMs = 5_000.0
    """An open circuit half-opens after this long: one trial request decides whether it closes."""


class Estimation(_Frozen):
    service_time_weight: float = Field(0.1, gt=0, le=1)
    """EWMA weight of each new service-time sample."""
    drain_window_s: float = Field(2.0, gt=0)
    """Seconds of backlog over which the drain rate is averaged (exponentially forgotten)."""
    rate_window_s: float = Field(2.0, gt=0)
    """Time constant of the arrival-rate estimates."""
    drain_stale_after_s: float = Field(10.0, gt=0)
    """A drain rate measured longer ago than this falls back to slots / service time."""
    handover_cost_weight: float = Field(0.1, ge=0, le=1)
    """EWMA weight of each hand-over's work in the mean work per hand-over (0 keeps it at 1)."""


class Autoscaling(_Frozen):
    """The replica-count hint exported for the autoscaler (gateway_desired_replicas)."""

    target_wait_ms: PositiveMs = 100.0
    """The mean queue wait the fleet should keep to."""
    target_p_wait: float | None = Field(None, gt=0, le=1)
    """Optionally also: the largest acceptable probability of waiting at all."""
    max_utilization: float = Field(0.8, gt=0, le=1)
    window_s: float = Field(30.0, gt=0)
    """Arrival rates are averaged over this long (exponentially forgotten)."""
    scale_down_window_s: float = Field(300.0, ge=0)
    """A lower answer is published only after it has held this long (no flapping)."""
    interval_ms: PositiveMs = 1000.0


class Forwarding(_Frozen):
    """What of the client's request the backend does not see."""

    strip_request_headers: list[str] = ["x-tenant", "x-priority", "x-request-timeout-ms"]
    """The gateway's own control headers, dropped before forwarding. Authorization is dropped too
    whenever tenants are configured: the key is the gateway's then, not the backend's."""
    forwarded_for: bool = True
    """Append the client's address to X-Forwarded-For (a client's own value is kept in front of it,
    never taken as the client's address)."""


class Shutdown(_Frozen):
    drain_timeout_ms: PositiveMs = 30_000.0


class Settings(_Frozen):
    listen: Listen = Listen()
    admin_listen: Listen | None = None
    """Serve /metrics, /healthz and /readyz here, and not on the client listener."""
    store: Store = Store()
    priorities: list[PriorityClass] = Field(min_length=1)
    default_priority: str
    ordering: Ordering = Ordering.FIFO
    models: list[Model] = Field(min_length=1)
    tenants: list[Tenant] = []
    limits: Limits = Limits()
    admission: Admission = Admission()
    retry_after: RetryAfter = RetryAfter()
    health: Health = Health()
    signals: Signals = Signals()
    kueue: Kueue | None = None
    autoscaling: Autoscaling = Autoscaling()
    estimation: Estimation = Estimation()
    forwarding: Forwarding = Forwarding()
    shutdown: Shutdown = Shutdown()

    @model_validator(mode="after")
    def _cross_references(self) -> Settings:
        class_names = [p.name for p in self.priorities]
        _unique("priorities", class_names)
        _unique("models", [m.name for m in self.models])
        _unique("tenants", [t.name for t in self.tenants])
        _unique("tenants api_keys", [key for t in self.tenants for key in t.api_keys])
        admin = self.admin_listen
        if admin is not None and admin.port != 0 and admin.port == self.listen.port:
            raise ValueError("admin_listen must use another port than listen")
        if self.default_priority not in class_names:
            raise ValueError(f"default_priority {self.default_priority!r} is not one of {class_names}")
        for tenant in self.tenants:
            if tenant.max_priority is not None and tenant.max_priority not in class_names:
                problem = f"max_priority {tenant.max_priority!r} is not one of {class_names}"
                raise ValueError(f"tenant {tenant.name!r}: {problem}")
        return self

    def band_of(self, class_name: str) -> int | None:
        for band, priority in enumerate(self.priorities):
            if priority.name == class_name:
                return band
        return None

    def admission_policy(self) -> AdmissionConfig:
        return AdmissionConfig(safety_sigmas=self.admission.safety_sigmas, retry=self.retry_after.policy())

    def queued_byte_limits(self) -> ByteLimits:
        per_model = {m.name: m.max_queued_bytes for m in self.models if m.max_queued_bytes is not None}
        return ByteLimits(self.limits.max_queued_bytes, per_model)

    def backend_connections(self) -> int:
        """Connections the backends (a slot each, as configured) and the Redis pool may take."""
        slots = sum(b.max_concurrency or 0 for m in self.models for b in m.backends)
        return slots + (self.store.pool_size if self.store.kind == "redis" else 0)

    def api_key_digests(self) -> dict[bytes, Tenant]:
        """Tenants by the SHA-256 of their keys, so lookups never compare secrets directly."""
        return {key_digest(key): t for t in self.tenants for key in t.api_keys}


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def _unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what}: {name!r} appears twice")
        seen.add(name)


def parse_settings(data: Any, source: str = "config") -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as error:
        raise ConfigError(source, [_describe(e) for e in error.errors()]) from None


def load_settings(path: str | Path) -> Settings:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(source, [f"cannot read: {error.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(source, [f"not valid YAML: {error}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, ["the top level must be a mapping of keys"])
    return parse_settings(data, source)


def _describe(error: Any) -> str:
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {message}" if path else message
