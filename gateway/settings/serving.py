"""Settings of what the gateway serves: listeners, classes, models and backends, tenants,
limits, forwarding and shutdown."""

from __future__ import annotations

import ssl
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from gateway.settings.base import Frozen, Name, PositiveMs, http_url


class Tls(Frozen):
    """A listener's TLS: its certificate chain and key (PEM), and for mutual TLS the CA its clients'
    certificates must be signed by. Checked when the config loads: files that cannot be read, or a
    key that does not match its certificate, make the config invalid rather than the start fail."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    """Require a client certificate signed by this CA (PEM): mutual TLS."""

    @model_validator(mode="after")
    def _loads(self) -> Tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as error:
            raise ValueError(f"cannot load {self.cert_file} with {self.key_file}: {_reason(error)}") from None
        if self.client_ca_file is not None:
            try:
                context.load_verify_locations(self.client_ca_file)
            except (OSError, ssl.SSLError) as error:
                reason = _reason(error)
                raise ValueError(f"cannot load client_ca_file {self.client_ca_file}: {reason}") from None
        return self


def _reason(error: OSError | ssl.SSLError) -> str:
    if isinstance(error, ssl.SSLError):
        return error.reason or str(error)
    return error.strerror or str(error)


class Listen(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    tls: Tls | None = None
    """Serve TLS on this listener (HTTPS, or gRPC over TLS); plain when unset."""


class PriorityClass(Frozen):
    name: Name
    max_wait_ms: PositiveMs
    only_in: str | None = None
    """The name of a window (`windows`) outside which this class is refused (429 outside_window,
    Retry-After: until it opens)."""
    reserved_slots: int = Field(0, ge=0, le=1_000_000)
    """Slots of each model's pool that less urgent classes never hold (policies.reservations): an
    urgent request finds one free however the others flood. A pool with no more slots than the
    reservations above a class serves that class nothing."""
    reserved_slots_in: dict[str, Annotated[int, Field(ge=0, le=1_000_000)]] = Field(default_factory=dict)
    """Window name -> the slots it reserves while that window is open (the largest of those open;
    `reserved_slots` outside them)."""


_HEALTH_PATHS = {"kserve": "/v2/health/ready", "triton": "/v2/models/{model}/ready", "vllm": "/health"}
# vLLM stops generating when its client goes away; Triton and KServe servers compute on.
_ON_ABANDON = {"kserve": "drain", "triton": "drain", "vllm": "abort"}


class BackendTls(Frozen):
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


class ForwardPriority(Frozen):
    """The gateway's class of each request, told to an engine that schedules by priority, in the
    engine's own terms: vLLM's body field `priority` (lower first, with --scheduling-policy
    priority), Triton's request parameter `priority` (1 highest)."""

    field: str = Field("priority", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    """OpenAI routes: the body's field; KServe routes: the request's `parameters` entry."""
    values: dict[str, int]
    """Class name -> the engine's value. A class without one reaches the engine without the field:
    the client's own value is never passed on."""


class Backend(Frozen):
    url: str
    kind: Literal["kserve", "triton", "vllm"] = "kserve"
    """triton: readiness and capacity are discovered with tritonclient (model config)."""
    max_concurrency: int | Literal["auto"] | None = None
    """Slots; for kind triton it defaults to instances x max_batch_size (with dynamic batching).
    auto: found by the gateway from the backend's metrics (metrics_url), between min_concurrency
    and max_concurrency_cap, for engines with continuous batching (policies.concurrency_limit)."""
    min_concurrency: int = Field(1, ge=1, le=100_000)
    """auto: the limit never goes below this, and starts here."""
    max_concurrency_cap: int = Field(1024, ge=1, le=100_000)
    """auto: the limit never goes above this."""
    ttft_objective_ms: PositiveMs | None = None
    """auto: the engine's mean time to first token must stay within this (vLLM; none by default:
    the clients' deadlines are the objective)."""
    itl_objective_ms: PositiveMs | None = None
    """auto: the engine's mean inter-token latency must stay within this (vLLM; none by default)."""
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
    forward_priority: ForwardPriority | None = None
    """Tell the backend each request's class (none: the body passes as the client sent it)."""
    grpc_port: int | None = Field(None, ge=1, le=65535)
    """The backend's KServe v2 gRPC port on the url's host (Triton: 8001): a decoupled model's
    requests go there (gateway.upstream.streamed)."""

    @field_validator("max_concurrency", mode="before")
    @classmethod
    def _slots_or_auto(cls, value: object) -> object:
        """One clear message, where the union would give one per member."""
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("Input should be a whole number of slots, or auto")
        if not 1 <= value <= 100_000:
            raise ValueError("Input should be greater than or equal to 1 and at most 100000 (or auto)")
        return value

    @model_validator(mode="after")
    def _slots_known(self) -> Backend:
        if self.max_concurrency is None and self.kind != "triton":
            raise ValueError("max_concurrency is required unless kind is triton (discovered)")
        if self.max_concurrency == "auto":
            if self.metrics_url is None:
                raise ValueError("max_concurrency: auto needs metrics_url (the engine's own metrics)")
            if self.min_concurrency > self.max_concurrency_cap:
                raise ValueError("min_concurrency must not exceed max_concurrency_cap")
        return self

    @property
    def auto_concurrency(self) -> bool:
        return self.max_concurrency == "auto"

    @property
    def fixed_slots(self) -> int | None:
        """The configured slots; for auto, the limit it starts at."""
        if self.max_concurrency == "auto":
            return self.min_concurrency
        return self.max_concurrency

    @property
    def latency_objectives_s(self) -> tuple[float | None, float | None]:
        """(first token, inter-token) objectives of an auto limit, where the operator set them. None by
        default: the clients' deadlines are the objective (policies.concurrency_limit), and a fixed
        latency stricter than they ask would hold the limit below the engine's knee."""
        ttft, itl = self.ttft_objective_ms, self.itl_objective_ms
        return (None if ttft is None else ttft / 1000, None if itl is None else itl / 1000)

    @property
    def readiness_path(self) -> str:
        return self.health_path or _HEALTH_PATHS[self.kind]

    @property
    def abandon_mode(self) -> Literal["abort", "drain"]:
        return self.on_abandon or _ON_ABANDON[self.kind]  # type: ignore[return-value]

    _check_url = field_validator("url")(http_url)

    @field_validator("metrics_url")
    @classmethod
    def _check_metrics_url(cls, value: str | None) -> str | None:
        return None if value is None else http_url(value)

    @field_validator("health_path")
    @classmethod
    def _check_health_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("must start with /")
        return value


class Batching(Frozen):
    """Gateway-side micro-batching of a model's KServe v2 inference requests (gateway.flow.batch_calls)."""

    max_batch_size: int | None = Field(None, ge=1, le=65_536)
    """The most batch items one upstream call carries. None: a Triton model's own max_batch_size,
    read from its config (every backend must then be kind: triton)."""
    max_delay_ms: float = Field(5.0, ge=0, le=60_000)
    """How long a batch may wait for companions on the last free slot (policies.batching)."""
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """A batch that reaches one of these sizes leaves at once."""


class TokenPricing(Frozen):
    """How a model that prices by tokens estimates an OpenAI request's cost (policies.token_costs)."""

    prompt_weight: float = Field(0.5, ge=0, le=100)
    """What a prompt token costs against a generated one."""
    output_quantile: float = Field(0.9, ge=0.5, le=1.0)
    """The quantile of the recent completion lengths taken as a request's expected output."""
    default_output_tokens: int = Field(256, ge=1, le=1_000_000)
    """The expected output of a request without max_tokens, before any answer was seen."""


class Model(Frozen):
    name: Name
    backends: list[Backend] = Field(min_length=1)
    expected_service_ms: PositiveMs = 100.0
    """The service time assumed until one is measured."""
    upstream_timeout_ms: PositiveMs = 300_000.0
    cost: Literal["requests", "batch_items", "tokens"] = "requests"
    """What a request costs in work units (fair shares, quotas, queue caps, admission): 1 each, or
    for KServe inference its batch size (dimension 0 of its first input; gateway.http.pricing);
    tokens: an OpenAI request its estimated tokens (learned from the answers' usage), a KServe
    request its batch size."""
    token_pricing: TokenPricing = TokenPricing()
    max_queued_work: float | None = Field(None, gt=0)
    """The most work (in `cost` units) queued for this model: beyond it a more
    urgent arrival takes the place of the least urgent, newest queued request (429 displaced);
    with none less urgent it is refused queue_full. None: no cap but the classes' waits."""
    max_queued_bytes: int | None = Field(None, ge=1)
    """The most request-body bytes one replica holds queued for this model (limits.max_queued_bytes
    bounds all models together)."""
    batching: Batching | None = None
    """Merge queued KServe inference requests into one upstream call; off when absent. A Triton
    backend's model is batched only while its own dynamic batcher is off."""
    decoupled: bool = False
    """Each request may get several responses, or none (Triton's decoupled transaction policy, as
    its vLLM and TensorRT-LLM backends stream tokens): served on gRPC streams only, sent upstream
    over gRPC (every backend needs grpc_port), its slot held until the backend's final response."""

    @model_validator(mode="after")
    def _batching_counts_items(self) -> Model:
        if self.batching is None:
            return self
        if "cost" in self.model_fields_set and self.cost == "requests":
            raise ValueError("batching counts batch items: cost must be batch_items or tokens (or left out)")
        if self.batching.max_batch_size is None and any(b.kind != "triton" for b in self.backends):
            raise ValueError("batching.max_batch_size is required unless every backend is kind: triton")
        return self

    @model_validator(mode="after")
    def _decoupled_goes_over_grpc(self) -> Model:
        if not self.decoupled:
            return self
        if self.batching is not None:
            raise ValueError("a decoupled model's requests are not batched by the gateway: drop batching")
        if any(b.grpc_port is None for b in self.backends):
            raise ValueError("decoupled: every backend needs grpc_port (its responses stream over gRPC)")
        if any(b.url.startswith("https://") and not b.tls.verify for b in self.backends):
            raise ValueError("decoupled: tls.verify: false is not possible on gRPC, which always verifies")
        return self

    @property
    def priced_by_items(self) -> bool:
        """A KServe inference request costs its batch size: by `cost`, or because it may be batched."""
        return self.cost != "requests" or self.batching is not None


class Tenant(Frozen):
    name: Name
    api_keys: list[Annotated[str, Field(min_length=8, max_length=512)]] = Field(default_factory=list)
    """Keys that name this tenant (Authorization: Bearer). Either every tenant has keys, or none
    does and `X-Tenant` names them."""
    max_priority: str | None = None
    """The most urgent class this tenant may ask for; None allows every class."""
    weight: float = Field(1.0, gt=0, le=1e6)
    """Its share of a band's service against the other tenants with work queued there (fair
    queuing on cost); the unnamed flow of requests from no configured tenant weighs 1."""
    weight_in: dict[str, Annotated[float, Field(gt=0, le=1e6)]] = Field(default_factory=dict)
    """Window name -> its weight while that window is open (the largest of those open)."""
    only_in: str | None = None
    """The name of a window outside which this tenant's requests are refused."""
    quota: float | None = Field(None, ge=0)
    """Work in flight per model pool that is this tenant's own, in the model's cost units (requests,
    batch items, tokens); none: it owns nothing and runs on what others lend and no quota covers
    (the pool's slots times the mean work a slot takes)."""
    borrowing_limit: float | None = Field(None, ge=0)
    """The most work beyond its quota it may borrow (none: as much as is lendable)."""
    lending_limit: float | None = Field(None, ge=0)
    """The most of its unused quota others may borrow (none: all of it)."""


class AccessLog(Frozen):
    """One line per request on the `gateway.access` logger (gateway.telemetry.access_log); live on a
    config reload."""

    enabled: bool = True
    format: Literal["text", "json"] = "text"
    max_lines_per_s: float = Field(100.0, gt=0.0)
    """Lines a second at most (a second's worth at once): a refusal storm must not fill the disk.
    What is dropped is counted, and told in the next line."""


class Limits(Frozen):
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
    body_idle_ms: PositiveMs = 5_000.0
    """A body of which nothing came for this long (while the gateway reads) is stalled: at
    `max_connections` its connection is closed for a newcomer, as an idle one is, until it sends
    again. It is still cut only at `body_timeout_ms`."""
    send_timeout_ms: PositiveMs = 30_000.0
    """A client that takes none of its answer for this long, once the socket's buffer is full, is
    cut: a slot it holds goes back as if it had left."""
    max_connections: int | None = Field(None, ge=16)
    """Client connections at once, both listeners together (default: from the open-file limit); at
    it, the one waiting longest without a request in progress is closed for a new one."""
    max_queued_bytes: int = Field(512 * 1024 * 1024, ge=1)
    """The most request-body bytes one replica holds queued, all models together; a request that
    would go beyond is refused 429 queue_full with Retry-After."""


class Forwarding(Frozen):
    """What of the client's request the backend does not see."""

    strip_request_headers: list[str] = Field(
        default_factory=lambda: ["x-tenant", "x-priority", "x-request-timeout-ms"]
    )
    """The gateway's own control headers, dropped before forwarding. Authorization is dropped too
    whenever tenants are configured: the key is the gateway's then, not the backend's."""
    forwarded_for: bool = True
    """Append the client's address to X-Forwarded-For (a client's own value is kept in front of it,
    never taken as the client's address)."""


class Shutdown(Frozen):
    drain_timeout_ms: PositiveMs = 30_000.0
