"""Through the simulator: quotas that lend what their owners leave unused and take it back.

The seed's lesson, in numbers: two teams each own half of an 8-slot pool. Hard quotas alone leave
half of it idle while one team floods and the other is quiet; a pool that lends keeps it busy, and
gives the quiet team its quota back as the borrowed requests finish, without stopping any.
"""

import bisect
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tools.simulate.admitting import Admission
from gateway.tools.simulate.engine import Band, Handover, Setup, simulate
from gateway.tools.simulate.workload import ServiceModel, TenantMix, merged, poisson_arrivals
from policies.quotas import Quota, borrowed

SLOTS = 8
EXPONENTIAL = ServiceModel("exponential", 0.1, 1.0)


def flood(tenant, seed, *, rate, seconds, start_s=0.0, service=EXPONENTIAL):
    stream = poisson_arrivals(
        rate, int(rate * seconds), service, random.Random(seed), tenants=(TenantMix(tenant),), start_s=start_s
    )
    return [a for a in stream if a.at_s < start_s + seconds]


def halves(borrowing_limit=math.inf):
    return {"a": Quota(4, borrowing_limit), "b": Quota(4, borrowing_limit)}


def busy_share(run, seconds):
    return sum(t.busy_s for t in run.tallies.values()) / (SLOTS * seconds)


def test_hard_quotas_leave_half_the_pool_idle_where_lending_keeps_it_busy():
    # team-a offers 1.5 times the pool; team-b sends nothing.
    arrivals = flood("a", 1, rate=120, seconds=60)
    hard = simulate(arrivals, Setup(SLOTS, quotas=halves(borrowing_limit=0), until_s=60))
    lent = simulate(arrivals, Setup(SLOTS, quotas=halves(), until_s=60))
    assert 0.45 < busy_share(hard, 60) < 0.55
    assert busy_share(lent, 60) > 0.97


def test_an_owner_that_returns_gets_its_quota_back_as_borrowed_requests_finish_whatever_its_class():
    # team-a floods the whole pool in the urgent class; at 20 s team-b floods the other class. No
    # new borrowing starts while team-b waits under its quota, however urgent team-a's work is, and
    # nothing running is stopped: team-b reaches its quota as team-a's borrowed requests finish (a
    # few of 0.1 s each), and from then on neither borrows, since the other owner always waits.
    urgent = flood("a", 2, rate=120, seconds=40)
    later = [a._replace(band=1) for a in flood("b", 3, rate=120, seconds=20, start_s=20)]
    arrivals = list(merged(urgent, later))
    seen: list[Handover] = []
    setup = Setup(SLOTS, (Band(), Band()), quotas=halves(), until_s=40)
    simulate(arrivals, setup, on_handover=seen.append)
    before = [h for h in seen if 10 <= h.at_s < 20]
    assert max(h.running_by_tenant.get("a", 0) for h in before) == SLOTS  # it borrowed team-b's idle quota
    back = next((h.at_s for h in seen if h.running_by_tenant.get("b", 0) == 4), None)
    assert back is not None and 20 <= back < 20.5
    after = [h for h in seen if h.at_s >= back]
    assert all(h.running_by_tenant.get(t, 0) <= 4 for h in after for t in "ab")
    # Until then, a slot that freed went to team-a only while no request of team-b waited.
    b_arrivals = [a.at_s for a in later]
    handed_b = 0
    for h in seen:
        if h.tenant == "b":
            handed_b += 1
        elif 20 <= h.at_s < back:
            assert bisect.bisect_right(b_arrivals, h.at_s) == handed_b, h


def test_a_capped_quota_refuses_at_arrival_what_it_would_keep_past_the_allowance():
    # team-a may run one request at a time (quota 1, borrowing_limit 0) and offers three times
    # that; the pool's other 7 slots are idle. The pool alone would admit every request, and they
    # would expire in the queue; the quota's wait refuses them at arrival instead.
    fixed = ServiceModel("fixed", 0.1, 0.0)
    arrivals = flood("a", 4, rate=30, seconds=60, service=fixed)
    bands = (Band(max_wait_s=1.0),)
    admission = Admission(0.1)
    capped = {"a": Quota(1, 0)}
    run = simulate(arrivals, Setup(SLOTS, bands, quotas=capped, until_s=60, admission=admission))
    tally = run.tallies[(0, "a")]
    assert tally.refused > 0.5 * tally.arrived
    assert tally.expired == 0
    assert max(tally.waits_s) <= 1.0


quota_sets = st.dictionaries(
    st.sampled_from("abc"),
    st.builds(
        Quota, st.integers(0, 4), st.sampled_from([0, 1, 2, math.inf]), st.sampled_from([0, 2, math.inf])
    ),
)


@settings(max_examples=40, deadline=None)
@given(quota_sets, st.integers(0, 2**16))
def test_no_tenant_ever_borrows_past_its_limit_nor_runs_more_than_the_pool(quotas, seed):
    rng = random.Random(seed)
    arrivals = list(
        merged(*(flood(t, rng.randrange(2**16), rate=rng.uniform(5, 60), seconds=5) for t in "abc"))
    )
    seen: list[Handover] = []
    simulate(arrivals, Setup(4, quotas=quotas, until_s=5), on_handover=seen.append)
    for h in seen:
        assert sum(h.running_by_tenant.values()) <= 4
        for tenant in h.running_by_tenant:
            limit = quotas[tenant].borrowing_limit if tenant in quotas else math.inf
            assert borrowed(tenant, h.running_by_tenant, quotas) <= limit
