"""Quotas that lend what their owners leave unused and take it back (policies.quotas)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.quotas import Quota, borrowed, lendable, may_start, owner_waiting, quota_wait_s, under_quota

QUOTAS = {"a": Quota(4), "b": Quota(4)}


def test_without_quotas_nothing_is_held_back():
    assert may_start("anyone", 100.0, {"anyone": 1e6}, {}, 8, 1.0, owner_waiting=True)


def test_within_its_quota_a_tenant_starts_even_while_an_owner_waits():
    assert may_start("a", 1.0, {"a": 3.0, "b": 4.0}, QUOTAS, 8, 1.0, owner_waiting=True)


def test_beyond_it_a_tenant_borrows_what_another_leaves_unused():
    assert may_start("a", 1.0, {"a": 4.0, "b": 1.0}, QUOTAS, 8, 1.0, owner_waiting=False)
    assert not may_start("a", 1.0, {"a": 7.0, "b": 1.0}, QUOTAS, 8, 1.0, owner_waiting=False)


def test_no_new_borrowing_while_an_owner_under_its_quota_waits():
    assert not may_start("a", 1.0, {"a": 4.0, "b": 1.0}, QUOTAS, 8, 1.0, owner_waiting=True)


def test_an_owner_waits_when_a_queued_head_would_run_within_its_quota():
    running = {"a": 4.0, "b": 3.0}
    assert owner_waiting([("a", 1.0), ("b", 1.0)], running, QUOTAS)  # b's runs within its 4
    assert not owner_waiting([("a", 1.0), ("b", 2.0)], running, QUOTAS)  # b's would pass its quota
    assert not owner_waiting([("c", 1.0)], {}, QUOTAS)  # a tenant without a quota owns nothing


def test_the_borrowing_and_lending_limits_cap_what_moves():
    capped = {"a": Quota(4, borrowing_limit=1), "b": Quota(4, lending_limit=2)}
    assert may_start("a", 1.0, {"a": 4.0}, capped, 8, 1.0, owner_waiting=False)
    assert not may_start("a", 1.0, {"a": 5.0}, capped, 8, 1.0, owner_waiting=False)  # borrows 2 > 1
    lent = {"a": Quota(4), "b": Quota(4, lending_limit=2)}
    assert may_start("a", 1.0, {"a": 5.0}, lent, 8, 1.0, owner_waiting=False)
    assert not may_start("a", 1.0, {"a": 6.0}, lent, 8, 1.0, owner_waiting=False)  # b lends 2 at most


def test_a_tenant_without_a_quota_runs_on_what_no_quota_covers():
    assert lendable({}, {"a": Quota(4)}, 6) == 6  # 2 no quota covers, and a's 4 unused
    assert may_start("free", 1.0, {"a": 4.0, "free": 1.0}, {"a": Quota(4)}, 6, 1.0, owner_waiting=False)
    assert not may_start("free", 1.0, {"a": 4.0, "free": 2.0}, {"a": Quota(4)}, 6, 1.0, owner_waiting=False)


tenants = st.sampled_from(["a", "b", "c"])
quota_sets = st.dictionaries(
    tenants,
    st.builds(
        Quota,
        st.integers(0, 6).map(float),
        st.one_of(st.just(math.inf), st.integers(0, 4).map(float)),
        st.one_of(st.just(math.inf), st.integers(0, 4).map(float)),
    ),
)


@given(quota_sets, st.lists(tenants, max_size=40), st.integers(1, 16))
def test_granting_only_what_may_start_keeps_every_limit(quotas, arrivals, capacity):
    inflight: dict[str, float] = {}
    for tenant in arrivals:
        if sum(inflight.values()) + 1 > capacity:
            break
        if not may_start(tenant, 1.0, inflight, quotas, capacity, 1.0, False):
            continue
        owned = under_quota(tenant, 1.0, inflight, quotas)
        inflight[tenant] = inflight.get(tenant, 0.0) + 1
        for name, quota in quotas.items():
            assert borrowed(name, inflight, quotas) <= quota.borrowing_limit
        if not owned:
            # A grant that borrows stays within what is lendable. (One within its owner's quota
            # may take back what is lent: reclaim, done as the borrowed requests finish.)
            total = sum(borrowed(name, inflight, quotas) for name in inflight)
            assert total <= lendable(inflight, quotas, capacity) + 1e-9


def test_a_hard_quota_makes_a_tenant_wait_for_its_own_work_to_come_down():
    quotas = {"a": Quota(2.0, borrowing_limit=0.0), "b": Quota(2.0)}
    # Under its cap: no wait of its own.
    assert quota_wait_s("a", 1.0, 0.0, {"a": 1.0}, quotas, 0.2) == 0.0
    # 2 in flight and 3 queued ahead: 4 must finish before it fits, 2 at a time, 0.2 s each.
    assert quota_wait_s("a", 1.0, 3.0, {"a": 2.0}, quotas, 0.2) == pytest.approx(0.4)
    # A quota that may borrow without bound, or none: only the pool's wait, which admission reads.
    assert quota_wait_s("b", 1.0, 9.0, {"b": 9.0}, quotas, 0.2) == 0.0
    assert quota_wait_s("c", 1.0, 9.0, {"c": 9.0}, quotas, 0.2) == 0.0
    # A request larger than the cap never starts.
    assert quota_wait_s("a", 3.0, 0.0, {}, quotas, 0.2) == math.inf


@given(
    st.floats(0, 10),
    st.floats(0, 20),
    st.floats(0, 20),
    st.floats(0.5, 5),
    st.floats(0, 3),
    st.floats(0.01, 2),
)
def test_quota_wait_grows_with_what_the_tenant_has_ahead(cost, inflight, ahead, nominal, limit, service):
    quotas = {"a": Quota(nominal, borrowing_limit=limit)}
    wait = quota_wait_s("a", cost, ahead, {"a": inflight}, quotas, service)
    assert wait >= 0
    assert quota_wait_s("a", cost, ahead + 1, {"a": inflight}, quotas, service) >= wait
    assert quota_wait_s("a", cost, ahead, {"a": inflight + 1}, quotas, service) >= wait
    if inflight + ahead + cost <= nominal + limit:
        assert wait == 0


def test_a_request_costlier_than_the_pool_has_slots_starts_alone_on_an_idle_pool():
    # Quotas count work (batch items, tokens), the pool counts slots: 8 items take one slot of 4.
    assert may_start("b", 8.0, {}, {"a": Quota(1)}, 4, 1.0, owner_waiting=False)
    assert may_start("a", 8.0, {}, {"a": Quota(1)}, 4, 1.0, owner_waiting=False)
    # Measured at 8 items a slot, the pool holds 32, all of it lendable (31 unowned, and a's 1 unused).
    assert may_start("b", 8.0, {"b": 24.0}, {"a": Quota(1)}, 4, 8.0, owner_waiting=False)
    assert not may_start("b", 8.0, {"b": 32.0}, {"a": Quota(1)}, 4, 8.0, owner_waiting=False)
