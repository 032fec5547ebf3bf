"""Where a free slot goes (policies.dispatch.next_flow): the one decision the memory store and the
simulator both hand slots over by."""

from hypothesis import given
from hypothesis import strategies as st

from policies.dispatch import Head, QuotaState, next_flow
from policies.quotas import Quota, may_start, owner_waiting


def heads_of(bands):
    return lambda band: bands[band]


def depths(bands):
    return [len(heads) for heads in bands]


def test_nothing_waiting_hands_nothing_over():
    assert next_flow([0, 0], heads_of([[], []])) is None
    assert next_flow([], heads_of([])) is None


def test_the_most_urgent_band_with_work_gets_the_slot_whatever_the_scores():
    bands = [[], [Head(9.0, 7, "a", 1.0)], [Head(0.0, 1, "b", 1.0)]]
    assert next_flow(depths(bands), heads_of(bands)) == (1, bands[1][0])


def test_within_a_band_the_lowest_head_score_then_the_earliest_arrival():
    bands = [[Head(2.0, 1, "a", 1.0), Head(1.0, 5, "b", 1.0), Head(1.0, 3, "c", 1.0)]]
    assert next_flow(depths(bands), heads_of(bands)) == (0, Head(1.0, 3, "c", 1.0))


def test_a_reservation_that_leaves_a_band_no_slot_keeps_it_from_every_less_urgent_band():
    bands = [[], [Head(0.0, 1, "a", 1.0)], [Head(0.0, 2, "b", 1.0)]]
    assert next_flow(depths(bands), heads_of(bands), usable=lambda band: 0 if band >= 1 else 1) is None
    assert next_flow(depths(bands), heads_of(bands), usable=lambda band: 1) == (1, bands[1][0])


def test_quotas_pass_over_a_borrower_while_an_owner_under_its_quota_waits_in_a_less_urgent_band():
    quotas = QuotaState({"owner": Quota(2)}, {"borrower": 2.0}, slots=4)
    bands = [[Head(0.0, 1, "borrower", 1.0)], [Head(5.0, 2, "owner", 1.0)]]
    assert next_flow(depths(bands), heads_of(bands), quotas=quotas) == (1, bands[1][0])


def test_heads_quotas_hold_back_in_every_band_leave_the_slot_free():
    quotas = QuotaState({"a": Quota(1, borrowing_limit=0)}, {"a": 1.0}, slots=4)
    bands = [[Head(0.0, 1, "a", 1.0)], [Head(1.0, 2, "a", 1.0)]]
    assert next_flow(depths(bands), heads_of(bands), quotas=quotas) is None


head_lists = st.lists(
    st.builds(
        Head,
        st.floats(0, 100, allow_nan=False),
        st.integers(0, 10**6),
        st.sampled_from("abcd"),
        st.sampled_from([1.0, 2.0, 4.0]),
    ),
    max_size=4,
    unique_by=lambda head: (head.sequence, head.tenant),
).map(lambda heads: list({head.tenant: head for head in heads}.values()))
"""One band's flow heads: one per tenant."""


@given(
    st.lists(head_lists, min_size=1, max_size=3),
    st.dictionaries(st.sampled_from("abc"), st.builds(Quota, st.sampled_from([1.0, 2.0, 4.0]))),
    st.dictionaries(st.sampled_from("abcd"), st.sampled_from([0.0, 1.0, 2.0, 4.0])),
    st.integers(1, 8),
    st.lists(st.integers(0, 2), min_size=3, max_size=3),
)
def test_the_slot_goes_to_the_lowest_startable_head_of_the_most_urgent_band_that_has_one(
    bands, quota_set, inflight, slots, usable_by_band
):
    # Unique arrival numbers across bands, as the stores number their arrivals.
    bands = [
        [head._replace(sequence=b * 10**7 + head.sequence) for head in heads] for b, heads in enumerate(bands)
    ]
    quotas = QuotaState(quota_set, inflight, slots) if quota_set else None
    usable = usable_by_band.__getitem__
    found = next_flow(depths(bands), heads_of(bands), usable, quotas)

    every_head = [(h.tenant, h.cost) for heads in bands for h in heads]
    waiting = owner_waiting(every_head, inflight, quota_set)

    def starts(head):
        return quotas is None or may_start(head.tenant, head.cost, inflight, quota_set, slots, 1.0, waiting)

    # The bands before the one it picks (or every band up to the first a reservation closes,
    # when it picks none) have no head that may start.
    reached = found[0] if found is not None else len(bands)
    for band in range(reached + 1 if found is not None else len(bands)):
        if bands[band] and usable(band) <= 0:
            assert found is None and band <= reached
            break
        if band < reached:
            assert not any(starts(h) for h in bands[band])
    if found is not None:
        band, head = found
        assert head in bands[band] and starts(head)
        assert all(head <= other for other in bands[band] if starts(other))
