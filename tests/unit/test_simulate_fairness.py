"""Through the simulator: weighted fair shares between tenants of a band, and strict priority between bands.

Every run floods a pool of 4 slots, each holding a request for 1 s (4 hand-overs per second), with
Poisson arrivals of 8 per second per tenant, so that a tenant meant to be backlogged stays so
from its first second on. The work handed over, not finished, is what fair queuing splits
(policies.fairness: the SFQ bound is on hand-overs).
"""

import bisect
import random

from gateway.tools.simulate.admitting import Admission
from gateway.tools.simulate.engine import Band, Handover, Setup, simulate
from gateway.tools.simulate.workload import ServiceModel, TenantMix, merged, poisson_arrivals

SLOTS = 4
ONE_SECOND = ServiceModel("fixed", 1.0, 0.0)
PER_COST_SECOND = ServiceModel("fixed", 1.0, 0.0, per_cost=True)


def flood(tenant, seed, *, rate=8.0, seconds=400.0, cost=1.0, start_s=0.0, band=0, service=ONE_SECOND):
    """A tenant's Poisson arrivals at `rate` per second for `seconds` from `start_s`, all in `band`."""
    count = int(rate * seconds)
    stream = poisson_arrivals(
        rate, count, service, random.Random(seed), tenants=(TenantMix(tenant, cost=cost),), start_s=start_s
    )
    return [a._replace(band=band) for a in stream if a.at_s < start_s + seconds]


def handovers(arrivals, setup):
    seen: list[Handover] = []
    simulate(arrivals, setup, on_handover=seen.append)
    return seen


def work_by_tenant(seen, since_s=0.0, until_s=float("inf")):
    work: dict[str, float] = {}
    for h in seen:
        if since_s <= h.at_s < until_s:
            work[h.tenant] = work.get(h.tenant, 0.0) + h.cost
    return work


def test_backlogged_tenants_weighted_3_to_1_are_handed_work_3_to_1():
    arrivals = list(merged(flood("a", 1), flood("b", 2)))
    run = simulate(arrivals, Setup(SLOTS, weights={"a": 3, "b": 1}, until_s=300))
    a, b = run.tallies[(0, "a")].handed_work, run.tallies[(0, "b")].handed_work
    assert a + b >= 0.99 * SLOTS * 300  # no slot idles while both wait
    assert abs((a / b) / 3 - 1) < 0.02


def test_weighted_shares_are_counted_in_work_when_one_tenant_sends_8x_larger_requests():
    # a's requests cost 8 and hold a slot 8 times as long: it gets 3/4 of the work, not of the requests.
    big = flood("a", 3, cost=8.0, service=PER_COST_SECOND)
    small = flood("b", 4, service=PER_COST_SECOND)
    run = simulate(list(merged(big, small)), Setup(SLOTS, weights={"a": 3, "b": 1}, until_s=300))
    a, b = run.tallies[(0, "a")].handed_work, run.tallies[(0, "b")].handed_work
    assert abs((a / b) / 3 - 1) < 0.02


def test_the_weighted_work_gap_of_backlogged_tenants_stays_within_the_sfq_bound():
    # policies.fairness: over any interval in which both are backlogged, |W_a/w_a - W_b/w_b| <=
    # c_a/w_a + c_b/w_b. Both flood from t = 0, so both are queued from t = 2 s on.
    big = flood("a", 5, cost=8.0, service=PER_COST_SECOND, seconds=300)
    small = flood("b", 6, service=PER_COST_SECOND, seconds=300)
    seen = handovers(list(merged(big, small)), Setup(SLOTS, weights={"a": 3, "b": 1}, until_s=300))
    bound = 8.0 / 3 + 1.0 / 1
    handed = {"a": 0.0, "b": 0.0}
    gaps = []
    for h in seen:
        if h.at_s >= 2.0:
            handed[h.tenant] += h.cost
            gaps.append(abs(handed["a"] / 3 - handed["b"] / 1))
    assert len(gaps) > 300  # hand-overs (a's hold a slot 8 s)
    assert max(gaps) <= bound


def test_an_idle_tenants_share_goes_to_the_backlogged_one_at_once():
    # b (weight 3) asks for less than its share until t = 100 s, then goes idle; a (weight 1)
    # floods throughout. Once b's last request is out, a is handed every slot as it frees.
    b = flood("b", 8, rate=2.5, seconds=100)
    seen = handovers(list(merged(flood("a", 7), b)), Setup(SLOTS, weights={"a": 1, "b": 3}, until_s=400))
    b_last = max(h.at_s for h in seen if h.tenant == "b")
    after = work_by_tenant(seen, since_s=b_last + 1e-9, until_s=400)
    assert b_last < 110  # b never built a backlog: its queue drained as it stopped
    assert set(after) == {"a"}
    assert after["a"] >= SLOTS * (400 - b_last - 1)  # no slot left idle


def test_a_tenant_back_from_idle_gets_its_weight_share_not_credit_for_the_idle_time():
    # b (weight 3) floods for 50 s, is idle for 150 s, and floods again; a (weight 1) throughout.
    b_before = flood("b", 9, seconds=50)
    b_after = flood("b", 10, seconds=100, start_s=200)
    seen = handovers(
        list(merged(flood("a", 11, seconds=300), b_before, b_after)),
        Setup(SLOTS, weights={"a": 1, "b": 3}, until_s=300),
    )
    back = work_by_tenant(seen, since_s=201, until_s=300)
    assert abs(back["b"] / (back["a"] + back["b"]) / 0.75 - 1) < 0.02


def test_a_less_urgent_band_is_handed_slots_only_when_no_urgent_request_waits():
    # The urgent band asks for half the pool, the other floods: the less urgent one gets the rest,
    # and never a slot while an urgent request is queued.
    urgent = flood("a", 12, rate=2.0, seconds=300, band=0, service=ServiceModel("exponential", 1.0))
    plain = flood("a", 13, rate=8.0, seconds=300, band=1, service=ServiceModel("exponential", 1.0))
    seen = handovers(list(merged(urgent, plain)), Setup(SLOTS, bands=(Band(), Band()), until_s=300))
    to_plain = [h for h in seen if h.band == 1]
    assert len(to_plain) > 0.4 * SLOTS * 300  # the rest of the pool, about half, goes to it
    assert all(h.queued_by_band[0] == 0 for h in to_plain)


def test_a_slot_reserved_by_the_urgent_class_is_never_held_by_less_urgent_work():
    urgent = flood("a", 16, rate=0.2, seconds=300, band=0)
    plain = flood("a", 17, rate=8.0, seconds=300, band=1)
    bands = (Band(reserved_slots=1), Band())
    seen = handovers(list(merged(urgent, plain)), Setup(SLOTS, bands=bands, until_s=300))
    # Each request holds its slot for 1 s: the plain class holds what it was handed in the last second.
    plain_at = [h.at_s for h in seen if h.band == 1]
    held = [i + 1 - bisect.bisect_right(plain_at, at - 1.0 + 1e-9) for i, at in enumerate(plain_at)]
    assert max(held) == SLOTS - 1


def test_an_urgent_request_finds_the_reserved_slot_free_instead_of_waiting_behind_a_flood():
    urgent = flood("a", 18, rate=0.2, seconds=300, band=0)
    plain = flood("a", 19, rate=8.0, seconds=300, band=1)
    run = simulate(
        list(merged(urgent, plain)), Setup(SLOTS, bands=(Band(reserved_slots=1), Band()), until_s=300)
    )
    waits = run.tallies[(0, "a")].waits_s
    # Only an urgent request arriving while another holds the reserved slot waits (about 1 in 5).
    assert sum(1 for w in waits if w == 0) >= 0.7 * len(waits)


def test_with_admission_a_light_tenant_is_admitted_on_its_turn_while_a_heavy_one_floods():
    # 4 slots of 1 s, a 5 s queue wait: the heavy tenant at 8/s keeps about 20 of its requests
    # queued and is refused the rest; the light one at 0.5/s is a request or so from its turn.
    heavy, light = flood("heavy", 5, seconds=200.0), flood("light", 6, rate=0.5, seconds=200.0)
    admission = Admission(1.0)
    setup = Setup(SLOTS, bands=(Band(max_wait_s=5.0, deadline_s=6.0),), admission=admission, until_s=200)
    run = simulate(list(merged(heavy, light)), setup)
    heavy_tally, light_tally = run.tallies[(0, "heavy")], run.tallies[(0, "light")]
    assert heavy_tally.refused > heavy_tally.arrived / 2
    assert light_tally.arrived > 50
    assert light_tally.refused == light_tally.expired == 0
