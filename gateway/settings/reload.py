"""What a reloaded config changes now, and what only a restart would: `plan_reload(old, new)`.

Live: the tenants' keys, names (a tenant added, or removed: its keys stop working, its queued work
is still served) and `max_priority`, which decide how a request is classified, and their `weight`,
which fair queuing reads at every hand-over; and each class's `max_wait_ms`, which admission reads
for each arrival (the classes themselves, their names and order, stay: the queues are laid out by
them; a request queued before keeps the allowance it was admitted with); and the access log
(`access_log`: on or off, its format and rate, from the next request). Everything else waits for
a restart and is reported,
never half-applied: listeners and TLS (sockets are bound), the store, classes (the queues are laid
out by them), models and backends, quotas and windows (the stores and admission hold them). A
request admitted before a reload keeps the class and tenant it was admitted under.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.settings import PriorityClass, Settings, Tenant, parse_settings

LIVE_TENANT_FIELDS = frozenset({"name", "api_keys", "max_priority", "weight"})


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    applied: Settings
    """The settings that run once the reload is applied: the old ones, with the live changes."""
    live: list[str]
    """The changes applied, described (never a key)."""
    restart_only: list[str]
    """The changes seen and not applied: they take a restart."""


def plan_reload(old: Settings, new: Settings, running: Settings | None = None) -> ReloadPlan:
    """The plan to go from the config `old` (as the process started with it) to the config `new`;
    `running`: the settings that run where they are not `old` itself (the command line's overrides,
    a port bound for 0, earlier reloads), which the applied settings are made from. A change that
    takes a restart is reported at every reload until one. ConfigError when the applied settings
    would not be a valid config (new tenants beside the old classes, say)."""
    live_sections = ("tenants", "priorities", "access_log")
    restart = [f for f in Settings.model_fields if f not in live_sections and _differs(old, new, f)]
    base = running or old
    priorities, classes_live, classes_held = _classes(base, new)
    restart += classes_held
    before = {t.name: t for t in base.tenants}  # as they run: earlier reloads' changes in
    merged: list[Tenant] = []
    live: list[str] = []
    for tenant in new.tenants:
        kept = before.get(tenant.name) or Tenant(name=tenant.name)
        scheduled = {f: getattr(kept, f) for f in Tenant.model_fields if f not in LIVE_TENANT_FIELDS}
        held = sorted(f for f, value in scheduled.items() if getattr(tenant, f) != value)
        if held:
            restart.append(f"tenants[{tenant.name}]: {', '.join(held)}")
        merged.append(tenant.model_copy(update=scheduled))
        if tenant.name not in before:
            live.append(f"tenants[{tenant.name}] added")
        elif changed := sorted(f for f in LIVE_TENANT_FIELDS if _differs(before[tenant.name], tenant, f)):
            live.append(f"tenants[{tenant.name}]: {', '.join(changed)}")
    names = {t.name for t in new.tenants}
    live += [f"tenants[{name}] removed" for name in before if name not in names]
    live += classes_live
    if _differs(base, new, "access_log"):
        live.append("access_log")
    document = base.model_dump()
    document["access_log"] = new.access_log.model_dump()
    document["tenants"] = [t.model_dump() for t in merged]
    document["priorities"] = [p.model_dump() for p in priorities]
    applied = parse_settings(document, "the reloaded config")  # the cross-references checked again
    return ReloadPlan(applied, live, restart)


def _classes(base: Settings, new: Settings) -> tuple[list[PriorityClass], list[str], list[str]]:
    """The classes as they run after the reload, the live changes to them and the held ones: with
    the same names in the same order, each class's `max_wait_ms` is live; anything else about them
    takes a restart."""
    if [p.name for p in base.priorities] != [p.name for p in new.priorities]:
        return list(base.priorities), [], ["priorities"]
    classes, live, held = [], [], []
    for running, wanted in zip(base.priorities, new.priorities, strict=True):
        others = sorted(
            f for f in PriorityClass.model_fields if f != "max_wait_ms" and _differs(running, wanted, f)
        )
        if others:
            held.append(f"priorities[{running.name}]: {', '.join(others)}")
        if running.max_wait_ms != wanted.max_wait_ms:
            live.append(f"priorities[{running.name}]: max_wait_ms")
        classes.append(running.model_copy(update={"max_wait_ms": wanted.max_wait_ms}))
    return classes, live, held


def _differs(old: object, new: object, field: str) -> bool:
    return bool(getattr(old, field) != getattr(new, field))
