"""Slots a class reserves from the less urgent ones (policies.reservations)."""

from hypothesis import given
from hypothesis import strategies as st

from policies.reservations import usable_by_band, usable_free_slots

bands = st.integers(1, 5)


@st.composite
def pools(draw):
    count = draw(bands)
    held = draw(st.lists(st.integers(0, 8), min_size=count, max_size=count))
    reserved = draw(st.lists(st.integers(0, 6), min_size=count, max_size=count))
    return draw(st.integers(0, 8)), held, reserved


@given(pools())
def test_the_most_urgent_class_may_take_every_free_slot(pool):
    free, held, reserved = pool
    assert usable_free_slots(0, free, held, reserved) == free


@given(pools())
def test_a_band_never_gets_more_than_the_free_slots_nor_more_than_a_more_urgent_one(pool):
    free, held, reserved = pool
    usable = usable_by_band(free, held, reserved)
    assert all(0 <= n <= free for n in usable)
    assert list(usable) == sorted(usable, reverse=True)


@given(pools(), st.data())
def test_taking_a_usable_slot_keeps_every_reservation(pool, data):
    free, held, reserved = pool
    band = data.draw(st.integers(0, len(held) - 1))
    if usable_free_slots(band, free, held, reserved) == 0:
        return
    after = list(held)
    after[band] += 1
    total = free + sum(held)
    for urgent, kept in enumerate(reserved[:band]):
        # Held below the class before: within its bound, it stays within it.
        if sum(held[urgent + 1 :]) <= total - kept:
            assert sum(after[urgent + 1 :]) <= total - kept


def test_an_interactive_reservation_keeps_two_of_eight_slots_from_a_batch_flood():
    # 8 slots; batch holds 6, interactive none: the 2 free ones are interactive's only.
    assert usable_by_band(2, [0, 6], [2, 0]) == (2, 0)
    # Interactive took one of them: batch still may not.
    assert usable_by_band(1, [1, 6], [2, 0]) == (1, 0)
    # Batch down to 5: one more may start.
    assert usable_by_band(3, [0, 5], [2, 0]) == (3, 1)
