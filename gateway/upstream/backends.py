"""The gateway's view of each model server: where it is, how many slots it has, whether it is ready."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.settings import Backend, Batching, ForwardPriority, Model
from gateway.upstream.origin import DEFAULT_OPTIONS, ConnectionOptions, OnAbandon, TlsOptions
from gateway.upstream.reply import InFlight
from policies.batching import BatchLimits
from policies.circuit import CLOSED, Circuit, Quiet, slot_limit
from policies.token_costs import TokenCostModel, TokenPricing


@dataclass(slots=True, eq=False)
class BackendState:
    """One backend of one model. `inflight` is the slots this gateway holds on it.

    `ready` and `max_concurrency` are what the stores dispatch by: ready when its health checks
    pass and its circuit is not open; all its slots while the circuit is closed, one while it is
    half-open (the trial request), none while it is open. gateway.upstream.health keeps both.
    """

    model: str
    url: str
    known_slots: int
    """Its slots: 0 until known (a Triton backend's is discovered)."""
    health_path: str
    metrics_url: str | None = None
    kind: str = "kserve"
    served_model: str = ""
    configured_slots: bool = True
    ready: bool = False
    inflight: int = 0
    # What the backend itself reports (its /metrics), while that source is fresh.
    signal_up: bool = False
    reported_waiting: float = 0.0
    reported_running: float | None = None
    scraped_at: float | None = None
    """When its metrics were last read (the gateway's clock); None before the first reading."""
    max_batch_size: int = 0
    dynamic_batching: bool | None = None
    """Whether its model batches requests itself (a Triton model's dynamic batcher); None until read."""
    origin: str = ""
    """The configured URL this backend comes from (a discovered one: its host name's)."""
    on_abandon: OnAbandon = OnAbandon.DRAIN
    connection: ConnectionOptions = DEFAULT_OPTIONS
    probed_ready: bool = False
    """What its health checks (and refused connections) last said, whatever its circuit."""
    failed_probes: int = 0
    """Health checks failed in a row."""
    judged: bool = False
    """Whether its readiness has been logged once: every verdict after is a transition."""
    circuit: Circuit = CLOSED
    quiet: Quiet = field(default_factory=Quiet)
    """What the stall watch last saw of it."""
    in_flight: InFlight = field(default_factory=InFlight)
    """Its exchanges sent and not yet ended, and the answer bytes they brought (counted)."""
    forward_priority: ForwardPriority | None = None
    """How it is told each request's class (gateway.upstream.priority)."""
    grpc_port: int | None = None
    """Its KServe v2 gRPC port, on the host of `url` (a decoupled model's requests go there)."""
    deadlines_kept: int = 0
    deadlines_missed: int = 0
    """Requests with a deadline that it ended within it, and past it: the clients' objective for
    `max_concurrency: auto` (gateway.flow.auto_limits). Only those sent since `limit_moved_at`."""
    limit_moved_at: float = -math.inf
    """When `max_concurrency: auto` last moved its limit: a request sent before ends at the pace of
    the old limit, and its deadline tells nothing of the new one (counted, the deadlines missed
    after an overshoot went on cutting for seconds after the limit was back below the knee)."""

    @property
    def max_concurrency(self) -> int:
        """The slots the stores may fill, as its circuit allows (policies.circuit.slot_limit)."""
        return slot_limit(self.circuit, self.known_slots)

    @max_concurrency.setter
    def max_concurrency(self, slots: int) -> None:
        self.known_slots = slots

    @property
    def grpc_target(self) -> str:
        """Where its gRPC port listens, as grpc names it: host:port (of `url`'s host)."""
        host = urlsplit(self.url).hostname or "127.0.0.1"
        return f"[{host}]:{self.grpc_port}" if ":" in host else f"{host}:{self.grpc_port}"

    @classmethod
    def from_settings(cls, model: Model, backend: Backend, *, origin: str = "") -> BackendState:
        return cls(
            model=model.name,
            url=backend.url,
            known_slots=backend.fixed_slots or 0,
            health_path=backend.readiness_path.replace("{model}", backend.served_model or model.name),
            metrics_url=backend.metrics_url,
            kind=backend.kind,
            served_model=backend.served_model or model.name,
            configured_slots=backend.max_concurrency is not None,
            origin=origin or backend.url,
            on_abandon=OnAbandon(backend.abandon_mode),
            forward_priority=backend.forward_priority,
            grpc_port=backend.grpc_port,
            connection=ConnectionOptions(
                keepalive_s=backend.keepalive_ms / 1000,
                max_head_bytes=backend.max_answer_head_bytes,
                tls=TlsOptions(**backend.tls.model_dump()),
            ),
        )

    @property
    def external_waiting(self) -> float:
        """Requests queued inside the backend ahead of ours: its own count, while fresh."""
        return self.reported_waiting if self.signal_up else 0.0


@dataclass(slots=True, eq=False)
class ModelPool:
    name: str
    backends: list[BackendState] = field(default_factory=list)
    expected_service_s: float = 0.1
    upstream_timeout_s: float = 300.0
    max_queued_work: float | None = None
    """The most work queued for the model; a more urgent arrival displaces less urgent work."""
    priced_by_items: bool = False
    """A KServe inference request costs its batch size (else 1)."""
    batching: Batching | None = None
    """Gateway-side batching, as configured (None: off)."""
    token_costs: TokenCostModel | None = None
    """An OpenAI request costs its estimated tokens, learned by this (None: it costs 1)."""
    pins_sequences: bool = True
    """Its requests' sequences are read and pinned (policies.sequences): where it may have more than
    one backend. One fixed backend needs no pin, and its bodies no scan for one."""
    decoupled: bool = False
    """Its requests may get several responses each: served on gRPC streams, upstream over gRPC."""

    @property
    def batch_limits(self) -> BatchLimits | None:
        """How its requests are batched now; None while they pass alone.

        A Triton backend's model must have been read (gateway.upstream.discovery): with its own
        dynamic batcher on, or not batching at all (max_batch_size 0), the gateway leaves it be;
        its max_batch_size bounds the gateway's batches.
        """
        batching = self.batching
        if batching is None:
            return None
        largest = batching.max_batch_size or 1 << 30
        for backend in self.backends:
            if backend.kind == "triton":
                if backend.dynamic_batching is not False or backend.max_batch_size < 1:
                    return None
                largest = min(largest, backend.max_batch_size)
        if largest < 2:
            return None
        return BatchLimits(largest, batching.max_delay_ms / 1000, tuple(batching.preferred_batch_sizes))

    @property
    def any_ready(self) -> bool:
        return any(b.ready for b in self.backends)

    @property
    def external_waiting(self) -> float:
        """Requests queued inside the ready backends ahead of ours, as they report them."""
        return sum(b.external_waiting for b in self.backends if b.ready)

    @property
    def total_slots(self) -> int:
        return sum(b.max_concurrency for b in self.backends if b.ready)

    @classmethod
    def from_settings(cls, model: Model) -> ModelPool:
        return cls(
            name=model.name,
            # Backends found by DNS appear once their name resolves (gateway.upstream.endpoints).
            backends=[BackendState.from_settings(model, b) for b in model.backends if b.discover == "none"],
            expected_service_s=model.expected_service_ms / 1000,
            upstream_timeout_s=model.upstream_timeout_ms / 1000,
            max_queued_work=model.max_queued_work,
            priced_by_items=model.priced_by_items,
            batching=model.batching,
            token_costs=_token_costs(model),
            pins_sequences=len(model.backends) > 1 or any(b.discover != "none" for b in model.backends),
            decoupled=model.decoupled,
        )


def _token_costs(model: Model) -> TokenCostModel | None:
    if model.cost != "tokens":
        return None
    pricing = model.token_pricing
    return TokenCostModel(
        TokenPricing(pricing.prompt_weight, pricing.output_quantile, pricing.default_output_tokens)
    )
