"""Load and validate the YAML config into frozen settings, with errors that name the field.

The sections live in gateway.settings.serving and gateway.settings.tuning; every name is
importable from here.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, model_validator

from gateway.settings.base import ConfigError, Frozen, Name, PositiveMs
from gateway.settings.serving import (
    AccessLog,
    Backend,
    BackendTls,
    Batching,
    Forwarding,
    ForwardPriority,
    Limits,
    Listen,
    Model,
    PriorityClass,
    Shutdown,
    Tenant,
    Tls,
)
from gateway.settings.store import Store
from gateway.settings.tuning import Admission, Autoscaling, Estimation, Health, Kueue, RetryAfter, Signals
from gateway.settings.windows import TimeWindow
from policies.admission import AdmissionConfig
from policies.calibration import CalibrationConfig
from policies.ordering import Ordering
from policies.queued_bytes import ByteLimits
from policies.quotas import Quota

__all__ = [
    "AccessLog",
    "Admission",
    "Autoscaling",
    "Backend",
    "BackendTls",
    "Batching",
    "ConfigError",
    "Estimation",
    "ForwardPriority",
    "Forwarding",
    "Health",
    "Kueue",
    "Limits",
    "Listen",
    "Model",
    "Name",
    "PositiveMs",
    "PriorityClass",
    "RetryAfter",
    "Settings",
    "Shutdown",
    "Signals",
    "Store",
    "Tenant",
    "TimeWindow",
    "Tls",
    "key_digest",
    "load_settings",
    "parse_settings",
]


class Settings(Frozen):
    listen: Listen = Listen()
    admin_listen: Listen | None = None
    """Serve /metrics, /healthz and /readyz here, and not on the client listener."""
    grpc_listen: Listen | None = None
    """Serve KServe v2 / Triton gRPC (`inference.GRPCInferenceService`) here too."""
    store: Store = Store()
    priorities: list[PriorityClass] = Field(min_length=1)
    default_priority: str
    priority_levels: dict[Annotated[int, Field(ge=1, le=2**63)], str] = Field(default_factory=dict)
    """Triton's `priority` request parameter (1 the highest; tritonclient's `priority=`,
    perf_analyzer's) -> class, for a request that sends no X-Priority; 0, Triton's default, is the
    default class, and a level not listed is refused (unknown_priority)."""
    ordering: Ordering = Ordering.FIFO
    models: list[Model] = Field(min_length=1)
    tenants: list[Tenant] = Field(default_factory=list)
    windows: list[TimeWindow] = Field(default_factory=list)
    """Named weekly windows of local time that classes and tenants refer to (only_in, weight_in)."""
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
    access_log: AccessLog = AccessLog()

    def config_hash(self) -> str:
        """A digest of the settings as loaded (keys digested too), the same for the same config on
        every replica: what the status page shows, to tell replicas' configs apart. The listeners'
        ports are left out: a replica told port 0 runs with the one it bound."""
        settings = self.model_dump(mode="json")
        for listener in ("listen", "admin_listen", "grpc_listen"):
            if settings.get(listener):
                settings[listener].pop("port", None)
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()

    @model_validator(mode="after")
    def _cross_references(self) -> Settings:
        class_names = [p.name for p in self.priorities]
        _unique("priorities", class_names)
        _unique("models", [m.name for m in self.models])
        _unique("tenants", [t.name for t in self.tenants])
        _unique_keys(self.tenants)
        keyed = [t.name for t in self.tenants if t.api_keys]
        if keyed and len(keyed) != len(self.tenants):
            keyless = [t.name for t in self.tenants if not t.api_keys]
            raise ValueError(f"tenants {keyless} have no api_keys: give every tenant keys, or none")
        admin = self.admin_listen
        if admin is not None and admin.port != 0 and admin.port == self.listen.port:
            raise ValueError("admin_listen must use another port than listen")
        taken = {self.listen.port, *([admin.port] if admin is not None else [])}
        if self.grpc_listen is not None and self.grpc_listen.port != 0 and self.grpc_listen.port in taken:
            raise ValueError("grpc_listen must use another port than listen and admin_listen")
        decoupled = [m.name for m in self.models if m.decoupled]
        if decoupled and self.grpc_listen is None:
            raise ValueError(
                f"models {decoupled} are decoupled: their requests come on gRPC, set grpc_listen"
            )
        if self.default_priority not in class_names:
            raise ValueError(f"default_priority {self.default_priority!r} is not one of {class_names}")
        for level, name in self.priority_levels.items():
            if name not in class_names:
                raise ValueError(f"priority_levels[{level}]: {name!r} is not one of {class_names}")
        _unique("windows", [w.name for w in self.windows])
        window_names = {w.name for w in self.windows}
        named = [(f"class {p.name!r}", p.only_in) for p in self.priorities]
        named += [(f"tenant {t.name!r}", t.only_in) for t in self.tenants]
        named += [(f"tenant {t.name!r}", name) for t in self.tenants for name in t.weight_in]
        named += [(f"class {p.name!r}", name) for p in self.priorities for name in p.reserved_slots_in]
        for owner, window in named:
            if window is not None and window not in window_names:
                raise ValueError(f"{owner}: no window named {window!r} (windows: {sorted(window_names)})")
        for model in self.models:
            for backend in model.backends:
                forward = backend.forward_priority
                unknown = sorted(set(forward.values) - set(class_names)) if forward else []
                if unknown:
                    raise ValueError(f"model {model.name!r}: forward_priority names no class {unknown}")
        for tenant in self.tenants:
            limits = tenant.borrowing_limit is not None or tenant.lending_limit is not None
            if limits and tenant.quota is None:
                raise ValueError(f"tenant {tenant.name!r}: borrowing and lending limits need a quota")
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
        return AdmissionConfig(
            safety_sigmas=self.admission.safety_sigmas,
            retry=self.retry_after.policy(),
            calibration=CalibrationConfig(target_expiry=self.admission.target_expiry),
            room_for_costliest=self.admission.room_for_costliest,
        )

    def queued_byte_limits(self) -> ByteLimits:
        per_model = {m.name: m.max_queued_bytes for m in self.models if m.max_queued_bytes is not None}
        return ByteLimits(self.limits.max_queued_bytes, per_model)

    def backend_connections(self) -> int:
        """Connections the backends (a slot each, as configured) and the Redis pool may take."""
        slots = sum(
            b.max_concurrency_cap if b.auto_concurrency else b.fixed_slots or 0
            for m in self.models
            for b in m.backends
        )
        return slots + (self.store.pool_size if self.store.kind == "redis" else 0)

    def reserved_slots(self) -> tuple[int, ...]:
        """Per band, the slots its class reserves from the less urgent ones, outside its windows."""
        return tuple(p.reserved_slots for p in self.priorities)

    def quotas(self) -> dict[str, Quota]:
        """The tenants' quotas (policies.quotas), of those that have one."""
        return {
            t.name: Quota(
                t.quota,
                math.inf if t.borrowing_limit is None else t.borrowing_limit,
                math.inf if t.lending_limit is None else t.lending_limit,
            )
            for t in self.tenants
            if t.quota is not None
        }

    def tenant_weights(self) -> dict[str, float]:
        """Each configured tenant's weight in fair queuing."""
        return {t.name: t.weight for t in self.tenants}

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


def _unique_keys(tenants: list[Tenant]) -> None:
    """Every api key names one tenant; an error says whose keys collide, never the key."""
    holder: dict[bytes, str] = {}
    for tenant in tenants:
        for index, key in enumerate(tenant.api_keys):
            digest = key_digest(key)
            if (first := holder.get(digest)) is not None:
                both = first if first == tenant.name else f"{first!r} and {tenant.name!r}"
                whose = f"tenant {first!r}" if first == tenant.name else f"tenants {both}"
                raise ValueError(
                    f"{whose}: one api key is listed twice (api_keys[{index}] of {tenant.name!r};"
                    " the key is not shown)"
                )
            holder[digest] = tenant.name


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
        raise ConfigError(source, [_yaml_problem(error)]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, ["the top level must be a mapping of keys"])
    return parse_settings(data, source)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML syntax error as `line L, column C: what` (the file is named by ConfigError), not as
    PyYAML prints it, which names the text it was given ("<unicode string>") for the file."""

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark, context_mark = getattr(error, "problem_mark", None), getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f"{at(mark)}: " if mark is not None else ""
    context = getattr(error, "context", None)
    if context and context_mark is not None:
        context += f" begun at {at(context_mark)}"
    return f"not valid YAML: {where}{problem}" + (f" ({context})" if context else "")


def _describe(error: Any) -> str:
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {message}" if path else message
