"""Start-time fair queuing between the tenant flows of a band (policies.fairness)."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fairness import (
    FairTurns,
    arrivals_in_turn,
    finish_after,
    head_start,
    joining_start,
    shares,
    turn_ahead,
    virtual_time_after,
    work_ahead_in_turn,
)


class Band:
    """A band as a store keeps it: each flow's finish tag and its queue, first come, first served,
    its head's start tag taken as it becomes the head; the virtual time."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.finish = dict.fromkeys(weights, 0.0)
        self.virtual_time = 0.0
        self.flows: dict[str, collections.deque[tuple[int, float]]] = {
            f: collections.deque() for f in weights
        }
        self.head: dict[str, float] = {}
        self.sequence = itertools.count()
        self.enqueued_sequence = self.handed_sequence = -1

    def _follow_head(self, flow: str) -> None:
        if self.flows[flow]:
            self.head[flow] = head_start(self.virtual_time, self.finish[flow])

    def joining(self, flow: str) -> float:
        """Where a request of `flow` enqueued now starts (if nothing ahead of it leaves)."""
        queue = self.flows[flow]
        queued = sum(cost for _, cost in queue)
        head = self.head[flow] if queue else None
        return joining_start(self.virtual_time, self.finish[flow], head, queued, self.weights[flow])

    def enqueue(self, flow: str, cost: float) -> float:
        start = self.joining(flow)
        self.enqueued_sequence = next(self.sequence)
        self.flows[flow].append((self.enqueued_sequence, cost))
        if len(self.flows[flow]) == 1:
            self._follow_head(flow)
        return start

    def hand_over(self) -> tuple[str, float]:
        flow = min((f for f, q in self.flows.items() if q), key=lambda f: (self.head[f], self.flows[f][0][0]))
        self.handed_sequence, cost = self.flows[flow].popleft()
        start = self.head[flow]
        self.virtual_time = virtual_time_after(self.virtual_time, start)
        self.finish[flow] = finish_after(start, cost, self.weights[flow])
        self._follow_head(flow)
        return flow, cost

    def leave(self, flow: str, index: int) -> None:
        """The `index`-th queued request of `flow` (if any) leaves unserved."""
        queue = self.flows[flow]
        if index < len(queue):
            del queue[index]
            if index == 0:
                self._follow_head(flow)

    def run(self, steps: list[Step]) -> None:
        """Enqueues (flow, cost), leaves (flow, -index - 1) and hand-overs (None, skipped while
        nothing waits), in order."""
        for step in steps:
            if step is None:
                if self.queued_work():
                    self.hand_over()
            elif step[1] < 0:
                self.leave(step[0], int(-step[1]) - 1)
            else:
                self.enqueue(*step)

    def queued(self, flow: str) -> int:
        return len(self.flows[flow])

    def queued_work(self) -> float:
        return sum(cost for queue in self.flows.values() for _, cost in queue)

    def work_before(self, flow: str, cost: float) -> float:
        """The queued work that would be handed out before a request of `flow` enqueued now: each
        queued request's start tag, once those ahead of it in its flow are handed out, is at most
        the joining one's (queued earlier, it goes first on a tie)."""
        start, before = self.joining(flow), 0.0
        for name, queue in self.flows.items():
            tag = self.head.get(name, 0.0)
            for _, queued_cost in queue:
                if tag > start:
                    break
                before += queued_cost
                tag = finish_after(tag, queued_cost, self.weights[name])
        return before

    def turns(self) -> FairTurns:
        queued = {f: sum(cost for _, cost in q) for f, q in self.flows.items() if q}
        finish = {f: self.joining(f) for f in self.flows}
        return FairTurns(self.virtual_time, finish, queued, self.weights)


Step = tuple[str, float] | None


def band_steps(most: int) -> st.SearchStrategy[list[Step]]:
    """Enqueues (flow, cost), leaves unserved (flow, -index - 1) and hand-overs (None) of a band of
    flows a, b and c, in any order."""
    flows = st.sampled_from(["a", "b", "c"])
    enqueue = st.tuples(flows, st.sampled_from([1.0, 2.0, 8.0]))
    leave = st.tuples(flows, st.sampled_from([-1.0, -2.0, -4.0]))
    return st.lists(st.one_of(st.none(), enqueue, leave), max_size=most)


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
        finish_after(0.0, 1.0, 0.0)


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
    assert turn_ahead(band.turns(), joining, slack=8.0) <= band.queued_work() + 1e-9


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
        if step is not None and step[0] != joining and step[1] > 0:
            sent[step[0]] = sent.get(step[0], 0.0) + step[1]
    turns = band.turns()
    bound = turn_ahead(turns, joining, slack=8.0) + arrivals_in_turn(turns, joining, 8.0, sent)
    band.enqueue(joining, 1.0)
    own = band.enqueued_sequence
    handed = 0.0
    for step in later:
        if step is None:
            _, cost = band.hand_over()
            if band.handed_sequence == own:
                break
            handed += cost
        elif step[0] != joining:
            band.run([step])
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
