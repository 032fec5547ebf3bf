"""Displacement in the simulator, as the memory store displaces (policies.displacement): queued
work that a more urgent arrival pushes past its allowance is told at once, not left to expire."""

from gateway.tools.simulate.admitting import Admission
from gateway.tools.simulate.engine import Band, Setup, simulate
from gateway.tools.simulate.workload import Arrival

SERVICE_S = 0.2


def lows_then_highs(highs: int) -> list[Arrival]:
    # The scenario: one slot of a fixed 200 ms, 12 low requests sent 10 ms apart, then
    # urgent ones 300 ms in; both classes wait at most 1.5 s.
    lows = [Arrival(0.01 * i, 1, "", 1.0, SERVICE_S) for i in range(12)]
    return lows + [Arrival(0.3 + 0.01 * i, 0, "", 1.0, SERVICE_S) for i in range(highs)]


def run(highs: int):
    bands = (Band(max_wait_s=1.5), Band(max_wait_s=1.5))
    setup = Setup(1, bands=bands, admission=Admission(SERVICE_S))
    return simulate(lows_then_highs(highs), setup)


def test_lows_the_urgent_arrivals_push_past_their_allowance_are_displaced_not_left_to_expire():
    alone = run(highs=0).tallies[(1, "")]
    assert alone.displaced == alone.expired == 0  # admitted lows are served in time
    pushed = run(highs=4)
    low, high = pushed.tallies[(1, "")], pushed.tallies[(0, "")]
    assert high.served >= 3  # the urgent work is served (the fourth may not fit its own wait)
    assert low.displaced > 0  # the lows counting on the hand-overs the highs took are told at once
    assert low.expired == 0  # none is left to wait out its 1.5 s
    assert low.served + low.displaced + low.refused == low.arrived == 12
