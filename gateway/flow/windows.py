"""The configured time windows, read on the wall clock: which classes and tenants are open now, and
which weight a tenant has (policies.windows decides; this turns instants into local times)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from zoneinfo import ZoneInfo

from gateway.settings import Settings
from policies.windows import MINUTES_PER_DAY, Window, minutes_until_open


class WindowClock:
    """The windows of `settings`, on `clock` (epoch seconds)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._windows = {w.name: (w.policy(), ZoneInfo(w.tz)) for w in settings.windows}
        self._class_window = [p.only_in for p in settings.priorities]
        self._tenant_window = {t.name: t.only_in for t in settings.tenants if t.only_in}
        self._weights = {t.name: t.weight for t in settings.tenants}
        self._weight_in = {t.name: dict(t.weight_in) for t in settings.tenants if t.weight_in}
        self._reserved = settings.reserved_slots()
        self._reserved_in = [dict(p.reserved_slots_in) for p in settings.priorities]
        self._reserved_at: tuple[int, tuple[int, ...]] | None = None
        """The reservations last read, and the whole second of the clock they were read in."""

    def reload_weights(self, settings: Settings) -> None:
        """The tenants' weights from `settings` from now on (a reload changes nothing else here)."""
        self._weights = {t.name: t.weight for t in settings.tenants}

    @property
    def moves_reservations(self) -> bool:
        """Whether a class reserves more slots in some window (else `reserved_slots` never changes)."""
        return any(self._reserved_in)

    @property
    def restricts(self) -> bool:
        """Whether any class or tenant is kept to a window (else `closed_for` is always None)."""
        return any(self._class_window) or bool(self._tenant_window)

    def closed_for(self, band: int, tenant: str) -> tuple[float, str] | None:
        """Seconds until the windows of the class and of the tenant are both open, and the window
        that opens last; None when they are (or neither has one)."""
        waits = [
            (self._until_open(n) or 0.0, n)
            for n in (self._class_window[band], self._tenant_window.get(tenant))
            if n
        ]
        longest = max(waits, default=(0.0, ""))
        return longest if longest[0] > 0 else None

    def weight(self, tenant: str) -> float:
        """The tenant's weight now: the largest of its windows' weights that are open, else its own
        (1 for a tenant not configured, and for the unnamed flow)."""
        base = self._weights.get(tenant, 1.0)
        boosted = [w for name, w in self._weight_in.get(tenant, {}).items() if not self._until_open(name)]
        return max(boosted, default=base)

    def reserved_slots(self) -> tuple[int, ...]:
        """Per band, the slots its class reserves now: the largest of its open windows'
        reservations, else its own. Read once per second of the clock: the stores ask on every
        offer and hand-over, and a window opens on a minute."""
        second = int(self._clock())
        if self._reserved_at is None or self._reserved_at[0] != second:
            now = tuple(
                max((n for name, n in windows.items() if not self._until_open(name)), default=own)
                for own, windows in zip(self._reserved, self._reserved_in, strict=True)
            )
            self._reserved_at = (second, now)
        return self._reserved_at[1]

    def _until_open(self, name: str | None) -> float | None:
        if name is None:
            return None
        window, zone = self._windows[name]
        return seconds_until_open(window, datetime.fromtimestamp(self._clock(), zone))


def seconds_until_open(window: Window, local: datetime) -> float:
    """Seconds from the local time `local` until `window` opens (0: it is open), to the second."""
    minute = local.hour * 60 + local.minute
    minutes = minutes_until_open(window, local.weekday(), minute)
    if minutes == 0:
        return 0.0
    into_minute_s = local.second + local.microsecond / 1e6
    return min(minutes * 60.0 - into_minute_s, 7 * MINUTES_PER_DAY * 60.0)
