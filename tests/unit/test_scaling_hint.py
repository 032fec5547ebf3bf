import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.capacity import Targets, mgc
from policies.scaling_hint import desired_replicas, stabilized

TARGETS = Targets(mean_wait=0.05, max_utilization=0.8)


def test_desired_replicas_meet_the_target_and_one_fewer_does_not():
    # 150 req/s of 40 ms work on replicas of 8 slots: 6 slots of work, the ceiling wants 7.5+.
    replicas = desired_replicas(150.0, 0.04, 1.0, 8, TARGETS)
    assert replicas == 1 or not TARGETS.met_by(mgc(150.0, 25.0, (replicas - 1) * 8, 1.0))
    assert TARGETS.met_by(mgc(150.0, 25.0, replicas * 8, 1.0))


@pytest.mark.parametrize(
    ("rate", "expected"),
    [(0.0, 1), (10.0, 1), (1000.0, 7)],  # 1000/s x 40 ms = 40 busy slots; 0.8 x 8 per replica: 7 replicas
)
def test_desired_replicas_grow_with_load(rate, expected):
    assert desired_replicas(rate, 0.04, 1.0, 8, Targets(mean_wait=1.0, max_utilization=0.8)) == expected


def test_unknown_service_time_or_slots_ask_for_one():
    assert desired_replicas(100.0, 0.0, 1.0, 8, TARGETS) == 1
    assert desired_replicas(100.0, 0.04, 1.0, 0, TARGETS) == 1


def test_stabilized_keeps_the_highest_answer_of_the_window():
    history = [(0.0, 5), (10.0, 3), (20.0, 2)]
    assert stabilized(history, now=25.0, window_s=30.0) == 5
    assert stabilized(history, now=35.0, window_s=30.0) == 3  # the 5 has left the window
    assert stabilized([], now=0.0, window_s=30.0) == 1


@given(st.floats(0, 5000), st.floats(0, 5000))
def test_more_load_never_asks_for_fewer_replicas(a, b):
    low, high = sorted((a, b))
    assert desired_replicas(low, 0.04, 1.0, 8, TARGETS) <= desired_replicas(high, 0.04, 1.0, 8, TARGETS)
