"""The configured windows on the wall clock, time zones and DST included (gateway/flow/windows.py)."""

from datetime import datetime
from typing import get_args
from zoneinfo import ZoneInfo

import pytest

from gateway.flow.windows import WindowClock
from gateway.settings import ConfigError, parse_settings
from gateway.settings.windows import Day
from policies.windows import DAYS

AMSTERDAM = ZoneInfo("Europe/Amsterdam")
BASE = {
    "priorities": [
        {"name": "high", "max_wait_ms": 250, "reserved_slots": 1, "reserved_slots_in": {"nightly": 0}},
        {
            "name": "compliance",
            "max_wait_ms": 60_000,
            "only_in": "nightly",
            "reserved_slots_in": {"nightly": 2},
        },
    ],
    "default_priority": "high",
    "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9", "max_concurrency": 1}]}],
    "windows": [{"name": "nightly", "from": "02:00", "to": "04:00", "tz": "Europe/Amsterdam"}],
    "tenants": [{"name": "batch", "weight": 1, "weight_in": {"nightly": 5}}, {"name": "chat", "weight": 3}],
}


def clock_at(*local: int) -> WindowClock:
    instant = datetime(*local, tzinfo=AMSTERDAM).timestamp()
    return WindowClock(parse_settings(BASE), clock=lambda: instant)


def test_a_class_kept_to_a_window_is_refused_until_it_opens():
    assert clock_at(2026, 12, 1, 1, 30).closed_for(1, "") == (pytest.approx(30 * 60), "nightly")
    assert clock_at(2026, 12, 1, 2, 0).closed_for(1, "") is None
    assert clock_at(2026, 12, 1, 4, 0).closed_for(1, "") == (pytest.approx(22 * 3600), "nightly")
    assert clock_at(2026, 12, 1, 1, 30).closed_for(0, "") is None  # high has no window


def test_windows_are_local_time_across_a_change_of_the_clocks():
    # 29 March 2026: Amsterdam's clocks go from 02:00 to 03:00, so 01:30 is 30 real minutes
    # before 03:00, and the window (02:00-04:00 local) is open from 03:00 that night.
    assert clock_at(2026, 3, 29, 3, 0).closed_for(1, "") is None
    assert clock_at(2026, 3, 29, 4, 0).closed_for(1, "") == (pytest.approx(22 * 3600), "nightly")
    # In summer time the same window is 00:00-02:00 UTC, not 01:00-03:00.
    summer = datetime(2026, 7, 1, 0, 30, tzinfo=ZoneInfo("UTC")).timestamp()
    assert WindowClock(parse_settings(BASE), clock=lambda: summer).closed_for(1, "") is None


def test_a_tenant_has_its_window_weight_while_the_window_is_open():
    assert clock_at(2026, 12, 1, 3, 0).weight("batch") == 5
    assert clock_at(2026, 12, 1, 12, 0).weight("batch") == 1
    assert clock_at(2026, 12, 1, 3, 0).weight("chat") == 3
    assert clock_at(2026, 12, 1, 3, 0).weight("unknown") == 1


def test_a_window_must_exist_and_its_zone_be_known():
    with pytest.raises(ConfigError, match="no window named 'daily'"):
        parse_settings({**BASE, "tenants": [{"name": "batch", "only_in": "daily"}]})
    zone = [{"name": "nightly", "from": "02:00", "to": "04:00", "tz": "Mars/Olympus"}]
    with pytest.raises(ConfigError, match="unknown time zone"):
        parse_settings({**BASE, "windows": zone})
    late = [{"name": "nightly", "from": "25:00", "to": "04:00"}]
    with pytest.raises(ConfigError, match="from"):
        parse_settings({**BASE, "windows": late})


def test_a_class_reserves_its_window_share_while_the_window_is_open():
    # high gives its slot up at night, when the compliance class keeps two for itself.
    assert clock_at(2026, 12, 1, 3, 0).reserved_slots() == (0, 2)
    assert clock_at(2026, 12, 1, 12, 0).reserved_slots() == (1, 0)
    assert clock_at(2026, 12, 1, 12, 0).moves_reservations


def test_the_reservations_follow_the_clock_from_one_second_to_the_next():
    night = datetime(2026, 12, 1, 3, 59, 59, tzinfo=AMSTERDAM).timestamp()
    now = [night]
    clock = WindowClock(parse_settings(BASE), clock=lambda: now[0])
    assert clock.reserved_slots() == (0, 2)
    now[0] += 1.0  # 04:00: the window has closed
    assert clock.reserved_slots() == (1, 0)


def test_a_reservation_in_a_window_that_does_not_exist_is_a_config_error():
    broken = {**BASE, "priorities": [{"name": "high", "max_wait_ms": 250, "reserved_slots_in": {"nope": 1}}]}
    with pytest.raises(ConfigError, match="nope"):
        parse_settings(broken)


def test_the_settings_name_the_days_in_the_order_the_policy_numbers_them():
    # A window's days are checked by the settings' Literal and numbered by policies.windows.DAYS:
    # one list written twice, so that a mismatch would shift every window by a day.
    assert get_args(Day) == DAYS
