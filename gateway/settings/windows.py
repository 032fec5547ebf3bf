"""Settings of time windows: named weekly spans of local time, in a time zone of the tz database."""

from __future__ import annotations

from typing import Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator, model_validator

from gateway.settings.base import Frozen, Name
from policies.windows import DAYS, Window

Day = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
_CLOCK = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"


class TimeWindow(Frozen):
    """Open on `days` from `from` (included) to `to` (not), local time in `tz`; a `to` not after
    `from` closes the next day, and `from` equal to `to` is the whole day (policies.windows)."""

    name: Name
    days: list[Day] = Field(default_factory=lambda: list(get_args(Day)), min_length=1)
    from_: str = Field(alias="from", pattern=_CLOCK)
    to: str = Field(pattern=_CLOCK)
    tz: str = "UTC"

    @field_validator("tz")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {value!r} (a tz database name, e.g. Europe/Amsterdam)"
            ) from None
        return value

    @model_validator(mode="after")
    def _distinct_days(self) -> TimeWindow:
        if len(set(self.days)) != len(self.days):
            raise ValueError(f"window {self.name!r}: a day is listed twice")
        return self

    def policy(self) -> Window:
        return Window(frozenset(DAYS.index(day) for day in self.days), _minute(self.from_), _minute(self.to))


def _minute(clock: str) -> int:
    hours, minutes = clock.split(":")
    return int(hours) * 60 + int(minutes)
