"""Quotas that lend what their owners leave unused and take it back (policies.quotas)."""

import math

from hypothesis import given
from hypothesis import strategies as st

from policies.quotas import Quota, borrowed, lendable, may_start, under_quota

QUOTAS = {"a": Quota(4), "b": Quota(4)}


def test_without_quotas_nothing_is_held_back():
    assert may_start("anyone", 100.0, {"anyone": 1e6}, {}, 8, owner_waiting=True)


def test_within_its_quota_a_tenant_starts_even_while_an_owner_waits():
    assert may_start("a", 1.0, {"a": 3.0, "b": 4.0}, QUOTAS, 8, owner_waiting=True)


def test_beyond_it_a_tenant_borrows_what_another_leaves_unused():
    assert may_start("a", 1.0, {"a": 4.0, "b": 1.0}, QUOTAS, 8, owner_waiting=False)
    assert not may_start("a", 1.0, {"a": 7.0, "b": 1.0}, QUOTAS, 8, owner_waiting=False)


def test_no_new_borrowing_while_an_owner_under_its_quota_waits():
    assert not may_start("a", 1.0, {"a": 4.0, "b": 1.0}, QUOTAS, 8, owner_waiting=True)


def test_the_borrowing_and_lending_limits_cap_what_moves():
    capped = {"a": Quota(4, borrowing_limit=1), "b": Quota(4, lending_limit=2)}
    assert may_start("a", 1.0, {"a": 4.0}, capped, 8, owner_waiting=False)
    assert not may_start("a", 1.0, {"a": 5.0}, capped, 8, owner_waiting=False)  # borrows 2 > 1
    lent = {"a": Quota(4), "b": Quota(4, lending_limit=2)}
    assert may_start("a", 1.0, {"a": 5.0}, lent, 8, owner_waiting=False)
    assert not may_start("a", 1.0, {"a": 6.0}, lent, 8, owner_waiting=False)  # b lends 2 at most


def test_a_tenant_without_a_quota_runs_on_what_no_quota_covers():
    assert lendable({}, {"a": Quota(4)}, 6) == 6  # 2 no quota covers, and a's 4 unused
    assert may_start("free", 1.0, {"a": 4.0, "free": 1.0}, {"a": Quota(4)}, 6, owner_waiting=False)
    assert not may_start("free", 1.0, {"a": 4.0, "free": 2.0}, {"a": Quota(4)}, 6, owner_waiting=False)


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
        if not may_start(tenant, 1.0, inflight, quotas, capacity, False):
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
