"""Start-time fair queuing between the tenant flows of a band (policies.fairness)."""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fairness import (
    FairTurns,
    arrivals_in_turn,
    shares,
    tags,
    turn_ahead,
    virtual_time_after,
    work_ahead_in_turn,
)


class Band:
    """A band as a store keeps it: each flow's finish tag, the virtual time, one heap of start tags."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.finish = dict.fromkeys(weights, 0.0)
        self.virtual_time = 0.0
        self.heap: list[tuple[float, int, str, float]] = []
        self.sequence = itertools.count()

    def enqueue(self, flow: str, cost: float) -> float:
        tagged = tags(self.virtual_time, self.finish[flow], cost, self.weights[flow])
        self.finish[flow] = tagged.finish
        heapq.heappush(self.heap, (tagged.start, next(self.sequence), flow, cost))
        return tagged.start

    def hand_over(self) -> tuple[str, float]:
        start, _, flow, cost = heapq.heappop(self.heap)
        self.virtual_time = virtual_time_after(self.virtual_time, start)
        return flow, cost

    def run(self, steps: list[tuple[str, float] | None]) -> None:
        """Enqueues (flow, cost) and hand-overs (None, skipped while nothing waits), in order."""
        for step in steps:
            if step is None:
                if self.heap:
                    self.hand_over()
            else:
                self.enqueue(*step)

    def queued(self, flow: str) -> int:
        return sum(entry[2] == flow for entry in self.heap)

    def work_before(self, flow: str, cost: float) -> float:
        """The queued work that would be handed out before a request of `flow` enqueued now (its
        start tag is higher, or equal and it came later)."""
        start = tags(self.virtual_time, self.finish[flow], cost, self.weights[flow]).start
        return sum(entry[3] for entry in self.heap if entry[0] <= start)

    def turns(self) -> FairTurns:
        queued: dict[str, float] = {}
        for _, _, flow, cost in self.heap:
            queued[flow] = queued.get(flow, 0.0) + cost
        return FairTurns(self.virtual_time, dict(self.finish), queued, self.weights)


def band_steps(most: int) -> st.SearchStrategy[list[tuple[str, float] | None]]:
    """Enqueues (flow, cost) and hand-overs (None) of a band of flows a, b and c, in any order."""
    enqueue = st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from([1.0, 2.0, 8.0]))
    return st.lists(st.one_of(st.none(), enqueue), max_size=most)


costs = st.lists(st.sampled_from([1.0, 2.0, 4.0, 8.0, 16.0]), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(
    weight_f=st.sampled_from([0.5, 1.0, 3.0]),
    weight_g=st.sampled_from([1.0, 2.0, 7.0]),
    costs_f=costs,
    costs_g=costs,
    handovers=st.integers(1, 300),
)
def test_two_backlogged_flows_are_handed_work_by_weight_within_the_bound(
    weight_f, weight_g, costs_f, costs_g, handovers
):
    # Both flows stay backlogged: each refills with its next cost as soon as one of its own leaves.
    band = Band({"f": weight_f, "g": weight_g})
    cycles = {"f": itertools.cycle(costs_f), "g": itertools.cycle(costs_g)}
    for flow in ("f", "g"):
        for _ in range(3):
            band.enqueue(flow, next(cycles[flow]))
    handed = {"f": 0.0, "g": 0.0}
    bound = max(costs_f) / weight_f + max(costs_g) / weight_g
    for _ in range(handovers):
        flow, cost = band.hand_over()
        handed[flow] += cost
        band.enqueue(flow, next(cycles[flow]))
        assert abs(handed["f"] / weight_f - handed["g"] / weight_g) <= bound + 1e-9


def test_shares_of_backlogged_flows_converge_to_their_weights():
    band = Band({"a": 3.0, "b": 1.0})
    handed = {"a": 0.0, "b": 0.0}
    for flow, cost in (("a", 1.0), ("b", 8.0)):  # b sends requests 8 times larger
        for _ in range(4):
            band.enqueue(flow, cost)
    for _ in range(4000):
        flow, cost = band.hand_over()
        handed[flow] += cost
        band.enqueue(flow, cost)
    assert handed["a"] / handed["b"] == pytest.approx(3.0, rel=0.02)


def test_a_flow_back_from_idleness_gets_no_credit_for_it():
    band = Band({"busy": 1.0, "idle": 1.0})
    for _ in range(100):
        band.enqueue("busy", 1.0)
    for _ in range(100):
        band.hand_over()
        band.enqueue("busy", 1.0)
    # The idle flow comes back: it shares from now on, it does not take the next 100 slots.
    for _ in range(10):
        band.enqueue("idle", 1.0)
    first_ten = [band.hand_over()[0] for _ in range(10)]
    assert 4 <= first_ten.count("idle") <= 6


def test_an_idle_flows_share_goes_to_the_others_at_once():
    band = Band({"a": 1.0, "b": 3.0})
    for _ in range(5):
        band.enqueue("a", 1.0)
    assert [band.hand_over()[0] for _ in range(5)] == ["a"] * 5


@given(st.lists(st.floats(0.1, 32.0), min_size=1, max_size=40))
def test_one_flow_is_served_first_come_first_served(cost_list):
    band = Band({"only": 1.0})
    starts = [band.enqueue("only", cost) for cost in cost_list]
    assert starts == sorted(starts)
    assert [band.hand_over()[1] for _ in cost_list] == cost_list


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0.5, 16.0)), min_size=1, max_size=60),
    st.integers(0, 60),
)
def test_within_a_flow_requests_leave_in_arrival_order(arrivals, handovers):
    band = Band({"a": 1.0, "b": 2.0, "c": 0.5})
    sent: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    for flow, cost in arrivals:
        band.enqueue(flow, cost)
        sent[flow].append(cost)
    left: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    for _ in range(min(handovers, len(arrivals))):
        flow, cost = band.hand_over()
        left[flow].append(cost)
    for flow, costs_left in left.items():
        assert costs_left == sent[flow][: len(costs_left)]


def test_virtual_time_never_goes_back():
    assert virtual_time_after(5.0, 3.0) == 5.0
    assert virtual_time_after(5.0, 7.0) == 7.0


def test_a_weight_must_be_positive():
    with pytest.raises(ValueError, match="weight"):
        tags(0.0, 0.0, 1.0, 0.0)


@settings(max_examples=300, deadline=None)
@given(
    steps=band_steps(120),
    joining=st.sampled_from(["a", "b", "c"]),
)
def test_the_work_ahead_of_a_turn_is_never_less_than_what_goes_first(steps, joining):
    # The band's steps, then a request of `joining` arrives.
    band = Band({"a": 1.0, "b": 3.0, "c": 0.5})
    band.run(steps)
    exact = band.work_before(joining, 1.0)
    assert turn_ahead(band.turns(), joining, slack=8.0) >= exact - 1e-9
    assert turn_ahead(band.turns(), joining, slack=8.0) <= sum(entry[3] for entry in band.heap) + 1e-9


def test_a_light_flow_behind_a_heavy_backlog_waits_for_its_turn_not_for_the_band():
    band = Band({"heavy": 1.0, "light": 1.0})
    for _ in range(100):
        band.enqueue("heavy", 1.0)
    for _ in range(10):
        band.hand_over()
        band.enqueue("heavy", 1.0)
    assert band.work_before("light", 1.0) == 0.0  # it goes next
    assert turn_ahead(band.turns(), "light", slack=1.0) == 1.0  # one request of slack, not 100
    # The heavy flow's own next request waits behind all of its backlog.
    assert turn_ahead(band.turns(), "heavy", slack=1.0) == 100.0


def test_a_light_flow_with_requests_queued_waits_for_its_weighted_share_of_the_others():
    # Its start tag is 4 ahead of the virtual time: a flow of weight 3 goes 12 units ahead of it,
    # one of weight 1 four, each at most its own backlog, and one request's slack each.
    ahead = work_ahead_in_turn(10.0, 14.0, 4.0, [(100.0, 3.0), (100.0, 1.0), (2.0, 1.0)], slack=1.0)
    assert ahead == 4.0 + 13.0 + 5.0 + 2.0


def test_a_band_of_one_flow_has_its_whole_backlog_ahead():
    band = Band({"only": 1.0})
    for cost in (1.0, 2.0, 3.0):
        band.enqueue("only", cost)
    assert turn_ahead(band.turns(), "only", slack=3.0) == band.work_before("only", 1.0) == 6.0


@settings(max_examples=300, deadline=None)
@given(
    steps=band_steps(80),
    joining=st.sampled_from(["a", "b", "c"]),
    later=band_steps(120),
)
def test_what_goes_before_a_turn_while_others_keep_arriving_is_within_the_count(steps, joining, later):
    # A request of `joining` is enqueued after `steps`; then the other flows send `later` while the
    # band hands work over. What is handed out before it never exceeds the queued work ahead of its
    # turn plus arrivals_in_turn with what they sent as their reach.
    band = Band({"a": 1.0, "b": 3.0, "c": 0.5})
    band.run(steps)
    sent: dict[str, float] = {}
    for step in later:
        if step is not None and step[0] != joining:
            sent[step[0]] = sent.get(step[0], 0.0) + step[1]
    turns = band.turns()
    bound = turn_ahead(turns, joining, slack=8.0) + arrivals_in_turn(turns, joining, 8.0, sent)
    own_start = band.enqueue(joining, 1.0)
    handed = 0.0
    for step in later:
        if step is None:
            flow, cost = band.hand_over()
            if flow == joining and cost == 1.0 and band.virtual_time >= own_start:
                break
            handed += cost
        elif step[0] != joining:
            band.enqueue(*step)
    assert handed <= bound + 1e-9


def test_a_flow_that_keeps_arriving_goes_ahead_up_to_its_weight_of_the_turn():
    # The joining flow's start tag is 4 past the virtual time. A flow of weight 3 that has queued 2
    # but may send 100 within the horizon sends 12 (+1 straddling) ahead of it: 11 more than queued;
    # a flow that may send 2, nothing queued, adds its 2; a flow that sends nothing adds nothing.
    turns = FairTurns(10.0, {"f": 14.0}, {"f": 4.0, "heavy": 2.0}, {"f": 1.0, "heavy": 3.0})
    reach = {"f": 50.0, "heavy": 100.0, "light": 2.0, "idle": 0.0}
    assert arrivals_in_turn(turns, "f", 1.0, reach) == 11.0 + 2.0
    assert arrivals_in_turn(turns, "f", 1.0, {}) == 0.0


def test_shares_split_the_handed_work_and_are_zero_when_none_is():
    assert shares({"a": 3.0, "b": 1.0}) == {"a": 0.75, "b": 0.25}
    assert shares({"a": 0.0}) == {"a": 0.0}
