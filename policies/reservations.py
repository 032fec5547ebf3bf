"""How many free slots may a request of a band take? Slots reserved by more urgent classes.

A class may reserve slots of each model's pool that less urgent classes never use
(`priorities[].reserved_slots`): a dedicated interactive share that a flood of batch work cannot
fill, so that an urgent request finds a slot free instead of waiting for a long request to end.
The rule kept: for every class a with R_a reserved, the slots held by the classes less urgent than
a stay at most the pool's slots less R_a. Class a itself, and those more urgent than it, may use
every slot. A free slot is therefore usable by band b only while, for each more urgent class a,
the classes below a hold fewer than their bound.

The bound is on slots held, not on slots in use by a: reserved slots that the urgent class leaves
idle stay idle (what reserving is for). A pool with no more slots than the reservations above a
band serves that band nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def usable_free_slots(
    band: int, free_slots: int, held_by_band: Sequence[int], reserved_by_band: Sequence[int]
) -> int:
    """The free slots a request of `band` may take now: `free_slots` of the pool's, less what the
    reservations of the more urgent classes keep from it, given the slots each band holds."""
    usable = max(0, free_slots)
    if not any(reserved_by_band[:band]):
        return usable
    pool = usable + sum(held_by_band)
    for urgent in range(band):
        reserved = reserved_by_band[urgent]
        if reserved > 0:
            held_below = sum(held_by_band[urgent + 1 :])
            usable = min(usable, pool - reserved - held_below)
    return max(0, usable)


def usable_by_band(
    free_slots: int, held_by_band: Sequence[int], reserved_by_band: Sequence[int]
) -> tuple[int, ...]:
    """`usable_free_slots` for every band (never rising from one band to the next)."""
    return tuple(
        usable_free_slots(band, free_slots, held_by_band, reserved_by_band)
        for band in range(len(held_by_band))
    )


def slots_held_at_most(band: int, slots: int, reserved_by_band: Sequence[int]) -> int:
    """The most slots `band` may ever hold: the pool's less the largest reservation of a more
    urgent class (that class's bound on the slots held below it)."""
    return max(0, slots - max(reserved_by_band[:band], default=0))
