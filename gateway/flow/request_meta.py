"""Who is asking, how urgently, and with what budget: the gateway's request headers, checked.

- `Authorization: Bearer <key>` names the tenant when keys are configured, else `X-Tenant` does;
  a request joins its tenant's flow (fair queuing by weight) when that is a configured tenant, the
  one unnamed flow otherwise, so flows and their metrics are configured names only;
- `X-Priority: <class>` picks the class, capped by the tenant's `max_priority`; without it, Triton's
  `priority` request parameter does where `priority_levels` maps it (`at_level`, once the ingress
  has read the request);
- `X-Request-Timeout-Ms: <int>` is the client's whole budget;
- `x-stainless-retry-count` (the openai SDK's) or `X-Retry-Attempt` above 0 marks a retry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.flow.admitted import RequestMeta
from gateway.settings import Settings, Tenant, key_digest
from policies.outcomes import Outcome

MAX_BUDGET_MS = 86_400_000
MAX_TENANT_BYTES = 128
MAX_AUTHORIZATION_BYTES = 1024


_RETRY_HEADERS = frozenset({b"x-stainless-retry-count", b"x-retry-attempt"})


def _counts_a_retry(value: bytes) -> bool:
    """A retry count above 0; anything else (0, junk) is not taken as one."""
    text = value.strip()
    return text.isdigit() and len(text) <= 9 and int(text) > 0


@dataclass(frozen=True, slots=True)
class Problem:
    outcome: Outcome
    detail: str


class RequestClassifier:
    def __init__(self, settings: Settings) -> None:
        self.reload(settings)

    def reload(self, settings: Settings) -> None:
        """Classify by `settings` from now on (a config reload: gateway.settings.reload). Its tables
        are replaced with no await between them: a request is classified by the old settings or the
        new, never a mix."""
        self._class_names = [p.name for p in settings.priorities]
        self._bands = {name.encode(): band for band, name in enumerate(self._class_names)}
        self._default_band = self._class_names.index(settings.default_priority)
        self._tenants_by_digest = settings.api_key_digests()
        self._tenants_by_name = {} if self._tenants_by_digest else {t.name: t for t in settings.tenants}
        self._priority_limit = settings.limits.max_priority_header_bytes
        self._levels = {
            level: self._class_names.index(name) for level, name in settings.priority_levels.items()
        }
        self._caps = {
            t.name: self._class_names.index(t.max_priority) for t in settings.tenants if t.max_priority
        }
        self.keyed = bool(self._tenants_by_digest)
        """Tenants are told apart by their keys (every caller needs one)."""

    def classify(self, headers: list[tuple[bytes, bytes]]) -> RequestMeta | Problem:
        priority = authorization = tenant_name = timeout = None
        retry = twice = False
        for key, value in headers:
            if key == b"x-priority":
                twice, priority = twice or priority is not None, value
            elif key == b"authorization":
                twice, authorization = twice or authorization is not None, value
            elif key == b"x-tenant":
                twice, tenant_name = twice or tenant_name is not None, value
            elif key == b"x-request-timeout-ms":
                twice, timeout = twice or timeout is not None, value
            elif key in _RETRY_HEADERS:
                retry = retry or _counts_a_retry(value)
        if twice:  # which one would count is anyone's guess: the gateway and its backend may differ
            detail = "X-Priority, X-Tenant, X-Request-Timeout-Ms and Authorization may each be sent once"
            return Problem(Outcome.BAD_REQUEST, detail)

        tenant: str | None = None
        found: Tenant | None = None
        if self._tenants_by_digest:
            found = self._tenant_for(authorization)
            if found is None:
                return Problem(Outcome.UNAUTHORIZED, "send Authorization: Bearer <key>")
            tenant = found.name
        elif tenant_name is not None:
            if len(tenant_name) > MAX_TENANT_BYTES or not tenant_name.isascii():
                detail = f"X-Tenant must be ASCII of at most {MAX_TENANT_BYTES} bytes"
                return Problem(Outcome.BAD_REQUEST, detail)
            tenant = tenant_name.decode().strip()
            found = self._tenants_by_name.get(tenant)
        cap_band = 0
        if found is not None and found.max_priority is not None:
            cap_band = self._class_names.index(found.max_priority)

        band = self._default_band
        if priority is not None:
            if len(priority) > self._priority_limit:
                return Problem(
                    Outcome.UNKNOWN_PRIORITY, f"X-Priority is longer than {self._priority_limit} bytes"
                )
            found_band = self._bands.get(priority.strip())
            if found_band is None:
                shown = priority.decode("ascii", "replace")
                expected = ", ".join(self._class_names)
                return Problem(Outcome.UNKNOWN_PRIORITY, f"{shown!r}; expected one of {expected}")
            band = found_band
        band = max(band, cap_band)

        budget_s: float | None = None
        if timeout is not None:
            text = timeout.strip()
            if not text.isdigit() or len(text) > 9 or not 0 < int(text) <= MAX_BUDGET_MS:
                return Problem(
                    Outcome.BAD_REQUEST,
                    f"X-Request-Timeout-Ms must be an integer from 1 to {MAX_BUDGET_MS}",
                )
            budget_s = int(text) / 1000
        flow_tenant = found.name if found is not None else ""
        return RequestMeta(self._class_names[band], band, tenant, budget_s, flow_tenant, retry)

    @property
    def reads_levels(self) -> bool:
        """Whether Triton's `priority` parameter picks the class of requests without X-Priority."""
        return bool(self._levels)

    def at_level(self, meta: RequestMeta, level: object) -> RequestMeta | Problem:
        """`meta`, of a request that sent no X-Priority, in the class of Triton's `priority`
        parameter `level` (None: it sent none), capped by its tenant's `max_priority`."""
        if level is None:
            return meta
        if isinstance(level, bool) or not isinstance(level, int) or level < 0:
            return Problem(Outcome.UNKNOWN_PRIORITY, "the priority parameter must be a non-negative integer")
        band = self._default_band if level == 0 else self._levels.get(level)
        if band is None:
            mapped = ", ".join(f"{n}: {self._class_names[b]}" for n, b in sorted(self._levels.items()))
            return Problem(
                Outcome.UNKNOWN_PRIORITY, f"priority {level} is not mapped (priority_levels: {mapped})"
            )
        band = max(band, self._caps.get(meta.flow_tenant, 0))
        return replace(meta, priority=self._class_names[band], band=band)

    def _tenant_for(self, authorization: bytes | None) -> Tenant | None:
        if authorization is None or len(authorization) > MAX_AUTHORIZATION_BYTES:
            return None
        scheme, _, key = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not key:
            return None
        return self._tenants_by_digest.get(key_digest(key.strip()))
