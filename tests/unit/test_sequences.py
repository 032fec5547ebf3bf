"""Sequences: what a request's parameters name, where its sequence is pinned, and what dispatch
gives a pinned request (policies.sequences, policies.dispatch, gateway/queues/memory/pins.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.http.pricing import json_part
from gateway.queues.memory.pins import SWEEP_AT, SequencePins, has_room
from policies.balancing import least_loaded
from policies.dispatch import Head, pinned_goes_first
from policies.sequences import PIN_IDLE_S, SequenceRef, sequence_of


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, None),
        ({"sequence_id": 0}, None),
        ({"sequence_id": ""}, None),
        ({"sequence_id": 7}, SequenceRef("7")),
        ({"sequence_id": "call-1", "sequence_start": True}, SequenceRef("call-1", start=True)),
        ({"sequence_id": 7, "sequence_end": True}, SequenceRef("7", end=True)),
    ],
)
def test_a_request_names_its_sequence_in_its_parameters(parameters, expected):
    assert sequence_of(parameters) == expected


@pytest.mark.parametrize(
    "parameters",
    [
        {"sequence_id": -1},
        {"sequence_id": 1.5},
        {"sequence_id": True},
        {"sequence_id": 3, "sequence_end": "yes"},
    ],
)
def test_a_malformed_sequence_is_told(parameters):
    assert isinstance(sequence_of(parameters), str)


@dataclass
class Backend:
    url: str
    ready: bool = True


@dataclass
class Share:
    backend: Backend
    max_concurrency: int = 2
    inflight: int = 0
    external_waiting: float = 0.0

    @property
    def ready(self) -> bool:
        return self.backend.ready


def place(pins: SequencePins, sequence: SequenceRef, pool, now: float, *, admitted: bool = True):
    """Where a request of `sequence` arriving `now` goes, pinned there if `admitted`."""
    backend, anew = pins.backend_of(sequence, pool, now)
    if admitted:
        pins.admitted(sequence, backend, anew, now)
    return backend


def test_a_sequence_is_pinned_on_arrival_to_the_least_loaded_backend_and_stays_there():
    pool = [Share(Backend("a"), inflight=2), Share(Backend("b"), inflight=1)]
    pins = SequencePins()
    assert place(pins, SequenceRef("s"), pool, now=0.0) == "b"  # pinned at once, full or not
    pool[1].inflight = 2
    pool[0].inflight = 0
    assert place(pins, SequenceRef("s"), pool, now=1.0) == "b"  # a free A does not move it
    assert not has_room(pool, "b") and has_room(pool, "a")
    # A start refused (admission) pins nothing; admitted, it pins anew.
    assert place(pins, SequenceRef("s", start=True), pool, now=2.0, admitted=False) == "a"
    assert place(pins, SequenceRef("s"), pool, now=2.0) == "b"
    assert place(pins, SequenceRef("s", start=True), pool, now=2.0) == "a"
    pins.follow(SequenceRef("s", end=True), "a", seen_at=3.0)
    assert len(pins) == 0
    assert place(pins, SequenceRef("t"), pool, now=0.0) == "a"
    assert place(pins, SequenceRef("t"), pool, now=PIN_IDLE_S + 1) == "a"  # re-pinned: least loaded
    pool[0].backend.ready = False
    assert place(pins, SequenceRef("t"), pool, now=PIN_IDLE_S + 2) == "b"  # its backend went down
    pool[1].backend.ready = False
    assert place(pins, SequenceRef("t"), pool, now=PIN_IDLE_S + 3) is None and len(pins) == 0


def test_least_loaded_counts_full_backends_and_skips_unready_ones():
    assert least_loaded([Share(Backend("a"), inflight=2), Share(Backend("b"), inflight=2)]) == 0
    assert least_loaded([Share(Backend("a", ready=False)), Share(Backend("b"), inflight=2)]) == 1
    assert least_loaded([]) is None


def test_a_pinned_request_goes_first_within_its_band_and_never_before_a_more_urgent_one():
    head = Head(0.0, 1, "", 1.0)
    assert pinned_goes_first(1, None)
    assert pinned_goes_first(1, (1, head))
    assert pinned_goes_first(0, (1, head))
    assert not pinned_goes_first(1, (0, head))


def test_only_a_requests_json_is_scanned_for_its_sequence():
    header = b'{"parameters": {"sequence_id": 7}}'
    binary = header + b"\x00" * 64
    length = [(b"inference-header-content-length", str(len(header)).encode())]
    assert json_part(binary, length) == header
    assert json_part(header, []) == header
    assert json_part(binary, [(b"inference-header-content-length", b"9999")]) == binary  # the backend judges


def test_the_redis_scripts_keep_a_pin_as_long_as_the_memory_store():
    from gateway.queues.redis.scripts import script_source

    assert f"local PIN_IDLE_S = {PIN_IDLE_S:g}  --" in script_source("offer")


def test_many_live_pins_are_swept_now_and_then_not_on_every_request():
    pins = SequencePins()
    for i in range(SWEEP_AT):
        pins.follow(SequenceRef(f"old-{i}" if i < 100 else f"s-{i}"), "a", seen_at=0.0 if i < 100 else 700.0)
    left = SWEEP_AT - 100
    assert len(pins) == left  # the first sweep dropped the 100 past their time
    swept = pins._pins
    for i in range(left - 1):  # live ones, up to one short of twice what it left
        pins.follow(SequenceRef(f"more-{i}"), "a", seen_at=700.0)
    assert pins._pins is swept and len(pins) == 2 * left - 1  # not rebuilt on the way
    pins.follow(SequenceRef("last"), "a", seen_at=700.0)
    assert pins._pins is not swept and len(pins) == 2 * left


def test_pinned_requests_ahead_hold_back_no_request_a_free_slot_can_take():
    from policies.wait import QueueStats

    pinned_only = QueueStats(queued_by_band=(2, 0), free_slots=1, pinned_by_band=(2, 0))
    assert pinned_only.work_before_grant(1, None, 1.0, 1.0, {}) == 0.0
    mixed = QueueStats(queued_by_band=(2, 0), free_slots=1, pinned_by_band=(1, 0))
    assert mixed.work_before_grant(1, None, 1.0, 1.0, {}) > 0.0
    full = QueueStats(queued_by_band=(2, 0), free_slots=0, pinned_by_band=(2, 0))
    assert full.work_before_grant(1, None, 1.0, 1.0, {}) > 0.0
