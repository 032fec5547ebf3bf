"""The pure parts of gateway.server.connections and gateway.server.client_limits: which connection a newcomer
closes at the limit, the limits' defaults and the 431's body."""

import json

import pytest

from gateway.server.client_limits import ClientLimits, Cut, connections_for, refusal_body
from gateway.server.connection_table import ConnectionTable
from gateway.settings import Limits


def test_under_the_limit_nothing_is_closed():
    table: ConnectionTable[str] = ConnectionTable(max_connections=2)
    assert table.opened("a") is None
    assert table.opened("b") is None
    assert len(table) == 2


def test_at_the_limit_the_newcomer_closes_the_connection_waiting_longest():
    table: ConnectionTable[str] = ConnectionTable(max_connections=2)
    table.opened("a")
    table.opened("b")
    assert table.opened("c") == "a"
    assert len(table) == 2


def test_a_connection_with_a_request_in_progress_is_never_closed_for_a_newcomer():
    table: ConnectionTable[str] = ConnectionTable(max_connections=2)
    table.opened("a")
    table.opened("b")
    table.busy("a")
    assert table.opened("c") == "b"


def test_waiting_counts_from_the_end_of_the_last_request_not_from_the_connection():
    table: ConnectionTable[str] = ConnectionTable(max_connections=3)
    for name in ("a", "b", "c"):
        table.opened(name)
    table.busy("a")
    table.waiting("a")  # "a" served a request since "b" and "c" came
    assert table.opened("d") == "b"
    assert table.opened("e") == "c"
    assert table.opened("f") == "a"


def test_the_newcomer_is_closed_itself_when_every_other_has_a_request_in_progress():
    table: ConnectionTable[str] = ConnectionTable(max_connections=2)
    for name in ("a", "b"):
        table.opened(name)
        table.busy(name)
    assert table.opened("c") == "c"
    assert len(table) == 2


def test_a_closed_connection_frees_its_place_and_never_comes_back_as_waiting():
    table: ConnectionTable[str] = ConnectionTable(max_connections=2)
    table.opened("a")
    table.opened("b")
    table.closed("a")
    table.waiting("a")  # a late "request done" from a connection already gone
    assert table.opened("c") is None
    assert table.opened("d") == "b"


def test_the_connection_limit_leaves_a_quarter_of_the_open_files_and_at_least_64():
    assert connections_for(1024) == 768
    assert connections_for(256) == 192
    assert connections_for(100) == 36
    assert connections_for(40) == 16


@pytest.mark.parametrize(("configured", "expected"), [(None, 192), (500, 500)])
def test_max_connections_comes_from_the_settings_or_else_from_the_open_file_limit(configured, expected):
    limits = ClientLimits.from_settings(Limits(max_connections=configured), open_files=256)
    assert limits.max_connections == expected
    assert (limits.header_timeout_s, limits.body_timeout_s) == (10.0, 60.0)


def test_the_431_body_is_shaped_like_the_gateway_errors_of_each_style():
    limits = ClientLimits.from_settings(Limits(), open_files=1024)
    kserve = json.loads(refusal_body(Cut.HEADERS_TOO_LARGE, limits, openai=False))
    assert kserve["reason"] == "headers_too_large" and "32768 bytes" in kserve["error"]
    openai = json.loads(refusal_body(Cut.TOO_MANY_HEADERS, limits, openai=True))["error"]
    assert (openai["type"], openai["code"]) == ("invalid_request_error", "too_many_headers")
    assert "more than 100" in openai["message"]


def test_the_default_cap_leaves_room_for_the_backends_and_redis():
    assert connections_for(1024, backend_files=8) == 768  # the quarter is room enough
    assert connections_for(1024, backend_files=400) == 1024 - 464
    assert connections_for(1024, backend_files=5000) == 16  # the floor: raise the limit
